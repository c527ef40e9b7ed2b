"""Agent loops over real Ray Serve and real HTTP with the official openai SDK: a tiny model whose
template knows tools (mlx-lm's json_tools parser), and the real default model (SmolLM2, whose
template knows no tools: Pomona's generic fallback renders them)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from agent_helpers import SCHEMAS, TOOLS, tools_model_dir
from e2e_helpers import serve_apps, tiny_args, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
ASK = [{"role": "user", "content": "What is the weather in Paris today? Use the tool."}]


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    native = tools_model_dir(tiny_model_dir, tmp_path_factory.mktemp("tools") / "model")
    smol = {"model": "default", "served_model_name": "smol", "drain_s": 1,
            "engine": {"max_running": 4, "prefill_batch": 4, "max_waiting": 16, "request_timeout_s": 300},
            "llm_server": {"num_cpus": 1, "resources": {"apple_silicon": 1}}, "ingress": {"num_cpus": 0}}
    with serve_apps({"/": tiny_args(native), "/smol": smol}) as url:
        wait_healthy(url)
        wait_healthy(f"{url}/smol", timeout_s=600)
        yield url


def client_for(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


def loop(client: openai.OpenAI, model: str, result: str) -> tuple:
    """One agent turn: a forced call, its result sent back as role "tool", then the answer."""
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=200)
    assert first.choices[0].finish_reason == "tool_calls", first
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = client.chat.completions.create(model=model, messages=history, tools=TOOLS, temperature=0,
                                           max_tokens=40)
    return first, call, final


def test_tool_loop_on_a_template_that_knows_tools(base):
    first, call, final = loop(client_for(base), "tiny", '{"temp_c": 21}')
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "<tool_call>" not in (final.choices[0].message.content or "")
    assert final.usage.prompt_tokens_details.cached_tokens > 0  # the turn's prefix came from the cache


def test_streamed_tool_call_over_http(base):
    stream = client_for(base).chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0, seed=3, max_tokens=200, stream=True)
    name, args, pieces, finish = None, "", 0, None
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            name = tc.function.name or name
            if tc.function.arguments:
                args, pieces = args + tc.function.arguments, pieces + 1
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert name == "get_weather" and finish == "tool_calls" and pieces > 1
    jsonschema.validate(json.loads(args), SCHEMAS["get_weather"])


@pytest.mark.real_model
def test_default_model_answers_over_http(base):
    """The real default model served by Pomona end to end (Serve, HTTP, the official client)."""
    client = client_for(f"{base}/smol")
    out = client.chat.completions.create(model="smol", temperature=0, max_tokens=30,
                                         messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "paris" in out.choices[0].message.content.lower(), out
    assert out.choices[0].finish_reason == "stop" and out.model == "smol"


@pytest.mark.real_model
def test_default_model_tool_loop_through_the_fallback(base):
    client = client_for(f"{base}/smol")
    first, call, final = loop(client, "smol", '{"temp_c": 21, "sky": "sunny"}')
    assert first.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    answer = final.choices[0].message
    # A 135M model often just restates the result; what Pomona owes is an answer with no call markup.
    assert final.choices[0].finish_reason in ("stop", "length") and not answer.tool_calls
    assert answer.content and "<tool_call>" not in answer.content
    assert final.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2


@pytest.mark.real_model
def test_default_model_json_schema_and_bad_schema(base):
    client = client_for(f"{base}/smol")
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40},
                                               "country": {"type": "string", "maxLength": 40}},
              "required": ["capital", "country"], "additionalProperties": False}
    out = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        temperature=0, max_tokens=60)
    answer = json.loads(out.choices[0].message.content)
    jsonschema.validate(answer, schema)
    assert "paris" in answer["capital"].lower()
    r = httpx.post(f"{base}/smol/v1/chat/completions", timeout=60, json={
        "model": "smol", "messages": ASK, "response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "x", "schema": {"type": 5}}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


@pytest.mark.real_model
def test_readme_tool_loop_runs_as_written(base, capsys):
    """The README's openai-SDK tool loop, run against the default model (only its URL changed)."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = readme.split("```python\n")[1:]
    [code] = [b.split("```")[0] for b in blocks if 'tool_choice="required"' in b]
    exec(compile(code.replace("http://127.0.0.1:8000/v1", f"{base}/smol/v1"), "README.md", "exec"), {})
    first, second = capsys.readouterr().out.strip().splitlines()[:2]
    assert first.startswith("get_weather {") and "city" in first
    assert second.strip()
