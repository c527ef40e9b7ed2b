"""Cache state <-> store-owned snapshots (the MLX side; bytes live in codec.py).

A `Snapshot` is the store's own copy of a prompt cache: per layer the class name and its `state`
tuple (the same protocol `mlx_lm.models.cache.save_prompt_cache` uses), with every array sliced to
the cache's offset (KVCache buffers grow in 256-row steps; the unused tail must neither be stored
nor counted), copied into a fresh buffer and evaluated. Caches handed back out are new objects
built from slices of the snapshot, so the engine mutating them can never reach the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
import safetensors.numpy as stn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

SUPPORTED: dict[str, type] = {c.__name__: c for c in (KVCache, RotatingKVCache, QuantizedKVCache)}


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    cls: str
    slots: tuple[Any, ...]  # the cache's `state`: arrays, tuples of arrays, or plain scalars


@dataclass(frozen=True, eq=False)
class Snapshot:
    tokens: np.ndarray  # int64 token ids the state covers; len == offset
    layers: tuple[LayerSnapshot, ...]
    nbytes: int  # bytes of arrays actually held (no buffer tail)
    trimmable: bool  # can serve any shorter prefix; otherwise only its exact length

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


def _cut(x: mx.array, n: int) -> mx.array:
    """A private, contiguous copy of rows [:n] along the sequence axis."""
    return mx.array(x[..., :n, :])



def _snapshot_layer(layer: Any, n: int) -> tuple[LayerSnapshot, bool]:
    cls = type(layer).__name__
    if cls not in SUPPORTED:
        raise TypeError(f"cache class {cls} is not storable")
    state = tuple(layer.state)
    if state[0] is None or state[2] != n:
        raise ValueError(f"{cls} offset {state[2]} does not match {n} tokens")
    if cls == "KVCache":
        return LayerSnapshot(cls, (_cut(state[0], n), _cut(state[1], n), n)), True
    if cls == "QuantizedKVCache":
        k, v = (tuple(_cut(a, n) for a in part) for part in state[:2])
        return LayerSnapshot(cls, (k, v, n, state[3], state[4])), True
    keys, values, offset, keep, max_size, _idx = state
    if offset < max_size:  # never rotated: temporal order, rows [:offset] are the whole state
        return LayerSnapshot(cls, (_cut(keys, n), _cut(values, n), n, keep, max_size, n)), True
    return LayerSnapshot(cls, (mx.array(keys), mx.array(values), offset, keep, max_size, _idx)), False


def _arrays(layers: Sequence[LayerSnapshot]) -> list[mx.array]:
    out: list[mx.array] = []
    for layer in layers:
        for s in layer.slots:
            if isinstance(s, mx.array):
                out.append(s)
            elif isinstance(s, tuple):
                out.extend(s)
    return out


def snapshot(tokens: Sequence[int], cache: Sequence[Any]) -> Snapshot:
    """Copy `cache` (covering exactly `tokens`) into a store-owned, evaluated Snapshot."""
    n = len(tokens)
    if n == 0 or not cache:
        raise ValueError("nothing to store")
    made = [_snapshot_layer(layer, n) for layer in cache]
    layers = tuple(m[0] for m in made)
    arrays = _arrays(layers)
    mx.eval(*arrays)
    return Snapshot(
        tokens=np.asarray(tokens, dtype=np.int64).copy(),
        layers=layers,
        nbytes=sum(a.nbytes for a in arrays) + n * 8,
        trimmable=all(m[1] for m in made),
    )


def _restore_layer(layer: LayerSnapshot, n: int) -> Any:
    s = layer.slots
    if layer.cls == "RotatingKVCache" and s[2] >= s[4]:  # rotated: only whole, new array objects
        state: tuple = (s[0][...], s[1][...], *s[2:])
    else:
        state = _sliced_slots(layer, n)
    if layer.cls == "KVCache" and isinstance(state[0], tuple):  # stored quantized (quant.py)
        _, _, _, group_size, bits = state
        k, v = (mx.dequantize(*part, group_size=group_size, bits=bits) for part in state[:2])
        state = (k, v, n)
    return SUPPORTED[layer.cls].from_state(state)


def restore(snap: Snapshot, n: int) -> list[Any]:
    """Fresh cache objects covering snap.tokens[:n]; new array objects, nothing shared mutably."""
    if n > snap.num_tokens or (n < snap.num_tokens and not snap.trimmable):
        raise ValueError(f"cannot restore {n} of {snap.num_tokens} tokens")
    return [_restore_layer(layer, n) for layer in snap.layers]


def usable_length(snap: Snapshot, common: int, prompt_len: int) -> int:
    """How many prompt tokens this entry can serve, given their common prefix length.

    mlx-lm must feed at least one token, so never more than prompt_len - 1. A trimmable entry
    serves any shorter prefix; a non-trimmable one only its whole length, and only when that is a
    strict prefix of the prompt.
    """
    if snap.trimmable:
        return max(0, min(common, prompt_len - 1))
    n = snap.num_tokens
    return n if common >= n and n <= prompt_len - 1 else 0


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays (vectorised)."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def truncate(snap: Snapshot, n: int) -> Snapshot:
    """The first `n` tokens of a trimmable snapshot, as views (no copy): used to cut an entry to a
    block boundary before it is written; the writer thread copies while serializing."""
    if n == snap.num_tokens:
        return snap
    if not snap.trimmable or n > snap.num_tokens:
        raise ValueError(f"cannot truncate {snap.num_tokens} tokens to {n}")
    layers = tuple(LayerSnapshot(layer.cls, _sliced_slots(layer, n)) for layer in snap.layers)
    arrays = _arrays(layers)
    mx.eval(*arrays)
    return Snapshot(snap.tokens[:n].copy(), layers, sum(a.nbytes for a in arrays) + n * 8, True)


def _cut_slot(slot: Any, n: int) -> Any:
    if isinstance(slot, mx.array):
        return slot[..., :n, :]
    if isinstance(slot, tuple):
        return tuple(a[..., :n, :] for a in slot)
    return slot


def _sliced_slots(layer: LayerSnapshot, n: int) -> tuple[Any, ...]:
    """Every array cut to n rows (views) and the offset (and a rotating cache's index) set to n.
    Works for all stored layouts: plain, mlx-lm-quantized, and store-quantized (quant.py)."""
    slots = [_cut_slot(s, n) for s in layer.slots]
    slots[2] = n
    if layer.cls == "RotatingKVCache":
        slots[5] = n
    return tuple(slots)
