"""Llama-family attention and MLP that run faster on MLX's CPU backend, with the same results.

Why: on the CPU backend MLX computes exp one element at a time (see `modelio.cpu_kernels`), and a
llama forward pass calls it for SiLU in every MLP and for the softmax in every attention
(`mx.fast.scaled_dot_product_attention` falls back to a precise softmax on the CPU).
These subclasses of mlx-lm's own `Attention` and `MLP` keep their parameters and their call
signature and change only how two functions are evaluated: SiLU and softmax, from `fast_exp`.
The softmax path is for decode-sized queries only (at most `FAST_ATTENTION_MAX_QUERIES` per
sequence) against long contexts (`FAST_SOFTMAX_MIN_KEYS`), and `silu_mul` for more than one row:
below those sizes mlx-lm's own ops are faster. A prefill chunk (more queries) goes to `prefill_attention`: NumPy's exp is vectorised
(AVX2/AVX-512 here), MLX's and the polynomial one are not at that size, and for an agent's
follow-up turn (350 queries against 4,750 keys, SmolLM2's heads) the softmax alone took 215 ms in
MLX and 20 ms in NumPy; the whole attention 5x less than MLX's own SDPA (benchmarks/attention_paths.py,
removed; last in ecdd556; docs/measurements.md).
Quantized KV caches go to mlx-lm's code unchanged. (A table of rope cosines and sines was tried
and measured no faster than `mx.fast.rope`: rope is a small share of the step.)

`accelerate(model)` swaps them into a loaded mlx-lm llama model in place; `modelio.models` does it
on the CPU backend only. Greedy outputs match mlx-lm's model (tests/modelio/test_cpu_llama.py).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama

from modelio.cpu_kernels import silu_mul, softmax_parts
from modelio.flat_llama import FlatAttention, swap_attention

log = logging.getLogger("pomona.models")

# Queries per sequence up to which `attention` (MLX, fast softmax) is used: decode. From 4 queries up
# NumPy's `prefill_attention` is 1.6-7x faster than it at 4-8k keys (benchmarks/attention_paths.py,
# quiet box: 4 queries 2.8 vs 4.7 ms, 24 queries 10.5 vs 59 ms at 8k keys); at one query the two are
# within a millisecond and the MLX path avoids a synchronisation per layer.
FAST_ATTENTION_MAX_QUERIES = 1
# Queries per sequence up to which a short context (under FAST_SOFTMAX_MIN_KEYS keys) takes MLX's
# attention too: a speculative step's verified proposals (engine/step/step_runner.py).
FEW_QUERIES = 16
# Keys from which a decode call takes the fast softmax; below, MLX's own SDPA. Measured on the
# 2-core box, whole decode steps of the default model interleaved with mlx-lm's (fast / mlx-lm):
# one sequence against 128 keys 1.07, 1,024 keys 1.08, 3,000 keys 0.81; eight against 256 keys 0.99.
# With few keys the softmax is cheap either way and the fast path's extra ops cost more than it saves;
# an agent's long context (10-40k tokens) is where it pays.
FAST_SOFTMAX_MIN_KEYS = 2048
# Rows (batch x queries) from which the MLP takes `silu_mul`; one decoding sequence takes mlx-lm's
# compiled swiglu (the same measurement, MLP alone: 1 row 1.02-1.03, 4-8 rows 0.96-0.98).
FAST_SILU_MIN_ROWS = 2


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    """softmax(q k^T * scale + mask) v with grouped KV heads; what MLX's CPU fallback of
    `scaled_dot_product_attention` computes, with `cpu_kernels.softmax_parts`."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    rep = H // Hk
    q = (q * scale).reshape(B, Hk, rep * L, D)
    scores = (q @ k.swapaxes(-1, -2)).reshape(B, Hk, rep, L, S)
    if isinstance(mask, str):  # "causal": query i sees keys up to S - L + i (one query: all of them)
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None] if L > 1 else None
    if mask is not None:
        mask = _grouped(mask, H, Hk, rep)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    # Normalised after the product (as `_attend`): a pass fewer over the scores (decode at 6,500 keys,
    # SmolLM2's heads: 47.1 -> 45.1 ms over 30 layers with the causal mask of one query dropped).
    weights, sums = softmax_parts(scores)
    return ((weights.reshape(B, Hk, rep * L, S) @ v) / sums.reshape(B, Hk, rep * L, 1)).reshape(B, H, L, D)


# Bytes of float32 scores one NumPy pass materialises at most: longer chunks are split by query rows
# (a 2,048-query chunk against 32k keys would otherwise hold 2.4 GB of scores for SmolLM2's heads).
# Under 32 MB because MLX's CPU allocator keeps a freed buffer for reuse only below that size
# (`mx.get_cache_memory()` stays 0 after freeing a 33 MB array, holds 31 MB after a 31 MB one): a
# larger scores block is a fresh allocation every layer, its pages faulted in again as the matmul
# writes them. Measured on the 2-core box, one layer of a 256-query chunk, SmolLM2's heads: 46 ms
# against 4,983 keys with 128 MB blocks (one block of 44 MB), 34 ms with 16 MB; 76 / 57 ms at 8,000.
SCORES_BYTES = 16 * 2**20


