"""Cache state <-> blocks: the MLX side of the block store (bytes live in codec.py).

The prefix store keeps KV the way vLLM's prefix caching, SGLang's radix cache and LMCache do: by
block. An offered cache (one mlx-lm cache object per layer, covering n tokens) splits into

- KV layers (mlx-lm's plain `KVCache`: one row per token), cut into blocks of `block_size` tokens.
  A block is named by its hash chain digest (keys.py: it covers every token before it), so the
  KV of a block is stored once however many conversations share it, and an offer adds only the
  blocks the store lacks: a conversation's next turn costs its new tokens, not its history.
  A block holds every KV layer's rows for its tokens, stacked by shape into one array per group
  (`Layout.groups`: one group for most models, whose layers share heads, head dim and dtype),
  so a block is one or two arrays rather than 2 x layers of them, and a restore of m blocks is
  one concatenate per group.
- exact layers (every other class: a state-space `ArraysCache`, a rotated `RotatingKVCache`...):
  their state summarises every token so far and cannot be cut, so it is kept whole at a block
  boundary as an `ExactState`, beside the blocks (a hybrid model's checkpoints). A prefix of such
  a model is served only where an exact state lies, from the blocks before it plus that state.

Blocks and states are built lazily and started with `mx.async_eval`, never waited for here: the
MLX thread's cost of an offer is building a few ops per new block. Arrays are private copies
(nothing the engine later writes can reach them), and caches handed out are new objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from .layer_state import LayerSnapshot, cut_layer, keep, known_class, layer_lengths, leaves, restore_layer

Slot = tuple[int, int]  # (layer index, 0 keys | 1 values)


@dataclass(frozen=True)
class Layout:
    """Which layers of a model's cache are KV layers, and how their rows are grouped in a block."""

    num_layers: int
    groups: tuple[tuple[Slot, ...], ...]  # per group array: the slots stacked along its first axis

    @property
    def kv(self) -> tuple[int, ...]:
        return tuple(sorted({layer for group in self.groups for layer, _ in group}))

    @property
    def needs_exact(self) -> bool:
        """Some layer is not a KV layer: a prefix is served only where an exact state lies."""
        return len(self.kv) < self.num_layers

    def as_json(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "groups": [[list(s) for s in g] for g in self.groups]}

    @classmethod
    def from_json(cls, d: Any) -> "Layout":
        groups = tuple(tuple((int(a), int(b)) for a, b in g) for g in d["groups"])
        layout = cls(int(d["num_layers"]), groups)
        slots = [s for g in groups for s in g]
        if len(set(slots)) != len(slots) or any(not 0 <= a < layout.num_layers or b not in (0, 1) for a, b in slots) \
                or any(len(g) == 0 for g in groups):
            raise ValueError("bad block layout")
        return layout


@dataclass(frozen=True, eq=False)
class Block:
    """The KV rows of `block_size` tokens, for every KV layer of the model."""

    digest: bytes  # chain digest: names this block and every token before it
    parent: bytes | None  # the previous block's digest (None: the first block)
    tokens: np.ndarray  # int64 ids of this block's tokens
    layout: Layout
    # Per group: its (slots, heads, block_size, dim) array, or with `quant` mx.quantize's
    # (packed, scales, biases) of it.
    arrays: tuple[Any, ...]
    quant: tuple[int, int] | None  # (bits, group_size) when stored quantized
    nbytes: int


@dataclass(frozen=True, eq=False)
class ExactState:
    """The exact layers' state after `num_tokens` tokens, at the end of block `digest`."""

    digest: bytes
    num_tokens: int
    num_layers: int
    layers: tuple[tuple[int, LayerSnapshot], ...]  # (layer index, its kept state)
    nbytes: int


@dataclass(frozen=True, eq=False)
class Tail:
    """The tokens past an offer's last whole block (fewer than a block), held in RAM only: the
    KV rows of those tokens and, for a model with exact layers, the exact state at their end.
    Why: a conversation's next turn, or the same prompt again, extends a prefix that rarely ends
    on a block boundary; without its tail every hit would recompute up to a block of tokens, and
    a hybrid model, whose state serves only its exact length, could not resume from a finished
    turn at all."""

    parent: bytes | None  # digest of the last whole block (None: the offer is shorter than a block)
    tokens: np.ndarray  # int64, 1 .. block_size - 1 of them
    layout: Layout
    arrays: tuple[Any, ...]  # per group: (slots, heads, len(tokens), dim)
    state: ExactState | None
    nbytes: int


@dataclass(frozen=True)
class Split:
    """An offered cache taken apart: its layout, each KV slot's rows (heads, n, dim), the exact
    layers (index, class, state)."""

    layout: Layout
    rows: dict[Slot, mx.array]
    exact: tuple[tuple[int, str, tuple], ...]
    num_tokens: int


def split(cache: Sequence[Any], n: int) -> Split:
    """Take a single-sequence cache covering exactly n tokens apart (raises on what cannot be
    stored: a batch, a wrong length, an unknown class)."""
    if n <= 0 or not cache:
        raise ValueError("nothing to store")
    rows: dict[Slot, mx.array] = {}
    exact = []
    shapes: dict[tuple, list[Slot]] = {}
    for i, layer in enumerate(cache):
        cls = type(layer).__name__
        known_class(cls)
        state = tuple(layer.state)
        if any(length != n for length in layer_lengths(cls, state)):
            raise ValueError(f"{cls} covers {layer_lengths(cls, state)} tokens, not {n}")
        if cls == "KVCache" and isinstance(state[0], mx.array):
            for kind in (0, 1):
                x = state[kind]
                if x.ndim != 4 or x.shape[0] != 1:
                    raise ValueError("a KV layer of more than one sequence")
                rows[(i, kind)] = x[0, :, :n, :]
                shapes.setdefault((x.shape[1], x.shape[3], x.dtype), []).append((i, kind))
        else:
            exact.append((i, cls, state))
    layout = Layout(len(cache), tuple(tuple(slots) for slots in shapes.values()))
    return Split(layout, rows, tuple(exact), n)


