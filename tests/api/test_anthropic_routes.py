"""Anthropic Messages routes through the real app and engine in process (no Ray), driven by the
official `anthropic` SDK: messages, streams, tools, thinking, output_config, count_tokens, errors."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx2
import jsonschema
import pytest

from agent_helpers import SCHEMAS, THINK_TEMPLATE, in_process
from modelio.models import tokenizer_for as load_tokenizer
from engine_helpers import FaultyModel
from test_anthropic_api import ASK, SEARCH_TOOL, WEATHER_TOOL, sse_events

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def served(model_dir, wrap=None, **app_args):
    """agent_helpers.in_process with httpx2, the anthropic SDK's HTTP package."""
    return in_process(model_dir, httpx2, wrap, **app_args)


def run(model_dir, body, key="x", wrap=None, **app_args):
    """Run `body(client, http)` against a fresh in-process app, with the official SDK."""
    async def main():
        async with served(model_dir, wrap, **app_args) as http:
            client = anthropic.AsyncAnthropic(base_url="http://pomona.test", api_key=key,
                                              http_client=http, max_retries=0)
            return await body(client, http)
    return asyncio.run(main())


def test_message_stream_and_count_tokens_over_the_app(tiny_model_dir):
    system = "You answer in one short sentence."

    async def body(client, http):
        whole = await client.messages.create(model="tiny", max_tokens=12, system=system, messages=ASK,
                                             extra_body={"ignore_eos": True, "temperature": 0})
        async with client.messages.stream(model="tiny", max_tokens=12, system=system, messages=ASK,
                                          extra_body={"ignore_eos": True, "temperature": 0}) as stream:
            events = [e.type async for e in stream]
            final = await stream.get_final_message()
        raw = (await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 3, "messages": ASK,
                                                     "stream": True})).text
        count = await client.messages.count_tokens(model="tiny", system=system, messages=ASK)
        return whole, events, final, raw, count
    whole, events, final, raw, count = run(tiny_model_dir, body)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 12
    assert whole.content[0].type == "text" and whole.content[0].text
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == count.input_tokens > 0
    assert final.content[0].text == whole.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 12
    assert events[0] == "message_start" and events[-1] == "message_stop"
    names = [n for n, _ in sse_events(raw)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def test_forced_tool_use_validates_and_a_tool_result_is_answered(tiny_model_dir):
    tools = [WEATHER_TOOL, SEARCH_TOOL]

    async def body(client, http):
        outs = []
        for seed in range(4):
            for choice in ({"type": "any"}, {"type": "tool", "name": "search_docs"}):
                outs.append((choice, await client.messages.create(
                    model="tiny", max_tokens=120, messages=ASK, tools=tools, tool_choice=choice,
                    extra_body={"temperature": 1.0, "seed": seed})))
        first = outs[0][1]
        call = next(b for b in first.content if b.type == "tool_use")
        follow = await client.messages.create(model="tiny", max_tokens=16, tools=tools, messages=ASK + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21C, clear"}]}],
            tool_choice={"type": "none"}, extra_body={"temperature": 0})
        return outs, follow
    outs, follow = run(tiny_model_dir, body)
    for choice, out in outs:
        assert out.stop_reason == "tool_use", out
        calls = [b for b in out.content if b.type == "tool_use"]
        assert calls and all(c.id.startswith("toolu_") for c in calls)
        for c in calls:
            jsonschema.validate(c.input, SCHEMAS[c.name])
            assert choice["type"] == "any" or c.name == "search_docs"
    assert follow.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in follow.content] == ["text"] and "<tool_call>" not in follow.content[0].text


