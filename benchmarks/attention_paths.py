"""Attention on MLX's CPU backend: Pomona's two paths vs MLX's SDPA, side by side.

    python -m benchmarks.attention_paths

Prints wall time per call for decode-sized and prefill-sized queries against 4-5k keys, SmolLM2-135M's
head layout (9 query, 3 KV heads, dim 64): MLX's SDPA, the materialised fast softmax (decode path,
`modelio.cpu_llama.attention`) and NumPy's (prefill path, `prefill_attention`).
`modelio.cpu_llama.FAST_ATTENTION_MAX_QUERIES` is set from where the fast softmax stops winning.
Measured 2026-12-02 on the 2-core box, fast softmax / SDPA: 1 query 0.94x, 16 0.58x, 32 0.92x, 64
1.39x, 256 1.5x, 350 (vs 4,750 keys) 1.5-1.9x, 2,048 3.8x.
"""

from __future__ import annotations

import time

import mlx.core as mx

from modelio.cpu_llama import attention, prefill_attention

SHAPES = ((1, 4096), (8, 4096), (16, 4096), (32, 4096), (64, 4096), (256, 4608), (350, 4750), (2048, 4096))


def wall_ms(fn, repeats: int = 4) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main() -> None:
    for L, S in SHAPES:
        q, k, v = mx.random.normal((1, 9, L, 64)), mx.random.normal((1, 3, S, 64)), mx.random.normal((1, 3, S, 64))
        mx.eval(q, k, v)
        mask = "causal" if L > 1 else None
        sdpa = wall_ms(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)))
        fast = wall_ms(lambda: mx.eval(attention(q, k, v, 0.125, mask)))
        numpy = wall_ms(lambda: mx.eval(prefill_attention(q, k, v, 0.125, mask)))
        print(f"{L:5d} queries x {S} keys: SDPA {sdpa:8.1f} ms, fast softmax {fast:8.1f} ms ({fast / sdpa:.2f}x), "
              f"NumPy {numpy:8.1f} ms ({numpy / sdpa:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
