"""Whether host reads of KV blocks cost the GPU: the candidate cause of the SSD tier's throughput cost on
the H200 (0.82x at 32 concurrent one-off prompts in session 20, none on the CPU).

    python -m benchmarks.device.host_reads [--blocks 128] [--block-mb 6] [--rounds 7]

MLX's CUDA backend allocates arrays in managed memory (`cudaMallocManaged`), and the SSD writer reads
every block it writes on the host (`codec.encode`: a dense copy and a CRC32 of each byte). If a host
read migrates a block's pages off the GPU, three things slow down, each measured here against the same
work on blocks no host read touched (medians of `--rounds`, both orders alternated):
- gather: a RAM hit's restore (concatenate the blocks, then reduce them: the GPU reads every byte);
- recycled: new arrays of the freed blocks' sizes, filled by the GPU (MLX's buffer cache hands the
  freed buffers out again, pages and all);
- overlap: a chain of small matmuls (a host-bound step's shape) while a thread reads other blocks'
  host views, against the chain alone.
On a Mac (unified memory) and on the CPU every ratio should be ~1; this CPU is the dry run.
Prints a line per measurement and a JSON summary on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import zlib
from typing import Any, Callable

import mlx.core as mx
import numpy as np


def _blocks(n: int, nbytes: int) -> list[mx.array]:
    out = [mx.random.uniform(shape=(nbytes // 2,), dtype=mx.bfloat16) for _ in range(n)]
    mx.eval(out)
    return out


def _host_read(blocks: list[mx.array]) -> None:
    """What the SSD writer does to a block: a host view (as `codec.to_host`), then every byte read."""
    for b in blocks:
        view = np.asarray(mx.view(b, mx.uint16))
        zlib.crc32(memoryview(np.ascontiguousarray(view)).cast("B"))


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def gather(n: int, nbytes: int, flip: bool) -> tuple[float, float]:
    def restore(blocks: list[mx.array]) -> None:
        mx.eval(mx.sum(mx.concatenate(blocks).astype(mx.float32)))

    fresh, read = _blocks(n, nbytes), _blocks(n, nbytes)
    restore(fresh[:2])  # the kernels compiled
    _host_read(read)
    if flip:
        host = _timed(lambda: restore(read))
        return _timed(lambda: restore(fresh)), host
    return _timed(lambda: restore(fresh)), _timed(lambda: restore(read))


def recycled(n: int, nbytes: int, flip: bool) -> tuple[float, float]:
    def refill() -> None:
        outs = [mx.full((nbytes // 2,), 1.0, dtype=mx.bfloat16) * 2 for _ in range(n)]
        mx.eval(outs)

    times = {}
    for host in ((True, False) if flip else (False, True)):
        blocks = _blocks(n, nbytes)
        if host:
            _host_read(blocks)
        del blocks  # their buffers go to MLX's cache, and the refill gets them back
        times[host] = _timed(refill)
        mx.clear_cache()
    return times[False], times[True]


def overlap(n: int, nbytes: int, flip: bool, iters: int = 200) -> tuple[float, float]:
    w = mx.random.normal((1024, 1024)).astype(mx.bfloat16)
    x = mx.random.normal((32, 1024)).astype(mx.bfloat16)
    mx.eval(w, x)

    def chain() -> None:
        a = x
        for _ in range(iters):
            a = mx.tanh(a @ w)
            mx.eval(a)  # a step each: the host waits for the GPU, as the engine's loop does

    def with_reader() -> float:
        reader = threading.Thread(target=_host_read, args=(_blocks(n, nbytes),))
        reader.start()
        took = _timed(chain)
        reader.join()
        return took

    chain()
    if flip:
        beside = with_reader()
        return _timed(chain) / iters, beside / iters
    alone = _timed(chain)
    return alone / iters, with_reader() / iters


def run(blocks: int, block_mb: float, rounds: int, iters: int = 200) -> dict[str, Any]:
    nbytes = int(block_mb * 2**20) // 2 * 2
    out: dict[str, Any] = {"device": str(mx.default_device()), "blocks": blocks, "block_mb": block_mb}
    parts: tuple[tuple[str, Callable[[int, int, bool], tuple[float, float]]], ...] = (
        ("gather", gather), ("recycled", recycled), ("overlap", lambda n, b, f: overlap(n, b, f, iters)))
    for name, fn in parts:
        base, host = [], []
        for r in range(rounds):
            a, b = fn(blocks, nbytes, r % 2 == 1)
            base.append(a)
            host.append(b)
            mx.clear_cache()
        b0, h0 = statistics.median(base), statistics.median(host)
        out[name] = {"untouched_ms": round(1e3 * b0, 3), "host_read_ms": round(1e3 * h0, 3), "ratio": round(h0 / b0, 3)}
        print(f"{name}: untouched {1e3 * b0:.2f} ms, after host reads {1e3 * h0:.2f} ms ({h0 / b0:.2f}x)", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=128, help="blocks per measurement")
    p.add_argument("--block-mb", type=float, default=6.0, help="MB a block (64 tokens of a 1B model in bf16: ~8)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=200, help="steps of the overlap part's matmul chain")
    args = p.parse_args()
    print(json.dumps(run(args.blocks, args.block_mb, args.rounds, args.iters)))


if __name__ == "__main__":
    main()
