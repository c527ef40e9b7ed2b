"""TTFT of prefix hits with and without the direct first token (`engine.direct_first_token`).

In one process, on the same weights, alternating the two settings round by round: the quick
suite's prefix-repetition workload (2 shared system prompts of 512 tokens, 32-token questions,
16 output tokens, 16 requests, 4 concurrent) and its multi-turn chat (2 conversations of 8 turns,
64-token messages, 32-token replies, 2 concurrent; each turn resends the history and the reply).
Prefix cache on (RAM tier), greedy, EOS ignored; each round starts with an empty cache.

    python -m benchmarks.first_token                     # default model (float32 on CPU)
    python -m benchmarks.first_token --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any, Sequence

from benchmarks.engine_common import engine_loader, ensure_blas


def _engine(model: str, loader: Any, direct: str | None) -> Any:
    from cache_tiers.config import CacheConfig
    from engine.config import EngineConfig
    from engine.loop import AsyncEngine

    cache = CacheConfig(ram_bytes=512 * 2**20)
    return AsyncEngine(EngineConfig(model=model, cache=cache, direct_first_token=direct), loader=loader)


async def _ask(engine: Any, tokens: Sequence[int], max_tokens: int) -> tuple[float, str, int]:
    """(TTFT s, reply text, cached tokens) of one greedy request."""
    from engine.types import Request, SamplingParams

    t0 = time.perf_counter()
    ttft, parts, cached = None, [], 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for event in engine.generate(Request(tuple(tokens), params)):
        if event.token_id is not None and ttft is None:
            ttft = time.perf_counter() - t0
        parts.append(event.text)
        if event.error:
            raise RuntimeError(event.error)
        if event.usage is not None:
            cached = event.usage.cached_tokens
    return ttft or 0.0, "".join(parts), cached


async def prefix_round(engine: Any, tokenizer: Any, suite: Any) -> dict[str, Any]:
    from benchmarks.bare_loop import chat_prompts
    from benchmarks.workloads import TextMaker, build, first_turn_messages

    convs = build(suite.prefix, TextMaker.from_tokenizer(tokenizer))
    prompts = chat_prompts(tokenizer, [first_turn_messages(c) for c in convs])
    gate = asyncio.Semaphore(suite.prefix_concurrency)

    async def one(p: list[int]) -> tuple[float, str, int]:
        async with gate:
            return await _ask(engine, p, suite.prefix.output_len)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    ttfts = [r[0] for r in results]
    return {"ttft_p50_ms": 1000 * statistics.median(ttfts), "ttft_mean_ms": 1000 * statistics.fmean(ttfts),
            "cached_share": sum(r[2] for r in results) / sum(len(p) for p in prompts),
            "wall_s": time.perf_counter() - t0}


async def multiturn_round(engine: Any, tokenizer: Any, suite: Any) -> dict[str, Any]:
    from benchmarks.workloads import TextMaker, build

    convs = build(suite.multiturn, TextMaker.from_tokenizer(tokenizer))
    by_turn: list[list[float]] = [[] for _ in range(suite.multiturn.turns)]

    async def chat(conv: Any) -> None:
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(conv.turns):
            messages.append({"role": "user", "content": text})
            tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ttft, reply, _ = await _ask(engine, tokens, conv.max_tokens)
            by_turn[turn].append(ttft)
            messages.append({"role": "assistant", "content": reply})

    await asyncio.gather(*(chat(c) for c in convs))
    p50 = [1000 * statistics.median(t) for t in by_turn]
    return {"ttft_p50_ms_by_turn": p50, "turn8_over_turn1": p50[-1] / p50[0]}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.workloads import quick_suite

    suite, loader = quick_suite(), engine_loader(args.model)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for direct in ("auto", None) if r % 2 == 0 else (None, "auto"):
            engine = _engine(args.model, loader, direct)
            await engine.wait_ready(timeout=900)
            try:
                row = {"round": r, "direct_first_token": direct,
                       "prefix": await prefix_round(engine, engine.tokenizer, suite),
                       "multiturn": await multiturn_round(engine, engine.tokenizer, suite),
                       "direct_first_tokens": engine.stats()["direct_first_tokens"]}
            finally:
                await engine.shutdown()
            print(json.dumps(row), flush=True)
            rounds.append(row)
    return {"rounds": rounds, "summary": summarize(rounds)}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for direct in ("auto", None):
        rows = [r for r in rounds if r["direct_first_token"] == direct]
        out[str(direct)] = {
            "prefix_ttft_p50_ms": statistics.median(r["prefix"]["ttft_p50_ms"] for r in rows),
            "multiturn_turn8_over_turn1": statistics.median(r["multiturn"]["turn8_over_turn1"] for r in rows),
        }
    out["prefix_ttft_direct_over_batch"] = out["auto"]["prefix_ttft_p50_ms"] / out["None"]["prefix_ttft_p50_ms"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--rounds", type=int, default=2, help="each round runs both settings, order alternating")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ensure_blas()
    result = asyncio.run(main_async(args))
    print(json.dumps(result["summary"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
