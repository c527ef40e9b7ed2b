"""Decode stall: the slowest gap between two tokens of a running request while a long prompt is
admitted, over a plain decode step, for each engine step side by side (engine in process, no HTTP).

    python -m benchmarks.engine.decode_stall [MODEL_DIR] [--running 7] [--prompt 1000] [--rounds 2]
        [--steps mlx_lm,pomona,pomona:max_decode_stall=1.5]

`running` requests decode (short prompts, long outputs); once they are steady, gaps are recorded
for a while (the plain step: their median), then a `prompt`-token prompt arrives and gaps are
recorded until its first token (the stall: their maximum); twice, since the first long prompt also
grows the KV table. Each engine step is measured `rounds`
times, taking turns (mlx_lm, pomona, mlx_lm, ...), since this box drifts; a step may carry engine
settings (`pomona:max_decode_stall=1.5`, several joined by `;`). The long prompt's time
to first token is reported beside it: feeding a prompt in chunks beside the decodes trades some of
it for the running requests' smoothness.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any, Sequence

STEPS = ("mlx_lm", "pomona")


def step_settings(step: str) -> dict[str, Any]:
    """"pomona:max_decode_stall=1.5;prefill_chunk=128" as engine settings."""
    import yaml

    name, _, rest = step.partition(":")
    settings = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in rest.split(";") if item)}
    return {"engine_step": name, **settings}


async def _decode(engine: Any, rid: str, prompt: list[int], arrivals: list[float], max_tokens: int) -> None:
    from engine.types import Request, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for batch in engine.stream(Request(tuple(prompt), params, request_id=rid)):
        now = time.perf_counter()
        arrivals.extend(now for e in batch if e.token_id is not None)


async def _until(tasks: list[asyncio.Task], done: Any) -> None:
    while not done():
        for t in tasks:
            if t.done():  # a running request ended early: its error says why
                t.result()
                raise RuntimeError("a running request ended before the measurement")
        await asyncio.sleep(0.01)


async def one_round(engine: Any, vocab: int, running: int, prompt_len: int, seed: int) -> dict[str, float]:
    from engine.types import Request, SamplingParams

    rng = random.Random(seed)
    arrivals: list[list[float]] = [[] for _ in range(running)]
    tasks = [asyncio.create_task(_decode(engine, f"r{seed}-{i}", [rng.randrange(1, vocab) for _ in range(20)],
                                         arrivals[i], 1000)) for i in range(running)]
    await _until(tasks, lambda: min(len(a) for a in arrivals) >= 12)  # past every admission: steady
    plain_from = time.perf_counter()
    await _until(tasks, lambda: min(len([t for t in a if t > plain_from]) for a in arrivals) >= 10)
    sent = time.perf_counter()
    long = Request(tuple(rng.randrange(1, vocab) for _ in range(prompt_len)),
                   SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), request_id=f"long{seed}")
    async for _ in engine.stream(long):
        pass
    first = time.perf_counter()
    await asyncio.sleep(0.3)  # the gap that contains the first token closes after it
    for rid in range(running):
        engine.abort(f"r{seed}-{rid}")
    await asyncio.gather(*tasks, return_exceptions=True)
    plain, stall = [], []
    for a in arrivals:
        for prev, nxt in zip(a, a[1:]):
            if plain_from <= prev and nxt <= sent:
                plain.append(nxt - prev)
            elif nxt > sent and prev < first:  # a gap overlapping the long prompt's admission
                stall.append(nxt - prev)
    step = statistics.median(plain)
    # The slowest plain gap over the median: how far the box's own noise takes a maximum (a stall
    # ratio near it is as flat as this machine gets).
    return {"plain_step_ms": 1000 * step, "plain_max_ratio": max(plain) / step, "max_gap_ms": 1000 * max(stall),
            "stall_ratio": max(stall) / step, "long_ttft_ms": 1000 * (first - sent)}


async def measure(model_dir: str, step: str, running: int, prompt_len: int, seed: int) -> dict[str, float]:
    from benchmarks.engine.engine_loop import engine_config
    from engine.loop import AsyncEngine

    config = engine_config(model_dir, max(running + 1, 8), None, prefix_cache=False, overrides=step_settings(step))
    engine = AsyncEngine(config)
    await engine.wait_ready()
    try:
        vocab = engine.tokenizer.vocab_size
        await one_round(engine, vocab, running, min(prompt_len, 64), seed + 999)  # warm-up: shapes, buffers
        # The first long prompt grows the KV table (the own step's; BatchGenerator allocates on every
        # merge), a one-time copy into fresh memory; the second finds it grown: both are reported.
        cold = await one_round(engine, vocab, running, prompt_len, seed)
        warm = await one_round(engine, vocab, running, prompt_len, seed + 500)
        return {**warm, **{f"first_{k}": v for k, v in cold.items() if not k.startswith("plain")}}
    finally:
        await engine.shutdown(drain_s=0)


def run(model_dir: str, running: int, prompt_len: int, rounds: int,
        steps: Sequence[str] = STEPS) -> dict[str, Any]:
    results: dict[str, list[dict[str, float]]] = {s: [] for s in steps}
    for r in range(rounds):
        for step in (steps if r % 2 == 0 else steps[::-1]):
            results[step].append(asyncio.run(measure(model_dir, step, running, prompt_len, seed=r)))
            print(step, json.dumps({k: round(v, 2) for k, v in results[step][-1].items()}), flush=True)
    summary = {s: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for s, rs in results.items()}
    return {"running": running, "prompt_tokens": prompt_len, "rounds": rounds, "median": summary, "runs": results}


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from benchmarks.harness.models import benchmark_model_dir

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", nargs="?", default=None, help="an mlx-lm model directory (default: the default model)")
    p.add_argument("--running", type=int, default=7)
    p.add_argument("--prompt", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", default=",".join(STEPS), help="engine steps to compare, with settings after a colon")
    args = p.parse_args(argv)
    out = run(str(args.model_dir or benchmark_model_dir()), args.running, args.prompt, args.rounds,
              args.steps.split(","))
    for step, m in out["median"].items():
        print(f"{step}: plain step {m['plain_step_ms']:.1f} ms, slowest gap while a {args.prompt}-token prompt "
              f"is admitted {m['max_gap_ms']:.1f} ms = {m['stall_ratio']:.2f}x, its TTFT {m['long_ttft_ms']:.0f} ms "
              f"(the first such prompt, as the table grows: {m['first_stall_ratio']:.2f}x, {m['first_long_ttft_ms']:.0f} ms; "
              f"slowest plain gap {m['plain_max_ratio']:.2f}x)")
    print(json.dumps(out["median"]))
    return 0


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    raise SystemExit(main())
