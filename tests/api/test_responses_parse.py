"""/v1/responses request parsing: string and item inputs, function_call / _output items, instructions,
flat tools (built-in ones refused), tool_choice, text.format, reasoning, and every field given every
wrong JSON type (a 400 naming it, never another exception)."""

from __future__ import annotations

import json

import pytest

from agent_helpers import SCHEMAS
from api.core.conversation import Message
from api.core.errors import ApiError
from api.core.fields import Limits
from api.responses.parse import parse_responses

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
                "parameters": SCHEMAS["get_weather"]}


def parse(body, history=()):
    return parse_responses({"model": "tiny", **body}, Limits(), 1024, tuple(history))


def refused(body) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# ---------------------------------------------------------------------------------------------- parsing


def test_string_input_instructions_and_defaults():
    p = parse({"input": "Hello", "instructions": "Be brief."})
    assert p.conversation.messages == (Message("system", "Be brief."), Message("user", "Hello"))
    assert p.turn == (Message("user", "Hello"),) and p.store is True and p.previous_response_id is None
    assert p.conversation.format_param == "text.format" and p.conversation.max_tokens is None
    assert p.echo["instructions"] == "Be brief." and p.echo["tool_choice"] == "auto"


def test_items_calls_outputs_and_reasoning():
    p = parse({"input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                        {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": {"city": "Lyon"}},
        {"type": "function_call_output", "call_id": "call_a", "output": "18C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "20C"}]},
    ]})
    system, user, assistant, out_a, out_b = p.conversation.messages
    assert system == Message("system", "Use tools.") and user.content == "Weather in Paris?"
    assert assistant.content == "Checking." and assistant.reasoning == "hm"
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == [
        ("call_a", "get_weather", {"city": "Paris"}), ("call_b", "get_weather", {"city": "Lyon"})]
    assert out_a == Message("tool", "18C", tool_call_id="call_a", name="get_weather")
    assert out_b.content == "20C" and out_b.tool_call_id == "call_b"


def test_history_goes_between_instructions_and_input():
    history = (Message("user", "Hi"), Message("assistant", "Hello!"))
    p = parse({"input": "Again", "instructions": "New rules.", "previous_response_id": "resp_x"}, history)
    assert p.conversation.messages == (Message("system", "New rules."),) + history + (Message("user", "Again"),)
    assert p.turn == (Message("user", "Again"),) and p.history == history and p.previous_response_id == "resp_x"


def test_flat_function_tools_strict_by_default_and_tool_choice():
    p = parse({"input": "x", "tools": [WEATHER_TOOL, {**WEATHER_TOOL, "name": "other", "strict": False}],
               "tool_choice": {"type": "function", "name": "other"}})
    first, second = p.conversation.tools
    assert first.name == "get_weather" and first.parameters == SCHEMAS["get_weather"] and first.strict
    assert not second.strict
    assert p.conversation.tool_choice.mode == "named" and p.conversation.tool_choice.name == "other"
    assert p.echo["tools"][0] == {**WEATHER_TOOL, "strict": True}
    assert p.echo["tool_choice"] == {"type": "function", "name": "other"}
    assert parse({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": "required"}).conversation.tool_choice.mode \
        == "required"


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "web_search"}]}, "tools[0]", "built-in tool 'web_search'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name", "letters"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "JSON schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", "json_schema"),
    ({"frobnicate": 1}, "frobnicate", "not a field"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"max_output_tokens": 0}, "max_output_tokens", "between 1 and 1024"),
    ({"temperature": "hot"}, "temperature", "a number"),
    ({"store": "yes"}, "store", "a boolean"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "one of"),
])
def test_bad_fields_name_the_field(body, param, words):
    err = refused({"input": "x", **body})
    assert err.param == param and words in err.message, err.message


@pytest.mark.parametrize("value,param", [
    (None, "input"), ("", "input"), ([], "input"), ([3], "input[0]"),
    ([{"role": "robot", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}], "input[0].arguments"),
    ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
    ([{"type": "item_reference", "id": "msg_1"}], "input[0].type"),
])
def test_bad_input_names_the_item(value, param):
    assert refused({"input": value}).param == param


def test_text_format_and_reasoning_effort():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p = parse({"input": "x", "text": {"format": {"type": "json_schema", "name": "thing", "schema": schema,
                                                 "strict": True}},
               "reasoning": {"effort": "none"}})
    fmt = p.conversation.output_format
    assert (fmt.kind, fmt.schema, fmt.name) == ("json_schema", schema, "thing")
    assert dict(p.conversation.chat_template_kwargs) == {"enable_thinking": False}
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}).conversation.output_format.kind \
        == "json_object"
    assert dict(parse({"input": "x", "reasoning": {"effort": "high"}}).conversation.chat_template_kwargs) \
        == {"enable_thinking": True}


FULL = {"model": "tiny", "instructions": "Be brief.", "input": [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}], "content": [{"type": "reasoning_text",
                                                                                          "text": "r"}]},
    {"role": "assistant", "content": "ok"},
    {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "18C"}]}],
    "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "get_weather"},
    "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True},
             "verbosity": "low"},
    "reasoning": {"effort": "low", "summary": "auto"}, "max_output_tokens": 16, "temperature": 0.5, "top_p": 0.9,
    "store": True, "previous_response_id": "resp_1", "metadata": {"k": "v"}, "parallel_tool_calls": False,
    "truncation": "disabled", "stream": False, "stop": ["x"], "seed": 1, "logit_bias": {"1": 2},
    "chat_template_kwargs": {"a": 1}, "include": [], "user": "u"}
WRONG = [None, True, 3, 1.5, "s", "", [], [1], [[1]], [{}], {}, {"a": [1]}, {"type": [1]}]


def paths(value, path=()):
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from paths(child, path + (key,))


def replaced(value, path, new):
    if not path:
        return new
    out = dict(value) if isinstance(value, dict) else list(value)
    out[path[0]] = replaced(value[path[0]], path[1:], new)
    return out


def test_every_field_with_every_wrong_json_type_is_a_400_or_accepted():
    parse(FULL)  # the template itself is valid
    for path in list(paths(FULL))[1:]:  # the body itself is always an object (decode_body)
        for new in WRONG:
            try:
                parse_responses(replaced(FULL, path, new), Limits(), 1024)
            except ApiError as err:
                assert err.status == 400 and err.message, (path, new)