def test_errors_in_anthropics_shape_and_the_key(tiny_model_dir):
    async def body(client, http):
        errors = []
        for kw in ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                   {"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web"}]}):
            with pytest.raises(anthropic.BadRequestError) as err:
                await client.messages.create(model="tiny", **kw)
            errors.append(err.value)
        missing = await http.post("/v1/messages", json={"model": "tiny", "messages": ASK}, headers={"x-api-key": "k"})
        broken = await http.post("/v1/messages", content=b"{not json", headers={"x-api-key": "k"})
        with pytest.raises(anthropic.NotFoundError):
            await client.messages.create(model="claude-nope", max_tokens=5, messages=ASK)
        bad_key = anthropic.AsyncAnthropic(base_url="http://pomona.test", api_key="wrong", http_client=http,
                                           max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await bad_key.messages.create(model="tiny", max_tokens=5, messages=ASK)
        return errors, missing, broken, auth.value
    errors, missing, broken, auth = run(tiny_model_dir, body, api_keys=["k"], key="k")
    for err in errors:
        assert err.status_code == 400 and err.body["type"] == "error"
        assert err.body["error"]["type"] == "invalid_request_error"
    assert "image" in errors[0].body["error"]["message"] and "web_search_20250305" in errors[1].body["error"]["message"]
    for r in (missing, broken):
        assert r.status_code == 400 and r.json()["type"] == "error" and r.json()["error"]["message"]
    assert "max_tokens" in missing.json()["error"]["message"]
    assert auth.status_code == 401 and auth.body["error"]["type"] == "authentication_error"


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_output_config_schema_holds_and_max_tokens_is_capped_by_the_room_left(tiny_model_dir):
    long = " ".join(f"Paris is the capital of France {i}." for i in range(20))

    async def body(client, http):
        shaped = [await client.messages.create(
            model="tiny", max_tokens=150, messages=ASK, extra_body={"temperature": 1.0, "seed": s},
            output_config={"format": {"type": "json_schema", "schema": PERSON}}) for s in range(3)]
        count = await client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": long}])
        capped = await client.messages.create(model="tiny", max_tokens=32000, messages=[{"role": "user", "content": long}],
                                              extra_body={"ignore_eos": True})
        return shaped, count, capped
    shaped, count, capped = run(tiny_model_dir, body, engine={"max_model_len": 320})
    for out in shaped:
        assert out.stop_reason == "end_turn"
        jsonschema.validate(json.loads(out.content[0].text), PERSON)
    assert 150 < count.input_tokens < 320
    assert capped.stop_reason == "max_tokens" and capped.usage.output_tokens == 320 - count.input_tokens


@pytest.fixture(scope="module")
def think_model_dir(tmp_path_factory):
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-think"), extra_special=("<think>", "</think>"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    return path


def test_thinking_blocks_whole_and_streamed_and_passed_back(think_model_dir):
    end = load_tokenizer(str(think_model_dir)).convert_tokens_to_ids("</think>")
    kw = dict(model="tiny", max_tokens=16, messages=ASK,
              extra_body={"temperature": 0, "ignore_eos": True, "logit_bias": {str(end): 1}})

    async def body(client, http):
        whole = await client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
        async with client.messages.stream(thinking={"type": "adaptive"}, **kw) as stream:
            deltas = [e.delta.type async for e in stream if e.type == "content_block_delta"]
            final = await stream.get_final_message()
        off = await client.messages.create(thinking={"type": "disabled"}, **kw)
        again = await client.messages.create(**{**kw, "messages": ASK + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in whole.content]},
            {"role": "user", "content": "And tomorrow?"}]})
        return whole, deltas, final, off, again
    whole, deltas, final, off, again = run(think_model_dir, body)
    assert [b.type for b in whole.content] == ["thinking", "text"], whole.content
    thought, answer = whole.content[0].thinking, whole.content[1].text
    assert thought and whole.content[0].signature and "think>" not in thought and not answer.startswith("</think>")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert deltas[0] == "thinking_delta" and "signature_delta" in deltas and deltas[-1] == "text_delta"
    assert deltas.index("signature_delta") < deltas.index("text_delta")
    assert [b.type for b in off.content] == ["text"]
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens > whole.usage.input_tokens


def test_a_stop_sequence_is_reported_whole_and_streamed(tiny_model_dir):
    greedy = dict(model="tiny", messages=ASK, extra_body={"temperature": 0})

    async def body(client, http):
        free = await client.messages.create(max_tokens=16, **{**greedy, "extra_body": {"temperature": 0,
                                                                                        "ignore_eos": True}})
        text = free.content[0].text
        stop = text[len(text) // 2:][:3]  # a piece of what the model will say again, greedily
        whole = await client.messages.create(max_tokens=16, stop_sequences=[stop], **greedy)
        async with client.messages.stream(max_tokens=16, stop_sequences=[stop], **greedy) as stream:
            final = await stream.get_final_message()
        return text, stop, whole, final
    text, stop, whole, final = run(tiny_model_dir, body)
    assert stop.strip() and stop in text
    for out in (whole, final):
        assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
        assert text.startswith(out.content[0].text) and stop not in out.content[0].text


def test_a_failure_after_the_first_token_is_an_error_event(tiny_model_dir):
    holder = {}

    def wrap(model):
        holder["model"] = FaultyModel(model)
        return holder["model"]

    async def body(client, http):
        holder["model"].fail_after = 10  # the prompt and a few tokens go through, then a step fails
        raw = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 50, "messages": ASK, "stream": True,
                                                    "ignore_eos": True})
        holder["model"].fail_after = 10
        with pytest.raises(anthropic.APIStatusError) as err:
            async with client.messages.stream(model="tiny", max_tokens=50, messages=ASK,
                                              extra_body={"ignore_eos": True}) as stream:
                async for _ in stream:
                    pass
        after = await client.messages.create(model="tiny", max_tokens=3, messages=ASK, extra_body={"ignore_eos": True})
        return raw, err.value, after
    raw, err, after = run(tiny_model_dir, body, wrap=wrap)
    events = sse_events(raw.text)
    names = [n for n, _ in events]
    assert raw.status_code == 200 and names[:2] == ["message_start", "ping"] and "content_block_delta" in names
    assert names[-1] == "error" and "message_stop" not in names
    error = events[-1][1]["error"]
    assert error["type"] == "api_error" and "retry" in error["message"]
    assert err.body["error"]["type"] == "api_error"
    assert after.usage.output_tokens == 3  # the server goes on serving
