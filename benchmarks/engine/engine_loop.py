"""Pomona's engine in process: the side-by-side suite's random workload through `AsyncEngine`, no Ray, no HTTP.

The same prompts (chat template applied, first turns), the same closed loop as the HTTP client (at most
`concurrency` requests in flight, a new one as soon as one ends), greedy, EOS ignored, and the engine
settings of serve_config.yaml (`--max-running` overriding), so Pomona over HTTP / this is the cost
of Ray Serve, the ingress and SSE alone.

    python -m benchmarks.engine.engine_loop MODEL_DIR --concurrency 1,8,32,128 [--quick] [--max-running 128]

JSON on stdout (last line): {concurrency: {output_throughput, ttft_ms_p50, itl_ms_p50, ...}}.
"""

from __future__ import annotations

import asyncio
import os
import random
import tempfile
from pathlib import Path
import time
from typing import Any, Sequence

from benchmarks.harness.client import percentile


def engine_config(model_dir: str, max_running: int | None, ssd_dir: str | None, prefix_cache: bool = True,
                  overrides: dict[str, Any] | None = None) -> Any:
    """serve_config.yaml's engine settings for `model_dir`; `overrides`: settings replaced (--engine K=V;
    `cache.K` replaces one cache setting)."""
    import yaml

    from benchmarks.harness.pomona_server import SERVE_CONFIG
    from engine.config import EngineConfig

    app = (yaml.safe_load(SERVE_CONFIG.read_text()).get("applications") or [{}])[0]
    engine = dict((app.get("args") or {}).get("engine") or {})
    engine["model"] = model_dir
    if max_running:
        engine["max_running"] = max_running
        # Fewer running than the configured prefill batch (one stream, say): a batch that fits, not an error.
        engine["prefill_batch"] = min(int(engine.get("prefill_batch", max_running)), max_running)
    cache = dict(engine.get("cache") or {})
    if cache.get("ssd_dir"):
        cache["ssd_dir"] = ssd_dir  # empty, as the HTTP run's (benchmarks/harness/pomona_server.py); None: no SSD tier
    if not prefix_cache:
        cache["enabled"] = False
    overrides = dict(overrides or {})
    for key in [k for k in overrides if k.startswith("cache.")]:  # one cache setting, the rest kept
        cache[key.removeprefix("cache.")] = overrides.pop(key)
    engine["cache"] = cache
    engine.update(overrides)
    return EngineConfig.from_dict(engine)


async def _one(engine: Any, tokens: Sequence[int], max_tokens: int, rid: str) -> tuple[int, float, list[float]]:
    from engine.types import Request, SamplingParams

    req = Request(tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                  request_id=rid)
    t0 = time.perf_counter()
    first = last = None
    count, gaps = 0, []
    async for batch in engine.stream(req):
        now = time.perf_counter()
        n = sum(1 for e in batch if e.token_id is not None)
        if any(e.error for e in batch):
            raise RuntimeError(f"request failed in the engine: {batch[-1].error}")
        if n and first is None:
            first = now
        elif n:
            gaps.append(now - last)  # per batch, as the HTTP client sees chunks
        if n:
            last = now
        count += n
    return count, (first or time.perf_counter()) - t0, gaps


async def closed_loop(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                      concurrency: int, tag: str, jitter_s: float = 0.0) -> dict[str, Any]:
    """`jitter_s`: each request waits uniform(0, jitter_s) before it is sent, as requests sent over
    HTTP reach the engine spread out by the path (separates the engine's own rate from what spread
    arrivals cost it: more, smaller prefills)."""
    from benchmarks.harness.step_report import counters, report

    sem = asyncio.Semaphore(concurrency)
    before = counters(engine.stats())

    rng = random.Random(7)

    async def run(i: int, p: Sequence[int]) -> tuple[int, float, list[float]]:
        async with sem:
            if jitter_s:
                await asyncio.sleep(rng.uniform(0, jitter_s))
            return await _one(engine, p, max_tokens, f"{tag}-{i}")

    t0 = time.perf_counter()
    results = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    duration = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    gaps = [g for r in results for g in r[2]]
    steps = report(before, counters(engine.stats()), duration)
    return {"engine_steps": steps, "concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens,
            "duration_s": duration,
            "output_throughput": tokens / duration, "ttft_ms_p50": percentile([r[1] for r in results], 50) * 1000,
            "itl_ms_p50": percentile(gaps, 50) * 1000 if gaps else None}


