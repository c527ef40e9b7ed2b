"""End to end: the official `openai` SDK's `client.responses`, unmodified, against the real app on real
Ray Serve over real HTTP (a tiny model whose template knows no tools: Pomona's generic fallback renders
them), the response store in a diskcache directory of the test's own.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from agent_helpers import SCHEMAS
from e2e_helpers import serve_apps, tiny_args, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
INSTRUCTIONS = "You answer questions about the weather. Use the tools when they help."
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.",
          "parameters": SCHEMAS["get_weather"]},
         {"type": "function", "name": "search_docs", "description": "Search the docs.",
          "parameters": SCHEMAS["search_docs"]}]


@pytest.fixture(scope="module")
def client(tiny_model_dir, tmp_path_factory):
    store = tmp_path_factory.mktemp("responses")
    with serve_apps({"/": tiny_args(tiny_model_dir, responses={"directory": str(store)})}) as url:
        wait_healthy(url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_text_and_retrieve(client):
    out = client.responses.create(model="tiny", input="What is the weather in Paris?", instructions=INSTRUCTIONS,
                                  max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "response" and out.id.startswith("resp_") and out.model == "tiny"
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output[0].type == "message" and out.output_text == out.output[0].content[0].text != ""
    assert out.usage.output_tokens == 8 and out.usage.total_tokens == out.usage.input_tokens + 8
    assert out.instructions == INSTRUCTIONS and out.store is True
    assert client.responses.retrieve(out.id).model_dump() == out.model_dump()
    client.responses.delete(out.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(out.id)


def test_stream_events_in_order(client):
    # (the SDK's `responses.stream()` helper returns a final response only after response.completed;
    # a response cut by max_output_tokens ends with response.incomplete, as on OpenAI)
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=8, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True}))
    final = events[-1].response
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta") != ""
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_forced_call_then_output_follow_up_served_from_cache(client):
    first = client.responses.create(model="tiny", input="What is the weather in Paris?", instructions=INSTRUCTIONS,
                                    tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=200, temperature=1.0, extra_body={"seed": 3})
    call = first.output[-1]
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_weather"])
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, instructions=INSTRUCTIONS, tools=TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}],
        max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert second.previous_response_id == first.id and second.output_text
    # turn 2's prompt is turn 1's prompt + its call + the result: the prefix cache serves turn 1's part
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens


def test_stream_a_forced_call(client):
    with client.responses.stream(model="tiny", input="Find the docs on caching.", tools=TOOLS, tool_choice="required",
                                 max_output_tokens=200, temperature=1.0, extra_body={"seed": 5}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = final.output[-1]
    assert call.type == "function_call" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments  # in pieces as generated, not one chunk


def test_refusals(client):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_" + "0" * 32)
    assert unknown.value.body["param"] == "previous_response_id"
    assert unknown.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model="tiny", input=[{"type": "function_call_output", "output": "x"}])
    assert bad.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.BadRequestError) as builtin:
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    assert "web_search" in builtin.value.body["message"]
