"""A repeated prompt's TTFT from the RAM tier and, after a restart, from the SSD tier, against its cold
TTFT: the engine in process with serve_config.yaml's settings (SSD tier on, a fresh directory).

    python -m benchmarks.engine.prefix_hit [--model default] [--tokens 1323]

The same prompt is sent three times: cold, again (RAM hit), then to a new engine on the same SSD
directory (a restart: SSD hit). Prints each TTFT and the two ratios (issue 31's goal: <= 0.10).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time


async def first_token(engine, tokens, rid: str, max_tokens: int = 8, salt: str = "",
                      ignore_eos: bool = False) -> tuple[float, float, int]:
    """Send `tokens` (greedy) and read it to its end: (sent at, first token at, cached tokens)."""
    from engine.types import Request, SamplingParams

    req = Request(tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos),
                  request_id=rid, cache_salt=salt)
    t0, first, cached = time.perf_counter(), None, 0
    async for batch in engine.stream(req):
        if first is None and any(e.token_id is not None for e in batch):
            first = time.perf_counter()
        for e in batch:
            if e.error:
                raise RuntimeError(f"request {rid} failed in the engine: {e.error}")
            if e.finished and e.usage:
                cached = e.usage.cached_tokens
    return t0, first or time.perf_counter(), cached


async def _ttft(engine, tokens, rid: str) -> tuple[float, int]:
    t0, first, cached = await first_token(engine, tokens, rid)
    return first - t0, cached


def _prompt(tokenizer, n: int) -> list[int]:
    """A chat-templated user message of about `n` tokens (plain prose, as a user would paste)."""
    words = ("The quick brown fox jumps over the lazy dog while the committee reviews the quarterly "
             "report on water usage in the northern districts. ").split()
    text, i = [], 0
    while True:
        text.append(words[i % len(words)])
        i += 1
        if i % 50 == 0:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": " ".join(text)}],
                                                add_generation_prompt=True)
            if len(ids) >= n:
                return list(ids)[:n]


async def run(args: argparse.Namespace) -> dict:
    from benchmarks.engine.engine_loop import engine_config
    from engine.loop import AsyncEngine

    ssd = tempfile.mkdtemp(prefix="pomona-prefix-hit-")
    config = engine_config(args.model, None, ssd)
    engine = AsyncEngine(config)
    await engine.wait_ready(600)
    tokens = _prompt(engine.tokenizer, args.tokens)
    cold, _ = await _ttft(engine, tokens, "cold")
    ram, ram_cached = await _ttft(engine, tokens, "ram")
    await engine.shutdown()  # flushes the SSD writer
    engine = AsyncEngine(config)
    await engine.wait_ready(600)
    ssd_t, ssd_cached = await _ttft(engine, tokens, "ssd")
    await engine.shutdown()
    out = {"prompt_tokens": len(tokens), "cold_ms": 1e3 * cold, "ram_ms": 1e3 * ram, "ram_cached": ram_cached,
           "ssd_ms": 1e3 * ssd_t, "ssd_cached": ssd_cached, "ram_ratio": ram / cold, "ssd_ratio": ssd_t / cold}
    print(f"{len(tokens)}-token prompt: cold {1e3 * cold:.0f} ms; RAM hit {1e3 * ram:.0f} ms ({ram_cached} cached, "
          f"{ram / cold:.3f}x); SSD hit after a restart {1e3 * ssd_t:.0f} ms ({ssd_cached} cached, {ssd_t / cold:.3f}x)")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=1323)
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    main()