def cut_blocks(parts: Split, chain: Sequence[bytes], tokens: np.ndarray, first: int, last: int,
               block_size: int, quant: tuple[int, int] | None = None, offset: int = 0) -> list[Block]:
    """Blocks `first` .. `last - 1` of the offer (private copies, started, not waited for).
    `offset`: the token `parts`' first row holds (an offer of what the store lacked only)."""
    if first >= last:
        return []
    a, b = first * block_size - offset, last * block_size - offset
    if a < 0:
        raise ValueError(f"block {first} starts before the offer's rows (token {offset})")
    groups = parts.layout.groups
    if quant is not None and any(parts.rows[g[0]].shape[-1] % quant[1] for g in groups):
        quant = None  # a head dim the group size does not divide: stored as it is
    # A model with no KV layer at all (every layer exact) still gets its blocks, of tokens only: the
    # chain's presence is then found the same way for every model.
    stacked = [mx.stack([parts.rows[s][:, a:b, :] for s in group]) for group in groups]
    blocks = []
    for j in range(first, last):
        lo = (j - first) * block_size
        arrays: list[Any] = []
        for big in stacked:
            rows = big[:, :, lo:lo + block_size, :]
            if quant is not None:
                arrays.append(tuple(mx.quantize(rows, group_size=quant[1], bits=quant[0])))
            else:  # a private copy of just these rows, so no block keeps the offer's buffer alive
                arrays.append(mx.contiguous(rows) if last - first > 1 else rows)
        blocks.append(Block(chain[j], chain[j - 1] if j else None,
                            np.asarray(tokens[j * block_size:(j + 1) * block_size], dtype=np.int64).copy(),
                            parts.layout, tuple(arrays), quant, _nbytes(arrays) + block_size * 8))
    mx.async_eval([x for blk in blocks for x in leaves(blk.arrays)])
    return blocks


def exact_state(parts: Split, digest: bytes) -> ExactState | None:
    """The exact layers of an offer that ends on a block boundary (None: it has none)."""
    if not parts.exact:
        return None
    n = parts.num_tokens
    layers = tuple((i, LayerSnapshot(cls, cut_layer(cls, state, n, keep))) for i, cls, state in parts.exact)
    arrays = [x for _, layer in layers for x in leaves(layer.slots)]
    mx.async_eval(arrays)
    return ExactState(digest, n, parts.layout.num_layers, layers, _nbytes(arrays))


def cut_tail(parts: Split, start: int, parent: bytes | None, tokens: np.ndarray, offset: int = 0) -> Tail:
    """The offer's tokens from `start` (its last whole block's end) on, as a private copy.
    `offset`: the token `parts`' first row holds."""
    n = offset + parts.num_tokens
    arrays = tuple(mx.stack([parts.rows[s][:, start - offset:n - offset, :] for s in group])
                   for group in parts.layout.groups)
    mx.async_eval(list(arrays))
    state = exact_state(parts, parent or b"")
    nbytes = _nbytes(arrays) + (n - start) * 8 + (state.nbytes if state else 0)
    return Tail(parent, np.asarray(tokens[start:n], dtype=np.int64).copy(), parts.layout, arrays, state, nbytes)


def as_tail(block: Block) -> Tail:
    """A held block read as a tail (its rows plain), to serve a prompt that diverges inside it."""
    arrays = tuple(_plain(x, block.quant) for x in block.arrays)
    return Tail(block.parent, block.tokens, block.layout, arrays, None, block.nbytes)


def assemble(blocks: Sequence[Block], exact: ExactState | None, num_layers: int,
             tail: Tail | None = None, tail_rows: int = 0) -> list[Any]:
    """Fresh mlx-lm cache objects covering the blocks' tokens, then `tail_rows` of the tail's (and
    the exact layers at their end: `exact`, or the tail's own state)."""
    n = sum(len(b.tokens) for b in blocks) + tail_rows
    out: list[Any] = [None] * num_layers
    layout = blocks[0].layout if blocks else (tail.layout if tail is not None else None)
    if layout is not None and n:
        kv: dict[Slot, mx.array] = {}
        for g, group in enumerate(layout.groups):
            parts = [_plain(b.arrays[g], b.quant) for b in blocks]
            if tail is not None and tail_rows:
                parts.append(tail.arrays[g][:, :, :tail_rows, :])
            big = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)
            for k, slot in enumerate(group):
                kv[slot] = big[k][None]
        for layer in (layout.kv if layout.groups else ()):
            c = KVCache()
            c.state = (kv[(layer, 0)], kv[(layer, 1)], n)
            out[layer] = c
    if exact is not None:
        for i, layer in exact.layers:
            out[i] = restore_layer(layer.cls, layer.slots, exact.num_tokens)
    if any(c is None for c in out):
        raise ValueError("the blocks and exact state do not cover every layer")
    return out


def _plain(x: Any, quant: tuple[int, int] | None) -> mx.array:
    if quant is None:
        return x
    return mx.dequantize(*x, group_size=quant[1], bits=quant[0])


def _nbytes(arrays: Sequence[Any]) -> int:
    return sum(x.nbytes for x in leaves(list(arrays)))
