"""The batch's KV cache as a table of rows, and the per-forward views mlx-lm's models write through.

Each layer keeps keys and values as one array of shape (rows * kv_heads, capacity, head_dim): row
r's heads are rows r*H .. r*H+H-1, its tokens at positions [0, length). With rows and positions as
the two leading axes, one scatter writes every sequence's new tokens at its own position (MLX
indexes two leading axes in one assignment; rows and positions split by the heads axis it does
not), in place: nothing else may hold a view of a layer's array when the next step writes, or
MLX copies the whole array instead (20 ms rather than 0.7 ms for 128 rows x 2,048 positions on
the CPU), so whatever leaves the table (`extract`) is copied out.

A model sees a `RowsView` per layer: mlx-lm's attention asks it for `offset` (the rotary position
of each row), `update_and_fetch` and `make_mask`, the same protocol as mlx-lm's `BatchKVCache`,
whose array offsets every mlx-lm model already supports. No mlx-lm internals are touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from engine.step.plan import round_up
from engine.step.rings import RingPlan, extract_ring, write_ring


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: Any


def layer_shapes(model: Any) -> list[LayerShape]:
    """Each layer's KV heads, head dims and dtype, from a one-token forward into mlx-lm's caches."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    shapes = []
    for c in cache:
        keys, values = c.state[:2]
        shapes.append(LayerShape(keys.shape[1], keys.shape[3], values.shape[3], keys.dtype))
    return shapes


