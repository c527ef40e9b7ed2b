"""The side-by-side suite's prefix part through the engine in process, with a timeline of each
first token: where a prefix hit's TTFT goes, step by step, under one or more engine settings.

    python -m benchmarks.engine.prefix_part MODEL_DIR [--variant NAME:KEY=VALUE,...] ... [--quick]

Why: over HTTP on the H200 the prefix part's TTFT p50 (2,000-token system prompts shared by 4
groups, 64-token user messages, 4 in flight) stayed at ~100 ms, ~90 of them in the engine, while
a step there takes ~12 ms: a hit that restores its prefix and prefills ~70 tokens should need two
or three. This runs the same requests (chat template applied, greedy, EOS ignored) against
`AsyncEngine` and records, for every step, its start, end, decoding rows and new admissions, and
for every request when it was sent, the step that admitted it and its first token; the report
splits a warm request's TTFT into waiting for admission, the admitting step, and the steps after
it until the first token, so the fix goes where the time is.

Variants run one after the other, each on a fresh engine and a fresh SSD directory (the default
serve_config.yaml settings, `--variant` overriding): e.g. `--variant default: --variant nossd:cache.ssd_dir=null
--variant direct:direct_first_token=128`. JSON (last line): {variant: {warm: {...}, cold: {...}, steps: {...}}}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from benchmarks.harness.client import percentile


@dataclass
class StepLog:
    """Every engine step's (start, end, running rows, requests it admitted), appended on the MLX thread."""

    steps: list[tuple[float, float, int, tuple[str, ...]]] = field(default_factory=list)
    runs: list[float] = field(default_factory=list)  # per step, the seconds of its batch's run (Engine.run)

    def wrap(self, engine: Any) -> None:
        step, run = engine.step, engine.run
        took = [0.0]

        def timed_run() -> Any:
            t = time.perf_counter()
            try:
                return run()
            finally:
                took[0] = time.perf_counter() - t

        def logged() -> Any:
            waiting = {rid for rid, seq in engine.seqs.items() if seq.admitted_at is None}
            took[0] = 0.0
            t0 = time.perf_counter()
            events = step()
            t1 = time.perf_counter()
            admitted = tuple(rid for rid in waiting if rid in engine.seqs and engine.seqs[rid].admitted_at is not None)
            self.steps.append((t0, t1, len(engine.runner), admitted))
            self.runs.append(took[0])
            return events

        engine.step, engine.run = logged, timed_run


def timed_engine(config: Any, log: StepLog) -> Any:
    """An AsyncEngine whose engine steps are logged in `log` (the class is built here: the engine
    module is imported only once MLX may load)."""
    from engine.loop import AsyncEngine

    class Timed(AsyncEngine):
        def _build(self) -> Any:
            engine = super()._build()
            log.wrap(engine)
            return engine

    return Timed(config)


async def _one(engine: Any, tokens: Sequence[int], max_tokens: int, rid: str) -> dict[str, Any]:
    from benchmarks.engine.prefix_hit import first_token

    sent, first, cached = await first_token(engine, tokens, rid, max_tokens, ignore_eos=True)
    return {"id": rid, "sent": sent, "first": first, "cached": cached, "prompt": len(tokens)}


def timeline(req: dict[str, Any], steps: Sequence[tuple[float, float, int, tuple[str, ...]]],
             runs: Sequence[float] = ()) -> dict[str, float]:
    """One request's TTFT split by the step log: until its admitting step began (the step running when
    it arrived, and any it waited through), that step (`admit_run_ms` of it the batch's run, the rest
    scheduling and admitting: the prefix restore), and the steps after it until its first token."""
    admit = next((i for i, s in enumerate(steps) if req["id"] in s[3]), None)
    ttft = req["first"] - req["sent"]
    if admit is None:
        return {"ttft_ms": 1e3 * ttft}
    t0, t1 = steps[admit][0], steps[admit][1]
    after = [s for s in steps[admit + 1:] if s[0] < req["first"]]
    return {"ttft_ms": 1e3 * ttft, "to_admit_ms": 1e3 * (t0 - req["sent"]), "admit_step_ms": 1e3 * (t1 - t0),
            "after_ms": 1e3 * (req["first"] - t1), "steps_after": float(len(after)),
            "steps_waited": float(sum(1 for s in steps[:admit] if s[1] > req["sent"])),
            "rows_at_admit": float(steps[admit][2]),
            **({"admit_run_ms": 1e3 * runs[admit]} if admit < len(runs) else {})}


