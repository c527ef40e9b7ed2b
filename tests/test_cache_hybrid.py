"""Prefix caching for every mlx-lm cache class, hybrid (state-space) models included.

Unit level: each class `mlx_lm.models.cache` defines survives snapshot -> safetensors bytes ->
restore with its state intact, and is trimmable exactly when it can serve a shorter prefix.
Non-trimmable entries are served only at their own length, from RAM and from the SSD, and a
longer exact entry on the SSD never hides a shorter one that serves. Model level: tiny random
qwen3_next, mamba2 and falcon_h1 models continue from a restored prefix (RAM, SSD, a fresh store
on the same directory) with the same greedy tokens as a cold run.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, ConcatenateKVCache, KVCache,
                                 QuantizedKVCache, RotatingKVCache, make_prompt_cache)
from hybrid_models import hybrid_model_dir  # noqa: F401 (a fixture)
from test_cache_support import rotating_cache, store, toks
from tiny_model import CORPUS

from cache_tiers import codec
from cache_tiers.snapshot import CACHE_CLASSES, leaves, restore, snapshot

HEADS, DIM = 2, 8


def _kv(c, n: int):
    c.update_and_fetch(mx.random.normal((1, HEADS, n, DIM)), mx.random.normal((1, HEADS, n, DIM)))
    return c


def _ssm(n: int) -> ArraysCache:
    """A state-space layer's cache: a conv window and a recurrent state, whatever n is."""
    c = ArraysCache(size=2)
    c[0] = mx.random.normal((1, 3, 16)) + n
    c[1] = mx.random.normal((1, 2, 4, 8))
    return c


def _layer(kind: str, n: int):
    return {
        "KVCache": lambda: _kv(KVCache(), n),
        "RotatingKVCache": lambda: _kv(RotatingKVCache(max_size=64), n),
        "ChunkedKVCache": lambda: _kv(ChunkedKVCache(chunk_size=64), n),
        "ConcatenateKVCache": lambda: _kv(ConcatenateKVCache(), n),
        "ArraysCache": lambda: _ssm(n),
        "CacheList": lambda: CacheList(_ssm(n), _kv(KVCache(), n)),
    }[kind]()


def _quantized(n: int) -> QuantizedKVCache:  # mx.quantize needs head dims of a whole group
    c = QuantizedKVCache(group_size=32, bits=8)
    c.update_and_fetch(mx.random.normal((1, HEADS, n, 32)), mx.random.normal((1, HEADS, n, 32)))
    return c


TRIMMABLE = {"KVCache": True, "QuantizedKVCache": True, "RotatingKVCache": True, "ChunkedKVCache": True,
             "ConcatenateKVCache": True, "ArraysCache": False, "CacheList": False}


def _cache(kind: str, n: int) -> list:
    return [_quantized(n) if kind == "QuantizedKVCache" else _layer(kind, n) for _ in range(2)]


def _round_trip(tokens, cache):
    data = codec.encode(codec.to_host(snapshot(tokens, cache)), "fp")
    return codec.from_host(codec.decode(data, "fp"))


def _state_arrays(c, n: int) -> list[np.ndarray]:
    """Every array of a cache's state; a KV cache's cut to n rows (its buffer grows in steps)."""
    if isinstance(c, CacheList):
        return [a for child in c.caches for a in _state_arrays(child, n)]
    if isinstance(c, ArraysCache):
        return [np.array(a) for a in c.cache]
    return [np.array(a)[..., :n, :] for a in leaves([c.state])]


def test_every_mlx_lm_cache_class_is_covered():
    assert set(CACHE_CLASSES) == set(TRIMMABLE)


@pytest.mark.parametrize("kind", sorted(TRIMMABLE))
def test_every_cache_class_round_trips_through_bytes(kind):
    n = 40
    cache = _cache(kind, n)
    snap = _round_trip(toks(n), cache)
    assert snap.trimmable is TRIMMABLE[kind]
    back = restore(snap, n)
    assert [type(c) for c in back] == [type(c) for c in cache]
    want = [a for c in cache for a in _state_arrays(c, n)]
    got = [a for c in back for a in _state_arrays(c, n)]
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    if not TRIMMABLE[kind]:
        with pytest.raises(ValueError):
            restore(snap, n - 8)


