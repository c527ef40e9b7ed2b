"""Issue 3's measurement: TTFT of a 2,000-token prompt cold, on a RAM hit, and on an SSD hit after
a restart, through Pomona's AsyncEngine with the cache tiers. Goals: RAM <= 0.1x cold, SSD <= 0.25x.

    python -m benchmarks.prefix_ttft                    # default model, 2,000 tokens, 3 prompts
    python -m benchmarks.prefix_ttft --model DIR --prompt-len 500 --prompts 2

Two engine processes on one SSD directory: the first sends each prompt twice (cold, then the RAM
hit) and shuts down, which flushes the SSD writer; the second, a fresh process with an empty RAM
tier, sends each prompt once more (the SSD hit). Medians over distinct prompts; the tier each hit
came from is checked from the request's usage, so a miss cannot pass as a hit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from benchmarks.engine_common import engine_loader, ensure_blas, random_prompts, run_concurrent


async def _phase(args: argparse.Namespace) -> dict[str, Any]:
    from cache_tiers.config import CacheConfig
    from engine.config import EngineConfig
    from engine.loop import AsyncEngine

    cache = CacheConfig(enabled=True, ssd_dir=args.ssd_dir)
    engine = AsyncEngine(EngineConfig(model=args.model, cache=cache), loader=engine_loader(args.model))
    await engine.wait_ready(timeout=900)
    out: dict[str, Any] = {"cold": [], "ram": [], "ssd": []}
    try:
        # First-call costs out of the numbers; a short unrelated prompt shares no 2,000-token prefix.
        await run_concurrent(engine, random_prompts(engine.tokenizer, 1, 16, seed=999), 2)
        prompts = random_prompts(engine.tokenizer, args.prompts, args.prompt_len, seed=7)
        out["prompt_tokens"] = [len(p) for p in prompts]
        steps = ("cold", "ram") if args.phase == "first" else ("ssd",)
        for prompt in prompts:
            for step in steps:
                run = await run_concurrent(engine, [prompt], args.max_tokens)
                out[step].append({"ttft_s": run.ttfts_s[0], "cached_tokens": run.cached_tokens[0],
                                  "tier": run.cache_tiers[0]})
        out["cache_stats"] = engine.stats().get("cache")
    finally:
        await engine.shutdown()
    return out


def _run_phase(args: argparse.Namespace, phase: str, ssd_dir: str) -> dict[str, Any]:
    """A fresh process per phase: the restart is a real one (new Python, new MLX, empty RAM tier)."""
    cmd = [sys.executable, "-m", "benchmarks.prefix_ttft", "--phase", phase, "--ssd-dir", ssd_dir,
           "--model", args.model, "--prompt-len", str(args.prompt_len), "--prompts", str(args.prompts),
           "--max-tokens", str(args.max_tokens)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_ttft(rows: list[dict[str, Any]]) -> float:
    return statistics.median(r["ttft_s"] for r in rows)


def _report(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    cold, ram, ssd = _median_ttft(first["cold"]), _median_ttft(first["ram"]), _median_ttft(second["ssd"])
    result = {"prompt_tokens": first["prompt_tokens"], "cold_ttft_s": cold, "ram_hit_ttft_s": ram,
              "ssd_hit_ttft_s": ssd, "ram_ratio": ram / cold, "ssd_ratio": ssd / cold,
              "ram_tiers": [r["tier"] for r in first["ram"]], "ssd_tiers": [r["tier"] for r in second["ssd"]],
              "ram_cached_tokens": [r["cached_tokens"] for r in first["ram"]],
              "ssd_cached_tokens": [r["cached_tokens"] for r in second["ssd"]],
              "first": first, "second": second}
    print(f"prompt tokens: {first['prompt_tokens']}")
    print(f"TTFT cold:              {cold * 1000:8.1f} ms (median)")
    print(f"TTFT RAM hit:           {ram * 1000:8.1f} ms  tiers {result['ram_tiers']}, "
          f"cached {result['ram_cached_tokens']}")
    print(f"TTFT SSD hit (restart): {ssd * 1000:8.1f} ms  tiers {result['ssd_tiers']}, "
          f"cached {result['ssd_cached_tokens']}")
    print(f"RAM hit / cold = {result['ram_ratio']:.3f}  (goal <= 0.1)")
    print(f"SSD hit / cold = {result['ssd_ratio']:.3f}  (goal <= 0.25)")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--prompt-len", type=int, default=2000)
    p.add_argument("--prompts", type=int, default=3, help="distinct prompts (medians over them)")
    p.add_argument("--max-tokens", type=int, default=2)
    p.add_argument("--ssd-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--phase", choices=["first", "restart"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    ensure_blas()
    if args.phase:  # child process: one engine lifetime, JSON on the last stdout line
        print(json.dumps(asyncio.run(_phase(args))))
        return 0
    with tempfile.TemporaryDirectory(prefix="pomona-prefix-ttft-") as tmp:
        ssd_dir = args.ssd_dir or str(Path(tmp) / "ssd")
        result = _report(_run_phase(args, "first", ssd_dir), _run_phase(args, "restart", ssd_dir))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
