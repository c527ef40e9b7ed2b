"""What a long prefix hit costs the requests already decoding: their inter-token gaps while an SSD hit
(after a restart) and then a RAM hit of the same long prompt are taken in, the engine in process with
serve_config.yaml's settings (SSD tier on, a fresh directory).

    python -m benchmarks.engine.restore_stall [--model default] [--tokens 6000] [--streams 2]

A prompt of `--tokens` tokens is sent cold and the engine restarted (its SSD writer flushed), then
`--streams` requests decode (short prompts, EOS ignored); once they run, the long prompt is sent (an
SSD hit; the first one also grows the engine's KV table, so the same prompt under a second cache salt,
computed cold before the restart too, gives the SSD hit proper), and again later (a RAM hit). For each hit: its TTFT, the streams' gaps between tokens from
the hit's arrival to its first token (max and the hit's share of them) against their median gap
before, and the MLX thread's time in the store's SSD hand-over (`complete`) and `restore` for it.

Prints one line per hit and a JSON summary on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any


def _timed(store: Any, log: list[tuple[str, float, float]]) -> None:
    """Record the wall time of the store's calls a hit makes: the SSD read (reader thread), the
    hand-over into RAM and the restore (MLX thread); this store only."""
    targets = [(store, "complete"), (store, "restore")] + ([(store.ssd, "read_blocks")] if store.ssd else [])
    for obj, name in targets:
        inner = getattr(obj, name)

        def wrapper(*a: Any, _inner: Any = inner, _name: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _inner(*a, **k)
            finally:
                log.append((_name, t0, time.perf_counter() - t0))

        setattr(obj, name, wrapper)


async def _stream(engine: Any, tokens: list[int], rid: str, stamps: list[float], max_tokens: int) -> None:
    from engine.types import Request, SamplingParams

    req = Request(tuple(tokens), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                  request_id=rid)
    async for batch in engine.stream(req):
        if any(e.token_id is not None for e in batch):  # one stamp a delivery (a step may bring several)
            stamps.append(time.perf_counter())


async def _hit(engine: Any, tokens: list[int], rid: str, salt: str) -> tuple[float, float, int]:
    from benchmarks.engine.prefix_hit import first_token

    return await first_token(engine, tokens, rid, max_tokens=2, salt=salt)


def _gaps(stamps: list[list[float]], lo: float, hi: float) -> list[float]:
    """Gaps between consecutive tokens of each stream whose later token falls in (lo, hi]: a gap
    that spans the window's start counts (it is what the window cost)."""
    out = []
    for s in stamps:
        out += [b - a for a, b in zip(s, s[1:]) if lo < b <= hi or (a <= lo and b > hi)]
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.engine.engine_loop import engine_config
    from benchmarks.engine.prefix_hit import _prompt
    from engine.loop import AsyncEngine

    ssd = tempfile.mkdtemp(prefix="pomona-restore-stall-")
    # Speculation off: a stream's proposals would change how many tokens a step delivers as they are
    # accepted, and with it the gaps this compares.
    config = engine_config(args.model, None, ssd, overrides={"speculative": "off"})
    engine = AsyncEngine(config)
    await engine.wait_ready(600)
    tokens = _prompt(engine.tokenizer, args.tokens)
    t0, first, _ = await _hit(engine, tokens, "cold", "a")
    cold = first - t0
    await _hit(engine, tokens, "cold-b", "b")  # the same prompt under another salt: a second, separate prefix
    await engine.shutdown()  # flushes the SSD writer
    engine = AsyncEngine(config)
    await engine.wait_ready(600)
    calls: list[tuple[str, float, float]] = []
    store = await engine.call(lambda e: e.store)
    _timed(store, calls)
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    shorts = [engine.tokenizer.encode(f"Stream {i}: count slowly from one to one thousand.") for i in range(args.streams)]
    streams = [asyncio.create_task(_stream(engine, shorts[i], f"s{i}", stamps[i], args.stream_tokens))
               for i in range(args.streams)]
    while min(len(s) for s in stamps) < args.warm_tokens:
        await asyncio.sleep(0.05)
    rows = []
    # The first hit grows the engine's KV table to the prompt's length (a copy of every row, and on
    # this VM fresh memory's page faults): it is reported apart ("ssd-first"); the second SSD hit
    # (the other salt's prefix) and the RAM hit find the table grown.
    for kind, salt in (("ssd-first", "a"), ("ssd", "b"), ("ram", "a")):
        before = time.perf_counter()
        base = statistics.median(_gaps(stamps, before - 3.0, before))
        start, first, cached = await _hit(engine, tokens, kind, salt)
        window = _gaps(stamps, start, first)
        mine = [(n, d) for n, t, d in calls if start <= t <= first]
        row = {"hit": kind, "ttft_ms": 1e3 * (first - start), "cached": cached, "cold_ms": 1e3 * cold,
               "stream_gap_p50_ms": 1e3 * base, "window_gap_max_ms": 1e3 * max(window, default=0.0),
               "window_gap_max_x": max(window, default=0.0) / base,
               "complete_ms": [round(1e3 * d, 1) for n, d in mine if n == "complete"],
               "restore_ms": [round(1e3 * d, 1) for n, d in mine if n == "restore"],
               "read_ms": [round(1e3 * d, 1) for n, d in mine if n == "read_blocks"],
               "read_started_ms": [round(1e3 * (t - start), 1) for n, t, d in calls if n == "read_blocks" and start <= t <= first],
               "complete_at_ms": [round(1e3 * (t - start), 1) for n, t, d in calls if n == "complete" and start <= t <= first]}
        rows.append(row)
        print(f"{kind} hit: TTFT {row['ttft_ms']:.0f} ms ({cached} of {len(tokens)} cached; cold {1e3 * cold:.0f} ms); "
              f"streams' gap p50 {row['stream_gap_p50_ms']:.0f} ms before, max {row['window_gap_max_ms']:.0f} ms "
              f"({row['window_gap_max_x']:.1f}x) while it was taken in; store on the MLX thread: complete "
              f"{row['complete_ms']} ms (at {row['complete_at_ms']} ms), restore {row['restore_ms']} ms; SSD read "
              f"(reader thread) {row['read_ms']} ms from {row['read_started_ms']} ms", flush=True)
        await asyncio.sleep(1.0)
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)
    # What the engine learned of its reads and prefills (engine/restore_choice.py): whether it would
    # read the next such hit or compute it again.
    reads = await engine.call(lambda e: e.restores.as_dict())
    print(f"ssd reads: {reads}", flush=True)
    await engine.shutdown()
    return {"prompt_tokens": len(tokens), "streams": args.streams, "hits": rows, "ssd_reads": reads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--streams", type=int, default=2)
    p.add_argument("--stream-tokens", type=int, default=4000, help="each stream's max_tokens (they are stopped after)")
    p.add_argument("--warm-tokens", type=int, default=20, help="tokens each stream has before the first hit")
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args))))


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    main()