class SlotKV:
    """Every layer's keys and values for `rows` sequences of up to `capacity` positions; with a
    `window`, each row is a ring of that many slots (engine/step/rings.py) plus the scratch slot."""

    def __init__(self, shapes: list[LayerShape], block: int, window: int | None = None) -> None:
        self.shapes = shapes
        self.block = block
        self.window = window
        self.rows = 0
        self.capacity = 0
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []

    def ensure(self, rows: int, positions: int) -> None:
        """Grow to at least `rows` rows (to the next power of two) and `positions` positions (to
        the next block); a growth copies every layer once, so it happens in large steps."""
        rows = max(self.rows, 1 << max(rows - 1, 0).bit_length()) if rows > self.rows else self.rows
        if self.window is not None:  # a ring and one scratch slot past it is all a row ever needs
            positions = min(positions, self.window + 1)
        # Positions grow by half again at least: every growth copies the whole table, so a batch
        # decoding past its capacity must not pay that every block.
        capacity = round_up(max(positions, self.capacity + self.capacity // 2), self.block) \
            if positions > self.capacity else self.capacity
        if self.window is not None:
            capacity = min(capacity, round_up(self.window + 1, self.block))
        if (rows, capacity) == (self.rows, self.capacity):
            return
        keys, values = [], []
        for i, s in enumerate(self.shapes):
            k = mx.zeros((rows * s.kv_heads, capacity, s.k_dim), s.dtype)
            v = mx.zeros((rows * s.kv_heads, capacity, s.v_dim), s.dtype)
            if self.rows:
                n = self.rows * s.kv_heads
                k[:n, :self.capacity] = self.keys[i]
                v[:n, :self.capacity] = self.values[i]
            keys.append(k)
            values.append(v)
        self.keys, self.values = keys, values
        self.rows, self.capacity = rows, capacity
        mx.eval(self.keys, self.values)

    @property
    def scratch(self) -> int:
        """The start a decode gives a row that does not decode: the table's last position, which
        no sequence reaches; on a ring table a negative start (absolute positions pass any slot)."""
        return -1 if self.window is not None else self.capacity - 1

    def write_prefix(self, row: int, cache: list[Any], n: int) -> None:
        """Copy the first `n` positions of a single-sequence mlx-lm cache (a restored prefix) into
        `row` (on a ring table, the last of them its ring holds)."""
        if self.window is not None:
            return write_ring(self, row, cache, n)
        for i, (s, c) in enumerate(zip(self.shapes, cache)):
            keys, values = c.state[:2]
            lo, hi = row * s.kv_heads, (row + 1) * s.kv_heads
            self.keys[i][lo:hi, :n] = keys[0, :, :n, :]
            self.values[i][lo:hi, :n] = values[0, :, :n, :]

    def extract(self, row: int, n: int, start: int = 0) -> list[Any]:
        """Copies of `row`'s positions `start` .. `n - 1` as mlx-lm `KVCache`s (for the prefix store
        or a finished request), on a ring table its window as `RotatingKVCache`s (`start` 0);
        scheduled at once so no view of the table outlives this step."""
        if self.window is not None:
            return extract_ring(self, row, n)
        out = []
        for i, s in enumerate(self.shapes):
            lo, hi = row * s.kv_heads, (row + 1) * s.kv_heads
            c = KVCache()
            c.state = (mx.contiguous(self.keys[i][lo:hi, start:n])[None],
                       mx.contiguous(self.values[i][lo:hi, start:n])[None], n - start)
            out.append(c)
        mx.async_eval([c.state[:2] for c in out])
        return out

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values


class Batch:
    """One forward's rows: which table rows, their start positions and how many tokens each feeds.

    `rows` None means rows [0, count) (the decode batch: a slice, no gather); otherwise the table
    rows of the prefill chunks; `counts`, each row's real tokens (the rest pads it to `tokens`;
    only a ring table needs them: padding must not land in a ring). Builds the scatter indices,
    the rotary offsets and the mask once for all layers. On a ring table the positions to write
    and the mask come from `RingPlan`, and a prompt chunk reads `prior` ring slots before it writes.
    """

    def __init__(self, kv: SlotKV, starts: list[int], tokens: int, rows: list[int] | None,
                 keys_len: int, counts: list[int] | None = None) -> None:
        self.kv = kv
        self.count = len(starts)
        self.tokens = tokens
        self.rows = rows
        self.prior: int | None = None  # on a ring table, the ring slots a prompt chunk reads before its write
        table_rows = mx.arange(self.count, dtype=mx.int32) if rows is None else mx.array(rows, dtype=mx.int32)
        self._table_rows = table_rows
        self._index: dict[int, tuple[mx.array, mx.array]] = {}
        if kv.window is not None:
            plan = RingPlan(kv.window, kv.capacity - 1, starts, tokens, counts or [tokens] * len(starts),
                            keys_len, kv.block)
            self.offset, self.mask, self._positions = plan.offset, plan.mask, plan.slots
            self.keys_len, self.prior, self.single = plan.keys_len, plan.prior, None
            if (self.keys_len if tokens == 1 else self.prior) > kv.capacity:  # what it reads of the table
                raise RuntimeError(f"a forward over {self.keys_len} ring slots on a table of {kv.capacity}")
            return
        if keys_len > kv.capacity:
            raise RuntimeError(f"a forward over {keys_len} positions on a table of {kv.capacity}")
        self.keys_len = keys_len
        start = mx.array(starts, dtype=mx.int32)
        self.offset = start
        positions = start[:, None] + mx.arange(tokens, dtype=mx.int32)[None]  # (B, n)
        # (B, 1, n, T): query i of row b sees keys up to its own position
        self.mask = (mx.arange(keys_len, dtype=mx.int32)[None, None, None, :]
                     <= positions[:, None, :, None])
        # One row (every prefill on a CPU): a slice, written and read without scatter or gather.
        self.single = (rows[0], starts[0]) if rows is not None and len(rows) == 1 else None
        self._positions = positions

    def index(self, heads: int) -> tuple[mx.array, mx.array]:
        """Scatter indices into a layer's (rows * heads, capacity, dim) array, per head count."""
        if heads not in self._index:
            flat_rows = (self._table_rows[:, None] * heads + mx.arange(heads, dtype=mx.int32)[None]).reshape(-1)
            flat_pos = mx.repeat(self._positions, heads, axis=0)  # (B * H, n)
            self._index[heads] = (flat_rows[:, None], flat_pos)
        return self._index[heads]

    def views(self) -> list["RowsView"]:
        return [RowsView(self, i) for i in range(len(self.kv.shapes))]


class RowsView:
    """A layer's cache as mlx-lm's attention uses it, for the rows of one forward."""

    def __init__(self, batch: Batch, layer: int) -> None:
        self.batch = batch
        self.layer = layer
        self.offset = batch.offset
        self._before: tuple[mx.array, mx.array] | None = None  # a ring chunk's keys and values to attend

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.update(keys, values)
        return self.fetch()

    def update(self, keys: mx.array, values: mx.array) -> None:
        """Write this forward's new keys and values (rows, heads, tokens, dim) into the table."""
        b, kv = self.batch, self.batch.kv
        s = kv.shapes[self.layer]
        n = b.tokens
        if b.prior is not None:  # a prompt chunk on a ring table: the ring as it was, then the chunk
            self._before = (
                mx.concatenate([self._fetch(kv.keys[self.layer], s.kv_heads, s.k_dim, b.prior), keys], axis=2),
                mx.concatenate([self._fetch(kv.values[self.layer], s.kv_heads, s.v_dim, b.prior), values], axis=2))
            # The write waits for the read (MLX's evaluation order does not promise it): run first,
            # it would find the table still referenced and copy all of it instead of writing in place.
            keys, values = mx.depends([keys, values], list(self._before))
        if b.single is not None:
            row, start = b.single
            lo, hi = row * s.kv_heads, (row + 1) * s.kv_heads
            kv.keys[self.layer][lo:hi, start:start + n] = keys.reshape(s.kv_heads, n, s.k_dim)
            kv.values[self.layer][lo:hi, start:start + n] = values.reshape(s.kv_heads, n, s.v_dim)
        else:
            rows, pos = b.index(s.kv_heads)
            kv.keys[self.layer][rows, pos] = keys.reshape(b.count * s.kv_heads, n, s.k_dim)
            kv.values[self.layer][rows, pos] = values.reshape(b.count * s.kv_heads, n, s.v_dim)

    def fetch(self) -> tuple[mx.array, mx.array]:
        """These rows' keys and values, (rows, heads, keys_len, dim), as the table holds them now;
        a ring table's prompt chunk: its ring as `update` read it before writing, then the chunk."""
        if self.batch.prior is not None:
            return self._before
        kv, s = self.batch.kv, self.batch.kv.shapes[self.layer]
        return self._fetch(kv.keys[self.layer], s.kv_heads, s.k_dim, self.batch.keys_len), \
            self._fetch(kv.values[self.layer], s.kv_heads, s.v_dim, self.batch.keys_len)

    def _fetch(self, table: mx.array, heads: int, dim: int, length: int) -> mx.array:
        b = self.batch
        full = table.reshape(b.kv.rows, heads, b.kv.capacity, dim)
        if b.rows is None:
            return full[:b.count, :, :length]
        if b.single is not None:
            return full[b.single[0]:b.single[0] + 1, :, :length]
        return full[mx.array(b.rows, dtype=mx.int32), :, :length]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> mx.array:
        if window_size is not None and window_size != self.batch.kv.window:
            raise NotImplementedError("sliding-window attention is not supported by the slot step")
        b = self.batch
        if b.single is not None and b.keys_len == b.single[1] + b.tokens:
            return "causal"  # one row whose keys end at its last query: mlx-lm's own causal mask
        return b.mask

    @property
    def state(self) -> Any:  # mlx-lm's helpers may look; the table is not a per-layer cache
        raise NotImplementedError("a RowsView has no state of its own")


class FlatView:
    """A layer's cache for a flat forward: one step's batches (the decode rows, then each prompt
    chunk) fed as one sequence of tokens, in this order. Attention that knows `parts`
    (modelio/cpu_llama.py's `CpuAttention`) splits its tokens by them; the mask is each part's."""

    def __init__(self, batches: list[Batch], layer: int) -> None:
        self.parts = [(RowsView(b, layer), b.count, b.tokens) for b in batches]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None, **_: Any) -> None:
        if window_size is not None and window_size != self.parts[0][0].batch.kv.window:  # as RowsView
            raise NotImplementedError("sliding-window attention is not supported by the slot step")
        return None  # each part brings its own

    @property
    def state(self) -> Any:
        raise NotImplementedError("a FlatView has no state of its own")


def flat_views(batches: list[Batch]) -> list[FlatView]:
    """Per layer, the views of a flat forward over `batches` (all on the same table)."""
    return [FlatView(batches, i) for i in range(len(batches[0].kv.shapes))]


def supports_flat(model: Any) -> bool:
    """Whether every layer's attention takes a flat forward (the CPU fast-path llama blocks)."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    return bool(layers) and all(hasattr(getattr(l, "self_attn", None), "flat_attention") for l in layers)
