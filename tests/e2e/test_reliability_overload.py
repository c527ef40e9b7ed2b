"""Overload, time limits and faults over real HTTP on a real local Ray Serve (tiny model, official client).

Apps on one cluster: "/load" (4 running + 8 queued = capacity 12), "/stages" (one slot, 8-token
prefill chunks, so a request can be caught queued, prefilling or decoding) and "/timeout"
(engine.request_timeout_s = 1 s); "/none" is added for one test: its model server can never be
placed. The kill tests run last: they restart "/stages"'s and "/load"'s replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from e2e_helpers import metric, tiny_args, wait_healthy
from reliability_helpers import admin, deploy, live_requests, own_cluster, token_prompt, undeploy, wait_for, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
RUNNING, WAITING = 4, 8
WAVES, PER_WAVE, MAX_TOKENS = 3, 48, 24  # 4x capacity per wave
SOAK_S, SOAK_CLIENTS = 60.0, 8


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
    """The replica's and its engine process's RSS together (the engine's own process holds the model)."""
    replica = admin(app, "cache")["data"][0]["replica"]
    assert replica["engine_pid"] != replica["pid"]  # engine_process: true, the default
    return sum(psutil.Process(replica[k]).memory_info().rss for k in ("pid", "engine_pid"))


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
    """(HTTP status, completion tokens, Retry-After) of one request; half stream, half do not."""
    kw = dict(model="tiny", prompt=f"Request {i}: tell a story", max_tokens=MAX_TOKENS, temperature=0.7,
              seed=i, extra_body={"ignore_eos": True})
    try:
        if i % 2:
            chunks = [c async for c in await client.completions.create(
                stream=True, stream_options={"include_usage": True}, **kw)]
            assert chunks[-1].usage is not None, "a stream ended without its usage chunk"
            return 200, chunks[-1].usage.completion_tokens, None
        out = await client.completions.create(**kw)
        return 200, out.usage.completion_tokens, None
    except openai.APIStatusError as exc:
        return exc.status_code, 0, exc.response.headers.get("retry-after")


async def wave(app: str, n: int, start: int) -> list[tuple[int, int, str | None]]:
    async with openai.AsyncOpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0, timeout=120) as client:
        return await asyncio.gather(*(one(client, start + i) for i in range(n)))


def test_load_at_four_times_capacity(base):
    app = f"{base}/load"
    rss, results = [], []
    for w in range(WAVES):
        results += asyncio.run(wave(app, PER_WAVE, w * PER_WAVE))
        wait_idle(app)
        rss.append(replica_rss(app))
    codes = [code for code, _, _ in results]
    accepted = [tokens for code, tokens, _ in results if code == 200]
    print(f"load: {len(results)} requests in {WAVES} waves of {PER_WAVE} against capacity "
          f"{RUNNING + WAITING}: {len(accepted)} completed, {codes.count(429)} got 429; "
          f"replica RSS after each wave (MiB): {[r // 2**20 for r in rss]}")
    assert set(codes) <= {200, 429}, sorted(set(codes))  # refused for load, never a 5xx
    assert codes.count(429) > 0 and len(accepted) >= WAVES * (RUNNING + WAITING)
    assert all(int(after) >= 1 for code, _, after in results if code == 429), "a 429 without Retry-After"
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
        # The holder decodes before `body` is sent: `body` then queues behind it (a fixed sleep let a
        # loaded box deliver `body` first, or catch it queued just as the holder ran out of tokens).
        task = None
        try:
            if holder and not await _entry(http, len(hold["prompt"]), "decode", holder):
                return {}
            task = asyncio.create_task(http.post("/v1/completions", json=body))
            return await _entry(http, len(body["prompt"]), phase, task)
        finally:
            for t in (task, holder):
                if t is not None:
                    t.cancel()


