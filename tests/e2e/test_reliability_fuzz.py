"""Bad input against the running server: the published OpenAPI schema drives a bounded hypothesis fuzz,
unstructured bodies follow, and every configurable limit is enforced.

`from_schema` covers the JSON Schema subset api/service/openapi.py emits (hypothesis-jsonschema
0.23 does not run on current hypothesis); with `wild`, a field may instead get any JSON value, so
bodies probe both sides of each bound.

Routes: chat and text completions, Anthropic's /v1/messages and /v1/messages/count_tokens, OpenAI's
/v1/responses, each refusal in its own dialect's error shape. Budget: about 450 requests in all, each
`max_tokens` <= 16 on a tiny model. Passing means no 5xx, no replica restart (same pid before and
after), and the server still answers afterwards.
"""

from __future__ import annotations

import hmac

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from api.service.auth import ApiKeyMiddleware, KeyRing
from api.core.metrics import IngressMetrics
from e2e_helpers import tiny_args, wait_healthy
from reliability_helpers import admin, auth, own_cluster

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "sk-fuzz-0123"
LIMITS = {"max_body_bytes": 4096, "max_prompt_tokens": 256, "max_tokens": 16, "max_stop": 2, "max_messages": 4,
          "max_stop_chars": 32}
ROUTES = {"ChatCompletionRequest": "/v1/chat/completions", "CompletionRequest": "/v1/completions",
          "MessagesRequest": "/v1/messages", "CountTokensRequest": "/v1/messages/count_tokens",
          "ResponsesRequest": "/v1/responses"}
ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")
FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@pytest.fixture(scope="module")
def base(tiny_model_dir, tmp_path_factory):
    args = tiny_args(tiny_model_dir, api_keys=[KEY], admin_api_keys=[KEY], limits=LIMITS,
                     responses={"directory": str(tmp_path_factory.mktemp("responses"))},
                     engine={"max_running": 4, "prefill_batch": 4, "max_waiting": 64})
    with own_cluster({"/": args}, apple_silicon=1) as url:
        wait_healthy(url)
        yield url


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, headers=auth(KEY), timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def openapi(http) -> dict:
    r = http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def replica_pid(base) -> int:
    return admin(base, "cache", KEY)["data"][0]["replica"]["pid"]


