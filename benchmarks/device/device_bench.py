"""Per-step cost on a real accelerator: raw decode step vs bare `BatchGenerator` vs Pomona's engine.

One process, one random llama (about 1.04B parameters, bf16 on a GPU; `--tiny` for a CPU smoke
test), one seeded workload per concurrency (prompts of random ids, 100-1,000 tokens; 128-256 output
tokens each; EOS ignored so every request produces exactly its `max_tokens`). For each concurrency:

- raw:    `model(...)` on the batch cache that `BatchGenerator` built for these prompts, greedy
          argmax on the device, `mx.eval` every step (decode only). Two more rungs add what
          `BatchGenerator._step` adds: `pipelined` (async_eval of step t+1 before waiting for t,
          `.tolist()` of the tokens) and `+logprobs` (log-softmax over the vocabulary and
          `list(logprobs)`, one array per sequence, evaluated every step).
- bare:   a `BatchGenerator` loop: insert every request, `next()` until all are done, greedy.
- engine: Pomona's `AsyncEngine` through its asyncio API (no HTTP): one task per request consuming
          `stream()`, with a real byte-level BPE tokenizer of the model's vocabulary size and mlx-lm's
          `BPEStreamingDetokenizer`, so detokenization is part of the cost.

Reported per mode: end-to-end output tokens/s (prefill and the shrinking tail included: bare and
engine only) and the steady-state decode step: the mean time between the starts of consecutive
`BatchGenerator.next()` calls over the steps where every request is decoding (full batch, no
prefill pending, none finishing), which is what the raw rungs time too.

`--profile` adds instrumented runs (timers wrapped around library and Pomona functions from the
outside; nothing is edited) that split that step into: forward-graph build, kernel launch
(`mx.async_eval`), waiting (`mx.eval`), the sampler graph before the launch, `.tolist()` and the
per-sequence response loop after the wait, `BatchGenerator` bookkeeping; and on Pomona's side the runner's mapping,
detokenization, stop-string checks, event building, the rest of `Engine.step`, the hand-off to
asyncio, and the MLX thread's unaccounted time (GIL waits while the asyncio side runs).

Code: device_models.py (model, tokenizer, workloads), device_modes.py (the three modes),
device_profile.py (step recording, timers), device_report.py (tables); mlx-lm through its public
API only (`BatchGenerator.insert/next/remove/extract_cache/stats()`, the responses of `next()`).

    python -m benchmarks.device.device_bench --tiny                    # CPU smoke test
    python -m benchmarks.device.device_bench --repeats 2 --profile      # the device run (docs/accelerators.md)
    python -m benchmarks.device.device_bench --modes bare,engine --repeats 6 --order alternate --budget-s 450
                                                                 # a verdict on engine vs bare (run F)

A verdict on "engine >= 0.95x bare" needs pairs: each repeat runs bare and engine back to back and
the report gives engine/bare per repeat, their median and the ratio of total wall times.
`--order alternate` flips which of the two runs first in every other repeat, so drift of the host
within a repeat (clocks, other tenants) does not always fall on the same side. `--modes bare,engine`
skips the raw rungs (they are not needed for the verdict and cost time).

JSON goes to --json, or to $OUT/device_bench.json when OUT is set.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

if __package__ in (None, ""):  # `python benchmarks/device/device_bench.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx

from benchmarks.device import device_report as report
from benchmarks.device.device_models import (MODEL_1B, MODEL_TINY, Workload, build_model, build_tokenizer,
                                      check_detokenizer, environment, make_workload)
from benchmarks.device.device_modes import EngineSession, run_bare, run_bare_in_thread, run_raw
from benchmarks.device.device_profile import pc, profile_table


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="small model and sizes, for a CPU smoke test")
    p.add_argument("--concurrency", help="comma-separated N or N:MIN-MAX (prompt lengths for that run); "
                                         "default 32,128 (--tiny 4,8)")
    p.add_argument("--prompt-len", help="min,max prompt tokens (default 100,1000; --tiny 20,60)")
    p.add_argument("--out-len", help="min,max output tokens (default 128,256; --tiny 8,16)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each mode per concurrency")
    p.add_argument("--raw-steps", type=int, help="timed raw steps per rung (default 64; --tiny 8)")
    p.add_argument("--raw-warm", type=int, default=4)
    p.add_argument("--prefill-batch", type=int, default=8, help="as EngineConfig.prefill_batch")
    p.add_argument("--prefill-chunk", type=int, default=256, help="as EngineConfig.prefill_chunk")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
                   help="default: float32 on the CPU backend, bfloat16 on GPUs")
    p.add_argument("--modes", default="raw,bare,engine",
                   help="raw,bare,engine and/or bare_thread (a control); bare,engine skips the raw rungs")
    p.add_argument("--order", choices=("fixed", "alternate"), default="fixed",
                   help="within a repeat: fixed = bare then engine every time; alternate = bare-engine, "
                        "engine-bare, ... (raw rungs, if any, always first)")
    p.add_argument("--budget-s", type=float,
                   help="start no repeat (or workload) that would likely end after this many seconds of "
                        "process time, so a device call ends with its JSON written instead of being killed")
    p.add_argument("--profile", nargs="?", const="all",
                   help="also run instrumented bare and engine passes (for these --concurrency items; default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--switch-interval", type=float, help="sys.setswitchinterval (GIL hand-over), seconds")
    p.add_argument("--prefill-group-ratio", type=_group_ratio,
                   help='experiment: EngineConfig.prefill_group_ratio (a number >= 1, "auto" or "none"); '
                        "default: the engine's default")
    p.add_argument("--first-token-first", choices=("on", "off"),
                   help="experiment: EngineConfig.first_token_first (admit nobody while a prompt awaits its "
                        "first token); default: the engine's default")
    p.add_argument("--json", help="write results here (default $OUT/device_bench.json when OUT is set)")
    cfg = p.parse_args(argv)
    cfg.prompt_len = _pair(cfg.prompt_len, (20, 60) if cfg.tiny else (100, 1000))
    cfg.out_len = _pair(cfg.out_len, (8, 16) if cfg.tiny else (128, 256))
    cfg.raw_steps = cfg.raw_steps or (8 if cfg.tiny else 64)
    return cfg


def _pair(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
    return default if text is None else tuple(int(x) for x in text.split(","))  # type: ignore[return-value]


def _group_ratio(text: str) -> float | str | None:
    return None if text == "none" else "auto" if text == "auto" else float(text)


def workloads(cfg: argparse.Namespace) -> list[tuple[str, int, tuple[int, int]]]:
    """(label, N, prompt lengths) for each --concurrency item."""
    out = []
    for item in (cfg.concurrency or ("4,8" if cfg.tiny else "32,128")).split(","):
        n, _, lens = item.partition(":")
        out.append((item, int(n), tuple(int(x) for x in lens.split("-")) if lens else cfg.prompt_len))
    return out  # type: ignore[return-value]


def rep_order(rep: int, order: str) -> tuple[str, str]:
    """Which of bare and engine runs first in repeat `rep`. With a fixed order (runs A-E) a drift of
    the host inside each repeat always lands on the same side; alternating puts it on both."""
    return ("engine", "bare") if order == "alternate" and rep % 2 else ("bare", "engine")


def over_budget(cfg: argparse.Namespace, t_start: float, next_cost_s: float) -> bool:
    """Whether starting something that takes about `next_cost_s` would run past `--budget-s`."""
    return cfg.budget_s is not None and pc() - t_start + next_cost_s > cfg.budget_s


def write_results(results: dict, out: str | None) -> None:
    """Tables into `results` and the JSON to `out`; called after every workload, so a run cut off at
    the device call's limit still leaves the workloads it finished."""
    table, results["ratios"] = report.summarize(results)
    results["table_md"], results["profile_md"] = table, profile_table(results)
    results["phases_md"] = report.phases_table(results)
    results["paired_md"] = report.paired_table(results)
    if out:
        Path(out).write_text(json.dumps(results, indent=1, default=str))


