"""Fleet end to end: two "hosts" on one machine, one LLM replica each, prefix-affinity routing, failover.

A head and a second node are started with `pomona node start/join` (own temp dirs, host names and
ports; tests/fleet_cluster.py), so nothing here touches another Ray cluster on this machine.
Two applications share the cluster: "/" is the fleet (affinity router, two replicas, at most one
per node) and "/single" one replica, the reference for the cached-token share. Clients are the
official `openai` client over real HTTP (raw SSE through httpx where the wire itself is checked),
never with client retries; the model is the tiny random one. The failover test runs last: it
kills a replica (Serve then starts a new one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from e2e_helpers import free_port, long_context_copy, metric, tiny_args, wait_healthy
from fleet_cluster import local_cluster, node_pids
from tiny_model import CORPUS

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# Saturation 8: a replica's load as Serve's queue-length probe sees it counts every call in flight
# there, the /admin/requests polls of the failover test included; at the default 4 the second
# waiting request spilled to the other replica (2 streams + 1 waiting + 1 admin call), and the
# test waited in vain for two queued requests on the victim.
FLEET = {"router": "affinity", "stats_period_s": 1.0, "saturation": 8}
LONG = 12_000  # tokens of the streams that must still run when their replica is killed


def prefix_requests(model_dir: Path, requests: int = 32, prefixes: int = 4, prefix_tokens: int = 256,
                    question_tokens: int = 24, seed: int = 5) -> list[list[dict[str, str]]]:
    """Prefix repetition, as vLLM's dataset of that name: `prefixes` shared system prompts, each
    followed by distinct questions, shuffled (seeded) so the requests of a group interleave. Lengths
    are exact in the tiny model's tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    words = CORPUS.split()
    rng = random.Random(seed)

    def text(tokens: int) -> str:
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(tokens)), add_special_tokens=False).ids
        return tok.decode(ids[:tokens])

    systems = [text(prefix_tokens) for _ in range(prefixes)]
    convs = [[{"role": "system", "content": systems[i % prefixes]}, {"role": "user", "content": text(question_tokens)}]
             for i in range(requests)]
    rng.shuffle(convs)
    return convs


def fleet_args(model_dir: Path, replicas: int) -> dict:
    llm = {"num_replicas": replicas, "num_cpus": 0.25, "resources": {"apple_silicon": 1},
           "max_replicas_per_node": 1}
    # A batch of 2: the failover test fills one replica with two streams, so more requests queue there.
    engine = {"max_running": 2, "prefill_batch": 2, "max_tokens_limit": LONG}
    return tiny_args(model_dir, llm_server=llm, fleet=FLEET, engine=engine)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from deployments.app import build_app

    # The victims of the failover test must outlast the setup around them (admin polls, a busy box).
    tiny_model_dir = long_context_copy(tiny_model_dir, tmp_path_factory.mktemp("fleet") / "model", LONG + 1024)
    port = free_port()
    with local_cluster(("a", "b"), cpus_per_node=1, port_base=11000 + (os.getpid() % 8) * 1000) as (addr, nodes):
        ray.init(address=addr, configure_logging=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_app(fleet_args(tiny_model_dir, 2)), name="fleet", route_prefix="/", blocking=False)
            # The reference replica needs no apple_silicon: both nodes' units go to the fleet.
            single = tiny_args(tiny_model_dir, llm_server={"num_replicas": 1, "num_cpus": 0.25, "resources": {}})
            serve.run(build_app(single), name="single", route_prefix="/single", blocking=False)
            base = f"http://127.0.0.1:{port}"
            wait_healthy(base, 240)
            wait_healthy(f"{base}/single", 240)
            yield base, nodes
        finally:
            serve.shutdown()
            ray.shutdown()


def run_workload(base: str, model_dir: Path, concurrency: int = 4) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) of each request of the prefix-repetition workload."""
    convs = prefix_requests(model_dir)

    async def main() -> list[tuple[int, int]]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        sem = asyncio.Semaphore(concurrency)

        async def one(messages: list[dict[str, str]]) -> tuple[int, int]:
            async with sem:
                out = await client.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=4, temperature=0,
                    extra_body={"ignore_eos": True})
            return out.usage.prompt_tokens, out.usage.prompt_tokens_details.cached_tokens

        try:
            return list(await asyncio.gather(*(one(c) for c in convs)))
        finally:
            await client.close()

    return asyncio.run(main())


def share(results: list[tuple[int, int]]) -> float:
    return sum(c for _, c in results) / sum(p for p, _ in results)


def replica_nodes(nodes) -> list[str]:
    """The node (host name) of each fleet LLM replica process: its parent is that node's raylet."""
    owners = {pid: n.name for n in nodes for pid in node_pids(n.temp_dir)}
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if cmdline.startswith(b"ray::ServeReplica:fleet:LLMServer"):
            found.append(owners.get(ppid, "?"))
    return sorted(found)


