"""RAM tier and lookup rules on the block store: budget, leaf-first LRU, longest run of blocks
plus a tail, at least one token left to feed, min_restore_tokens, private copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cache_support import (BLOCK, DIM, HEADS, block_bytes, entry_bytes, kv_cache, rotating_cache, same_kv,
                                store, toks)


def test_bytes_counted_without_buffer_tail():
    s = store()
    cache = kv_cache(300)  # buffer holds 512 rows
    assert cache[0].keys.shape[2] == 512
    s.offer(toks(300), cache, "finished")
    st = s.stats()
    # 18 blocks of 16 plus a 12-token tail, exactly their rows and token ids
    assert st["ram"]["bytes"] == s.ram.nbytes == entry_bytes(300)
    assert st["ram"]["blocks"] == 300 // BLOCK and st["blocks_offered"] == 300 // BLOCK
    for node in s.ram._nodes.values():
        assert all(x.shape[2] == BLOCK for x in node.block.arrays)


def test_budget_enforced_lru_order_leaves_first():
    n = 6 * BLOCK
    s = store(ram_bytes=int(entry_bytes(n) * 2.5))
    a, b, c = toks(n, 0), toks(n, 1000), toks(n, 2000)
    s.offer(a, kv_cache(n), "prompt")
    s.offer(b, kv_cache(n), "prompt")
    assert s.lookup(a + [7]).num_tokens == n  # a is now more recent than b
    s.offer(c, kv_cache(n), "prompt")
    st = s.stats()["ram"]
    assert st["bytes"] <= s.ram.budget and st["evictions"] == 3  # half a conversation: 3 blocks
    assert s.lookup(a + [7]).num_tokens == n and s.lookup(c + [7]).num_tokens == n
    assert s.lookup(b + [7]).num_tokens == 3 * BLOCK  # b's leaves went, its first blocks stay


def test_block_larger_than_budget_not_kept():
    s = store(ram_bytes=block_bytes() - 1)
    s.offer(toks(96), kv_cache(96), "prompt")
    st = s.stats()["ram"]
    assert st["blocks"] == 0 and st["rejected"] >= 1 and st["bytes"] == 0


def test_short_offer_tail_obeys_the_budget():
    s = store(ram_bytes=entry_bytes(10) - 1)
    s.offer(toks(10), kv_cache(10), "finished")
    assert s.ram.nbytes <= s.ram.budget
    s = store()
    s.offer(toks(10), kv_cache(10), "finished")
    s.set_ram_budget(0)
    assert s.ram.nbytes == 0


def test_longest_run_of_blocks_wins():
    s = store()
    base = toks(200)
    s.offer(base[:50] + [9999] * 10, kv_cache(60, seed=1), "prompt")
    s.offer(base[:120] + [8888] * 10, kv_cache(130, seed=2), "prompt")
    hit = s.lookup(base)
    # 7 whole blocks, then block 8 (tokens 112..127: 8 of the prompt's, then 8888s) up to where they part
    assert hit is not None and hit.num_tokens == 120 and hit.tier == "ram"
    assert all(c.offset == 120 and c.keys.shape[2] == 120 for c in hit.cache)


def test_find_answers_what_a_restore_would_serve_without_copying_or_counting():
    s = store(min_restore_tokens=20)
    base = toks(200)
    s.offer(base[:120] + [8888] * 10, kv_cache(130), "prompt")
    before = s.stats()
    match = s.find(base)
    assert match is not None and match.usable == 120 and match.tier == "ram"  # 7 blocks, 8 rows of the 8th
    assert s.find(toks(5, start=7000) + base) is None  # a different start: nothing cached
    short = s.find(base[:20])  # one block and 3 rows of the next: below min_restore_tokens
    assert short.too_short and short.usable == 0 and short.num_tokens == 19
    assert s.stats() == before
    hit = s.restore(base, match)
    assert hit.num_tokens == 120
    after = s.stats()
    assert after["lookups"] == before["lookups"] + 1 and after["hits"] == before["hits"] + 1
    assert s.restore(base[:20], s.find(base[:20])) is None
    assert s.stats()["hits_below_min_restore"] == before["hits_below_min_restore"] + 1


def test_longer_offer_serves_a_shorter_prompt_to_the_token():
    s = store()
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    hit = s.lookup(toks(40))
    assert hit.num_tokens == 39  # two whole blocks, then 7 rows of the third (one token left to feed)
    assert same_kv(hit.cache, original, 39)


def test_tail_serves_past_the_last_block_and_leaves_one_token_to_feed():
    s = store()
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")  # 6 blocks + a 4-token tail
    hit = s.lookup(toks(100))
    assert hit.num_tokens == 99 and all(c.offset == 99 for c in hit.cache)
    assert same_kv(hit.cache, original, 99)
    assert s.lookup(toks(101)).num_tokens == 100
    assert s.lookup(toks(98) + [5, 5, 5]).num_tokens == 98  # the tail's common part
    # an offer ending on a block boundary has no tail: its last block serves the same prompt again
    # up to the token left to feed
    s.offer(toks(96, 500), kv_cache(96), "finished")
    assert s.lookup(toks(96, 500)).num_tokens == 95


def test_a_longer_tail_replaces_the_one_it_extends():
    s = store()
    s.offer(toks(20), kv_cache(20), "prompt")
    s.offer(toks(25), kv_cache(25), "finished")
    assert s.stats()["ram"]["bytes"] == entry_bytes(25)
    assert s.lookup(toks(30)).num_tokens == 25


def test_an_offer_adds_only_the_blocks_ram_lacks():
    s = store()
    s.offer(toks(50), kv_cache(50), "prompt")
    assert s.stats()["blocks_offered"] == 3
    s.offer(toks(80), kv_cache(80), "finished")
    s.offer(toks(80), kv_cache(80), "finished")  # again: nothing new
    st = s.stats()
    assert st["blocks_offered"] == 5 and st["ram"]["blocks"] == 5
    assert entry_bytes(80) <= st["ram"]["bytes"] <= entry_bytes(80 + 2)  # at most the old 2-token tail


def test_min_restore_tokens_counts_as_miss():
    s = store(min_restore_tokens=32)
    s.offer(toks(20), kv_cache(20), "prompt")
    assert s.lookup(toks(30)) is None  # a block and its 4-token tail: 20 < 32
    assert s.stats()["hits_below_min_restore"] == 1 and s.stats()["hits"] == 0


def test_rotated_cache_served_only_at_its_length():
    s = store()
    cache = rotating_cache(40, max_size=32)  # rotated: an exact layer, kept whole in the tail
    assert not cache[0].is_trimmable()
    s.offer(toks(40), cache, "prompt")
    assert s.lookup(toks(40)) is None  # would need a cut
    assert s.lookup(toks(30) + [777] * 20) is None  # diverges inside
    hit = s.lookup(toks(45))
    assert hit.num_tokens == 40 and type(hit.cache[0]).__name__ == "RotatingKVCache"
    assert hit.cache[0].offset == 40


def test_unrotated_rotating_cache_is_an_exact_layer_too():
    s = store()
    s.offer(toks(20), rotating_cache(20, max_size=32), "prompt")
    assert s.lookup(toks(10)) is None  # no exact state at 9 tokens: not cut
    hit = s.lookup(toks(25))
    assert hit.num_tokens == 20 and hit.cache[0].offset == 20


def test_handed_out_cache_is_a_copy():
    s = store()
    s.offer(toks(100), kv_cache(100), "finished")
    before = np.array(s.lookup(toks(101)).cache[0].keys)
    hit = s.lookup(toks(101))
    assert hit.num_tokens == 100
    hit.cache[0].keys[..., :5, :] = 0.0  # slice assignment on the handed-out arrays
    for c in hit.cache:
        c.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    part = s.lookup(toks(50))  # whole blocks only, then write in place past them
    part.cache[0].update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    again = s.lookup(toks(101))
    assert np.array_equal(np.array(again.cache[0].keys), before)
    assert again.cache[0].keys is not hit.cache[0].keys and again.cache[0] is not hit.cache[0]


def test_offered_cache_mutated_afterwards_does_not_reach_the_store():
    """Blocks and tails are private copies of exactly their rows: the engine writing into the
    offered cache (in place, or by growing it) leaves what the store holds as it was."""
    n = 40
    caches = kv_cache(n)
    before = [(np.array(c.keys[..., :n, :]), np.array(c.values[..., :n, :])) for c in caches]
    s = store()
    s.offer(toks(n), caches, "finished")
    for c in caches:
        c.keys[..., :1, :] = mx.zeros_like(c.keys[..., :1, :])
        c.update_and_fetch(mx.ones((1, HEADS, 3, DIM)), mx.ones((1, HEADS, 3, DIM)))
        mx.eval(c.keys)
    hit = s.lookup(toks(n + 1))
    assert hit.num_tokens == n
    for c, (k, v) in zip(hit.cache, before):
        assert np.array_equal(np.array(c.keys), k) and np.array_equal(np.array(c.values), v)


def test_offer_wrong_length_or_unsupported_rejected():
    s = store()
    s.offer(toks(10), kv_cache(12), "prompt")
    s.offer(toks(10), [object()], "prompt")
    assert s.stats()["rejected_offers"] == 2 and s.stats()["ram"]["blocks"] == 0


def test_clear_ram():
    s = store()
    s.offer(toks(100), kv_cache(100), "finished")
    s.clear("ram")
    assert s.lookup(toks(101)) is None and s.stats()["ram"]["bytes"] == 0


def test_held_prefixes_report_chains_most_recent_first():
    s = store()
    s.offer(toks(64), kv_cache(64), "finished")
    s.offer(toks(48, 900), kv_cache(48), "finished")
    held = s.held_prefixes()
    assert [list(h) for h in held] == [toks(48, 900), toks(64)]
    s.lookup(toks(70))
    assert list(s.held_prefixes(limit=1)[0]) == toks(64)