def _summary(rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    if not rows:
        return {"n": 0}
    out: dict[str, Any] = {"n": len(rows)}
    for key in rows[0]:
        vals = [r[key] for r in rows if key in r]
        out[key] = {"p50": round(percentile(vals, 50), 2), "mean": round(statistics.fmean(vals), 2)}
    return out


async def run_variant(model_dir: str, overrides: dict[str, Any], quick: bool, concurrency: int | None) -> dict[str, Any]:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from benchmarks.engine.bare_loop import chat_prompts
    from benchmarks.engine.engine_loop import engine_config
    from benchmarks.harness.workloads import TextMaker, build, first_turn_messages, full_suite, quick_suite

    suite = quick_suite() if quick else full_suite()
    tokenizer = load_tokenizer(Path(model_dir))
    convs = build(suite.prefix, TextMaker.from_tokenizer(tokenizer))
    prompts = chat_prompts(tokenizer, [first_turn_messages(c) for c in convs])
    c = concurrency or suite.prefix_concurrency
    log = StepLog()
    # ignore_cleanup_errors: a shutdown that outlasts its 30 s join (a slow disk's backlog on a 2-core box)
    # leaves the SSD writer finishing a file while the directory is removed; the figures are already taken.
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as ssd_dir:
        # a fresh SSD directory, never the user's (`cache.ssd_dir=null` turns the tier off)
        engine = timed_engine(engine_config(model_dir, None, ssd_dir, overrides=overrides), log)
        await engine.wait_ready(600)
        warm = chat_prompts(tokenizer, [[{"role": "user", "content": "warm up"}]] * 2)
        for i, p in enumerate(warm):
            await _one(engine, p, 4, f"warm-{i}")
        log.steps.clear()
        log.runs.clear()
        sem = asyncio.Semaphore(c)

        async def one(i: int, p: Sequence[int]) -> dict[str, Any]:
            async with sem:
                return await _one(engine, p, suite.prefix.output_len, f"p{i}")

        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        duration = time.perf_counter() - t0
        await engine.shutdown()
    steps = list(log.steps)
    lines = [(r, timeline(r, steps, log.runs)) for r in reqs]
    warm_rows = [t for r, t in lines if r["cached"] >= r["prompt"] // 2]
    cold_rows = [t for r, t in lines if r["cached"] < r["prompt"] // 2]
    durations = [1e3 * (s[1] - s[0]) for s in steps]
    return {"overrides": overrides, "concurrency": c, "requests": len(reqs), "duration_s": round(duration, 3),
            "warm": _summary(warm_rows), "cold": _summary(cold_rows),
            "steps": {"n": len(steps), "ms_p50": round(percentile(durations, 50), 2),
                      "ms_mean": round(statistics.fmean(durations), 2) if durations else None,
                      "admitting_ms_p50": round(percentile([1e3 * (s[1] - s[0]) for s in steps if s[3]], 50), 2)
                      if any(s[3] for s in steps) else None}}


def _parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """"name:KEY=VALUE,KEY=VALUE" -> (name, overrides), values read as YAML; `cache.K` keys replace
    one cache setting (`engine_loop.engine_config`)."""
    import yaml

    name, _, rest = spec.partition(":")
    overrides = {key: yaml.safe_load(value) for key, _, value in (item.partition("=") for item in filter(None, rest.split(",")))}
    return name, overrides


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME:KEY=VALUE,... engine settings over serve_config.yaml's (repeatable; default: 'default:')")
    p.add_argument("--quick", action="store_true", help="the quick suite's prefix part (512-token prefixes)")
    p.add_argument("--concurrency", type=int, default=None)
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    for spec in args.variant or ["default:"]:
        name, overrides = _parse_variant(spec)
        out[name] = asyncio.run(run_variant(args.model_dir, overrides, args.quick, args.concurrency))
        w = out[name]["warm"]
        if w.get("n"):
            print(f"{name}: warm n={w['n']} TTFT p50 {w['ttft_ms']['p50']} ms = to admit {w['to_admit_ms']['p50']} "
                  f"+ admitting step {w['admit_step_ms']['p50']} (its run {w['admit_run_ms']['p50']}) "
                  f"+ after {w['after_ms']['p50']} ms "
                  f"({w['steps_after']['p50']} steps); steps p50 {out[name]['steps']['ms_p50']} ms, "
                  f"admitting steps p50 {out[name]['steps']['admitting_ms_p50']} ms", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    raise SystemExit(main())
