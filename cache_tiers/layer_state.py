"""One mlx-lm cache layer's state, as the store keeps it: its class, its `state` tree, its cuts.

Every mlx-lm cache class shares one protocol (the one `mlx_lm.models.cache.save_prompt_cache` /
`load_prompt_cache` use): the class name and its `state` tree (arrays, nested lists/tuples, plain
scalars; a `CacheList` nests its children's states and class names), rebuilt with the class's
`from_state`. Any class `mlx_lm.models.cache` defines is storable, so every architecture mlx-lm
ships gets a prefix cache, hybrid (state-space) models included.

The block store (blocks.py) cuts plain `KVCache` layers into blocks of rows; every other layer is
kept whole at a block boundary as an exact state, through the functions here. Token-indexed
classes need to know more, in `_RULES`: how long their state is and how to cut it to the first n
tokens (their buffers grow in 256-row steps and the unused tail must neither be stored nor
counted). A layer without a rule (a state-space `ArraysCache`: a running summary of every token
so far) is kept whole.

Arrays kept are evaluated and hold exactly the rows they cover (`keep`): a cut of a larger buffer
is copied; an array that already has exactly those rows is kept as a new array object over its
buffer, not copied again: MLX arrays are values (a cache update makes a new array and rebinds its
own object; a buffer still referenced is never donated). Caches handed back out are new objects
(`view`), so the engine mutating them never reaches the store.
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
# (rows None). the store copies what is longer than it keeps (`keep`); restores take views (`view`).
Take = Callable[[Any, "int | None"], Any]


@dataclass(frozen=True, eq=False)
class LayerSnapshot:
    cls: str
    slots: tuple[Any, ...]  # the cache's `state`, as a tuple of state trees


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


def copy(x: mx.array, rows: int | None) -> mx.array:
    """A private, contiguous copy (of rows [:rows] along the token axis)."""
    return mx.array(x if rows is None else x[..., :rows, :])


def view(x: mx.array, rows: int | None) -> mx.array:
    """A new array object over the same buffer (of rows [:rows])."""
    return x[...] if rows is None else x[..., :rows, :]


def keep(x: Any, rows: int | None) -> mx.array:
    """The store's take: an MLX array of exactly the rows kept is shared (a new object over its
    buffer), anything longer is cut by a copy, so no buffer tail is held or counted."""
    if isinstance(x, mx.array) and (rows is None or x.shape[-2] == rows):
        return view(x, None)
    return copy(x, rows)


def leaves(tree: Any) -> Iterator[Any]:
    """Every array in a state tree (or in a sequence of them)."""
    if isinstance(tree, (mx.array, np.ndarray)):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for t in tree:
            yield from leaves(t)


def restore_layer(cls: str, slots: tuple, n: int) -> Any:
    """A fresh cache object of class `cls` from kept state covering n tokens (views, nothing shared
    mutably)."""
    return CACHE_CLASSES[cls].from_state(cut_layer(cls, slots, n, view))
