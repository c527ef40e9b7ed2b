"""Prefix caching for every mlx-lm cache class, hybrid (state-space) models included.

Unit level: plain `KVCache` layers are cut into blocks; every other class (`mlx_lm.models.cache`
defines them) is an exact layer, kept whole at a block boundary or in a RAM tail as an
`ExactState`, and survives exact state -> safetensors bytes -> restore intact. A model with exact
layers is served only where an exact state lies, from RAM and from the SSD, and a deeper block run
on the SSD never hides a shallower exact state that serves. Model level: tiny random qwen3_next,
mamba2, nemotron_h and falcon_h1 models continue from a restored prefix (RAM, SSD, a fresh store
on the same directory) with the same greedy tokens as a cold run, and logprobs bit-identical to
continuing from the offered cache's twin.
"""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, ConcatenateKVCache, KVCache,
                                 QuantizedKVCache, RotatingKVCache, make_prompt_cache)
from hybrid_models import hybrid_model_dir  # noqa: F401 (a fixture)
from test_cache_support import generate, prefilled, rotating_cache, same_logprobs, settle, skey, ssd_only, store, toks
from tiny_model import CORPUS

from cache_tiers import blocks as blk
from cache_tiers import codec
from cache_tiers.layer_state import CACHE_CLASSES, is_trimmable, leaves, restore_layer

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


def _state_arrays(c, n: int) -> list[np.ndarray]:
    """Every array of a cache's state; a KV cache's cut to n rows (its buffer grows in steps)."""
    if isinstance(c, CacheList):
        return [a for child in c.caches for a in _state_arrays(child, n)]
    if isinstance(c, ArraysCache):
        return [np.array(a) for a in c.cache]
    return [np.array(a)[..., :n, :] for a in leaves([c.state])]


def _state_round_trip(state: blk.ExactState) -> blk.ExactState:
    data = codec.encode(codec.to_host(codec.prepare_state(state)), "fp")
    return codec.decode_state(data, "fp", state.digest)


def test_every_mlx_lm_cache_class_is_covered():
    assert set(CACHE_CLASSES) == set(TRIMMABLE)


