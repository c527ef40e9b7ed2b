"""Issue 2's measurement: 16 concurrent requests through Pomona's AsyncEngine vs the same prompts
through a bare `BatchGenerator` loop, on the default model. Goal: engine >= 0.9x bare.

    python -m benchmarks.engine_vs_bare                 # default model (float32 on CPU)
    python -m benchmarks.engine_vs_bare --model DIR --requests 16 --input-len 128 --output-len 128

Both run in this one process on the same weights, alternating (bare, engine, bare, engine...) so
drift on a shared machine hits both sides alike; each round uses fresh prompts. The prefix cache is
off: the bare loop has none, and a hit would measure the cache instead of the scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path
from typing import Any, Sequence

from benchmarks.engine_common import EngineRun, engine_loader, ensure_blas, random_prompts, run_concurrent


def _engine(model: str, loader: Any, max_running: int) -> Any:
    from cache_tiers.config import CacheConfig
    from engine.config import EngineConfig
    from engine.loop import AsyncEngine

    config = EngineConfig(model=model, cache=CacheConfig(enabled=False), max_running=max(32, max_running))
    return AsyncEngine(config, loader=loader)


async def _rounds(args: argparse.Namespace, engine: Any, bare_model: Any, tokenizer: Any) -> dict[str, Any]:
    from benchmarks.bare_loop import run_bare

    await engine.wait_ready(timeout=900)
    warm = random_prompts(tokenizer, 2, 16, seed=999)
    run_bare(bare_model, warm, 4, 2)
    await run_concurrent(engine, warm, 4)
    bare_tps, engine_tps, rounds = [], [], []
    for r in range(args.rounds):
        prompts = random_prompts(tokenizer, args.requests, args.input_len, seed=r)
        b = run_bare(bare_model, prompts, args.output_len, args.requests)
        e: EngineRun = await run_concurrent(engine, prompts, args.output_len)
        bare_tps.append(b.output_throughput)
        engine_tps.append(e.output_throughput)
        rounds.append({"bare": b.as_dict(), "engine": {"output_tokens": e.output_tokens,
                                                       "duration_s": e.duration_s,
                                                       "output_throughput": e.output_throughput}})
        print(f"round {r + 1}: bare {b.output_throughput:.1f} tok/s ({b.output_tokens} tokens), "
              f"engine {e.output_throughput:.1f} tok/s ({e.output_tokens} tokens), "
              f"ratio {e.output_throughput / b.output_throughput:.3f}", flush=True)
    bare_med, engine_med = statistics.median(bare_tps), statistics.median(engine_tps)
    return {"rounds": rounds, "bare_tok_s": bare_med, "engine_tok_s": engine_med, "ratio": engine_med / bare_med}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    ensure_blas()
    from engine.config import EngineConfig

    loader = engine_loader(args.model)
    loaded = loader(EngineConfig(model=args.model))  # the bare loop's copy of the same weights
    engine = _engine(args.model, loader, args.requests)
    try:
        result = asyncio.run(_rounds(args, engine, loaded.model, loaded.tokenizer))
    finally:
        asyncio.run(engine.shutdown())
    result.update(model=args.model, requests=args.requests, input_len=args.input_len, output_len=args.output_len)
    print(f"bare BatchGenerator: {result['bare_tok_s']:.1f} output tok/s (median of {args.rounds})")
    print(f"Pomona AsyncEngine:  {result['engine_tok_s']:.1f} output tok/s (median of {args.rounds})")
    print(f"engine / bare = {result['ratio']:.3f}  (goal >= 0.9)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