def check(r: httpx.Response) -> None:
    """Never a 5xx; a refusal is in the route's dialect's shape (Anthropic's on its routes, else
    OpenAI's); a stream that started ends the dialect's way, with no error event."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    path = r.request.url.path
    if r.status_code != 200:
        body = r.json()
        if path in ANTHROPIC:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]
        if path == "/v1/messages":
            assert last.startswith("event: message_stop") and "event: error" not in r.text, r.text[-300:]
        elif path == "/v1/responses":
            assert last.split("\n", 1)[0] in ("event: response.completed", "event: response.incomplete"), last
            assert "event: error" not in r.text
        else:
            assert last == "data: [DONE]" and '"server_error"' not in r.text


def test_openapi_is_published_behind_the_key_with_the_configured_limits(base, openapi):
    assert httpx.get(f"{base}/openapi.json").status_code == 401
    assert set(ROUTES.values()) | {"/admin/requests", "/admin/cache/clear"} <= set(openapi["paths"])
    schemas = openapi["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["maximum"] == LIMITS["max_tokens"]
    assert chat["messages"]["maxItems"] == LIMITS["max_messages"]
    assert chat["stop"]["anyOf"][1]["maxItems"] == LIMITS["max_stop"]
    assert chat["stop"]["anyOf"][0]["maxLength"] == LIMITS["max_stop_chars"]
    messages = schemas["MessagesRequest"]["properties"]
    assert messages["messages"]["maxItems"] == LIMITS["max_messages"]
    assert messages["stop_sequences"]["maxItems"] == LIMITS["max_stop"]
    assert "max_tokens" not in schemas["CountTokensRequest"]["properties"]
    responses = schemas["ResponsesRequest"]["properties"]
    assert responses["max_output_tokens"]["maximum"] == LIMITS["max_tokens"]
    assert responses["metadata"]["maxProperties"] == 16 and responses["cache_salt"]["maxLength"] == 256
    assert responses["input"]["anyOf"][1]["maxItems"] == LIMITS["max_messages"]


@pytest.mark.parametrize("name", sorted(ROUTES))
def test_schema_driven_fuzz(http, openapi, replica_pid, name):
    schema = openapi["components"]["schemas"][name]
    bodies = st.one_of(from_schema(schema), from_schema(schema, wild=0.2))
    # Most examples name the served model, so they reach tokenization and the engine, not only the 404.
    strategy = st.one_of(bodies, bodies.map(lambda b: {**b, "model": "tiny"}),
                         bodies.map(lambda b: {**b, "model": "tiny", "stream": True}))

    @FUZZ
    @given(strategy)
    def fuzz(body: dict) -> None:
        check(http.post(ROUTES[name], json=body))
    fuzz()
    assert admin(str(http.base_url).rstrip("/"), "cache", KEY)["data"][0]["replica"]["pid"] == replica_pid


def from_schema(schema: dict, wild: float = 0.0) -> st.SearchStrategy:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, wild) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, wild)
    if kind == "array":  # with `wild`, an item too may be any JSON value (a string where a block goes)
        item = from_schema(schema["items"], wild)
        return st.lists(st.one_of(item, JSON_VALUES) if wild else item, min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 5), 8))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 20), 40))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(lo, schema.get("maximum"), exclude_min="exclusiveMinimum" in schema)
    if kind == "boolean":
        return st.booleans()
    return JSON_VALUES


def _object(schema: dict, wild: float) -> st.SearchStrategy:
    props, required = schema.get("properties", {}), set(schema.get("required", ()))
    extra = schema.get("additionalProperties")
    if not props and isinstance(extra, dict):  # a map (Responses `metadata`): with `wild`, past its bounds
        most = schema.get("maxProperties", 4)
        key_len = schema.get("propertyNames", {}).get("maxLength", 20)
        keys = st.text(max_size=key_len + 2 if wild else min(key_len, 20))
        return st.dictionaries(keys, from_schema(extra, wild), max_size=most + 2 if wild else min(most, 8))

    def field(name: str) -> st.SearchStrategy:
        valid = from_schema(props[name], wild)
        return st.one_of(valid, JSON_VALUES) if wild else valid

    @st.composite
    def build(draw: st.DrawFn) -> dict:
        optional = sorted(set(props) - required)
        names = sorted(required) + (draw(st.lists(st.sampled_from(optional), unique=True, max_size=6))
                                    if optional else [])
        return {name: draw(field(name)) for name in names}
    return build()


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                           max_leaves=12)
FIELDS = ["model", "messages", "prompt", "max_tokens", "stop", "stream", "stream_options", "logprobs",
          "top_logprobs", "temperature", "seed", "n", "tools", "user", "ignore_eos", "system", "tool_choice",
          "stop_sequences", "thinking", "input", "instructions", "max_output_tokens", "text", "previous_response_id"]


@FUZZ
@given(route=st.sampled_from(sorted(ROUTES.values())),
       body=st.one_of(st.binary(max_size=64),
                      st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=6).map(
                          lambda d: {"model": "tiny", **d})))
def test_unstructured_fuzz(http, route, body):
    if isinstance(body, bytes):
        r = http.post(route, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(route, json=body)
    check(r)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x " * 3000}, 413, None),
    ({"prompt": [30] * 257}, 400, "prompt"),
    ({"prompt": "hi", "max_tokens": 17}, 400, "max_tokens"),
    ({"prompt": "hi", "stop": ["a", "b", "c"]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}] * 5}, 400, "messages"),
    ({"prompt": "hi", "stop": ["x" * 33]}, 400, "stop"),
    ({"prompt": "hi", "stop": "y" * 33}, 400, "stop"),
    ({"prompt": "hi", "cache_salt": "s" * 257}, 400, "cache_salt"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["z" * 33]}, 400, "stop"),
])
def test_configured_limits_are_enforced(http, body, status, param):
    route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = http.post(route, json={"model": "tiny", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


RESPONSES = {"input": "hi", "max_output_tokens": 2, "store": False}
MESSAGES = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("route,over,within,param", [
    ("/v1/responses", {**RESPONSES, "metadata": {f"k{i}": "v" for i in range(17)}},
     {**RESPONSES, "metadata": {f"k{i}": "v" for i in range(16)}}, "metadata"),
    ("/v1/responses", {**RESPONSES, "metadata": {"k" * 65: "v"}}, {**RESPONSES, "metadata": {"k" * 64: "v"}},
     "metadata"),
    ("/v1/responses", {**RESPONSES, "metadata": {"k": "v" * 513}}, {**RESPONSES, "metadata": {"k": "v" * 512}},
     "metadata"),
    ("/v1/responses", {**RESPONSES, "stop": ["s" * 33]}, {**RESPONSES, "stop": ["s" * 32]}, "stop"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": ["s" * 33]}, {**MESSAGES, "stop_sequences": ["s" * 32]},
     "stop_sequences"),
    ("/v1/messages", {**MESSAGES, "cache_salt": "s" * 257}, {**MESSAGES, "cache_salt": "s" * 256}, "cache_salt"),
])
def test_per_request_costs_are_bounded_on_every_dialect(http, route, over, within, param):
    """Responses `metadata` (OpenAI's own bounds: 16 pairs, keys <= 64, values <= 512 characters: it is
    stored with the response), stop-string length (work per token on the MLX thread) and the request's
    own cache_salt: past the bound a 400 naming the field, in the route's dialect; at it, served."""
    r = http.post(route, json={"model": "tiny", **over})
    check(r)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.get("param", param) == param and param in error["message"], error
    ok = http.post(route, json={"model": "tiny", **within})
    check(ok)
    assert ok.status_code == 200, ok.text


