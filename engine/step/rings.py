"""The slot table as rings: a bounded KV cache per row (`EngineConfig.max_kv_size`), with the
attention mlx-lm's `BatchGenerator` gives a rotating cache.

Which caches mlx-lm builds: `make_prompt_cache(model, max_kv_size)` returns the model's own
`make_cache()` where it has one, and mlx-lm's llama (the family the own step runs) has one, so
`BatchGenerator(max_kv_size=...)` keeps plain, unbounded `KVCache`s for it: the bound is silently
dropped there. For a model without `make_cache` it builds `RotatingKVCache(max_kv_size, keep=4)`s,
which `BatchGenerator` merges into a `BatchRotatingKVCache`: that class has no `keep` (it trims and
rotates from the first slot) and its `extract` hands back `RotatingKVCache(max_size)`, keep 0.
The own step applies the bound to every model it runs, with that batch semantics (tests compare it
against `BatchGenerator` handed rotating caches): a sliding window, where a decode at position p
sees keys (p - W, p] (a ring of W slots written in place), and a prompt chunk's update concatenates
the cache trimmed to its last W - 1 tokens with the chunk, under a causal mask of window W, so
query p of a chunk again sees (p - W, p]. The first tokens are not kept as attention sinks.

Here row r's ring is slots [0, W) of the table: position p lives at slot p mod W (rotary offsets
stay absolute), and masks are built from positions, so they hide slots not written yet and keys
outside the window. A decode (one token per row) writes at its slot, then attends over the ring.
A prompt chunk attends over the ring as it was before the chunk (read first) followed by the
chunk's own keys, as mlx-lm's concatenation does, so a chunk of any length sees the same keys as
mlx-lm's; then only the chunk's last W tokens are written to the ring. Whatever a forward must
write but no row may keep (padding of a shorter chunk in a group, the tokens a chunk itself
pushes out of its window, rows that do not decode) goes to the table's last slot, outside every
ring (`SlotKV.ensure` keeps it there).

One difference from mlx-lm's single-sequence `RotatingKVCache` (not from its batch): a restored
cache that kept its first tokens (`keep` > 0, rotated outside a batch) is taken as its last W
tokens in temporal order at consecutive positions, as `BatchRotatingKVCache.merge` takes it.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache


class LayerHeads(Protocol):
    kv_heads: int  # a layer's KV heads: each row holds this many rows of the layer's arrays


class RingTable(Protocol):
    """What the rings read and write of the KV table (engine/step/kv_table.py's `SlotKV`), declared
    here so this module needs nothing of the table's: per layer, keys and values of shape
    (rows x heads, slots, head dim), each row's ring its first `window` slots."""

    shapes: Sequence[LayerHeads]
    window: int
    keys: list[mx.array]
    values: list[mx.array]


class RingPlan:
    """One forward's writes, mask and key length on a ring table of window `window`.

    `starts`: each row's first position (negative: a row that does not decode, whose token is
    garbage); `tokens`: the forward's width; `counts`: each row's real tokens (the rest padding).
    `slots` (B, tokens) is where each token is written; `prior` is how many ring slots a prompt
    chunk reads before its write (None for a one-token forward, which writes first and then reads
    `keys_len` slots).
    """

    def __init__(self, window: int, scratch: int, starts: list[int], tokens: int, counts: list[int],
                 keys_len: int, block: int) -> None:
        start = mx.array(starts, dtype=mx.int32)[:, None]  # (B, 1)
        count = mx.array(counts, dtype=mx.int32)[:, None]
        j = mx.arange(tokens, dtype=mx.int32)[None]  # (1, n)
        self.offset = mx.maximum(start[:, 0], 0)
        # Written: real tokens still inside the window after the forward; the rest to scratch.
        keep = (start >= 0) & (j < count) & (j >= count - window)
        self.slots = mx.where(keep, (start + j) % window, scratch)
        if tokens == 1:
            self.prior: int | None = None
            self.keys_len = max(1, min(keys_len, window))
            self.mask = self._ring_mask(window, start, start, self.keys_len)
        else:
            self.prior = min(window, -(-max(max(starts), 0) // block) * block)
            self.keys_len = self.prior + tokens
            query = start + j  # (B, n) positions of the chunk's queries
            old = self._ring_mask(window, start - 1, query, self.prior)
            own = (j.T >= j) & (j.T < j + window)  # (n, n): causal within the window
            self.mask = mx.concatenate([old, mx.broadcast_to(own[None, None], (len(starts), 1, tokens, tokens))],
                                       axis=-1)

    @staticmethod
    def _ring_mask(window: int, last: mx.array, query: mx.array, length: int) -> mx.array:
        """(B, 1, n, length): slot s holds position last - ((last - s) mod W) (negative: never
        written), visible to a query at p when it lies in (p - W, p]. A row with a negative
        query (not decoding) sees slot 0 only, so its garbage stays finite."""
        s = mx.arange(length, dtype=mx.int32)[None, None]  # (1, 1, T)
        held = last[:, :, None] - ((last[:, :, None] - s) % window)  # (B, 1, T)
        q = query[:, :, None]  # (B, n, 1)
        visible = (held >= 0) & (held <= q) & (held > q - window)
        idle = (q < 0) & (s == 0)
        return (visible | idle)[:, None]


def temporal(cache: Any, n: int) -> tuple[mx.array, mx.array]:
    """A single-sequence mlx-lm cache's keys and values (1, heads, T, dim) in token order, the last
    ending at position n - 1: a `RotatingKVCache` unrolled from its public `state` (as its own
    `_temporal_order` does), another cache's first n positions."""
    if not isinstance(cache, RotatingKVCache):
        keys, values = cache.state[:2]
        return keys[..., :n, :], values[..., :n, :]
    keys, values, offset, keep, _, idx = cache.state
    if idx == keys.shape[2]:
        return keys, values
    if idx < offset:  # rotated: the oldest kept tokens start at idx (after the first `keep`)
        return tuple(mx.concatenate([a[..., :keep, :], a[..., idx:, :], a[..., keep:idx, :]], axis=2)
                     for a in (keys, values))
    return keys[..., :idx, :], values[..., :idx, :]


def ring_ranges(window: int, n: int, length: int) -> list[tuple[int, int, int]]:
    """Where positions [n - length, n) lie in a ring (length <= W): (first slot, end slot, offset
    into the run), one range or two when they wrap."""
    first = (n - length) % window
    head = min(length, window - first)
    ranges = [(first, first + head, 0)]
    if head < length:
        ranges.append((0, length - head, head))
    return ranges


def write_ring(kv: RingTable, row: int, cache: list[Any], n: int) -> None:
    """Put a restored cache covering n tokens into `row`'s ring: its last min(n, W) tokens."""
    for i, (s, c) in enumerate(zip(kv.shapes, cache)):
        keys, values = temporal(c, n)
        length = min(n, kv.window, keys.shape[2])
        keys, values = keys[0, :, keys.shape[2] - length:], values[0, :, values.shape[2] - length:]
        lo, hi = row * s.kv_heads, (row + 1) * s.kv_heads
        for first, end, at in ring_ranges(kv.window, n, length):
            kv.keys[i][lo:hi, first:end] = keys[:, at:at + end - first]
            kv.values[i][lo:hi, first:end] = values[:, at:at + end - first]


def extract_ring(kv: RingTable, row: int, n: int) -> list[RotatingKVCache]:
    """`row`'s last min(n, W) tokens (positions up to n - 1, the last written) as mlx-lm
    `RotatingKVCache`s in token order, as `BatchRotatingKVCache.extract` gives them: keep 0, the
    absolute offset n. Copies, so no view of the table outlives the step."""
    out = []
    for i, s in enumerate(kv.shapes):
        lo, hi = row * s.kv_heads, (row + 1) * s.kv_heads
        ranges = ring_ranges(kv.window, n, min(n, kv.window))
        parts = [(kv.keys[i][lo:hi, a:b], kv.values[i][lo:hi, a:b]) for a, b, _ in ranges]
        keys = mx.contiguous(mx.concatenate([k for k, _ in parts], axis=1))[None]
        values = mx.contiguous(mx.concatenate([v for _, v in parts], axis=1))[None]
        c = RotatingKVCache(kv.window)
        c.state = (keys, values, n, 0, kv.window, keys.shape[2])
        out.append(c)
    mx.async_eval([c.state[:2] for c in out])
    return out
