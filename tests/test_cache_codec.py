"""Codec, keys and quantized storage: round trips, dtypes, the never-pickle rule."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import safetensors.numpy as stn
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from test_cache_support import kv_cache, store, toks

from cache_tiers import codec
from cache_tiers.keys import block_chain, chain_seed
from cache_tiers.snapshot import restore, snapshot


def _round_trip(tokens, cache):
    snap = snapshot(tokens, cache)
    data = codec.encode(codec.to_host(snap), "fp")
    assert set(stn.load(data)) >= {"tokens"}  # standard safetensors, readable by anyone
    return codec.from_host(codec.decode(data, "fp"))


def test_bfloat16_round_trip():
    cache = []
    for _ in range(2):
        c = KVCache()
        x = mx.random.normal((1, 2, 10, 8)).astype(mx.bfloat16)
        c.update_and_fetch(x, x * 2)
        cache.append(c)
    back = restore(_round_trip(toks(10), cache), 10)
    assert back[0].keys.dtype == mx.bfloat16
    assert mx.array_equal(back[1].values, cache[1].values[..., :10, :])


def test_mlx_quantized_cache_round_trip():
    cache = []
    for _ in range(2):
        c = QuantizedKVCache(group_size=32, bits=8)
        c.update_and_fetch(mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)))
        cache.append(c)
    back = restore(_round_trip(toks(40), cache), 30)
    assert isinstance(back[0], QuantizedKVCache) and back[0].offset == 30
    assert mx.array_equal(back[0].keys[0], cache[0].keys[0][..., :30, :])


def test_chain_is_prefix_stable_and_seeded():
    a = block_chain(toks(64), 16, chain_seed("m"))
    b = block_chain(toks(40) + [7] * 30, 16, chain_seed("m"))
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]
    assert block_chain(toks(64), 16, chain_seed("other")) [0] != a[0]
    assert block_chain(toks(64), 16, chain_seed("m", version=99))[0] != a[0]


def test_quantized_storage_returns_plain_kv_close_to_original(tmp_path):
    s = store(tmp_path, quantize_bits=8, quantize_group_size=32, quantize_min_tokens=64)
    original = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, 100, 64)), mx.random.normal((1, 2, 100, 64)))
        original.append(c)
    s.offer(toks(100), original, "finished")
    plain_bytes = 2 * 2 * 100 * 64 * 4 * 2
    assert s.stats()["ram"]["bytes"] < plain_bytes * 0.35
    for tier in ("ram", "ssd"):
        if tier == "ssd":
            s.flush()
            s.clear("ram")
        hit = s.lookup(toks(120))
        assert hit.tier == tier and type(hit.cache[0]) is KVCache
        got = np.array(hit.cache[0].keys)
        want = np.array(original[0].keys[..., : hit.num_tokens, :])
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.abs(got - want).max() < 0.05
    s.close()


def test_short_entries_not_quantized():
    s = store(quantize_bits=4, quantize_group_size=32, quantize_min_tokens=256)
    s.offer(toks(100), kv_cache(100), "finished")
    assert s.ram.find(np.arange(101)).snap.layers[0].slots[0].dtype == mx.float32
