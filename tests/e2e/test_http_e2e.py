"""End to end: the real app on real Ray Serve over real HTTP, the official `openai` client, a tiny model.

Two applications share one local cluster: "/" with defaults, and "/strict" with an API key, a tiny
engine queue (to provoke 429) and a small body limit (413).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from e2e_helpers import metric, serve_apps, tiny_args, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
KEY = "sk-test-0123456789"
LONG = " ".join(f"Paris is the capital of France {i}." for i in range(40))


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    strict = tiny_args(tiny_model_dir, api_keys=[KEY], limits={"max_body_bytes": 4096},
                       engine={"max_running": 1, "prefill_batch": 1, "max_waiting": 1})
    with serve_apps({"/": tiny_args(tiny_model_dir), "/strict": strict}) as url:
        wait_healthy(url)
        wait_healthy(f"{url}/strict")
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, content="Hello", **kw):
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_models_and_health(base, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{base}/health").json()["status"] == "ok"


def test_chat_non_streaming_length_and_usage(client):
    out = chat(client, max_tokens=7, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].message.role == "assistant"
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(base, client):
    whole = chat(client, max_tokens=12, extra_body={"ignore_eos": True})
    channel_items = metric(base, 'pomona_engine_stream_items{kind="channel"}')
    chunks = list(chat(client, max_tokens=12, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))
    # After its first batch, the stream came through the step channel (deployments/channels.py),
    # pinned to the replica by the request router over real Serve.
    assert metric(base, 'pomona_engine_stream_items{kind="channel"}') > channel_items
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completions_both_ways_with_logprobs(client):
    whole = client.completions.create(model="tiny", prompt="Paris is", max_tokens=6, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.token_logprobs) == 6 and all(len(t) <= 2 for t in lp.top_logprobs)
    parts = list(client.completions.create(model="tiny", prompt="Paris is", max_tokens=6, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert whole.usage.completion_tokens == 6


def test_chat_logprobs(client):
    out = chat(client, max_tokens=4, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)


def test_stop_string(client):
    text = chat(client, "Tell me", max_tokens=30, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("the tiny model's output has no usable stop string")
    out = chat(client, "Tell me", max_tokens=30, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert stop not in out.choices[0].message.content
    assert text.startswith(out.choices[0].message.content)


def test_cached_tokens_on_repeated_prompt(client):
    first = chat(client, LONG, max_tokens=2)
    second = chat(client, LONG, max_tokens=2)
    assert first.usage.prompt_tokens > 100
    assert second.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n"),
    ({"messages": "hi"}, "messages"),
])
def test_invalid_fields_are_400(base, body, param):
    r = httpx.post(f"{base}/v1/chat/completions", json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2]", b'{"model": NaN}'])
def test_malformed_bodies_are_400(base, raw):
    r = httpx.post(f"{base}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, LONG, max_tokens=2040)
    assert err.value.code == "context_length_exceeded"


def test_unknown_model_and_path_are_404(base, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "model_not_found"
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_api_key_required_on_strict_app(base):
    url = f"{base}/strict"
    assert httpx.get(f"{url}/health").status_code == 200  # open on purpose, for load balancers
    missing = httpx.post(f"{url}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert good.models.list().data[0].id == "tiny"


def test_oversized_body_is_413(base):
    r = httpx.post(f"{base}/strict/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "prompt": "x" * 10_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_full_queue_is_429_with_retry_after(base):
    async def one(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 200,
                                                        "ignore_eos": True})

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=f"{base}/strict", timeout=120,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            return await asyncio.gather(*(one(http) for _ in range(8)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes, codes
    limited = next(r for r in responses if r.status_code == 429)
    assert int(limited.headers["Retry-After"]) >= 1 and limited.json()["error"]["code"] == "overloaded"
    assert set(codes) <= {200, 429}


def aborted(base: str) -> float:
    return metric(base, 'pomona_engine_requests_finished{kind="abort"}') or 0.0


def test_disconnect_aborts_the_engine_request(base):
    before, started = aborted(base), time.monotonic()
    with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "Hi", "max_tokens": 1900, "stream": True,
                            "ignore_eos": True}) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 6:
                break
    deadline = time.monotonic() + 10
    while (metric(base, "pomona_engine_running") != 0 or aborted(base) <= before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted(base) == before + 1, "the engine finished instead of aborting"
    assert metric(base, "pomona_engine_running") == 0
    assert metric(base, "pomona_client_disconnects_total") >= 1
    print(f"disconnect -> abort visible after {time.monotonic() - started:.2f} s")


def test_metrics_exposition(base, client):
    chat(client, max_tokens=2)
    text = httpx.get(f"{base}/metrics").text
    for name in ("pomona_requests_total", "pomona_time_to_first_token_seconds_bucket",
                 "pomona_inter_token_latency_seconds_count", 'pomona_tokens_total{kind="completion"}',
                 "pomona_engine_waiting", "pomona_engine_running"):
        assert name in text, name


def test_streaming_latency_through_the_stack(client):
    """TTFT through proxy -> ingress -> LLM server -> engine, for the tiny model (engine time ~5 ms)."""
    import statistics

    def ttft(i: int) -> float:
        started = time.perf_counter()
        for chunk in chat(client, f"Hello {i}", max_tokens=4, stream=True, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                return time.perf_counter() - started
        raise AssertionError("no content")

    samples = [ttft(i) for i in range(12)][2:]
    median = statistics.median(samples)
    print(f"tiny-model TTFT through the stack: median {median * 1000:.1f} ms, max {max(samples) * 1000:.1f} ms")
    assert median < 1.0  # generous: a shared 2-core CI box; the point is no added waits