DEEP = "[" * 1500 + "]" * 1500  # past the JSON parser's own recursion limit (within max_body_bytes)
NESTED = "[" * 101 + "]" * 101  # parsed, but deeper than decode_body's bound
HOSTILE = {
    "/v1/chat/completions": '{"model": "tiny", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 2, "x": %s}',
    "/v1/completions": '{"model": "tiny", "prompt": "%s", "max_tokens": 2, "x": %s}',
    "/v1/messages": '{"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "%s"}], "x": %s}',
    "/v1/messages/count_tokens": '{"model": "tiny", "messages": [{"role": "user", "content": "%s"}], "x": %s}',
    "/v1/responses": '{"model": "tiny", "input": "%s", "max_output_tokens": 2, "store": false, "x": %s}',
}


@pytest.mark.parametrize("route", sorted(HOSTILE))
def test_hostile_json_is_a_400_on_every_route(http, route):
    """Nesting past the parser's recursion limit or past MAX_JSON_DEPTH, and a lone surrogate escape
    (which the tokenizer cannot encode), are the client's 400 with a message, never a 500."""
    template = HOSTILE[route]
    for text, extra, says in [("hi", DEEP, "deeper than"), ("hi", NESTED, "deeper than"),
                              ("\\ud800 alone", "1", "surrogate")]:
        r = http.post(route, content=(template % (text, extra)).encode(), headers={"content-type": "application/json"})
        check(r)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text[:300]
    ok = http.post(route, content=(template % ("\\ud83d\\ude00 paired", "[[1]]")).encode(),
                   headers={"content-type": "application/json"})
    check(ok)  # a surrogate pair is valid Unicode: served, or refused only for the unknown field "x"
    assert "surrogate" not in ok.text and "deeper" not in ok.text, ok.text[:300]


def test_still_serving_after_the_fuzz(base, http, replica_pid):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "still here", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert admin(base, "cache", KEY)["data"][0]["replica"]["pid"] == replica_pid
    assert admin(base, "requests", KEY)["data"][0]["requests"] == []


def test_api_keys_are_compared_in_constant_time(monkeypatch):
    """Every configured key is compared, always on equal-length digests, whether or not one matches."""
    calls: list[tuple[int, int]] = []

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((len(a), len(b)))
        return a == b
    monkeypatch.setattr(hmac, "compare_digest", spy)
    mw = ApiKeyMiddleware(lambda *a: None, keys=KeyRing({"k1": "t1", "key-two": "t2"}, admin=("k3",)),
                          metrics=IngressMetrics())
    for token, ok in [("k1", True), ("key-two", True), ("x" * 500, False), ("", False)]:
        calls.clear()
        assert mw.allowed(token) is ok
        assert len(calls) == 3 and {pair for pair in calls} == {(32, 32)}
