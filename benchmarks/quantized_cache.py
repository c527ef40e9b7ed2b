"""Quantized prefix-cache entries: bytes saved and the effect on greedy output (issue 8).

For a set of prompts sharing long prefixes, greedy output after a cache hit on a quantized entry is
compared with cold greedy output: the share of identical tokens (position by position) and the
share of fully identical completions. Also prints RAM bytes held per entry, full vs quantized.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python -m benchmarks.quantized_cache
"""

from __future__ import annotations

import argparse
import asyncio

from cache_tiers.config import CacheConfig

from engine.config import EngineConfig
from engine.loop import AsyncEngine
from engine.types import Request, SamplingParams

PREFIXES = [
    "You are a careful assistant. Answer briefly and precisely. The following is a report about the "
    "history of the city of Paris, its rivers, bridges, and districts. " * 6,
    "System: you summarise documents. Document: The mitochondrion is the powerhouse of the cell; it "
    "produces energy through oxidative phosphorylation and has its own DNA. " * 6,
]
QUESTIONS = ["What is this about?", "Give one key fact.", "Summarise in five words.", "Who would read this?"]


async def greedy_tokens(engine: AsyncEngine, text: str, n: int) -> tuple[list[int], int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    request = Request(tuple(ids), SamplingParams(max_tokens=n, temperature=0.0, logprobs=0))
    events = [e async for e in engine.generate(request)]
    return [e.token_id for e in events], events[-1].usage.cached_tokens


async def run_config(model: str, bits: int | None, n: int) -> tuple[dict[str, list[int]], int, int]:
    cache = CacheConfig(enabled=bits != 0, ram_bytes=2**30, quantize_bits=bits or None, quantize_min_tokens=64)
    engine = AsyncEngine(EngineConfig(model=model, cache=cache))
    await engine.wait_ready()
    outputs, cached = {}, 0
    for prefix in PREFIXES:
        await greedy_tokens(engine, prefix + " Warm-up.", 1)  # stores the prefix
        for q in QUESTIONS:
            tokens, hit = await greedy_tokens(engine, prefix + " " + q, n)
            outputs[prefix[:20] + q], cached = tokens, cached + hit
    held = engine.stats().get("cache", {}).get("ram", {}).get("bytes", 0)
    await engine.shutdown()
    return outputs, cached, held


def compare(cold: dict[str, list[int]], warm: dict[str, list[int]]) -> tuple[float, float]:
    same = total = whole = 0
    for key, ref in cold.items():
        out = warm[key]
        same += sum(a == b for a, b in zip(ref, out))
        total += max(len(ref), len(out))
        whole += ref == out
    return same / max(total, 1), whole / max(len(cold), 1)


async def main_async(model: str, n: int) -> None:
    cold, _, _ = await run_config(model, 0, n)
    full, _, full_bytes = await run_config(model, None, n)
    print(f"{'storage':>8} {'RAM bytes':>12} {'vs full':>8} {'cached tok':>11} {'same tokens':>12} {'same outputs':>13}")
    share, whole = compare(cold, full)
    print(f"{'float':>8} {full_bytes:>12,} {1.0:>8.2f} {'':>11} {share:>12.3f} {whole:>13.3f}")
    for bits in (8, 4):
        warm, cached, held = await run_config(model, bits, n)
        share, whole = compare(cold, warm)
        print(f"{bits:>7}b {held:>12,} {held / max(full_bytes, 1):>8.2f} {cached:>11} {share:>12.3f} {whole:>13.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main_async(args.model, args.tokens))


if __name__ == "__main__":
    main()
