"""Llama attention that also takes a *flat* forward: one engine step's decode rows and prompt chunks
as one sequence of tokens.

Why: the own step (engine/step/step_runner.py) feeds a prompt chunk in the same step as the running
decodes. Run as two forwards (the decode rows', then the chunk's) a step reads every weight twice and
builds every layer twice; a flat forward runs each projection and MLP once, over all the step's
tokens as one matrix, and only attention per part (each part its own rows, rotary offsets, cache
writes and mask). On the 2-core CPU a chunk in a forward of its own nearly doubled a decoding step
(docs/measurements.md, session 15); on a GPU the step is bound by the host building it and, for a
large model, by reading the weights, both of which a second forward pays again.

`FlatAttention` is mlx-lm's llama `Attention` with its parameters and call signature: any other cache
goes through mlx-lm's own `__call__` unchanged. `flatten(model)` swaps it into a loaded model's llama
blocks in place (`modelio.models` does it on GPU backends; the CPU's `CpuAttention` extends it).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

log = logging.getLogger("pomona.models")


class FlatAttention(llama.Attention):
    """mlx-lm's llama attention, plus `flat_attention` for a cache with `parts`."""

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        if cache is not None and hasattr(cache, "parts") and not hasattr(cache, "bits"):
            return self.o_proj(self.flat_attention(x, cache))
        return super().__call__(x, mask, cache)

    def flat_attention(self, x: mx.array, cache: Any) -> mx.array:
        """Attention for x of shape (1, N, dim) whose N tokens are `cache.parts` in order: each part
        a (view, rows, tokens) of `rows` sequences feeding `tokens` each, with its own rotary
        offsets, cache rows and mask (the view's `offset`, `update`, `fetch`, `make_mask`).

        Every part writes its keys before any part reads: a read of the table between two writes
        would keep the older array alive and make MLX copy the whole table for the next write.
        """
        q_all, k_all, v_all = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries, start = [], 0
        for view, rows, tokens in cache.parts:
            span = slice(start, start + rows * tokens)
            q, k, v = self._heads(q_all[:, span], k_all[:, span], v_all[:, span], rows, tokens)
            q, k = self.rope(q, offset=view.offset), self.rope(k, offset=view.offset)
            view.update(k, v)
            queries.append(q)
            start += rows * tokens
        outs = []
        for (view, rows, tokens), q in zip(cache.parts, queries):
            k, v = view.fetch()
            out = self._attend(q, k, v, view.make_mask(tokens))
            outs.append(out.transpose(0, 2, 1, 3).reshape(1, rows * tokens, -1))
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=1)

    def _heads(self, q: mx.array, k: mx.array, v: mx.array, B: int, L: int) -> tuple[mx.array, mx.array, mx.array]:
        return (q.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3),
                k.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3),
                v.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Any) -> mx.array:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)


def swap_attention(model: nn.Module, cls: type, swap_mlp: type | None = None) -> int:
    """Make every plain llama attention of `model` a `cls` (a subclass of llama's `Attention` that
    adds methods only), and its MLP a `swap_mlp` where given; returns how many blocks changed (0 for
    other architectures, which are left alone).

    The modules change class in place rather than being rebuilt: each keeps its own layers as
    loaded (a 4-bit checkpoint's `QuantizedLinear`s, whose `scales` a new dense module has no place
    for), its parameters and its rope."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    changed = 0
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attn) is not llama.Attention:
            continue
        if swap_mlp is not None and type(mlp) is not llama.MLP:
            continue
        attn.__class__ = cls
        if swap_mlp is not None:
            mlp.__class__ = swap_mlp
        changed += 1
    return changed


def flatten(model: nn.Module) -> int:
    """Swap `FlatAttention` into the llama blocks of `model` in place; how many blocks changed."""
    changed = swap_attention(model, FlatAttention)
    if changed:
        log.info("flat forward on %d llama blocks", changed)
    return changed