def test_replicas_on_different_nodes(cluster):
    _, nodes = cluster
    assert replica_nodes(nodes) == ["a", "b"]


def test_affinity_keeps_cached_share(cluster, tiny_model_dir):
    base, _ = cluster
    single = share(run_workload(f"{base}/single", tiny_model_dir))
    fleet = share(run_workload(base, tiny_model_dir))
    print(f"cached-token share: single replica {single:.3f}, fleet with affinity {fleet:.3f}")
    assert single > 0.5
    assert fleet >= 0.8 * single


PREFIX = "Story of the victim replica: " + "once upon a time there was a fox " * 12  # > one cache block


def sse_stream(base: str, content: str, max_tokens: int, lines: list[str]) -> None:
    """A raw SSE chat stream (the wire, to see error events and [DONE]); no client retries."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=httpx.Timeout(60)) as resp:
            lines.append(f"status {resp.status_code}")
            lines.extend(line for line in resp.iter_lines() if line)
    except httpx.HTTPError as exc:  # recorded, and the assertions below say what was expected
        lines.append(f"transport error {exc!r}")


def chunks(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def replica_of(base: str, request_ids: set[str]) -> dict[str, tuple[int, str]]:
    """Request id -> (pid of the LLM replica holding it, its phase), from GET /admin/requests."""
    answer = httpx.get(f"{base}/admin/requests", timeout=10).json()
    return {r["id"]: (int(replica["replica"]["pid"]), r["phase"])
            for replica in answer.get("data", []) for r in replica["requests"] if r["id"] in request_ids}


def wait_for(base: str, predicate, what: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
            value = predicate()
            if value:
                return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; /admin/requests: "
                         f"{httpx.get(f'{base}/admin/requests', timeout=10).text}")


def test_killed_replica_fails_over(cluster):
    """SIGKILL one LLM replica mid-flight, clients without retries: streams that had tokens end with
    an error event and [DONE]; requests that had none (queued behind its full batch) are retried on
    the other replica and succeed; nothing hangs; requests for the dead replica's prefix then go to
    a live one at the first try."""
    base, _ = cluster
    metric_name = "pomona_failover_retries_total"
    start = metric(base, metric_name)
    started: list[threading.Thread] = []

    def launch(content: str, max_tokens: int) -> list[str]:
        lines: list[str] = []
        started.append(threading.Thread(target=sse_stream, args=(base, PREFIX + content, max_tokens, lines)))
        started[-1].start()
        return lines

    # Two long streams fill one replica's batch (engine.max_running 2); affinity sends both there.
    victims = []
    for i in range(2):
        victims.append(launch(f" Go on {i}.", LONG))
        wait_for(base, lambda: len(chunks(victims[-1])) >= 2, f"stream {i} to start")
    ids = {chunks(v)[0]["id"] for v in victims}
    where = wait_for(base, lambda: (w := replica_of(base, ids)) and len(w) == 2 and w, "/admin/requests to list both")
    pids = {pid for pid, _ in where.values()}
    assert len(pids) == 1, f"affinity should put both streams on one replica: {where}"
    victim = pids.pop()
    # Same prefix: to the same replica, where they wait for a slot and get no token before it dies.
    waiting = [launch(f" Then {i}?", 8) for i in range(2)]
    wait_for(base, lambda: sum(1 for replica in httpx.get(f"{base}/admin/requests", timeout=10).json()["data"]
                         if int(replica["replica"]["pid"]) == victim
                         for r in replica["requests"] if r["phase"] == "queued") == 2,
             "two requests queued on the victim")
    os.kill(victim, signal.SIGKILL)
    for t in started:
        t.join(90)
    assert not any(t.is_alive() for t in started), "a request hung after its replica died"

    for lines in victims:
        assert lines[0] == "status 200" and lines[-1] == "data: [DONE]", lines[-3:]
        *tokens, error = chunks(lines)
        assert error.get("error", {}).get("code") == "service_unavailable", error
        assert any(c["choices"][0]["delta"].get("content") for c in tokens)
    for lines in waiting:  # no client-visible error: a normal, complete answer
        assert lines[0] == "status 200" and lines[-1] == "data: [DONE]", lines[-3:]
        assert not any("error" in c for c in chunks(lines)), lines
        assert chunks(lines)[-1]["choices"][0]["finish_reason"] == "length", lines[-3:]
    after_kill = metric(base, metric_name)
    assert after_kill - start == 2  # each waiting request failed on the dead replica once, then succeeded

    # The router dropped the dead replica: the prefix it held is served elsewhere, first time.
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(6):
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PREFIX + f" {i}"}],
                                             max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason == "length"
    assert metric(base, metric_name) == after_kill
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
