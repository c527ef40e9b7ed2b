"""The SSD's tails (cache_tiers/tiered.py, ssd.py): a finished request's tokens past its last whole
block are kept on the SSD under that block, so after a restart (or once RAM let them go) a repeated
prompt, or the next turn of a conversation, is served whole rather than up to its last block
boundary. One tail per block, the latest; a block written later under the same block deletes it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from test_cache_support import (BLOCK, FlakyStorage, chain, flip_a_data_bit, kv_cache, kv_for, offered_to_ssd_only,
                                same_kv, settle, ssd_only, store, toks)

from cache_tiers.keys import tail_key


def tkey(tokens: list[int], k: int, salt: str = "") -> str:
    """The SSD key of the tail under block k (0-based) of `tokens`' chain."""
    return tail_key(chain(tokens, BLOCK, salt)[k])


def test_only_a_finished_offer_leaves_its_tail_on_the_ssd(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(100), kv_cache(100), "prompt")  # 6 blocks and a 4-token tail
    settle(s)
    assert not storage.contains(tkey(toks(100), 5)) and s.stats()["ssd"]["keys"] == 6
    s.offer(toks(100), kv_cache(100), "finished")
    settle(s)
    assert storage.contains(tkey(toks(100), 5)) and s.stats()["ssd"]["keys"] == 7
    s.close()


def test_a_restart_serves_the_blocks_and_the_tail_bit_for_bit(tmp_path):
    s = store(tmp_path)
    original = kv_cache(100, seed=3)
    s.offer(toks(100), original, "finished")
    s.close()  # flushes the writer
    again = store(tmp_path)
    p = again.prefetch(again.find(toks(100) + [5]), toks(100) + [5])
    p.future.result(timeout=30)
    assert again.complete(p) and p.blocks_taken == 6
    hit = again.restore(toks(100) + [5], again.find(toks(100) + [5]))
    assert hit.tier == "ssd" and hit.num_tokens == 100 and same_kv(hit.cache, original, 100)
    again.close()


def test_the_next_turns_block_deletes_the_tail_it_covers(tmp_path):
    """A conversation's tail row is stale once its next turn writes the block under the same
    parent: the directory keeps one tail per conversation end, not one per turn."""
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    turn1, turn2 = toks(100), toks(120)  # 6 blocks + 4; then 7 blocks + 8
    s.offer(turn1, kv_for(turn1), "finished")
    settle(s)
    assert storage.contains(tkey(turn1, 5))
    s.offer(turn2, kv_for(turn2), "finished")
    settle(s)
    assert not storage.contains(tkey(turn1, 5)) and storage.contains(tkey(turn2, 6))
    assert s.stats()["ssd"]["keys"] == 7 + 1
    ssd_only(s)
    hit = s.lookup(turn2 + [5])
    assert hit.tier == "ssd" and hit.num_tokens == 120 and same_kv(hit.cache, kv_for(turn2), 120)
    s.close()


def test_the_latest_finished_tail_under_a_block_replaces_the_one_before(tmp_path):
    s = store(tmp_path)
    a, b = toks(96) + [7, 7, 7], toks(96) + [8, 8]  # two endings under the same sixth block
    s.offer(a, kv_for(a), "finished")
    s.offer(b, kv_for(b), "finished")
    ssd_only(s)
    assert s.lookup(b + [5]).num_tokens == 98  # b's tail, the latest
    s.clear("ram")
    assert s.lookup(a + [5]).num_tokens == 96  # a's was replaced: its blocks still serve
    s.close()


def test_a_damaged_tail_is_deleted_and_counted_and_the_blocks_still_serve(tmp_path):
    storage, s, original = offered_to_ssd_only(tmp_path)
    key = tkey(toks(100), 5)
    flip_a_data_bit(storage, key)
    p = s.prefetch(s.find(toks(100) + [5]), toks(100) + [5])
    p.future.result(timeout=30)
    assert s.complete(p) and p.blocks_taken == 6
    hit = s.restore(toks(100) + [5], s.find(toks(100) + [5]))
    assert hit.tier == "ssd" and hit.num_tokens == 96
    assert mx.array_equal(hit.cache[0].keys, original[0].keys[..., :96, :])
    assert s.stats()["ssd"]["corrupt"] == 1 and not storage.contains(key)
    s.close()


def test_a_tenants_tail_is_not_served_to_another(tmp_path):
    s = store(tmp_path)
    s.offer(toks(100), kv_cache(100), "finished", salt="alice")
    ssd_only(s)
    assert s.lookup(toks(100) + [5], salt="bob") is None
    hit = s.lookup(toks(100) + [5], salt="alice")
    assert hit.tier == "ssd" and hit.num_tokens == 100
    s.close()



def test_a_stored_tail_is_checked_like_a_block():
    """bfloat16 rows round-trip; bytes under another block's key, a block's bytes under a tail key,
    or a tail as long as a block are refused (CorruptEntry: the tier deletes and counts them)."""
    import pytest

    from cache_tiers import blocks as blk
    from cache_tiers import codec

    cache = kv_cache(20)
    for c in cache:
        c.keys, c.values = c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16)
    parts = blk.split(cache, 20)
    digests = chain(toks(20), BLOCK)
    tail = blk.cut_tail(parts, 16, digests[0], np.asarray(toks(20)))
    data = codec.encode(codec.to_host(codec.prepare_tail(tail)), "fp")
    back = codec.to_tail(codec.parse_tail(data, "fp", digests[0], BLOCK))
    assert back.parent == digests[0] and list(back.tokens) == toks(20)[16:]
    assert all(mx.array_equal(a, b) and a.dtype == mx.bfloat16 for a, b in zip(back.arrays, tail.arrays))
    with pytest.raises(codec.CorruptEntry):
        codec.parse_tail(data, "fp", b"x" * 16, BLOCK)  # another block's tail
    with pytest.raises(codec.CorruptEntry):
        codec.parse_tail(data, "other-model", digests[0], BLOCK)
    with pytest.raises(codec.CorruptEntry):
        codec.parse_tail(data, "fp", digests[0], 4)  # 4 tokens is not fewer than a block of 4
    block = blk.cut_blocks(parts, digests, np.asarray(toks(20)), 0, 1, BLOCK)[0]
    with pytest.raises(codec.CorruptEntry):
        codec.parse_tail(codec.encode(codec.to_host(codec.prepare_block(block)), "fp"), "fp", digests[0], BLOCK)
