"""Benchmark one or more running OpenAI-compatible servers: concurrency sweep, request-rate mode,
prefix repetition and multi-turn chat. Writes results JSON and PNG plots.

    python -m benchmarks.harness.serve_bench --server mlx_lm=http://127.0.0.1:8081/v1 \
        --model DIR --tokenizer DIR --quick --out benchmarks/results/run1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

from tqdm import tqdm

from benchmarks.harness.client import Conversation, EndpointConfig, aggregate, run_closed_loop, run_poisson
from benchmarks.harness.workloads import Suite, TextMaker, WorkloadSpec, build, full_suite, quick_suite


def run_workload(cfg: EndpointConfig, convs: Sequence[Conversation], desc: str,
                 concurrency: int | None = None, rate: float | None = None, seed: int = 0) -> dict[str, Any]:
    """Closed loop at `concurrency`, or Poisson arrivals at `rate` req/s; aggregated metrics."""
    from benchmarks.harness.step_report import report, scrape

    total = sum(len(c.turns) for c in convs)
    before = scrape(cfg.base_url)  # Pomona's engine counters (None for other servers)
    with tqdm(total=total, desc=desc, unit="req", leave=False, file=sys.stderr) as bar:
        if rate is not None:
            coro = run_poisson(cfg, convs, rate, seed=seed, max_concurrency=concurrency, on_done=bar.update)
        else:
            coro = run_closed_loop(cfg, convs, concurrency or 1, on_done=bar.update)
        results, duration = asyncio.run(coro)
    agg = aggregate(results, duration)
    agg.update(concurrency=concurrency, request_rate=rate, num_conversations=len(convs))
    steps = report(before, scrape(cfg.base_url) if before else None, duration)
    if steps:
        agg["engine_steps"] = steps
    return agg


def warmup(cfg: EndpointConfig, maker: TextMaker) -> None:
    """One short request so first-call costs (graph building, allocation) stay out of the numbers."""
    conv = build(WorkloadSpec("warmup", "random", num_requests=2, input_len=16, output_len=4, seed=99), maker)
    run_workload(cfg, conv, "warmup", concurrency=2)


def run_suite(cfg: EndpointConfig, suite: Suite, maker: TextMaker, label: str,
              parts: Sequence[str] = ("sweep", "prefix", "multiturn", "rate")) -> dict[str, Any]:
    """Every workload of `suite` against one endpoint; keys: sweep, prefix, multiturn, rates."""
    warmup(cfg, maker)
    out: dict[str, Any] = {"label": label, "base_url": cfg.base_url}
    if "sweep" in parts:
        out["sweep"] = {}
        for c in suite.concurrencies:
            convs = build(suite.sweep_spec(c), maker)
            out["sweep"][str(c)] = run_workload(cfg, convs, f"{label} random c={c}", concurrency=c)
            _log(label, f"random c={c}", out["sweep"][str(c)])
    if "prefix" in parts:
        convs = build(suite.prefix, maker)
        out["prefix"] = run_workload(cfg, convs, f"{label} prefix", concurrency=suite.prefix_concurrency)
        _log(label, "prefix", out["prefix"])
    if "multiturn" in parts:
        convs = build(suite.multiturn, maker)
        out["multiturn"] = run_workload(cfg, convs, f"{label} multiturn", concurrency=suite.multiturn_concurrency)
        _log(label, "multiturn", out["multiturn"])
    if "rate" in parts and suite.request_rates:
        out["rates"] = {}
        spec = suite.sweep_spec(max(suite.concurrencies))
        for r in suite.request_rates:
            convs = build(replace(spec, name=f"random-r{r}", seed=spec.seed + 500 + int(r * 10)), maker)
            out["rates"][str(r)] = run_workload(cfg, convs, f"{label} rate={r}", rate=r, seed=spec.seed)
            _log(label, f"rate={r}", out["rates"][str(r)])
    return out


def _log(label: str, what: str, agg: dict[str, Any]) -> None:
    print(f"[{label}] {what}: {agg['completed']} ok, {agg['errors']} errors, "
          f"{agg['output_throughput']:.1f} out tok/s, TTFT p50 {agg['ttft_ms']['p50']:.0f} ms, "
          f"TPOT p50 {agg['tpot_ms']['p50']:.1f} ms, cached {agg['cached_token_share']:.0%}", flush=True)
    steps = agg.get("engine_steps") or {}
    if "engine_ttft_ms" in steps and "ingress_ttft_ms" in steps:  # Pomona: where its mean TTFT went
        client, ingress, engine = agg["ttft_ms"]["mean"], steps["ingress_ttft_ms"], steps["engine_ttft_ms"]
        print(f"[{label}]   TTFT mean {client:.1f} ms = engine {engine:.1f} (queue {steps['engine_queue_ms']:.1f}) "
              f"+ hops {ingress - engine:.1f} + front {client - ingress:.1f}", flush=True)
    if agg["errors"]:
        print(f"[{label}]   errors: {agg['error_samples']}", flush=True)


def eos_extra_body(mode: str, eos_ids: Sequence[int]) -> dict[str, Any]:
    """How to ask a server for fixed-length outputs. `ignore_eos` is vLLM's (and Pomona's) field;
    servers without it honour a -100 logit bias on the EOS ids, which has the same effect."""
    if mode == "ignore_eos":
        return {"ignore_eos": True}
    if mode == "logit_bias":
        return {"logit_bias": {str(t): -100.0 for t in eos_ids}}
    if mode == "none":
        return {}
    raise ValueError(f"unknown eos mode {mode!r}")


def eos_ids_of(model_dir: str | Path | None) -> list[int]:
    """EOS ids from an mlx-lm model directory's config / generation config (empty if unknown)."""
    ids: list[int] = []
    if model_dir is None:
        return ids
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if path.exists():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids += value if isinstance(value, list) else ([value] if value is not None else [])
    return sorted(set(ids))


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str))


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", action="append", required=True, metavar="LABEL=URL",
                   help="server to benchmark, e.g. pomona=http://127.0.0.1:8000/v1 (repeatable)")
    p.add_argument("--model", default="default", help="model name sent in requests")
    p.add_argument("--tokenizer", default=None, help="model dir or tokenizer.json for token-exact lengths")
    p.add_argument("--eos-mode", default="logit_bias", choices=["ignore_eos", "logit_bias", "none"])
    p.add_argument("--quick", action="store_true", help="small workloads (minutes on 2 cores)")
    p.add_argument("--parts", default="sweep,prefix,multiturn,rate")
    p.add_argument("--concurrency", default=None, help="comma list overriding the suite's sweep")
    p.add_argument("--request-rate", default=None, help="comma list of req/s for the Poisson mode")
    p.add_argument("--input-len", type=int, default=None)
    p.add_argument("--output-len", type=int, default=None)
    p.add_argument("--out", default=f"benchmarks/results/serve-{time.strftime('%Y%m%d-%H%M%S')}")
    return p.parse_args(argv)


