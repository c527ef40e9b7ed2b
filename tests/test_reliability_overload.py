"""Overload, time limits and faults over real HTTP on a real local Ray Serve (tiny model, official client).

Apps on one cluster: "/load" (4 running + 8 queued = capacity 12), "/stages" (one slot, 8-token
prefill chunks, so a request can be caught queued, prefilling or decoding) and "/timeout"
(engine.request_timeout_s = 1 s). The replica-kill test runs last: it restarts "/load"'s replica.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import openai
import psutil
import pytest

from e2e_helpers import metric, tiny_args, wait_healthy
from reliability_helpers import admin, live_requests, own_cluster, token_prompt, wait_for, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
RUNNING, WAITING = 4, 8
WAVES, PER_WAVE, MAX_TOKENS = 3, 60, 24  # 5x capacity per wave


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    load = tiny_args(tiny_model_dir, engine={"max_running": RUNNING, "prefill_batch": RUNNING, "max_waiting": WAITING})
    stages = tiny_args(tiny_model_dir, engine={"max_running": 1, "prefill_batch": 1, "prefill_chunk": 8,
                                               "max_batch_tokens": 8})
    timeout = tiny_args(tiny_model_dir, engine={"max_running": 2, "prefill_batch": 2, "request_timeout_s": 1.0})
    with own_cluster({"/load": load, "/stages": stages, "/timeout": timeout}, apple_silicon=3) as url:
        for prefix in ("/load", "/stages", "/timeout"):
            wait_healthy(url + prefix)
        yield url


def replica_rss(app: str) -> int:
    pid = admin(app, "cache")["data"][0]["replica"]["pid"]
    return psutil.Process(pid).memory_info().rss


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int]:
    """(HTTP status, completion tokens) of one request; half stream, half do not."""
    kw = dict(model="tiny", prompt=f"Request {i}: tell a story", max_tokens=MAX_TOKENS, temperature=0.7,
              seed=i, extra_body={"ignore_eos": True})
    try:
        if i % 2:
            chunks = [c async for c in await client.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw)]
            assert chunks[-1].usage is not None, "a stream ended without its usage chunk"
            return 200, chunks[-1].usage.completion_tokens
        out = await client.completions.create(**kw)
        return 200, out.usage.completion_tokens
    except openai.APIStatusError as exc:
        return exc.status_code, 0


async def wave(app: str, n: int, start: int) -> list[tuple[int, int]]:
    async with openai.AsyncOpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(one(client, start + i) for i in range(n)))


def test_load_at_five_times_capacity(base):
    app = f"{base}/load"
    rss, results = [], []
    for w in range(WAVES):
        results += asyncio.run(wave(app, PER_WAVE, w * PER_WAVE))
        wait_idle(app)
        rss.append(replica_rss(app))
    codes = [code for code, _ in results]
    accepted = [tokens for code, tokens in results if code == 200]
    print(f"load: {len(results)} requests in {WAVES} waves of {PER_WAVE} against capacity "
          f"{RUNNING + WAITING}: {len(accepted)} completed, {codes.count(429)} got 429, "
          f"{codes.count(503)} got 503; replica RSS after each wave (MiB): {[r // 2**20 for r in rss]}")
    assert set(codes) <= {200, 429, 503}, sorted(set(codes))
    assert codes.count(429) > 0 and len(accepted) >= WAVES * (RUNNING + WAITING)
    assert all(tokens == MAX_TOKENS for tokens in accepted), "an accepted request did not complete"
    assert rss[-1] - rss[0] < 200 * 2**20, "replica memory kept growing from wave to wave"
    assert httpx.get(f"{app}/health").status_code == 200 and live_requests(app) == []
    assert metric(app, "pomona_requests_in_flight") == 0


def test_timeout_ends_the_request_clearly_and_frees_its_slot(base):
    app = f"{base}/timeout"
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1900, "ignore_eos": True}
    whole = httpx.post(f"{app}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout", whole.text
    assert "fewer tokens" in whole.json()["error"]["message"]
    with httpx.stream("POST", f"{app}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"code":"timeout"' in lines[-2], lines[-2:]
    wait_idle(app)
    ok = httpx.post(f"{app}/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def aborted(app: str) -> float:
    return metric(app, 'pomona_engine_requests_finished{kind="abort"}') or 0.0


async def leave_when(app: str, body: dict, phase: str, hold: dict | None = None) -> dict:
    """Send `body` (and first `hold`, which keeps the one slot busy); disconnect it once it is in `phase`."""
    async with httpx.AsyncClient(base_url=app, timeout=120) as http:
        holder = asyncio.create_task(http.post("/v1/completions", json=hold)) if hold else None
        if holder:
            await asyncio.sleep(0.1)
        task = asyncio.create_task(http.post("/v1/completions", json=body))
        seen: dict = {}
        for _ in range(2000):
            entries = (await http.get("/admin/requests")).json()["data"][0]["requests"]
            seen = next((e for e in entries if e["prompt_tokens"] == len(body["prompt"]) and e["phase"] == phase), {})
            if seen or task.done():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        if holder:
            holder.cancel()
        return seen


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
def test_disconnect_at_each_stage_frees_the_slot(base, phase):
    app = f"{base}/stages"
    wait_idle(app)
    before = aborted(app)
    prompt = token_prompt(1900 if phase == "prefill" else 40, salt=11)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1900 - len(prompt) + 40 if phase == "decode" else 8,
            "ignore_eos": True, "stream": True}
    hold = {"model": "tiny", "prompt": token_prompt(10, salt=12), "max_tokens": 1500, "ignore_eos": True,
            "stream": True} if phase == "queued" else None
    seen = asyncio.run(leave_when(app, body, phase, hold))
    assert seen, f"the request was never seen in phase {phase}"
    wait_idle(app)
    expected = before + (2 if hold else 1)  # the holder leaves too
    wait_for(lambda: aborted(app) >= expected, 10)
    assert aborted(app) == expected
    ok = httpx.post(f"{app}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_replica_killed_mid_stream(base):
    """Runs last: SIGKILL the "/load" engine replica while it streams; the client gets an error event."""
    app = f"{base}/load"
    pid = admin(app, "cache")["data"][0]["replica"]["pid"]
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                os.kill(pid, signal.SIGKILL)
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-2:]
    assert not any('"finish_reason":"length"' in line for line in lines)

    def served() -> bool:
        r = httpx.post(f"{app}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert r.status_code in (200, 503), r.text  # 503 + Retry-After while the replica restarts
        return r.status_code == 200
    wait_for(served, 180, 0.5)
    assert admin(app, "cache")["data"][0]["replica"]["pid"] != pid