def prefill_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any) -> mx.array:
    """`attention` for prefill chunks: MLX's matmuls, NumPy's softmax (float32 only).

    Why NumPy: at prefill sizes the softmax's exp dominates attention on the CPU and MLX's CPU
    backend evaluates it one element at a time; NumPy's is vectorised, 10x faster. The matmuls stay
    in MLX: NumPy's would run on its own bundled OpenBLAS, whose threads then spin against the ones
    MLX's BLAS runs every projection on (a 300-token prompt prefilled 1.6x slower that way). Long
    chunks go in blocks of query rows, so one block holds at most SCORES_BYTES of scores.
    """
    B, H, L, D = q.shape
    S = k.shape[2]
    rows = max(1, SCORES_BYTES // (4 * B * H * S))
    per_row = isinstance(mask, mx.array) and mask.shape[-2] == L
    parts = [_attend(q[:, :, start:start + rows], k, v, scale,
                     mask[..., start:start + rows, :] if per_row else mask, causal_from=S - L + start)
             for start in range(0, L, rows)]
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _attend(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any, causal_from: int) -> mx.array:
    """softmax(q k^T * scale + mask) v for a block of query rows; a "causal" mask means query i
    (of this block) sees keys up to `causal_from + i`. Rows whose keys are all masked (left padding
    in a batch) get finite uniform weights, as in `attention`, never NaN."""
    B, H, L, D = q.shape
    Hk, S = k.shape[1], k.shape[2]
    rep = H // Hk
    scores = (q * scale).reshape(B, Hk, rep * L, D) @ k.swapaxes(-1, -2)
    mx.eval(scores, *([mask] if isinstance(mask, mx.array) else []))
    # The softmax runs in place on the evaluated scores' own buffer (MLX exposes it writeable through
    # the buffer protocol; the array is this function's and evaluated, so nothing recomputes it).
    view = np.asarray(scores)
    shared = view.flags.writeable and view.flags.c_contiguous
    weights, sums = _exp_weights(view if shared else view.copy(), mask, Hk, rep, L, S, causal_from)
    out = scores if shared else mx.array(weights.reshape(B, Hk, rep * L, S))
    # Normalised after the product: (e v) / sum(e) is the softmax's (e / sum(e)) v, and dividing the
    # (rows, D) output costs nothing beside a pass over the (rows, S) weights (5 % of the attention).
    return ((out @ v) / mx.array(sums.reshape(B, Hk, rep * L, 1))).reshape(B, H, L, D)


def _exp_weights(flat: np.ndarray, mask: Any, Hk: int, rep: int, L: int, S: int,
                 causal_from: int) -> tuple[np.ndarray, np.ndarray]:
    """The softmax's numerators exp(s - max s), in place in `flat`, and their row sums."""
    scores = flat.reshape(-1, Hk, rep, L, S)
    lowest = np.finfo(np.float32).min
    if isinstance(mask, str) and causal_from + 1 < S:  # only keys past the first row's last are hidden
        hidden = np.arange(causal_from + 1, S)[None, :] > (causal_from + np.arange(L))[:, None]
        np.copyto(scores[..., causal_from + 1:], lowest, where=hidden)
    elif mask is not None and not isinstance(mask, str):
        m = np.asarray(mask)
        m = m.reshape(*m.shape[:-3], Hk, rep, L, S) if m.ndim >= 3 and m.shape[-3] == Hk * rep and Hk * rep > 1 \
            else np.expand_dims(m, -3)
        if m.dtype == np.bool_:
            np.copyto(scores, lowest, where=~m)
        else:
            scores += m
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    return scores, scores.sum(axis=-1, keepdims=True)


def _grouped(mask: mx.array, H: int, Hk: int, rep: int) -> mx.array:
    """A mask broadcastable to (B, H, L, S) as one broadcastable to (B, Hk, rep, L, S)."""
    if mask.ndim >= 3 and mask.shape[-3] == H and H > 1:
        return mask.reshape(*mask.shape[:-3], Hk, rep, *mask.shape[-2:])
    return mx.expand_dims(mask, -3)


class CpuAttention(FlatAttention):
    """mlx-lm's llama attention with the softmax of `attention` above; rope and cache as mlx-lm's.

    It also takes a *flat* forward (`FlatAttention`, modelio/flat_llama.py): the decode rows and the
    prompt chunks of one engine step as one sequence of tokens, each part attended with `_attend`.
    """

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        if cache is not None and hasattr(cache, "bits"):  # quantized KV: mlx-lm's own path
            return llama.Attention.__call__(self, x, mask, cache)
        if cache is not None and hasattr(cache, "parts"):
            return self.o_proj(self.flat_attention(x, cache))
        B, L, _ = x.shape
        q, k, v = self._heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), B, L)
        if cache is not None:
            q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q, k = self.rope(q), self.rope(k)
        return self.o_proj(self._attend(q, k, v, mask).transpose(0, 2, 1, 3).reshape(B, L, -1))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Any) -> mx.array:
        L = q.shape[2]
        if L <= FAST_ATTENTION_MAX_QUERIES and k.shape[2] >= FAST_SOFTMAX_MIN_KEYS:
            return attention(q, k, v, self.scale, mask)
        if L <= FAST_ATTENTION_MAX_QUERIES or (L <= FEW_QUERIES and k.shape[2] < FAST_SOFTMAX_MIN_KEYS):
            # decode, or a few queries (speculative verification) against a short context: MLX's
            # own, which stays lazy (NumPy's evaluates every layer as it is built)
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        if q.dtype == mx.float32:  # a prefill chunk
            return prefill_attention(q, k, v, self.scale, mask)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)


class CpuMLP(llama.MLP):
    """mlx-lm's llama MLP with `silu_mul` in place of its compiled `swiglu` (from two rows up)."""

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[0] * x.shape[1] < FAST_SILU_MIN_ROWS:
            return super().__call__(x)
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def accelerate(model: nn.Module) -> int:
    """Swap `CpuAttention`/`CpuMLP` into the llama blocks of `model` in place; returns how many
    blocks changed (0 for models of other architectures, which are left alone)."""
    changed = swap_attention(model, CpuAttention, CpuMLP)
    if changed:
        log.info("CPU fast paths (SiLU, softmax) on %d llama blocks", changed)
    return changed