async def _entry(http: httpx.AsyncClient, prompt_tokens: int, phase: str, task: asyncio.Task) -> dict:
    """The engine's entry for the request of `prompt_tokens` tokens once it is in `phase` ({} if
    `task`, that request, ended first)."""
    for _ in range(2000):
        entries = (await http.get("/admin/requests")).json()["data"][0]["requests"]
        seen = next((e for e in entries if e["prompt_tokens"] == prompt_tokens and e["phase"] == phase), {})
        if seen or task.done():
            return seen
        await asyncio.sleep(0.01)
    return {}


@pytest.mark.parametrize("phase", ["queued", "prefill", "decode"])
def test_disconnect_at_each_stage_frees_the_slot(base, phase):
    app = f"{base}/stages"
    wait_idle(app)
    before = aborted(app)
    prompt = token_prompt(1900 if phase == "prefill" else 40, salt=11)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1900 - len(prompt) + 40 if phase == "decode" else 8,
            "ignore_eos": True, "stream": True}
    hold = {"model": "tiny", "prompt": token_prompt(10, salt=12), "max_tokens": 2000, "ignore_eos": True,
            "stream": True} if phase == "queued" else None
    seen = asyncio.run(leave_when(app, body, phase, hold))
    assert seen, f"the request was never seen in phase {phase}"
    wait_idle(app)
    expected = before + (2 if hold else 1)  # the holder leaves too
    wait_for(lambda: aborted(app) >= expected, 10)
    assert aborted(app) == expected
    ok = httpx.post(f"{app}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def _deploy_unplaceable(tiny_model_dir) -> None:
    """serve.run waits for a model server that never comes: on a thread, ended with the app."""
    args = tiny_args(tiny_model_dir, llm_server={"num_cpus": 0.5, "resources": {"pomona_no_such_node": 1}})
    with contextlib.suppress(Exception):
        deploy("/none", args)


def test_503_with_retry_after_while_no_replica_can_serve(base, tiny_model_dir):
    """Real Serve, real handle: the ingress is up, its model server replica can never be placed."""
    threading.Thread(target=_deploy_unplaceable, args=(tiny_model_dir,), daemon=True).start()
    app = f"{base}/none"
    try:
        wait_for(lambda: httpx.get(f"{app}/health", timeout=10).status_code == 503, 120, 0.5)
        chat = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for route, body in (("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                            ("/v1/chat/completions", chat), ("/v1/messages", chat),
                            ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2})):
            r = httpx.post(f"{app}{route}", json=body, timeout=30)
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1, (route, r.text)
            kind = r.json()["error"]["type"]
            assert kind == ("overloaded_error" if route == "/v1/messages" else "service_unavailable"), r.text
        with pytest.raises(openai.APIStatusError) as caught:  # what an SDK user sees
            openai.OpenAI(base_url=f"{app}/v1", api_key="x", max_retries=0).completions.create(
                model="tiny", prompt="hi", max_tokens=2)
        assert caught.value.status_code == 503
        assert metric(app, "pomona_engine_up") == 0 and metric(app, "pomona_engine_stats_errors_total") >= 1
    finally:
        undeploy("/none")


async def soak_client(app: str, rng: random.Random, deadline: float) -> list[str]:
    """Requests until `deadline`, each left at a random point (or read to its end); what happened."""
    seen: list[str] = []
    async with httpx.AsyncClient(base_url=app, timeout=120) as http:
        while time.monotonic() < deadline:
            body = {"model": "tiny", "prompt": f"soak {rng.random()}", "max_tokens": rng.randint(4, 48),
                    "ignore_eos": True, "stream": rng.random() < 0.75}
            leave_after = rng.choice([0, 1, 2, 4, 8, None])  # SSE lines read before leaving; None: all
            if not body["stream"]:
                try:
                    r = await asyncio.wait_for(http.post("/v1/completions", json=body), rng.uniform(0.01, 1.0))
                    seen.append(str(r.status_code))
                except asyncio.TimeoutError:
                    seen.append("left")
                continue
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    seen.append(str(resp.status_code))
                    continue
                lines = 0
                async for line in resp.aiter_lines():
                    lines += bool(line)
                    if leave_after is not None and lines > leave_after:
                        break
                seen.append("left" if leave_after is not None and lines > leave_after else "200")
    return seen


