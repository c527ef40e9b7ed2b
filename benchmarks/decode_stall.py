"""How long do running decodes stall while a 4k-token prompt is admitted? (issue 2)

Four requests decode; then a 4,096-token prompt arrives. For each prefill chunk size, prints the
longest gap between two tokens of the decoding requests while the long prompt is prefilled, the
median gap before it arrived, and the long prompt's TTFT. A chunk as large as the prompt is the
"no chunking" reference.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 python -m benchmarks.decode_stall
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from cache_tiers.config import CacheConfig

from engine.config import EngineConfig
from engine.loop import AsyncEngine
from engine.types import Request, SamplingParams


async def decode(engine: AsyncEngine, rid: str, stamps: list[float], tokens: int) -> None:
    prompt = tuple(engine.tokenizer.encode(f"Request {rid}: count slowly from one to one hundred."))
    request = Request(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True),
                      request_id=rid)
    async for _ in engine.generate(request):
        stamps.append(time.perf_counter())


async def measure(chunk: int, model: str, prompt_len: int) -> dict[str, float]:
    config = EngineConfig(model=model, prefill_chunk=chunk, max_batch_tokens=max(8192, prompt_len),
                          cache=CacheConfig(enabled=False), checkpoint_every=None)
    engine = AsyncEngine(config)
    await engine.wait_ready()
    stamps: dict[str, list[float]] = {f"d{i}": [] for i in range(4)}
    decoders = [asyncio.ensure_future(decode(engine, rid, s, 3000)) for rid, s in stamps.items()]
    while min(len(s) for s in stamps.values()) < 8:
        await asyncio.sleep(0.05)
    rng = random.Random(0)
    vocab = len(engine.tokenizer.get_vocab()) if hasattr(engine.tokenizer, "get_vocab") else 32000
    long_prompt = tuple(rng.randrange(100, vocab - 100) for _ in range(prompt_len))
    arrived = time.perf_counter()
    long_req = Request(long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    async for _ in engine.generate(long_req):
        first = time.perf_counter()
    for rid in stamps:
        engine.abort(rid)
    await asyncio.gather(*decoders, return_exceptions=True)
    await engine.shutdown()
    before, during = [], []
    for s in stamps.values():
        gaps = [(b - a, b) for a, b in zip(s, s[1:])]
        before += [g for g, t in gaps if t < arrived]
        during += [g for g, t in gaps if arrived <= t <= first + 0.5]
    return {"chunk": chunk, "ttft_s": first - arrived, "max_stall_ms": 1000 * max(during, default=0.0),
            "median_gap_before_ms": 1000 * statistics.median(before)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--chunks", default="128,256,512,4096")
    args = parser.parse_args()
    print(f"{'chunk':>6} {'long TTFT s':>12} {'max stall ms':>13} {'median gap ms':>14}")
    for chunk in (int(c) for c in args.chunks.split(",")):
        r = asyncio.run(measure(chunk, args.model, args.prompt_len))
        print(f"{r['chunk']:>6} {r['ttft_s']:>12.2f} {r['max_stall_ms']:>13.0f} {r['median_gap_before_ms']:>14.0f}")


if __name__ == "__main__":
    main()
