"""Codec, keys and quantized storage on the block store: round trips of blocks and exact states
through safetensors bytes, dtypes, validation, the never-pickle rule."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import numpy as np
import pytest
import safetensors.numpy as stn
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from test_cache_support import BLOCK, chain, kv_cache, ssd_only, store, toks

from cache_tiers import blocks as blk
from cache_tiers import codec
from cache_tiers.keys import block_chain, chain_seed
from cache_tiers.layer_state import restore_layer


def _blocks(cache, n: int, quant=None) -> list[blk.Block]:
    parts = blk.split(cache, n)
    return blk.cut_blocks(parts, chain(toks(n)), np.asarray(toks(n)), 0, n // BLOCK, BLOCK, quant)


def _bytes(item) -> bytes:
    prepared = codec.prepare_block(item) if isinstance(item, blk.Block) else codec.prepare_state(item)
    data = codec.encode(codec.to_host(prepared), "fp")
    loaded = stn.load(data)  # standard safetensors, readable by anyone
    assert "tokens" in loaded if isinstance(item, blk.Block) else True
    return data


def _block_round_trip(block: blk.Block) -> blk.Block:
    return codec.decode_block(_bytes(block), "fp", block.digest, BLOCK)


def test_bfloat16_block_round_trip():
    n = 2 * BLOCK
    cache = kv_cache(n, dtype=mx.bfloat16)
    back = [_block_round_trip(b) for b in _blocks(cache, n)]
    assert back[0].arrays[0].dtype == mx.bfloat16 and back[1].parent == back[0].digest
    restored = blk.assemble(back, None, 2)
    for got, want in zip(restored, cache):
        assert got.keys.dtype == mx.bfloat16 and got.offset == n
        assert mx.array_equal(got.values, want.values[..., :n, :])


def test_quantized_block_round_trip():
    n = BLOCK
    cache = kv_cache(n, dim=64)
    [block] = _blocks(cache, n, quant=(8, 32))
    back = _block_round_trip(block)
    assert back.quant == (8, 32)
    for a, b in zip(back.arrays[0], block.arrays[0]):
        assert mx.array_equal(a, b)


def test_mlx_quantized_cache_is_an_exact_layer_round_trip():
    cache = []
    for _ in range(2):
        c = QuantizedKVCache(group_size=32, bits=8)
        c.update_and_fetch(mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)))
        cache.append(c)
    parts = blk.split(cache, 40)
    assert parts.layout.kv == () and parts.layout.needs_exact
    state = blk.exact_state(parts, b"d" * 16)
    back = codec.decode_state(_bytes(state), "fp", b"d" * 16)
    assert back.num_tokens == 40
    for n in (40, 30):
        layers = [restore_layer(layer.cls, layer.slots, n) for _, layer in back.layers]
        assert isinstance(layers[0], QuantizedKVCache) and layers[0].offset == n
        assert mx.array_equal(layers[0].keys[0][..., :n, :], cache[0].keys[0][..., :n, :])


def test_decode_checks_digest_fingerprint_and_shapes():
    [block] = _blocks(kv_cache(BLOCK), BLOCK)
    data = _bytes(block)
    with pytest.raises(codec.CorruptEntry):
        codec.decode_block(data, "fp", b"z" * 16, BLOCK)  # under another key
    with pytest.raises(codec.CorruptEntry):
        codec.decode_block(data, "other-model", block.digest, BLOCK)
    with pytest.raises(codec.CorruptEntry):
        codec.decode_block(data, "fp", block.digest, BLOCK * 2)  # another block size
    host = codec.to_host(codec.prepare_block(block))
    forged = dict(host.meta, layout={"num_layers": 2, "groups": [[[0, 0], [0, 1], [1, 0], [1, 1], [2, 0]]]})
    with pytest.raises(codec.CorruptEntry):  # a layout the arrays do not have
        codec.decode_block(codec.encode(codec.HostEntry(host.tensors, forged), "fp"), "fp", block.digest, BLOCK)
    with pytest.raises(codec.CorruptEntry):  # a state's bytes under a block's key
        codec.decode_state(data, "fp", block.digest)


def test_header_is_json_and_data_is_checksummed():
    [block] = _blocks(kv_cache(BLOCK), BLOCK)
    data = _bytes(block)
    (hlen,) = struct.unpack("<Q", data[:8])
    meta = json.loads(json.loads(data[8:8 + hlen])["__metadata__"]["pomona"])
    assert meta["kind"] == "block" and meta["digest"] == block.digest.hex() and "crc32" in meta
    flipped = data[:-5] + bytes([data[-5] ^ 1]) + data[-4:]
    with pytest.raises(codec.CorruptEntry, match="checksum"):
        codec.decode_block(flipped, "fp", block.digest, BLOCK)


def test_chain_is_prefix_stable_and_seeded():
    a = block_chain(toks(64), 16, chain_seed("m"))
    b = block_chain(toks(40) + [7] * 30, 16, chain_seed("m"))
    assert len(a) == 4 and a[:2] == b[:2] and a[2] != b[2]
    assert block_chain(toks(64), 16, chain_seed("other"))[0] != a[0]
    assert block_chain(toks(64), 16, chain_seed("m", version=99))[0] != a[0]
    assert block_chain(toks(64), 16, chain_seed("m", salt="t"))[0] != a[0]
    assert chain_seed("m", salt="") == chain_seed("m")


def test_quantized_storage_returns_plain_kv_close_to_original(tmp_path):
    s = store(tmp_path, quantize_bits=8, quantize_group_size=32, quantize_min_tokens=64)
    original = []
    for _ in range(2):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, 2, 100, 64)), mx.random.normal((1, 2, 100, 64)))
        original.append(c)
    s.offer(toks(100), original, "finished")
    plain_bytes = 2 * 2 * 100 * 64 * 4 * 2
    assert s.stats()["ram"]["bytes"] < plain_bytes * 0.4  # blocks at 8 bits; the 4-token tail plain
    for tier in ("ram", "ssd"):
        if tier == "ssd":
            ssd_only(s)
        hit = s.lookup(toks(120))
        assert hit.tier == tier and type(hit.cache[0]) is KVCache
        assert hit.num_tokens == 100  # the 4-token tail (plain, never quantized) from either tier
        got = np.array(hit.cache[0].keys)
        want = np.array(original[0].keys[..., : hit.num_tokens, :])
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.abs(got - want).max() < 0.05
    s.close()


def test_short_offers_not_quantized():
    s = store(quantize_bits=4, quantize_group_size=32, quantize_min_tokens=256)
    s.offer(toks(100), kv_cache(100, dim=64), "finished")
    assert all(node.block.quant is None for node in s.ram._nodes.values())
    s.offer(toks(300, 1000), kv_cache(300, dim=64), "finished")
    assert sum(node.block.quant == (4, 32) for node in s.ram._nodes.values()) == 300 // BLOCK


def test_head_dim_the_group_does_not_divide_stored_plain():
    s = store(quantize_bits=8, quantize_group_size=32, quantize_min_tokens=1)
    s.offer(toks(32), kv_cache(32, dim=8), "finished")
    assert all(node.block.quant is None for node in s.ram._nodes.values())
