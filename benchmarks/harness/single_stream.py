"""Single-stream latency side by side, interleaved request by request so drift cancels.

    python -m benchmarks.harness.single_stream [--servers pomona,mlx_lm.server] [--rounds 12] [--model default]

The 2-core box drifts by up to 25 % in speed over minutes, so servers measured one after the other
(`benchmarks/harness/side_by_side.py`) can differ by more than the 5 % the single-stream goal allows. Here
every server is up at once and they take turns: each round sends one fresh prompt (the harness's
quick random workload: 64 prompt tokens, 64 output tokens held at length) to each server in turn,
the order reversed every other round. While one server answers, every other server's processes
are stopped (SIGSTOP, then SIGCONT), so an idle server's timers and threads (Ray's are many) cost
the measured one nothing. Reported per server: TPOT and TTFT p50 over the rounds; per server, the
median of its per-round TPOT ratios to mlx_lm.server's (or the last server's): both requests of a
round ran within seconds of each other.
Linux (procfs) only: elsewhere the other servers are not stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import httpx

from benchmarks.harness.client import EndpointConfig, percentile, stream_chat, wait_serving
from benchmarks.harness.proc_cpu import pids_of
from benchmarks.harness.servers import Running, available, ensure_blas, launched
from benchmarks.harness.side_by_side import make_spec, served_model_name
from benchmarks.harness.models import benchmark_model_dir
from benchmarks.harness.workloads import TextMaker, build, first_turn_messages, quick_suite


REFERENCE = "mlx_lm.server"  # every other server's TPOT is divided by this one's (else by the last's)


@contextlib.contextmanager
def paused(running: Sequence[Running]) -> Iterator[None]:
    """Stop every process of these servers for the duration, then let them go on."""
    pids = [p for r in running for p in pids_of(r.session, r.marker)]
    _signal(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal(pids, signal.SIGCONT)


def _signal(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def one_request(cfg: EndpointConfig, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    async def go() -> Any:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await stream_chat(client, cfg, messages, max_tokens)

    r = asyncio.run(go())
    if not r.ok:
        raise RuntimeError(f"{cfg.base_url}: {r.error}")
    return {"tpot_ms": r.tpot * 1000 if r.tpot else None, "ttft_ms": r.ttft * 1000, "tokens": r.output_tokens}


def rounds(names: Sequence[str], cfgs: dict[str, EndpointConfig], running: dict[str, Running],
           model_dir: Path, n: int) -> dict[str, list[dict[str, Any]]]:
    maker = TextMaker(model_dir)
    spec = quick_suite().sweep_spec(1)
    convs = build(replace(spec, num_requests=n + 1, seed=4242), maker)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i, conv in enumerate(convs):
        order = list(names) if i % 2 == 0 else list(reversed(names))
        for name in order:
            others = [running[o] for o in names if o != name]
            with paused(others):
                # Untimed: a server thawed after its wait answers again first (Pomona's ingress
                # finds its readiness poll timed out across the stop and polls again).
                asyncio.run(wait_serving(cfgs[name], 120))
                result = one_request(cfgs[name], first_turn_messages(conv), conv.max_tokens)
            if i > 0:  # the first round is untimed: first requests pay one-time costs
                out[name].append(result)
        if i > 0:
            print(f"round {i}: " + ", ".join(f"{k} {out[k][-1]['tpot_ms']:.1f} ms" for k in order), flush=True)
    return out


def summary(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    names = list(results)
    out: dict[str, Any] = {"servers": {}, "ratios": {}}
    for name, rs in results.items():
        tpot = [r["tpot_ms"] for r in rs if r["tpot_ms"]]
        out["servers"][name] = {"rounds": len(rs), "tpot_ms_p50": percentile(tpot, 50),
                                "ttft_ms_p50": percentile([r["ttft_ms"] for r in rs], 50)}
    ref = REFERENCE if REFERENCE in names else names[-1]
    for name in names:
        if name == ref:
            continue
        paired = [a["tpot_ms"] / b["tpot_ms"] for a, b in zip(results[name], results[ref])
                  if a["tpot_ms"] and b["tpot_ms"]]
        out["ratios"][f"{name} / {ref}"] = {"tpot_median_of_round_ratios": statistics.median(paired),
                                            "tpot_ratio_of_p50s": out["servers"][name]["tpot_ms_p50"]
                                            / out["servers"][ref]["tpot_ms_p50"]}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="pomona,mlx_lm.server",
                   help="any of side_by_side's servers and variants (e.g. pomona-throughput)")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--model", default="default")
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--out", default=f"benchmarks/results/single-{time.strftime('%Y%m%d-%H%M%S')}")
    args = p.parse_args(argv)
    ensure_blas()
    names = args.servers.split(",")
    model_dir = benchmark_model_dir(args.model)
    out = Path(args.out).resolve()
    specs = {n: make_spec(n, model_dir, args.base_port + i, out) for i, n in enumerate(names)}
    for name, spec in specs.items():
        if why := available(spec):
            raise SystemExit(f"{name} cannot run here: {why}")
    with contextlib.ExitStack() as stack:
        running: dict[str, Running] = {}
        cfgs: dict[str, EndpointConfig] = {}
        for name, spec in specs.items():  # one at a time: a loading server would slow the other's start
            with paused(list(running.values())):
                running[name] = stack.enter_context(launched(spec, out / "logs"))
                cfgs[name] = EndpointConfig(spec.base_url, served_model_name(spec), spec.extra_body)
                asyncio.run(wait_serving(cfgs[name], spec.ready_timeout_s))
            print(f"[{name}] serving", flush=True)
        results = rounds(names, cfgs, running, model_dir, args.rounds)
    data = {"command": "python -m benchmarks.harness.single_stream " + " ".join(argv or sys.argv[1:]),
            "model_dir": str(model_dir), "results": results, **summary(results)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(data, indent=1))
    print(json.dumps({k: data[k] for k in ("servers", "ratios")}, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