def suite_from_args(args: argparse.Namespace) -> Suite:
    suite = quick_suite() if args.quick else full_suite()
    if args.concurrency:
        suite = replace(suite, concurrencies=tuple(int(x) for x in args.concurrency.split(",")))
    if args.request_rate:
        suite = replace(suite, request_rates=tuple(float(x) for x in args.request_rate.split(",")))
    rnd = suite.random
    if args.input_len:
        rnd = replace(rnd, input_len=args.input_len)
    if args.output_len:
        rnd = replace(rnd, output_len=args.output_len)
    return replace(suite, random=rnd)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    suite = suite_from_args(args)
    maker = TextMaker(args.tokenizer)
    extra = eos_extra_body(args.eos_mode, eos_ids_of(args.tokenizer))
    out_dir = Path(args.out)
    results: dict[str, Any] = {"suite": asdict(suite), "servers": {}}
    for item in args.server:
        label, _, url = item.partition("=")
        cfg = EndpointConfig(base_url=url.rstrip("/"), model=args.model, extra_body=extra)
        results["servers"][label] = run_suite(cfg, suite, maker, label, parts=args.parts.split(","))
        write_json(out_dir / "results.json", results)  # after each server, so a crash keeps the rest
    from benchmarks.harness.report import plot_sweep

    for png in plot_sweep(results["servers"], out_dir):
        print(f"plot: {png}")
    print(f"results: {out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
