"""A process beside the engine that holds an MLX GPU context: idle, or using it every `--every-ms`.

    python -m benchmarks.gpu_sidecar --seconds 60 [--every-ms 10]

Why: in the serving stack other processes (the replica, the ingress) import MLX; whether a second
context on the GPU, idle or touched now and then, slows the engine's step is measured with this
beside benchmarks/engine_loop.py (benchmarks/device_engine_env.sh).
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--every-ms", type=float, default=0.0, help="0: touch the GPU once, then sleep")
    args = p.parse_args()
    import mlx.core as mx

    a = mx.ones((64, 64))
    mx.eval(a @ a)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        if args.every_ms > 0:
            mx.eval(a @ a)
            time.sleep(args.every_ms / 1000)
        else:
            time.sleep(0.5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
