"""Fleet end to end: two "hosts" on one machine, one LLM replica each, prefix-affinity routing, failover.

A head and a second node are started with `pomona node start/join` (own temp dirs, host names and
ports; benchmarks/fleet_cluster.py), so nothing here touches another Ray cluster on this machine.
Two applications share the cluster: "/" is the fleet (affinity router, two replicas, at most one
per node) and "/single" one replica, the reference for the cached-token share. Clients are the
official `openai` client over real HTTP; the model is the tiny random one.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from benchmarks.fleet_cluster import local_cluster, node_pids, stop_node
from benchmarks.workloads import TextMaker, WorkloadSpec, first_turn_messages, prefix_workload
from e2e_helpers import free_port, tiny_args, wait_healthy

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

FLEET = {"router": "affinity", "stats_period_s": 1.0}
SPEC = WorkloadSpec("fleet-prefix", "prefix", num_requests=32, input_len=24, output_len=4, prefix_len=256,
                    num_prefixes=4, seed=5)


def fleet_args(model_dir: Path, replicas: int) -> dict:
    llm = {"num_replicas": replicas, "num_cpus": 0.25, "resources": {"apple_silicon": 1},
           "max_replicas_per_node": 1}
    return tiny_args(model_dir, llm_server=llm, fleet=FLEET)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    from deployments.app import build_app

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
    convs = prefix_workload(SPEC, TextMaker(model_dir))

    async def main() -> list[tuple[int, int]]:
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        sem = asyncio.Semaphore(concurrency)

        async def one(conv) -> tuple[int, int]:
            async with sem:
                out = await client.chat.completions.create(
                    model="tiny", messages=first_turn_messages(conv), max_tokens=conv.max_tokens, temperature=0,
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


def test_stopping_a_node_leaves_the_endpoint_serving(cluster):
    base, nodes = cluster
    # Retries: the ingress's readiness poll may hit the dead replica once and answer 503 +
    # Retry-After until its next poll (http_app); the openai client honours that.
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=4, timeout=60)

    async def inflight() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(i: int) -> str:
            try:
                stream = await aclient.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"Story {i}: " + "once upon a time " * 20}],
                    max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for _ in stream:
                    pass
                return "done"
            except openai.APIError as exc:  # an error event after tokens, or a 5xx before
                return f"error: {exc}"

        tasks = [asyncio.create_task(one(i)) for i in range(4)]
        await asyncio.sleep(1.5)
        await asyncio.to_thread(stop_node, nodes[1])
        try:
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 90))  # never a hang
        finally:
            await aclient.close()

    outcomes = asyncio.run(inflight())
    assert len(outcomes) == 4
    t0 = time.monotonic()
    answers = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Hi {i}"}],
                                              max_tokens=3, temperature=0) for i in range(6)]
    assert all(a.choices[0].message.content is not None for a in answers)
    assert time.monotonic() - t0 < 60
    assert httpx.get(f"{base}/v1/models", timeout=10).status_code == 200