def test_restored_state_space_cache_is_private():
    cache = _cache("CacheList", 20)
    snap = snapshot(toks(20), cache)
    a, b = restore(snap, 20), restore(snap, 20)
    assert a[0].caches[0].cache is not b[0].caches[0].cache  # mlx-lm assigns into this list
    a[0].caches[0][1] = mx.zeros((1, 2, 4, 8))
    assert not mx.array_equal(b[0].caches[0][1], a[0].caches[0][1])


def test_rotated_and_chunked_past_start_are_exact_only():
    rotated = rotating_cache(40, max_size=32)
    assert not snapshot(toks(40), rotated).trimmable
    chunked = [ChunkedKVCache(chunk_size=16) for _ in range(2)]
    for c in chunked:
        _kv(c, 40)
        c.maybe_trim_front()  # keeps only the last chunk: tokens below 24 are gone
    snap = _round_trip(toks(40), chunked)
    assert not snap.trimmable and restore(snap, 40)[0].start_position == 24


def test_trimmable_flag_is_checked_on_decode():
    host = codec.to_host(snapshot(toks(16), _cache("ArraysCache", 16)))
    forged = codec.HostEntry(host.tensors, dict(host.meta, trimmable=True))
    with pytest.raises(codec.CorruptEntry):
        codec.decode(codec.encode(forged, "fp"), "fp")


def test_exact_entries_served_only_at_their_length(tmp_path):
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(toks(32), _cache("CacheList", 32), "checkpoint")
    s.flush()
    for tier in ("ram", "ssd"):
        if tier == "ssd":
            s.clear("ram")
        assert s.lookup(toks(31)) is None  # shorter than the entry: would need a cut
        assert s.lookup(toks(32)) is None  # the whole prompt: nothing left to feed
        assert s.lookup(toks(30) + [999, 998, 997]) is None  # diverges inside the entry
        hit = s.lookup(toks(40))
        assert hit is not None and hit.tier == tier and hit.num_tokens == 32
    s.offer(toks(36), _cache("CacheList", 36), "finished")  # not block-aligned: RAM only
    s.flush()
    assert s.stats()["ssd"]["rejected"] == 1
    s.close()


def test_longer_exact_entry_does_not_hide_a_shorter_one(tmp_path):
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(toks(16), _cache("ArraysCache", 16), "checkpoint")
    s.offer(toks(48), _cache("ArraysCache", 48), "checkpoint")
    s.flush()
    s.clear("ram")
    hit = s.lookup(toks(30) + [7] * 20)  # shares 30 tokens: only the 16-token entry serves
    assert hit is not None and hit.tier == "ssd" and hit.num_tokens == 16
    assert s.lookup(toks(56)).num_tokens == 48
    s.close()


# -- tiny hybrid models ----------------------------------------------------------------------------

def _greedy(model, prompt: list[int], n: int, cache=None) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                                             sampler=lambda x: mx.argmax(x, axis=-1))]


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2", "falcon_h1"])
def test_hybrid_model_restored_prefix_matches_cold_greedy(arch, hybrid_model_dir, tmp_path):
    model, tokenizer = mlx_lm.load(str(hybrid_model_dir(arch)))
    assert not all(c.is_trimmable() for c in make_prompt_cache(model))
    prompt = tokenizer.encode(CORPUS[:300])
    prefix = prompt[:48]  # six 8-token blocks
    cold = _greedy(model, prompt, 12)

    cache = make_prompt_cache(model)
    model(mx.array([prefix]), cache=cache)
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(prefix, cache, "checkpoint")
    s.flush()
    for tier in ("ram", "ssd", "reopened"):
        if tier == "ssd":
            s.clear("ram")
        if tier == "reopened":
            s.close()
            s = store(tmp_path, block_size=8, min_restore_tokens=4)
        hit = s.lookup(prompt)
        assert hit is not None and hit.tier == ("ram" if tier == "ram" else "ssd")
        assert hit.num_tokens == len(prefix)
        assert _greedy(model, prompt[len(prefix):], 12, cache=hit.cache) == cold, tier
        assert s.lookup(prefix[:40] + [1] * 20) is None  # never at a wrong length
    s.close()
