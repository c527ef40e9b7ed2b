"""Anthropic Messages: request parsing and the whole and streamed renderings, on hand-made outputs
(the routes over the real app and engine: tests/api/test_anthropic_routes.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent_helpers import SCHEMAS
from api.anthropic.messages import BlockWriter, content_blocks, error_event, stop_reason, tool_use_id, usage_body
from api.anthropic.request import parse_messages_request
from api.core.conversation import (Completion, ReasoningDelta, TextDelta, ToolArgsDelta, ToolCall, ToolCallEnd,
                                      ToolCallStart, Usage)
from api.core.errors import ApiError, server_error
from api.core.fields import Limits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
LIMITS = Limits()
WEATHER_TOOL = {"name": "get_weather", "description": "Weather for a city.", "input_schema": SCHEMAS["get_weather"]}
SEARCH_TOOL = {"name": "search_docs", "description": "Search the docs.", "input_schema": SCHEMAS["search_docs"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def parse(body: dict, counting: bool = False):
    full = {"model": "tiny", "max_tokens": 64, "messages": ASK, **body}
    return parse_messages_request({k: v for k, v in full.items() if v is not None}, LIMITS, 4096, counting)


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.status == 400 and err.message
    assert err.anthropic_body()["type"] == "error" and err.anthropic_body()["error"]["type"] == "invalid_request_error"
    return err


# ---------------------------------------------------------------------------------------------- parsing


def test_every_block_type_and_the_fields_agents_send():
    conv = parse({
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Use tools."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Need the tool.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "21C"}]}]},
            {"role": "user", "content": "Thanks"}],
        "tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\nHuman:", "END"], "temperature": 0.5, "top_p": 0.9, "top_k": 40,
        "metadata": {"user_id": "u1"}, "cache_control": {"type": "ephemeral"}, "service_tier": "auto",
        "container": None, "inference_geo": "us", "a_field_from_next_year": {"x": 1}, "stream": True})
    roles = [m.role for m in conv.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    assert conv.messages[0].content == "You are terse.\n\nUse tools."
    assistant = conv.messages[2]
    assert assistant.content == "Checking." and assistant.reasoning == "Need the tool."
    assert assistant.tool_calls == (ToolCall("toolu_1", "get_weather", '{"city": "Paris", "unit": "celsius"}'),)
    tool = conv.messages[3]
    assert (tool.content, tool.tool_call_id, tool.name) == ("21C", "toolu_1", "get_weather")
    assert [t.name for t in conv.tools] == ["get_weather"] and conv.tools[0].parameters == SCHEMAS["get_weather"]
    assert conv.tool_choice.mode == "auto" and conv.parallel_tool_calls is False
    s = conv.sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop) == (0.5, 0.9, 40, ("\n\nHuman:", "END"))
    assert conv.stream and conv.max_tokens == 64 and conv.n == 1


def test_tool_results_come_first_in_order_then_the_turns_text():
    conv = parse({"messages": [
        ASK[0],
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Oslo", "unit": "celsius"}},
            {"type": "tool_use", "id": "toolu_b", "name": "search_docs", "input": {"query": "oslo"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here you go."},
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "3C"},
            {"type": "tool_result", "tool_use_id": "toolu_b", "content": "no docs", "is_error": True},
            {"type": "text", "text": "Summarise."}]}]})
    tail = conv.messages[2:]
    assert [(m.role, m.tool_call_id, m.name, m.content) for m in tail] == [
        ("tool", "toolu_a", "get_weather", "3C"), ("tool", "toolu_b", "search_docs", "Error: no docs"),
        ("user", None, None, "Here you go.\n\nSummarise.")]
    only_results = parse({"messages": [ASK[0], {"role": "assistant", "content": "x"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t"}]}]})
    assert [m.role for m in only_results.messages] == ["user", "assistant", "tool"]


@pytest.mark.parametrize("choice, mode, name, parallel", [
    (None, "auto", None, True), ({"type": "auto"}, "auto", None, True), ({"type": "any"}, "required", None, True),
    ({"type": "tool", "name": "search_docs"}, "named", "search_docs", True), ({"type": "none"}, "none", None, True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", None, False),
])
def test_tool_choice_mapping(choice, mode, name, parallel):
    conv = parse({"tools": [WEATHER_TOOL, SEARCH_TOOL], "tool_choice": choice})
    assert (conv.tool_choice.mode, conv.tool_choice.name, conv.parallel_tool_calls) == (mode, name, parallel)


@pytest.mark.parametrize("thinking, expected", [
    ({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "adaptive"}, True),
    ({"type": "disabled"}, False), ({"type": "from_the_future"}, None), (None, None),
])
def test_thinking_sets_the_templates_switch_and_never_fails(thinking, expected):
    kwargs = dict(parse({"thinking": thinking}).chat_template_kwargs)
    assert kwargs.get("enable_thinking") == expected


def test_output_config_schema_takes_the_grammar_path():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    conv = parse({"output_config": {"effort": "high", "format": {"type": "json_schema", "schema": schema}}})
    assert (conv.output_format.kind, conv.output_format.schema) == ("json_schema", schema)
    assert conv.format_param == "output_config.format"
    beta = parse({"output_format": {"type": "json_schema", "schema": schema}})
    assert beta.output_format.schema == schema
    assert parse({"output_config": {"effort": "low"}}).output_format.kind == "text"
    assert refused({"output_config": {"format": {"type": "json_object"}}}).param == "output_config.format"


def test_max_tokens_required_and_clamped_to_the_servers_limit():
    err = refused({"max_tokens": None})
    assert err.param == "max_tokens" and "required" in err.message
    assert parse({"max_tokens": 32000}).max_tokens == 4096
    assert refused({"max_tokens": 0}).param == "max_tokens"
    assert parse({"max_tokens": None}, counting=True).max_tokens is None


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]}, "tools[0]", "web_search_20250305"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, "tools[0]", "bash_20250124"),
    ({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}, "mcp_servers", "MCP"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0]", "image"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}]}]}, "messages[0].content[0].content[0]", "text"),
    ({"messages": [ASK[0], {"role": "assistant", "content": "The answer is ("}]}, "messages[1]", "prefill"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role", "system"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": "hi"}, "messages", "array"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]", "None"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]}]},
     "messages[0].content[0]", "tool_use"),
    ({"messages": [ASK[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x",
                                                              "input": [1]}]}, ASK[0]]},
     "messages[1].content[0].input", "object"),
    ({"system": 5}, "system", "string"),
    ({"tools": [{"name": "x"}]}, "tools[0].input_schema", "required"),
    ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name", "letters"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "unique"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER_TOOL]}, "tool_choice", "nope"),
    ({"tool_choice": {"type": "any"}}, "tool_choice", "no tools"),
    ({"tool_choice": "auto"}, "tool_choice", "auto"),
    ({"stop_sequences": "END"}, "stop_sequences", "array"),
    ({"stop_sequences": [""]}, "stop_sequences", "empty"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"thinking": True}, "thinking", "object"),
    ({"model": None}, "model", "required"),
    ({"max_tokens": "many"}, "max_tokens", "integer"),
])
def test_bad_bodies_are_400s_that_say_what_to_fix(body, param, words):
    err = refused(body)
    assert err.param == param, err.message
    assert words.lower() in err.message.lower()


# ---------------------------------------------------------------------------------------------- answers

CALL = ToolCall("call_abc", "get_weather", '{"city": "Paris", "unit": "celsius"}')


def completion(**kw) -> Completion:
    values = dict(text="", reasoning="", tool_calls=(), finish="stop", usage=Usage(30, 5, 12))
    return Completion(**{**values, **kw})


def test_whole_message_blocks_stop_reasons_and_usage():
    c = completion(text="Let me check.", reasoning="The user wants weather.", tool_calls=(CALL,), finish="tool_calls")
    blocks = content_blocks(c)
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == "The user wants weather." and blocks[0]["signature"]
    assert blocks[2] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                         "input": {"city": "Paris", "unit": "celsius"}}
    assert stop_reason(c) == "tool_use"
    assert content_blocks(completion(tool_calls=(CALL,), finish="tool_calls"))[0]["type"] == "tool_use"
    assert content_blocks(completion()) == [{"type": "text", "text": ""}]
    assert stop_reason(completion(finish="length")) == "max_tokens"
    assert stop_reason(completion(stop_sequence="END")) == "stop_sequence"
    assert stop_reason(completion()) == "end_turn"
    # Anthropic's input_tokens exclude cache reads: the two add up to the prompt.
    assert usage_body(Usage(30, 5, 12)) == {"input_tokens": 18, "output_tokens": 5, "cache_read_input_tokens": 12,
                                            "cache_creation_input_tokens": 0}
    cut = ToolCall("call_x", "get_weather", '{"city": "Pa')  # cut off by max_tokens after its start
    assert content_blocks(completion(tool_calls=(cut,), finish="length"))[0]["input"] == {}


def sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for part in text.split("\n\n"):
        if part:
            name, data = part.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            body = json.loads(data[6:])
            assert body["type"] == name[7:]
            out.append((name[7:], body))
    return out


def test_stream_blocks_in_order_with_arguments_in_pieces():
    events = [ReasoningDelta("Hmm, "), ReasoningDelta("weather."), TextDelta(""), TextDelta("Checking"),
              TextDelta("."), ToolCallStart(0, "call_abc", "get_weather"), ToolArgsDelta(0, '{"city": "Pa'),
              ToolArgsDelta(0, 'ris", "unit": "celsius"}'), ToolCallEnd(0, CALL),
              ToolCallStart(1, "call_def", "search_docs"), ToolArgsDelta(1, '{"query": "x"}'),
              ToolCallEnd(1, ToolCall("call_def", "search_docs", '{"query": "x"}'))]
    writer = BlockWriter()
    got = sse_events("".join(writer.feed(e) for e in events) + writer.finish())
    assert [(n, b.get("index"), b.get("delta", b.get("content_block", {})).get("type")) for n, b in got] == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"), ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None)]
    start = got[9][1]["content_block"]
    assert start == {"type": "tool_use", "id": tool_use_id("call_abc"), "name": "get_weather", "input": {}}
    pieces = "".join(b["delta"]["partial_json"] for n, b in got if b.get("index") == 2 and n == "content_block_delta")
    assert pieces == CALL.arguments
    whole = content_blocks(completion(text="Checking.", reasoning="Hmm, weather.", tool_calls=(CALL,)))
    assert got[3][1]["delta"]["signature"] == whole[0]["signature"]  # the same block either way
    assert start["id"] == whole[2]["id"]


def test_stream_of_nothing_still_has_one_text_block_and_whole_calls_get_their_arguments():
    writer = BlockWriter()
    assert [n for n, _ in sse_events(writer.finish())] == ["content_block_start", "content_block_stop"]
    writer = BlockWriter()
    got = sse_events(writer.feed(ToolCallStart(0, "call_q", "search_docs")) +
                     writer.feed(ToolCallEnd(0, ToolCall("call_q", "search_docs", '{"query": "y"}'))) + writer.finish())
    assert [n for n, _ in got] == ["content_block_start", "content_block_delta", "content_block_stop"]
    assert json.loads(got[1][1]["delta"]["partial_json"]) == {"query": "y"}


def test_error_event_shape():
    name, body = sse_events(error_event(server_error("boom; retry")))[0]
    assert name == "error" and body == {"type": "error", "error": {"type": "api_error", "message": "boom; retry"}}


# ---------------------------------------------------------------------------------------------- fuzz

JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=6), lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                                              max_size=3), max_leaves=8)
KINDS = ["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image", "document", "server_tool_use"]
BLOCK = st.fixed_dictionaries({"type": st.sampled_from(KINDS) | JSON}, optional={
    "text": st.text(max_size=5) | JSON, "id": st.just("toolu_1") | JSON, "name": st.just("get_weather") | JSON,
    "input": st.just({"city": "x"}) | JSON, "tool_use_id": st.just("toolu_1") | JSON, "is_error": JSON,
    "content": st.text(max_size=5) | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": JSON})) | JSON,
    "thinking": st.text(max_size=5) | JSON, "cache_control": JSON})
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]) | JSON,
                                 "content": st.text(max_size=5) | st.lists(BLOCK, max_size=3) | JSON})
TOOL = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "search_docs"]) | JSON},
                             optional={"input_schema": st.just({"type": "object"}) | JSON, "type": JSON,
                                       "description": JSON, "strict": JSON})
FIELDS = st.fixed_dictionaries({}, optional={
    "model": JSON, "max_tokens": st.integers(-1, 70000) | JSON, "tools": st.lists(TOOL, max_size=2) | JSON,
    "system": st.lists(BLOCK, max_size=2) | JSON, "thinking": JSON, "output_format": JSON, "stop_sequences": JSON,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["x", "auto", "any", "tool", "none"])},
                                         optional={"name": JSON, "disable_parallel_tool_use": JSON}) | JSON,
    "output_config": st.fixed_dictionaries({}, optional={"format": JSON}) | JSON, "temperature": JSON, "top_p": JSON,
    "top_k": JSON, "seed": JSON, "logit_bias": JSON, "metadata": JSON, "mcp_servers": JSON, "stream": JSON,
    "cache_control": JSON, "chat_template_kwargs": JSON})
# Either the messages run wild beside valid fields, or the fields beside valid messages: an early
# refusal of one must not hide a crash in the other.
BODY = st.one_of(st.lists(MESSAGE, min_size=1, max_size=4).map(lambda m: {"model": "tiny", "max_tokens": 64,
                                                                           "messages": m}),
                 FIELDS.map(lambda f: {"model": "tiny", "max_tokens": 64, "messages": ASK, **f}))


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODY, counting=st.booleans())
def test_no_body_is_anything_but_a_parse_or_a_400(body, counting):
    try:
        conv = parse_messages_request(body, LIMITS, 4096, counting)
    except ApiError as err:
        assert err.status == 400 and err.message and err.anthropic_body()["error"]["message"] == err.message
    else:
        assert conv.messages and conv.model == body["model"] and conv.n == 1
