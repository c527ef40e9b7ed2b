"""Shared pieces of the in-process engine benchmarks (engine_vs_bare, prefix_ttft)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from benchmarks.servers import blas_env


def ensure_blas() -> None:
    """Re-exec this process with OpenBLAS preloaded (Linux), as the servers run: LD_PRELOAD only
    takes effect at process start, and MLX's bundled BLAS is ~15x slower on float32 GEMM."""
    env = blas_env()
    preload = env.get("LD_PRELOAD")
    if preload and preload not in os.environ.get("LD_PRELOAD", ""):
        new_env = {**os.environ, "LD_PRELOAD": preload}
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new_env)


def engine_loader(model: str) -> Callable[[Any], Any]:
    """Pomona's own loader (modelio.models: "default", float32 on CPU) when it exists; otherwise an
    mlx-lm directory loaded as it is (the float32 copy from benchmarks.models)."""
    from engine.loop import Loaded

    try:
        from engine.loop import default_loader
        import modelio.models  # noqa: F401 - only to know whether Pomona's loader is available

        return default_loader
    except ImportError:
        if model == "default":
            raise SystemExit("modelio.models has not landed: pass --model DIR (an mlx-lm directory)")

    def load(config: Any) -> Loaded:
        import mlx_lm

        m, tokenizer = mlx_lm.load(model)
        cfg = json.loads((Path(model) / "config.json").read_text())
        fingerprint = hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:16]
        return Loaded(m, tokenizer, int(cfg.get("max_position_embeddings", 2048)), Path(model).name,
                      f"dir:{fingerprint}")

    return load


@dataclass(frozen=True)
class EngineRun:
    output_tokens: int
    duration_s: float
    ttfts_s: tuple[float, ...]
    cached_tokens: tuple[int, ...]
    cache_tiers: tuple[str | None, ...]

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


async def _one(engine: Any, tokens: Sequence[int], max_tokens: int) -> tuple[int, float, int, str | None]:
    from engine.types import Request, SamplingParams

    req = Request(tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first: float | None = None
    count, cached, tier = 0, 0, None
    async for event in engine.generate(req):
        if event.token_id is not None:
            count += 1
            if first is None:
                first = time.perf_counter()
        if event.usage is not None:
            cached, tier = event.usage.cached_tokens, event.usage.cache_tier
        if event.error:
            raise RuntimeError(f"request failed in the engine: {event.error}")
    return count, (first or time.perf_counter()) - t0, cached, tier


async def run_concurrent(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> EngineRun:
    """All prompts at once through the AsyncEngine; greedy, EOS ignored so lengths are fixed."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*(_one(engine, p, max_tokens) for p in prompts))
    duration = time.perf_counter() - t0
    return EngineRun(sum(r[0] for r in results), duration, tuple(r[1] for r in results),
                     tuple(r[2] for r in results), tuple(r[3] for r in results))


def random_prompts(tokenizer: Any, n: int, input_len: int, seed: int) -> list[list[int]]:
    """Chat-templated random prompts of about `input_len` tokens (the serving benchmarks' workload)."""
    from benchmarks.bare_loop import chat_prompts
    from benchmarks.workloads import TextMaker, WorkloadSpec, build, first_turn_messages

    maker = TextMaker.from_tokenizer(tokenizer)
    convs = build(WorkloadSpec("r", "random", num_requests=n, input_len=input_len, seed=seed), maker)
    return chat_prompts(tokenizer, [first_turn_messages(c) for c in convs])