@pytest.mark.parametrize("kind", sorted(TRIMMABLE))
def test_every_cache_class_round_trips_through_bytes(kind):
    n = 40
    cache = _cache(kind, n)
    assert is_trimmable(type(cache[0]).__name__, tuple(cache[0].state)) is TRIMMABLE[kind]
    parts = blk.split(cache, n)
    if kind == "KVCache":  # cut into blocks
        assert not parts.layout.needs_exact
        chain = [bytes([k]) * 16 for k in range(n // 8)]
        blocks = blk.cut_blocks(parts, chain, np.arange(n), 0, n // 8, 8)
        back = [codec.decode_block(codec.encode(codec.to_host(codec.prepare_block(b)), "fp"), "fp", b.digest, 8)
                for b in blocks]
        restored = blk.assemble(back, None, 2)
    else:  # kept whole, as an exact state
        assert parts.layout.needs_exact and parts.layout.kv == ()
        state = _state_round_trip(blk.exact_state(parts, b"d" * 16))
        restored = blk.assemble([], state, 2)
    assert [type(c) for c in restored] == [type(c) for c in cache]
    want = [a for c in cache for a in _state_arrays(c, n)]
    got = [a for c in restored for a in _state_arrays(c, n)]
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_mixed_model_splits_kv_layers_into_blocks_and_keeps_the_rest_exact():
    n = 16
    cache = [_layer("ArraysCache", n), _layer("KVCache", n), _layer("ArraysCache", n), _layer("KVCache", n)]
    parts = blk.split(cache, n)
    assert parts.layout.kv == (1, 3) and parts.layout.needs_exact
    assert [i for i, _, _ in parts.exact] == [0, 2]


def test_restored_state_space_cache_is_private():
    cache = _cache("CacheList", 20)
    state = blk.exact_state(blk.split(cache, 20), b"d" * 16)
    a, b = blk.assemble([], state, 2), blk.assemble([], state, 2)
    assert a[0].caches[0].cache is not b[0].caches[0].cache  # mlx-lm assigns into this list
    a[0].caches[0][1] = mx.zeros((1, 2, 4, 8))
    assert not mx.array_equal(b[0].caches[0][1], a[0].caches[0][1])


def test_rotated_and_chunked_past_start_round_trip_whole():
    rotated = rotating_cache(40, max_size=32)
    assert not is_trimmable("RotatingKVCache", tuple(rotated[0].state))
    back = blk.assemble([], _state_round_trip(blk.exact_state(blk.split(rotated, 40), b"r" * 16)), 2)
    assert back[0].offset == 40 and mx.array_equal(back[0].keys, rotated[0].keys)
    chunked = [ChunkedKVCache(chunk_size=16) for _ in range(2)]
    for c in chunked:
        _kv(c, 40)
        c.maybe_trim_front()  # keeps only the last chunk: tokens below 24 are gone
    assert not is_trimmable("ChunkedKVCache", tuple(chunked[0].state))
    back = blk.assemble([], _state_round_trip(blk.exact_state(blk.split(chunked, 40), b"c" * 16)), 2)
    assert back[0].start_position == 24 and back[0].offset == 40


def test_state_length_is_checked_on_decode():
    state = blk.exact_state(blk.split(_cache("CacheList", 16), 16), b"d" * 16)
    host = codec.to_host(codec.prepare_state(state))
    forged = codec.HostEntry(host.tensors, dict(host.meta, num_tokens=12))  # a KV child of 16 rows
    with pytest.raises(codec.CorruptEntry):
        codec.decode_state(codec.encode(forged, "fp"), "fp", b"d" * 16)


def test_exact_layers_served_only_where_a_state_lies(tmp_path):
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(toks(32), _cache("CacheList", 32), "checkpoint")  # 4 blocks and a state at their end
    settle(s)
    assert s.stats()["ssd"]["keys"] == 5
    for tier in ("ram", "ssd"):
        if tier == "ssd":
            s.clear("ram")
        assert s.lookup(toks(31)) is None  # shorter than the state: would need a cut
        assert s.lookup(toks(32)) is None  # the whole prompt: nothing left to feed
        assert s.lookup(toks(30) + [999, 998, 997]) is None  # diverges before the state
        hit = s.lookup(toks(40))
        assert hit is not None and hit.tier == tier and hit.num_tokens == 32
    s.offer(toks(36), _cache("CacheList", 36), "finished")  # not block-aligned: a RAM tail only
    settle(s)
    assert s.stats()["ssd"]["keys"] == 5
    assert s.lookup(toks(40)).num_tokens == 36
    s.clear("ram")
    assert s.lookup(toks(40)).num_tokens == 32
    s.close()


def test_deeper_block_run_does_not_hide_a_shallower_state(tmp_path):
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(toks(16), _cache("ArraysCache", 16), "checkpoint")
    s.offer(toks(48), _cache("ArraysCache", 48), "checkpoint")
    ssd_only(s)
    hit = s.lookup(toks(30) + [7] * 20)  # shares 3 blocks; only the 16-token state serves
    assert hit is not None and hit.tier == "ssd" and hit.num_tokens == 16
    assert s.lookup(toks(56)).num_tokens == 48
    s.close()


def test_first_lookup_after_restart_finds_the_shallower_state(tmp_path):
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(toks(16), _cache("ArraysCache", 16), "checkpoint")
    s.offer(toks(48), _cache("ArraysCache", 48), "checkpoint")
    s.close()
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    hit = s.lookup(toks(30) + [7] * 20)
    assert hit is not None and hit.num_tokens == 16
    s.close()


def test_missing_state_row_serves_an_earlier_state(tmp_path):
    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(toks(16), _cache("ArraysCache", 16), "checkpoint")
    s.offer(toks(48), _cache("ArraysCache", 48), "checkpoint")
    ssd_only(s)
    s.ssd.storage.delete(skey(toks(48), 5, block=8))  # evicted by diskcache
    hit = s.lookup(toks(56))
    assert hit is None or hit.num_tokens == 16
    assert s.lookup(toks(56)).num_tokens == 16
    s.close()


# -- tiny hybrid models ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2", "nemotron_h", "falcon_h1"])
def test_hybrid_model_restored_prefix_matches_cold(arch, hybrid_model_dir, tmp_path):
    model, tokenizer = mlx_lm.load(str(hybrid_model_dir(arch)))
    assert not all(type(c) is KVCache for c in make_prompt_cache(model))
    prompt = tokenizer.encode(CORPUS[:300])
    prefix, turn = prompt[:48], prompt[:53]  # six 8-token blocks; a finished turn 5 tokens past them
    cold = generate(model, prompt, 12)

    s = store(tmp_path, block_size=8, min_restore_tokens=4)
    s.offer(prefix, prefilled(model, prefix), "checkpoint")
    s.offer(turn, prefilled(model, turn), "finished")
    for tier in ("ram", "ssd", "restart"):
        if tier == "ssd":
            ssd_only(s)
        if tier == "restart":
            s.close()
            s = store(tmp_path, block_size=8, min_restore_tokens=4)
        hit = s.lookup(prompt)
        assert hit is not None and hit.tier == ("ram" if tier == "ram" else "ssd")
        offered = turn if tier == "ram" else prefix  # RAM serves the tail's exact state too
        n = len(offered)
        assert hit.num_tokens == n
        warm = generate(model, prompt[n:], 12, cache=hit.cache)
        twin = generate(model, prompt[n:], 12, cache=prefilled(model, offered))
        assert warm[0] == cold[0], tier
        assert same_logprobs(warm[1], twin[1]), tier
        assert max(np.abs(a - b).max() for a, b in zip(warm[1], cold[1])) < 1e-3, tier
        assert s.lookup(prefix[:40] + [1] * 20) is None  # never at a length without an exact state
    s.close()