async def soak(app: str, seconds: float) -> list[str]:
    deadline = time.monotonic() + seconds
    rngs = [random.Random(seed) for seed in range(SOAK_CLIENTS)]
    return [s for client in await asyncio.gather(*(soak_client(app, r, deadline) for r in rngs)) for s in client]


def test_soak_with_random_disconnects_returns_to_idle_and_memory_stays_flat(base):
    app = f"{base}/load"
    asyncio.run(soak(app, 10))  # warm-up: allocator, caches and pools reach their working size
    wait_idle(app)
    admin(app, "cache/clear", method="POST")
    before, disconnects = replica_rss(app), metric(app, "pomona_client_disconnects_total")
    seen = asyncio.run(soak(app, SOAK_S))
    wait_idle(app)  # every running and queued request ended: the engine's slots are all free
    admin(app, "cache/clear", method="POST")
    after = replica_rss(app)
    print(f"soak: {len(seen)} requests in {SOAK_S:.0f} s from {SOAK_CLIENTS} clients: "
          f"{seen.count('200')} read to the end, {seen.count('left')} left early, {seen.count('429')} got 429; "
          f"replica RSS {before // 2**20} -> {after // 2**20} MiB")
    assert set(seen) <= {"200", "left", "429"}, sorted(set(seen))
    assert seen.count("left") > 0 and seen.count("200") > 0
    assert metric(app, "pomona_requests_in_flight") == 0 and metric(app, "pomona_engine_running") == 0
    assert metric(app, "pomona_client_disconnects_total") > disconnects
    assert after - before < 150 * 2**20, "replica memory grew over the soak"
    ok = httpx.post(f"{app}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and httpx.get(f"{app}/health").status_code == 200


def kill_mid_stream(app: str, victim: str) -> tuple[dict, list[str]]:
    """Stream a long completion from `app`, SIGKILL its replica's `victim` ("pid" or "engine_pid")
    after the first events, and wait until the app serves again (503 + Retry-After meanwhile).
    Returns the replica's admin record from before and the streamed lines."""
    replica = admin(app, "cache")["data"][0]["replica"]
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                os.kill(replica[victim], signal.SIGKILL)
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-2:]
    assert not any('"finish_reason":"length"' in line for line in lines)

    def served() -> bool:
        r = httpx.post(f"{app}/v1/completions", json={**body, "stream": False, "max_tokens": 3}, timeout=30)
        assert r.status_code in (200, 503), r.text
        return r.status_code == 200
    wait_for(served, 180, 0.5)
    return replica, lines


def test_engine_process_killed_mid_stream(base):
    """SIGKILL "/stages"'s engine process (not its replica) while it streams: the client gets an
    error event, the health check fails, and Serve replaces the replica, which serves again."""
    app = f"{base}/stages"
    replica, lines = kill_mid_stream(app, "engine_pid")
    assert "engine process exited" in lines[-2], lines[-2]
    now = admin(app, "cache")["data"][0]["replica"]
    assert now["pid"] != replica["pid"] and now["engine_pid"] != replica["engine_pid"]


def test_replica_killed_mid_stream(base):
    """Runs last: SIGKILL the "/load" engine replica while it streams; the client gets an error event."""
    app = f"{base}/load"
    replica, _ = kill_mid_stream(app, "pid")
    assert admin(app, "cache")["data"][0]["replica"]["pid"] != replica["pid"]
    # No orphan: the dead replica's engine process ended with it (it exits at its socket's end).
    wait_for(lambda: not psutil.pid_exists(replica["engine_pid"]) or
             psutil.Process(replica["engine_pid"]).status() == psutil.STATUS_ZOMBIE, 30, 0.2)