def setup(cfg: argparse.Namespace) -> tuple[Any, Any, dict, dict]:
    """The model, the tokenizer, the model's shape and the environment record."""
    on_gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, cfg.dtype) if cfg.dtype else (mx.bfloat16 if on_gpu else mx.float32)
    t_start = pc()
    shape = MODEL_TINY if cfg.tiny else MODEL_1B
    model, params = build_model(shape, dtype, cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = build_tokenizer(shape["vocab_size"], cfg.seed, Path(tmp))
    env = environment(params, dtype)
    env["detokenizer_check"] = check_detokenizer(tokenizer, shape["vocab_size"], cfg.seed)
    if cfg.switch_interval is not None:
        sys.setswitchinterval(cfg.switch_interval)
    env["switch_interval_s"] = sys.getswitchinterval()
    env["prefill_group_ratio"] = cfg.prefill_group_ratio if cfg.prefill_group_ratio is not None else "engine default"
    env["first_token_first"] = cfg.first_token_first or "engine default"
    print(f"# {params / 1e6:,.1f}M-parameter random llama, {dtype}, on {env['device']}; mlx {env['mlx']}, "
          f"mlx-lm {env['mlx_lm']}; built in {pc() - t_start:.1f} s", flush=True)
    return model, tokenizer, shape, env


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    items = workloads(cfg)
    profile_labels = None if cfg.profile is None else (
        {w[0] for w in items} if cfg.profile == "all" else set(cfg.profile.split(",")))
    modes = set(cfg.modes.split(","))
    t_start = pc()
    model, tokenizer, shape, env = setup(cfg)
    results: dict[str, Any] = {"env": env, "config": dict(vars(cfg)), "model": shape, "runs": {}}
    out = cfg.json or (os.path.join(os.environ["OUT"], "device_bench.json") if os.environ.get("OUT") else None)
    for label, n, prompt_len in items:
        if results["runs"] and over_budget(cfg, t_start, 0.0):
            print(f"# {label}: skipped, --budget-s {cfg.budget_s:.0f} reached", flush=True)
            continue
        wl = make_workload(n, shape["vocab_size"], prompt_len, cfg.out_len, cfg.seed)
        by: dict[str, Any] = {"n": n, "prompt_len": prompt_len, "raw": [], "bare": [], "engine": [], "order": [],
                              "bare_thread": [], "bare_profile": [], "engine_profile": []}
        results["runs"][label] = by
        asyncio.run(_measure(model, tokenizer, wl, cfg, label, by, modes,
                             profile_labels is not None and label in profile_labels, t_start))
        results["wall_s"] = pc() - t_start
        write_results(results, out)
    results["wall_s"] = pc() - t_start
    write_results(results, out)
    for part in (results["profile_md"], results["phases_md"], report.raw_table(results), report.cpu_lines(results),
                 results["table_md"], results["paired_md"]):
        if part:
            print("\n" + part)
    print(f"\n# total {results['wall_s']:.1f} s" + (f"; JSON in {out}" if out else ""), flush=True)
    return 0


async def _measure(model: Any, tokenizer: Any, wl: Workload, cfg: argparse.Namespace, label: str, by: dict,
                   modes: set[str], profile: bool, t_start: float) -> None:
    """Warm up, then the timed repeats (each: raw rungs, then bare and engine in `rep_order`), then
    the profiled passes, for one workload. With `--budget-s`, stops before a repeat that would
    likely not end in time (the previous repeat's duration is the estimate)."""
    t = pc()
    run_bare(model, wl, cfg)  # warm-up: every kernel and batch shape these runs meet
    session = None
    if "engine" in modes:
        session = EngineSession(model, tokenizer, cfg, by["n"])
        await session.start()
        by["engine_settings"] = await session.settings()
        print(f"# {label}: engine settings {by['engine_settings']}", flush=True)
        await session.run(wl, f"warm-{label}")
    print(f"# {label}: {len(wl.prompts)} requests, {sum(map(len, wl.prompts))} prompt tokens, "
          f"{wl.output_tokens} output tokens; warm-up {pc() - t:.1f} s", flush=True)
    try:
        last_rep_s = 0.0
        for rep in range(cfg.repeats):
            # alternating: start a bare-first repeat only if its engine-first partner fits too
            pair_left = 2 if cfg.order == "alternate" and rep % 2 == 0 else 1
            if over_budget(cfg, t_start, last_rep_s * pair_left):
                print(f"# {label}: stopped after {rep} repeats, --budget-s {cfg.budget_s:.0f}", flush=True)
                break
            t_rep = pc()
            if "raw" in modes:
                by["raw"] += run_raw(model, wl, cfg)
            order = [m for m in rep_order(rep, cfg.order) if m in modes]
            for mode in order:
                if mode == "bare":
                    by["bare"].append(run_bare(model, wl, cfg))
                elif session is not None:
                    by["engine"].append(await session.run(wl, f"{label}-r{rep}"))
            by["order"].append("-".join(order))
            last_rep_s = pc() - t_rep
            print(report.rep_line(label, rep, by), flush=True)
        if "bare_thread" in modes:
            by["bare_thread"].append(run_bare_in_thread(model, wl, cfg))
        if profile and "bare" in modes:
            by["bare_profile"].append(run_bare(model, wl, cfg, profile=True))
        if profile and session is not None:
            by["engine_profile"].append(await session.run(wl, f"prof-{label}", profile=True))
    finally:
        if session is not None:
            await session.close()


if __name__ == "__main__":
    rc = main()
    # MLX's CUDA backend aborts at interpreter exit ("terminate called without an active
    # exception") once threads other than the main one have used their thread-local streams; the
    # results are written by then, so leave without running C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
