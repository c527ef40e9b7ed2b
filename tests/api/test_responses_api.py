"""/v1/responses: the response object and its events (checked against the official `openai` SDK's own
models), and the route in process (real app, real engine, tiny model, the SDK's `client.responses`)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agent_helpers import SCHEMAS, in_process
from api.core.conversation import (Completion, ReasoningDelta, TextDelta, ToolArgsDelta, ToolCall,
                                      ToolCallEnd, ToolCallStart, Usage)
from api.core.errors import ApiError
from api.core.fields import Limits
from api.responses.parse import parse_responses
from api.responses.render import EventWriter, output_items, response_object, status_of
from test_responses_parse import FULL, WEATHER_TOOL, WRONG, parse, paths, replaced

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
EVENTS = TypeAdapter(ResponseStreamEvent)


# ---------------------------------------------------------------------------------------------- rendering


def ECHO():
    return parse({"input": "x", "tools": [WEATHER_TOOL], "max_output_tokens": 64}).echo


def test_whole_object_validates_with_the_sdk():
    call = ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')
    c = Completion("It is sunny.", "Think first.", (call,), "tool_calls", Usage(40, 12, 32))
    obj = response_object("resp_" + "0" * 32, 1700000000, "tiny", ECHO(), status=status_of(c),
                          output=output_items(c), usage=c.usage, previous=None, store=True)
    r = Response.model_validate(obj)
    assert [i.type for i in r.output] == ["reasoning", "message", "function_call"]
    assert r.output_text == "It is sunny." and r.status == "completed" and r.incomplete_details is None
    assert r.output[2].call_id == "call_1" and json.loads(r.output[2].arguments)["city"] == "Paris"
    assert r.output[0].content[0].text == "Think first."
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (40, 12, 52)
    assert r.usage.input_tokens_details.cached_tokens == 32 and r.tools[0].name == "get_weather"
    cut = Completion("It is", "", (), "length", Usage(40, 64, 0))
    r = Response.model_validate(response_object("resp_1", 1, "tiny", ECHO(), status=status_of(cut),
                                                output=output_items(cut), usage=cut.usage, previous="resp_0",
                                                store=False))
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.previous_response_id == "resp_0"


def sse_events(text: str) -> list[dict]:
    out = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[len("data: "):])
        assert body["type"] == kind[len("event: "):]
        EVENTS.validate_python(body)  # each event parses as the SDK's own event model
        out.append(body)
    return out


def test_stream_events_in_order_with_sequence_numbers():
    w = EventWriter()
    base = response_object("resp_1", 1, "tiny", ECHO(), status="in_progress", output=[], usage=None,
                           previous=None, store=True)
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    text = w.start(base) + w.feed([ReasoningDelta("Hm"), ReasoningDelta("m."), TextDelta("Let me "),
                                   TextDelta("check."), ToolCallStart(0, "call_1", "get_weather"),
                                   ToolArgsDelta(0, '{"city": '), ToolArgsDelta(0, '"Paris"}'),
                                   ToolCallEnd(0, call)]) + w.finish("completed")
    final = response_object("resp_1", 1, "tiny", ECHO(), status="completed", output=w.items,
                            usage=Usage(10, 5, 0), previous=None, store=True)
    events = sse_events(text + w.end(final))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    done = Response.model_validate(events[-1]["response"])
    assert done.output_text == "Let me check." and done.output[0].content[0].text == "Hmm."
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert args == call.arguments == done.output[2].arguments


def test_stream_cut_by_length_and_failure():
    w = EventWriter()
    text = w.feed([TextDelta("a"), ToolCallStart(0, "call_1", "f"), ToolArgsDelta(0, '{"x": ')])
    text += w.finish("incomplete")
    events = sse_events(text)
    assert events[-1]["type"] == "response.output_item.done" and events[-1]["item"]["status"] == "incomplete"
    assert events[-2]["arguments"] == '{"x": '
    base = response_object("resp_1", 1, "tiny", ECHO(), status="in_progress", output=[], usage=None,
                           previous=None, store=True)
    tail = sse_events(w.failed(ApiError(500, "engine died", "server_error"), base))
    assert [e["type"] for e in tail] == ["error", "response.failed"]
    assert tail[1]["response"]["status"] == "failed" and tail[1]["response"]["error"]["message"] == "engine died"


# ---------------------------------------------------------------------------------------------- routes


def run_app(model_dir, tmp_path, body, **app_args):
    """Run `body(client, http)` against a fresh in-process app whose store is in tmp_path."""
    async def main():
        async with in_process(model_dir, responses={"directory": str(tmp_path / "responses")}, **app_args) as http:
            client = openai.AsyncOpenAI(base_url="http://pomona.test/v1", api_key="x", http_client=http,
                                        max_retries=0)
            return await body(client, http)
    return asyncio.run(main())


def test_route_text_stream_and_retrieve(tiny_model_dir, tmp_path):
    async def body(client, http):
        whole = await client.responses.create(model="tiny", input="Hello", instructions="Be brief.",
                                              max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        events = [e async for e in await client.responses.create(
            model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0,
            stream=True, extra_body={"ignore_eos": True})]
        again = await client.responses.retrieve(whole.id)
        await client.responses.delete(whole.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(whole.id)
        return whole, events, again
    whole, events, again = run_app(tiny_model_dir, tmp_path, body)
    assert whole.id.startswith("resp_") and whole.status == "incomplete" and whole.output_text
    assert whole.usage.output_tokens == 8 and whole.usage.input_tokens > 0 and whole.store
    assert again.model_dump() == whole.model_dump()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == events[-1].response.output_text == whole.output_text  # greedy: same text both ways


def test_route_forced_call_then_output_follow_up(tiny_model_dir, tmp_path):
    async def body(client, http):
        first = await client.responses.create(
            model="tiny", input="Weather in Paris?", instructions="Use the tools.", tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200, temperature=0)
        call = first.output[-1]
        second = await client.responses.create(
            model="tiny", previous_response_id=first.id, instructions="Use the tools.", tools=[WEATHER_TOOL],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}],
            max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        return first, second
    first, second = run_app(tiny_model_dir, tmp_path, body)
    call = first.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    assert second.previous_response_id == first.id and second.output_text
    # turn 2's prompt starts with turn 1's prompt and answer: the prefix cache serves it
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens


def test_route_refusals_and_store_false(tiny_model_dir, tmp_path):
    async def body(client, http):
        with pytest.raises(openai.NotFoundError) as unknown:
            await client.responses.create(model="tiny", input="x", previous_response_id="resp_" + "0" * 32)
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model="tiny", input=[{"role": "robot", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as builtin:
            await client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
        kept = await client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError) as unstored:
            await client.responses.create(model="tiny", input="x", previous_response_id=kept.id)
        junk = await http.post("/v1/responses", content=b"{not json")
        with pytest.raises(openai.BadRequestError) as long:
            await client.responses.create(model="tiny", input="Paris is the capital of France. " * 20)
        return unknown.value, bad.value, builtin.value, kept, unstored.value, junk, long.value
    unknown, bad, builtin, kept, unstored, junk, long = run_app(tiny_model_dir, tmp_path, body,
                                                                limits={"max_prompt_tokens": 64})
    assert long.body["param"] == "input" and long.body["code"] == "context_length_exceeded"
    assert unknown.body["param"] == "previous_response_id" and unknown.body["code"] == "previous_response_not_found"
    assert bad.body["param"] == "input[0].role" and builtin.body["param"] == "tools[0]"
    assert kept.store is False and unstored.body["code"] == "previous_response_not_found"
    assert junk.status_code == 400 and junk.json()["error"]["type"] == "invalid_request_error"


THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory):
    """A tiny model with <think> / </think> tokens whose template opens a think section unless
    enable_thinking is false."""
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("think"), extra_special=("<think>", "</think>"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = THINK_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_route_reasoning_items_and_events(think_model_dir, tmp_path):
    vocab = json.loads((think_model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    # the random model ends its reasoning sometimes, and never opens a second think section (the whole
    # object holds one reasoning item before the message; a stream keeps the generation's order)
    close = {"logit_bias": {str(vocab["</think>"]): 3, str(vocab["<think>"]): -100}}

    async def body(client, http):
        wholes = [await client.responses.create(model="tiny", input="Hi", max_output_tokens=32, temperature=1.0,
                                                extra_body={"seed": seed, **close}) for seed in range(6)]
        both = next(i for i, r in enumerate(wholes) if [o.type for o in r.output] == ["reasoning", "message"])
        events = [e async for e in await client.responses.create(
            model="tiny", input="Hi", max_output_tokens=32, temperature=1.0, stream=True,
            extra_body={"seed": both, **close})]
        off = await client.responses.create(model="tiny", input="Hi", max_output_tokens=8, temperature=1.0,
                                            reasoning={"effort": "none"},
                                            extra_body={"logit_bias": {str(vocab["<think>"]): -100}})
        return wholes, both, events, off
    wholes, both, events, off = run_app(think_model_dir, tmp_path, body)
    for r in wholes:  # a reasoning item (never empty) comes first; a message follows unless cut off while reasoning
        assert [o.type for o in r.output] in (["reasoning", "message"], ["reasoning"], ["message"])
        assert r.output[0].type == "message" or r.output[0].content[0].text
    whole = wholes[both]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == whole.output[0].content[0].text and "<think>" not in reasoning
    assert events[-1].response.output_text == whole.output_text
    assert [o.type for o in off.output] == ["message"]  # effort "none": the template opened no think section
    assert off.usage.input_tokens < whole.usage.input_tokens


def test_route_never_answers_5xx_to_accepted_odd_bodies(tiny_model_dir, tmp_path):
    """Bodies the parser accepts with an odd value somewhere (a schema of any shape, text where a part
    was, ...) go through the pipeline: each is answered or refused, never a 5xx."""
    base = {k: v for k, v in FULL.items() if k != "previous_response_id"}
    accepted = []
    for path in list(paths(base))[1:]:
        for new in WRONG:
            body = replaced(base, path, new)
            try:
                parse_responses(body, Limits(), 1024)
            except ApiError:
                continue
            accepted.append(body)
    sample = accepted[::max(1, len(accepted) // 60)]

    async def run(client, http):
        return [await http.post("/v1/responses", json={**body, "max_output_tokens": 8}) for body in sample]
    for body, r in zip(sample, run_app(tiny_model_dir, tmp_path, run)):
        assert r.status_code < 500, (body, r.text[:300])
