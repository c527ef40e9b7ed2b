"""Request parsing and response shapes, with no Ray and no model: fast, run on every change."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from api.core.body import decode_body
from api.core.errors import ApiError
from api.core.fields import Limits
from api.core.streaming import sse
from api.openai.chat import parse_chat
from api.openai.completions import parse_completion
from api.openai.shapes import LogprobFormatter, completion_response
from api.core.metrics import IngressMetrics
from api.service.settings import AppSettings

LIMITS = Limits(max_stop=4)
MSG = [{"role": "user", "content": "hi"}]


def chat(**body):
    return parse_chat({"model": "m", "messages": MSG, **body}, LIMITS, 4096)


def refused(fn, **body) -> ApiError:
    with pytest.raises(ApiError) as err:
        fn(**body)
    assert err.value.status == 400
    return err.value


def test_defaults_and_mapping():
    p = chat(max_completion_tokens=5, max_tokens=9, temperature=0, top_k=-1, stop="END", seed=3,
             logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}, user="u1")
    assert p.max_tokens == 5  # max_completion_tokens wins, as in OpenAI's API
    assert p.sampling.temperature == 0.0 and p.sampling.top_k == 0 and p.sampling.stop == ("END",)
    assert p.sampling.logprobs == 2 and p.logprobs and p.include_usage
    assert chat().max_tokens is None and chat().sampling.logprobs is None


def test_content_parts_and_developer_role():
    p = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, LIMITS, 10)
    assert [(m.role, m.content) for m in p.messages] == [("system", "be brief"), ("user", "ab")]


@pytest.mark.parametrize("body,param", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 5000}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"), ({"n": 17}, "n"), ({"n": 0}, "n"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"), ({"stop": 7}, "stop"), ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"seed": -1}, "seed"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"), ({"model": ""}, "model"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"), ({"messages": ["hi"]}, "messages[0]"),
    ({"presence_penalty": 9}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
])
def test_invalid_chat_fields_name_the_param(body, param):
    assert refused(chat, **body).param == param


def test_completion_prompts():
    parse = lambda prompt, **kw: parse_completion({"model": "m", "prompt": prompt, **kw}, LIMITS, 100)
    assert parse("hi").prompt == "hi"
    assert parse(["hi"]).prompt == "hi"
    assert parse([1, 2, 3]).prompt == (1, 2, 3)
    assert parse([[4, 5]]).prompt == (4, 5)
    assert parse("x", logprobs=3).sampling.logprobs == 3
    for bad in ("", [], ["a", "b"], [-1], [True], None, {"a": 1}):
        assert refused(parse, prompt=bad).param == "prompt"
    assert refused(parse, prompt="x", logprobs=6).param == "logprobs"
    assert refused(parse, prompt="x", echo=True).param == "echo"


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff", b"[]", b'"x"', b'{"a": Infinity}', b'{"a": NaN}'])
def test_decode_body_refuses_bad_bytes(raw):
    with pytest.raises(ApiError) as err:
        decode_body(raw)
    assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "messages", "max_tokens", "temperature", "top_p", "stop", "n",
                                        "logprobs", "top_logprobs", "stream", "stream_options", "seed", "top_k",
                                        "min_p", "presence_penalty", "prompt", "user"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c,
                                                                                        max_size=3), max_leaves=8)))
def test_fuzzed_bodies_parse_or_refuse_with_400(body):
    for parse in (parse_chat, parse_completion):
        try:
            parse(body, LIMITS, 4096)
        except ApiError as err:
            assert err.status in (400,) and err.message


def test_response_shapes_round_trip_through_json():
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}
    body = completion_response("id", 1, "m", "hi", "stop", usage, None)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    assert sse(body).startswith("data: {") and sse(body).endswith("\n\n")
    json.loads(sse(body)[6:])
    fmt = LogprobFormatter(lambda t: {1: "a", 2: "bc"}[t])
    block = fmt.completion([{"id": 1, "lp": -0.1, "top": [[2, -2.0]]}, {"id": 2, "lp": -0.2, "top": []}], 5)
    assert block["text_offset"] == [5, 6] and block["top_logprobs"][0] == {"bc": -2.0}


def test_metrics_render_engine_stats():
    m = IngressMetrics()
    m.count("/v1/completions", 200)
    m.usage({"prompt_tokens": 4, "completion_tokens": 2, "cached_tokens": 3, "cache_tier": "ram"})
    m.ttft.observe(0.02)
    text = m.render({"waiting": 1, "running": 2, "requests_finished": {"stop": 3},
                     "cache": {"ram": {"hits": 5, "bytes": 100}, "ssd": {"hits": 1}}, "model": "x"})
    assert 'pomona_requests_total{route="/v1/completions",status="200"} 1' in text
    assert 'pomona_cached_tokens_total{tier="ram"} 3' in text
    assert 'pomona_cache_hits{tier="ssd"} 1' in text and "pomona_engine_running 2" in text
    assert 'pomona_time_to_first_token_seconds_bucket{le="0.025"} 1' in text


def test_settings_from_serve_config(tmp_path, monkeypatch):
    import yaml

    from e2e_helpers import ROOT

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    app = config["applications"][0]
    assert app["import_path"] == "deployments.app:build_app" and config["http_options"]["host"] == "127.0.0.1"
    s = AppSettings.from_args(app["args"])
    assert s.engine.model == s.model == "default"
    assert s.llm_server.actor_options()["resources"] == {"apple_silicon": 1.0}
    assert s.llm_env_vars(platform="darwin") == {}
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk2\n")
    monkeypatch.setenv("POMONA_API_KEYS", "k1, k2")
    assert AppSettings.from_args({"api_keys": ["k0"], "api_keys_file": str(keys)}).all_api_keys() == ("k0", "k1", "k2")
    with pytest.raises(ValueError, match="unknown"):
        AppSettings.from_args({"modle": "x"})
