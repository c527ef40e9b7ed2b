"""Cache state <-> store-owned snapshots (the MLX side; bytes live in codec.py).

A `Snapshot` is the store's own copy of a prompt cache, kept through the protocol every mlx-lm
cache class shares (the one `mlx_lm.models.cache.save_prompt_cache` / `load_prompt_cache` use):
per layer the class name and its `state` tree (arrays, nested lists/tuples, plain scalars; a
`CacheList` nests its children's states and class names), rebuilt with the class's `from_state`.
Any class `mlx_lm.models.cache` defines is storable, so every architecture mlx-lm ships gets a
prefix cache, hybrid (state-space) models included.

Only token-indexed KV caches need to know more, in `_RULES`: how to cut their arrays to the first
n tokens. That serves two ends: their buffers grow in 256-row steps and the unused tail must
neither be stored nor counted, and a trimmable entry serves any shorter prefix. A layer without a
rule (a state-space `ArraysCache`: a running summary of every token so far) is kept whole and
makes the snapshot non-trimmable: it serves exactly its own length, never a shorter prefix.

Snapshots hold evaluated arrays of exactly the rows they cover. A cut of a larger buffer is copied;
an array that already has exactly those rows (every cache the engine offers fresh from mlx-lm's
`extract`) is kept as a new array object over its buffer, not copied again: MLX arrays are values
(a cache update makes a new array and rebinds its own object; a buffer still referenced is never
donated), so sharing is as safe as the views restores hand out. Caches handed back out are new
objects (new containers, new array objects over the snapshot's buffers), so the engine mutating
them never reaches the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as mlx_cache


def _cache_classes() -> dict[str, type]:
    """mlx-lm's cache classes by name: what `load_prompt_cache` can rebuild. Batch* classes hold
    several sequences at once and never describe one prefix."""
    return {name: obj for name, obj in vars(mlx_cache).items()
            if isinstance(obj, type) and not name.startswith(("_", "Batch"))
            and callable(getattr(obj, "from_state", None)) and callable(getattr(obj, "is_trimmable", None))}


CACHE_CLASSES: dict[str, type] = _cache_classes()
SCALARS = (int, float, bool, str, type(None))

# take(array, rows): a copy or view of the first `rows` rows along the token axis, or of all of it
# (rows None). Snapshots copy what is longer than they keep (`_keep`); restores and truncations
# take views.
Take = Callable[[Any, "int | None"], Any]


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    cls: str
    slots: tuple[Any, ...]  # the cache's `state`, as a tuple of state trees


@dataclass(frozen=True, eq=False)
class Snapshot:
    tokens: np.ndarray  # int64 token ids the state covers
    layers: tuple[LayerSnapshot, ...]
    nbytes: int  # bytes of arrays actually held (no buffer tail)
    trimmable: bool  # can serve any shorter prefix; otherwise only its exact length

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class _Rule:
    """What a token-indexed cache class needs beyond the generic protocol."""

    length: Callable[[tuple], int]  # tokens the state covers
    trimmable: Callable[[tuple], bool]  # can be cut to fewer tokens
    cut: Callable[[tuple, int, Take], tuple]  # the state covering the first n tokens


def _kv_cut(s: tuple, n: int, take: Take) -> tuple:
    # KVCache (k, v, offset) and QuantizedKVCache ((wq, scales, biases) x2, offset, group, bits);
    # the store's own quantized KVCache layout (quant.py) is the latter under the KVCache name.
    return (_take_all(s[0], take, n), _take_all(s[1], take, n), n, *s[3:])


def _rotating_cut(s: tuple, n: int, take: Take) -> tuple:
    keys, values, offset, keep, max_size, idx = s
    if offset >= max_size:  # rotated: rows are not in token order; only ever kept whole
        return (take(keys, None), take(values, None), offset, keep, max_size, idx)
    return (take(keys, n), take(values, n), n, keep, max_size, n)


def _chunked_cut(s: tuple, n: int, take: Take) -> tuple:
    keys, values, _, chunk_size, start = s  # rows hold tokens [start, offset)
    return (take(keys, n - start), take(values, n - start), n, chunk_size, start)


_RULES: dict[str, _Rule] = {
    "KVCache": _Rule(lambda s: s[2], lambda s: True, _kv_cut),
    "QuantizedKVCache": _Rule(lambda s: s[2], lambda s: True, _kv_cut),
    "ConcatenateKVCache": _Rule(lambda s: s[0].shape[-2], lambda s: True,
                                lambda s, n, take: (take(s[0], n), take(s[1], n))),
    "RotatingKVCache": _Rule(lambda s: s[2], lambda s: s[2] < s[4], _rotating_cut),
    # cut below the first row it holds is impossible: trimmable only while it holds token 0
    "ChunkedKVCache": _Rule(lambda s: s[2], lambda s: s[4] == 0, _chunked_cut),
}


def _take_all(tree: Any, take: Take, rows: int | None) -> Any:
    """`take` applied to every array of a state tree; lists and tuples rebuilt (never shared)."""
    if isinstance(tree, (mx.array, np.ndarray)):
        return take(tree, rows)
    if isinstance(tree, list):
        return [_take_all(t, take, rows) for t in tree]
    if isinstance(tree, tuple):
        return tuple(_take_all(t, take, rows) for t in tree)
    if not isinstance(tree, SCALARS):
        raise TypeError(f"cache state holds a {type(tree).__name__}, which is not storable")
    return tree


def _children(state: Sequence[Any]) -> list[tuple[str, tuple]]:
    """A CacheList's state: [(child state, child class name), ...]."""
    return [(str(cls), tuple(child)) for child, cls in state]


