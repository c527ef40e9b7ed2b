"""Fleet routing: cached-token share and TTFT p50, prefix-affinity router vs Ray Serve's default router.

    python -m benchmarks.fleet.fleet_affinity                      # default model (SmolLM2-135M float32)
    python -m benchmarks.fleet.fleet_affinity --model tiny         # the tests' tiny random model (fast)

A two-node cluster on this machine (tests/fleet_cluster.py: own temp dirs and ports), two LLM
replicas, one per node. The same prefix-repetition workload (benchmarks/harness/workloads.py: several long
shared system prompts, distinct questions, shuffled) is sent through benchmarks/harness/client.py to a fresh
deployment with each router in turn; replicas are recreated between runs, so neither run inherits
the other's cache. Both deployments report routing stats at the same period.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness.client import EndpointConfig, aggregate, run_closed_loop, wait_serving
from benchmarks.harness.servers import ROOT
from benchmarks.harness.workloads import TextMaker, WorkloadSpec, prefix_workload

# The local cluster and the tiny model are the tests' fixtures (tests/fleet_cluster.py,
# tests/tiny_model.py), borrowed here: tests never import benchmarks, benchmarks may use them.
sys.path.insert(0, str(ROOT / "tests"))
from fleet_cluster import local_cluster  # noqa: E402

ROUTERS = ("affinity", "default")


def app_args(model: str, router: str, cpus: float) -> dict[str, Any]:
    return {
        "model": model, "served_model_name": "bench", "drain_s": 1,
        "engine": {"max_running": 8, "max_waiting": 256, "request_timeout_s": 600,
                   "cache": {"enabled": True, "ram_bytes": 512 * 2**20, "ssd_dir": None}},
        "llm_server": {"num_replicas": 2, "num_cpus": cpus, "resources": {"apple_silicon": 1},
                       "max_replicas_per_node": 1},
        "fleet": {"router": router, "stats_period_s": 1.0},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resolve_model(name: str) -> str:
    if name != "tiny":
        return name
    from tiny_model import build_tiny_model

    return str(build_tiny_model(Path(tempfile.mkdtemp(prefix="pomona-fleet-tiny-"))))


def workload(model: str, args: argparse.Namespace) -> list[Any]:
    from modelio.models import tokenizer_for as load_tokenizer

    spec = WorkloadSpec("fleet-prefix", "prefix", num_requests=args.prefixes * args.per_prefix,
                        input_len=args.question_len, output_len=args.output_len, prefix_len=args.prefix_len,
                        num_prefixes=args.prefixes, seed=args.seed)
    return prefix_workload(spec, TextMaker.from_tokenizer(load_tokenizer(model)))


def run_one(model: str, router: str, port: int, convs: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    from deployments.app import build_app

    name = f"fleet-{router}"
    serve.run(build_app(app_args(model, router, args.replica_cpus)), name=name, route_prefix="/")
    cfg = EndpointConfig(f"http://127.0.0.1:{port}/v1", "bench", extra_body={"ignore_eos": True})
    try:
        asyncio.run(wait_serving(cfg, 900))
        results, duration = asyncio.run(run_closed_loop(cfg, convs, args.concurrency))
        return aggregate(results, duration)
    finally:
        serve.delete(name)


def table(summary: dict[str, dict[str, Any]]) -> str:
    rows = [("router", "cached share", "TTFT p50 ms", "TTFT p95 ms", "req/s", "errors")]
    for router, s in summary.items():
        rows.append((router, f"{s['cached_token_share']:.3f}", f"{s['ttft_ms']['p50']:.0f}",
                     f"{s['ttft_ms']['p95']:.0f}", f"{s['request_throughput']:.2f}", str(s["errors"])))
    return "\n".join(f"{a:<10} {b:>12} {c:>12} {d:>12} {e:>7} {f:>7}" for a, b, c, d, e, f in rows)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default", help="default, tiny, or a local mlx-lm directory")
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--per-prefix", type=int, default=6, help="distinct questions per shared prefix")
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--question-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--replica-cpus", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--port-base", type=int, default=16000)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "fleet_affinity.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ["RAY_AUTH_MODE"] = "disabled"
    import ray
    from ray import serve

    model = resolve_model(args.model)
    convs = workload(model, args)
    port = free_port()  # replicas get OpenBLAS from the app's blas_preload: auto (platform notes)
    summary: dict[str, dict[str, Any]] = {}
    with local_cluster(("a", "b"), cpus_per_node=max(1, int(args.replica_cpus)), port_base=args.port_base) as (addr, _):
        ray.init(address=addr, configure_logging=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            for router in ROUTERS:
                summary[router] = run_one(model, router, port, convs, args)
                print(f"{router}: done", file=sys.stderr)
        finally:
            serve.shutdown()
            ray.shutdown()
    print(table(summary))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": summary},
                                   indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
