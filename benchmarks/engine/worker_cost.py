"""The engine process's event-loop cost a token: what the engine worker spends consuming its requests'
events and framing them for the replica, on the thread that shares the interpreter with the MLX thread.

Why: on a GPU the MLX thread builds every step in Python (steps bound by the host), so each
microsecond the worker's loop holds the GIL per token is taken from the steps at high concurrency
(issue 35: the stack over HTTP at 0.71-0.80x its engine in process on the smollm2 shape). This runs
`deployments.engine_worker.Worker` exactly as the engine process does (the replica's "add" frames in,
one "events" frame per step out), with the socket replaced by a counting sink, in a closed loop of
`concurrency` requests, and reports the loop thread's CPU time (`time.thread_time`) over the tokens
delivered, beside the MLX thread's and the steps' rate.

    python -m benchmarks.engine.worker_cost MODEL_DIR --concurrency 32,128 [--tokens 64] [--seconds 10]

A tiny model keeps the steps short so the loop's share shows (e.g. `python -m
benchmarks.device.device_serve_model tiny /tmp/models/tiny --dtype float32`). JSON on the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from typing import Any, Sequence


VOCAB = 256  # prompt ids drawn below this: inside any model's vocabulary


class _Sink:
    """Stands for the replica's socket: counts frames and bytes, never pushes back."""

    def __init__(self) -> None:
        self.frames = 0
        self.bytes = 0
        self.transport = self

    def write(self, data: bytes) -> None:
        self.frames += 1
        self.bytes += len(data)

    def get_write_buffer_size(self) -> int:
        return 0


async def _level(engine: Any, concurrency: int, tokens: int, seconds: float, vocab: int) -> dict[str, Any]:
    from deployments.engine_worker import Worker
    from engine.types import SamplingParams
    from api.core.wire import sampling_to_wire

    sink = _Sink()
    worker = Worker(engine, sink)  # type: ignore[arg-type]  # a writer is all it needs
    sampling = sampling_to_wire(SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    rng = random.Random(concurrency)
    ids = iter(range(10**9))

    counts = {"started": 0, "running": 0}
    timed = {"until": 0.0}
    all_done = asyncio.Event()

    def add() -> None:
        # The closed loop itself costs the loop O(1) a request (a done callback), not a wait over
        # every task: what is measured is the worker's cost.
        rid = f"r{next(ids)}"
        worker.handle(["add", rid, [rng.randrange(4, vocab) for _ in range(16)], sampling, 0, ""])
        counts["started"] += 1
        counts["running"] += 1
        worker.tasks[rid].add_done_callback(ended)

    def ended(_task: asyncio.Task) -> None:
        counts["running"] -= 1
        if time.perf_counter() < timed["until"]:
            add()
        elif counts["running"] == 0:
            all_done.set()

    async def round_of(until: float) -> int:
        all_done.clear()
        counts["started"] = 0
        timed["until"] = until
        for _ in range(concurrency):
            add()
        await all_done.wait()
        return counts["started"]

    await round_of(0.0)  # one round untimed: every shape of this level compiled or allocated once
    mlx_thread = next(t for t in threading.enumerate() if t.name == "pomona-mlx")
    mlx_clock = time.pthread_getcpuclockid(mlx_thread.ident)
    cpu0, mlx0, wall0, frames0 = time.thread_time(), time.clock_gettime(mlx_clock), time.perf_counter(), sink.frames
    started = await round_of(wall0 + seconds)  # then the last ones end (each request: `tokens` tokens)
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    mlx, frames = time.clock_gettime(mlx_clock) - mlx0, sink.frames - frames0
    generated = started * tokens
    return {
        "concurrency": concurrency, "requests": started, "tokens": generated, "wall_s": round(wall, 3),
        "tok_s": round(generated / wall, 1), "frames_per_s": round(frames / wall, 1),
        "loop_cpu_us_per_token": round(cpu / generated * 1e6, 2), "loop_cpu_share": round(cpu / wall, 3),
        "mlx_cpu_us_per_token": round(mlx / generated * 1e6, 2), "mlx_cpu_share": round(mlx / wall, 3),
    }


async def _run(model: str, levels: Sequence[int], tokens: int, seconds: float) -> dict[str, Any]:
    from benchmarks.engine.engine_loop import engine_config
    from engine.loop import AsyncEngine

    engine = AsyncEngine(engine_config(model, max(levels), None, prefix_cache=False))
    await engine.wait_ready()
    try:
        return {str(c): await _level(engine, c, tokens, seconds, VOCAB) for c in levels}
    finally:
        await engine.shutdown(drain_s=0)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--concurrency", default="32,128")
    p.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    p.add_argument("--seconds", type=float, default=10.0, help="timed closed loop a level")
    a = p.parse_args(argv)
    levels = [int(c) for c in a.concurrency.split(",")]
    out = asyncio.run(_run(a.model, levels, a.tokens, a.seconds))
    for c, r in out.items():
        print(f"{c} streams: {r['tok_s']} tok/s, {r['frames_per_s']} frames/s; CPU a token: loop "
              f"{r['loop_cpu_us_per_token']} us ({r['loop_cpu_share']:.0%} of a core), MLX thread "
              f"{r['mlx_cpu_us_per_token']} us ({r['mlx_cpu_share']:.0%})")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    from benchmarks.harness.servers import ensure_blas

    ensure_blas()  # as the servers run: Debian's OpenBLAS preloaded (MLX's bundled BLAS is ~15x slower here)
    raise SystemExit(main())