def known_class(cls: str) -> None:
    if cls not in CACHE_CLASSES:
        raise TypeError(f"cache class {cls} is not one mlx_lm.models.cache defines")


def is_trimmable(cls: str, state: tuple) -> bool:
    """Whether a layer of this class and state can be cut to any shorter prefix."""
    if cls == "CacheList":
        return all(is_trimmable(c, s) for c, s in _children(state))
    rule = _RULES.get(cls)
    return rule is not None and rule.trimmable(state)


def layer_lengths(cls: str, state: tuple) -> list[int]:
    """The token counts a layer records (a CacheList: its children's; state-space layers: none)."""
    known_class(cls)
    if cls == "CacheList":
        return [n for c, s in _children(state) for n in layer_lengths(c, s)]
    rule = _RULES.get(cls)
    return [] if rule is None else [rule.length(state)]


def cut_layer(cls: str, state: tuple, n: int, take: Take) -> tuple:
    """The layer's state covering the first n tokens (n must be its length unless trimmable),
    with every array passed through `take`. Checks the length it knows against n."""
    known_class(cls)
    if cls == "CacheList":
        return tuple((cut_layer(c, s, n, take), c) for c, s in _children(state))
    rule = _RULES.get(cls)
    if rule is None:  # state-space and other untrimmable state: whole
        return _take_all(tuple(state), take, None)
    length = rule.length(state)
    if n > length or (n < length and not rule.trimmable(state)):
        raise ValueError(f"{cls} covers {length} tokens, cannot serve {n}")
    return rule.cut(tuple(state), n, take)


def _copy(x: mx.array, rows: int | None) -> mx.array:
    """A private, contiguous copy (of rows [:rows] along the token axis)."""
    return mx.array(x if rows is None else x[..., :rows, :])


def _view(x: mx.array, rows: int | None) -> mx.array:
    """A new array object over the same buffer (of rows [:rows])."""
    return x[...] if rows is None else x[..., :rows, :]


def _keep(x: Any, rows: int | None) -> mx.array:
    """A snapshot's take: an MLX array of exactly the rows kept is shared (a new object over its
    buffer), anything longer is cut by a copy, so no buffer tail is held or counted. Offers of
    caches fresh from mlx-lm's `extract` (already contiguous copies) then copy nothing again:
    half the device copies of an offer, which the MLX thread launches on every finished request."""
    if isinstance(x, mx.array) and (rows is None or x.shape[-2] == rows):
        return _view(x, None)
    return _copy(x, rows)


def leaves(tree: Any) -> Iterator[Any]:
    """Every array in a state tree (or in a sequence of them)."""
    if isinstance(tree, (mx.array, np.ndarray)):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from leaves(t)


def _arrays(layers: Sequence[LayerSnapshot]) -> list[mx.array]:
    return [a for layer in layers for a in leaves(layer.slots)]


def snapshot(tokens: Sequence[int], cache: Sequence[Any]) -> Snapshot:
    """`cache` (covering exactly `tokens`) as a store-owned, evaluated Snapshot (see `_keep`)."""
    n = len(tokens)
    if n == 0 or not cache:
        raise ValueError("nothing to store")
    layers = []
    for layer in cache:
        cls = type(layer).__name__
        known_class(cls)
        state = tuple(layer.state)
        if any(length != n for length in layer_lengths(cls, state)):
            raise ValueError(f"{cls} covers {layer_lengths(cls, state)} tokens, not {n}")
        layers.append(LayerSnapshot(cls, cut_layer(cls, state, n, _keep)))
    arrays = _arrays(layers)
    if not arrays:
        raise ValueError("the cache holds no state")
    mx.eval(*arrays)
    return Snapshot(
        tokens=np.asarray(tokens, dtype=np.int64).copy(),
        layers=tuple(layers),
        nbytes=sum(a.nbytes for a in arrays) + n * 8,
        trimmable=all(is_trimmable(layer.cls, layer.slots) for layer in layers),
    )


def _restore_layer(layer: LayerSnapshot, n: int) -> Any:
    state = cut_layer(layer.cls, layer.slots, n, _view)
    if layer.cls == "KVCache" and isinstance(state[0], tuple):  # stored quantized (quant.py)
        _, _, _, group_size, bits = state
        k, v = (mx.dequantize(*part, group_size=group_size, bits=bits) for part in state[:2])
        state = (k, v, n)
    return CACHE_CLASSES[layer.cls].from_state(state)


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
    layers = tuple(LayerSnapshot(layer.cls, cut_layer(layer.cls, layer.slots, n, _view)) for layer in snap.layers)
    arrays = _arrays(layers)
    mx.eval(*arrays)
    return Snapshot(snap.tokens[:n].copy(), layers, sum(a.nbytes for a in arrays) + n * 8, True)
