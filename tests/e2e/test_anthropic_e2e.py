"""End to end: the official `anthropic` SDK, unmodified, against the real app on real Ray Serve over
real HTTP (a tiny model whose template knows no tools: Pomona's generic fallback renders them).

One app with an API key on one local cluster; the SDK sends it as `x-api-key`.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from agent_helpers import SCHEMAS
from e2e_helpers import serve_apps, tiny_args, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "sk-ant-test-0123456789"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"name": "get_weather", "description": "Weather for a city.", "input_schema": SCHEMAS["get_weather"]},
         {"name": "search_docs", "description": "Search the docs.", "input_schema": SCHEMAS["search_docs"]}]
SYSTEM = " ".join(f"Rule {i}: answer about the capitals of Europe, briefly and politely." for i in range(30))
RAW_EVENTS = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
              "message_stop")


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    with serve_apps({"/": tiny_args(tiny_model_dir, api_keys=[KEY])}) as url:
        wait_healthy(url)
        yield url


@pytest.fixture(scope="module")
def client(base):
    return anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0, timeout=60)


def test_message_and_count_tokens(client):
    out = client.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body={"ignore_eos": True})
    assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_")
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 8
    assert out.content[0].type == "text" and out.content[0].text
    count = client.messages.count_tokens(model="tiny", messages=ASK)
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == count.input_tokens > 0


def test_streams_have_every_event_in_order(client, base):
    with client.messages.stream(model="tiny", max_tokens=8, messages=ASK,
                                extra_body={"ignore_eos": True, "temperature": 0}) as stream:
        kinds = [e.type for e in stream if e.type in RAW_EVENTS]
        text = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text.stop_reason == "max_tokens" and text.usage.output_tokens == 8 and text.content[0].text
    with client.messages.stream(model="tiny", max_tokens=120, messages=ASK, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"},
                                extra_body={"temperature": 1.0, "seed": 1}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    pieces = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) > 1, "the tool input streams in pieces"
    assert final.stop_reason == "tool_use" and final.content[0].type == "tool_use"
    jsonschema.validate(final.content[0].input, SCHEMAS["get_weather"])
    raw = httpx.post(f"{base}/v1/messages", headers={"x-api-key": KEY}, timeout=60,
                     json={"model": "tiny", "max_tokens": 2, "messages": ASK, "stream": True})
    names = [line[7:] for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_forced_tool_use_validates_and_its_result_is_answered(client):
    outs = [client.messages.create(model="tiny", max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=choice,
                                   extra_body={"temperature": 1.0, "seed": seed})
            for seed in range(3) for choice in ({"type": "any"}, {"type": "tool", "name": "search_docs"})]
    for out in outs:
        calls = [b for b in out.content if b.type == "tool_use"]
        assert out.stop_reason == "tool_use" and calls
        for call in calls:
            assert call.id.startswith("toolu_")
            jsonschema.validate(call.input, SCHEMAS[call.name])
    first = outs[0]
    call = next(b for b in first.content if b.type == "tool_use")
    follow = client.messages.create(model="tiny", max_tokens=12, tools=TOOLS, messages=ASK + [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21C and clear"}]}],
        extra_body={"temperature": 0})
    assert follow.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert follow.usage.input_tokens + follow.usage.cache_read_input_tokens > \
        first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_follow_up_turn_reads_the_cache(client):
    turn = [{"role": "user", "content": "Which city is the capital of France?"}]
    first = client.messages.create(model="tiny", max_tokens=6, system=SYSTEM, messages=turn,
                                   extra_body={"ignore_eos": True, "temperature": 0})
    answer = first.content[0].text
    second = client.messages.create(model="tiny", max_tokens=6, system=SYSTEM, extra_body={"temperature": 0},
                                    messages=turn + [{"role": "assistant", "content": answer},
                                                     {"role": "user", "content": "And of Spain?"}])
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens < first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_bad_input_and_a_wrong_key(client, base):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="tiny", max_tokens=5, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}])
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "image" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="tiny", max_tokens=5, messages=ASK,
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])
    wrong = anthropic.Anthropic(base_url=base, api_key="sk-wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        wrong.messages.create(model="tiny", max_tokens=5, messages=ASK)
    assert auth.value.body["error"]["type"] == "authentication_error"