def cpu_list(spec: str) -> set[int]:
    """"0-3+8+10-11" -> {0, 1, 2, 3, 8, 10, 11} ('+' between parts: ENGINE_FLAGS splits on commas)."""
    cpus: set[int] = set()
    for part in filter(None, spec.replace(",", "+").split("+")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _burn(cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    while True:
        pass


def start_burners(n: int, cpus: set[int] | None = None) -> list[Any]:
    """`n` processes spinning on a core each (on `cpus` when given). Spawned, not forked: a forked child
    of a process that loaded OpenBLAS can deadlock in its fork handler (platform notes)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_burn, args=(cpus,), daemon=True) for _ in range(n)]
    for proc in procs:
        proc.start()
    return procs


def sweep(model_dir: str, quick: bool, concurrencies: Sequence[int], max_running: int | None,
          ssd: bool = True, jitter_s: float = 0.0, prefix_cache: bool = True, process: bool = False,
          overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """`process`: the engine in its own process (deployments/engine_process.py), as the server runs it."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from benchmarks.engine.bare_loop import chat_prompts
    from benchmarks.harness.workloads import TextMaker, build, first_turn_messages, full_suite, quick_suite
    from deployments.engine_process import EngineProcess
    from engine.loop import AsyncEngine

    suite = quick_suite() if quick else full_suite()
    maker = TextMaker(model_dir)
    tokenizer = load_tokenizer(Path(model_dir))
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as ssd_dir:  # see prefix_part.py
        engine = (EngineProcess if process else AsyncEngine)(
            engine_config(model_dir, max_running, ssd_dir if ssd else None, prefix_cache, overrides))

        async def main() -> None:
            await engine.wait_ready()
            warm = chat_prompts(tokenizer, [[{"role": "user", "content": "warm up"}]] * 2)
            await closed_loop(engine, warm, 4, 2, "warm")
            for c in concurrencies:
                # Cold at every level, as the HTTP servers are: a level run twice (side_by_side --warm)
                # would otherwise find its own prompts in the prefix cache the second time.
                await engine.clear_cache("all")
                convs = build(suite.sweep_spec(c), maker)
                prompts = chat_prompts(tokenizer, [first_turn_messages(conv) for conv in convs])
                out[str(c)] = await closed_loop(engine, prompts, suite.random.output_len, c, f"c{c}", jitter_s)
            await engine.shutdown(drain_s=0)

        asyncio.run(main())
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import json

    import yaml

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--concurrency", default="1,8,16,32")
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--no-ssd", action="store_true", help="no SSD tier (serve_config.yaml has one)")
    p.add_argument("--no-cache", action="store_true", help="no prefix cache at all (what offers and restores cost)")
    p.add_argument("--burn", type=int, default=0,
                   help="busy processes beside the engine for the whole run (the HTTP stack's proxy, ingress "
                        "and client keep ~4 cores busy: separates a slower step on a busier machine from Serve)")
    p.add_argument("--arrival-jitter-ms", type=float, default=0.0,
                   help="each request waits uniform(0, this) before it is sent (spread arrivals)")
    p.add_argument("--process", action="store_true",
                   help="the engine in its own process, as the server runs it (engine_process: true)")
    p.add_argument("--burn-cpus", default="", help="the burners' CPUs, e.g. 4-15 (Linux)")
    p.add_argument("--cpus", default="",
                   help="the engine's CPUs, e.g. 0-1+8-9 (Linux): with --burn-cpus, whether a burner on the "
                        "MLX thread's SMT sibling is what slows it")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine setting to override (YAML value), e.g. engine_step=mlx_lm; repeatable")
    args = p.parse_args(argv)
    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.engine)}
    if args.cpus:
        os.sched_setaffinity(0, cpu_list(args.cpus))
    burners = start_burners(args.burn, cpu_list(args.burn_cpus) or None)
    result = sweep(args.model_dir, args.quick, [int(c) for c in args.concurrency.split(",")], args.max_running,
                   ssd=not args.no_ssd, jitter_s=args.arrival_jitter_ms / 1000, prefix_cache=not args.no_cache,
                   process=args.process, overrides=overrides)
    for b in burners:
        b.terminate()
    print(json.dumps(result), flush=True)
    # MLX's CUDA backend can abort at interpreter exit once a second thread used it
    # (benchmarks/results/accelerators-engine-runs.md).
    os._exit(0)


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    raise SystemExit(main())
