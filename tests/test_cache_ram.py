"""RAM tier and lookup rules: budget, LRU, longest prefix, trim-to-serve, copies."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache
from test_cache_support import DIM, HEADS, entry_bytes, kv_cache, rotating_cache, store, toks

from cache_tiers.snapshot import cut_layer, snapshot


def test_bytes_counted_without_buffer_tail():
    s = store()
    cache = kv_cache(300)  # buffer holds 512 rows
    assert cache[0].keys.shape[2] == 512
    s.offer(toks(300), cache, "finished")
    assert s.stats()["ram"]["bytes"] == entry_bytes(300)


def test_budget_enforced_lru_order():
    s = store(ram_bytes=int(entry_bytes(100) * 2.5))
    a, b, c = toks(100, 0), toks(100, 1000), toks(100, 2000)
    s.offer(a, kv_cache(100), "prompt")
    s.offer(b, kv_cache(100), "prompt")
    assert s.lookup(a + [7]) is not None  # a is now more recent than b
    s.offer(c, kv_cache(100), "prompt")
    st = s.stats()["ram"]
    assert st["entries"] == 2 and st["evictions"] == 1 and st["bytes"] <= s.ram.budget
    assert s.lookup(b + [7]) is None
    assert s.lookup(a + [7]).num_tokens == 100 and s.lookup(c + [7]).num_tokens == 100


def test_entry_larger_than_budget_not_kept():
    s = store(ram_bytes=entry_bytes(50))
    s.offer(toks(100), kv_cache(100), "prompt")
    assert s.stats()["ram"]["entries"] == 0 and s.stats()["ram"]["rejected"] == 1


def test_longest_prefix_wins():
    s = store()
    base = toks(200)
    s.offer(base[:50] + [9999] * 10, kv_cache(60, seed=1), "prompt")
    s.offer(base[:120] + [8888] * 10, kv_cache(130, seed=2), "prompt")
    hit = s.lookup(base)
    assert hit is not None and hit.num_tokens == 120 and hit.tier == "ram"
    assert all(c.offset == 120 and c.keys.shape[2] == 120 for c in hit.cache)


def test_find_answers_what_a_restore_would_serve_without_copying_or_counting():
    s = store(min_restore_tokens=8)
    base = toks(200)
    s.offer(base[:120] + [8888] * 10, kv_cache(130), "prompt")
    before = s.stats()
    match = s.find(base)
    assert match is not None and match.usable == 120 and match.tier == "ram"
    assert s.find(toks(5, start=7000) + base) is None  # a different start: nothing cached
    assert s.find(base[:6]).too_short and s.find(base[:6]).usable == 0  # below min_restore_tokens
    assert s.stats() == before
    hit = s.restore(base, match)
    assert hit.num_tokens == 120
    after = s.stats()
    assert after["lookups"] == before["lookups"] + 1 and after["hits"] == before["hits"] + 1
    assert s.restore(base[:6], s.find(base[:6])) is None
    assert s.stats()["hits_below_min_restore"] == before["hits_below_min_restore"] + 1


def test_longer_entry_trimmed_to_serve_shorter_prompt():
    s = store()
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    hit = s.lookup(toks(40))
    assert hit.num_tokens == 39
    assert mx.array_equal(hit.cache[0].keys, original[0].keys[..., :39, :])


def test_exact_hit_leaves_one_token_to_feed():
    s = store()
    s.offer(toks(100), kv_cache(100), "finished")
    hit = s.lookup(toks(100))
    assert hit.num_tokens == 99 and all(c.offset == 99 for c in hit.cache)


def test_min_restore_tokens_counts_as_miss():
    s = store(min_restore_tokens=32)
    s.offer(toks(20), kv_cache(20), "prompt")
    assert s.lookup(toks(30)) is None
    assert s.stats()["hits_below_min_restore"] == 1 and s.stats()["hits"] == 0


def test_rotating_cache_exact_boundary_only():
    s = store()
    cache = rotating_cache(40, max_size=32)  # rotated: not trimmable
    assert not cache[0].is_trimmable()
    s.offer(toks(40), cache, "prompt")
    assert s.lookup(toks(40)) is None  # would need a trim
    assert s.lookup(toks(30) + [777] * 20) is None  # diverges inside the entry
    hit = s.lookup(toks(45))
    assert hit.num_tokens == 40 and type(hit.cache[0]).__name__ == "RotatingKVCache"
    assert hit.cache[0].offset == 40


def test_trimmable_rotating_cache_is_trimmed():
    s = store()
    s.offer(toks(20), rotating_cache(20, max_size=32), "prompt")
    hit = s.lookup(toks(10))
    assert hit.num_tokens == 9 and hit.cache[0].offset == 9


def test_longer_trimmable_offer_supersedes_prefix_entries():
    s = store()
    s.offer(toks(50), kv_cache(50), "prompt")
    s.offer(toks(80), kv_cache(80), "finished")
    st = s.stats()["ram"]
    assert st["entries"] == 1 and st["superseded"] == 1 and st["bytes"] == entry_bytes(80)
    s.offer(toks(60), kv_cache(60), "prompt")  # covered by the 80-token entry
    assert s.stats()["ram"]["entries"] == 1


def test_handed_out_cache_is_a_copy():
    s = store()
    s.offer(toks(100), kv_cache(100), "finished")
    before = np.array(s.lookup(toks(101)).cache[0].keys)
    hit = s.lookup(toks(101))
    hit.cache[0].keys[..., :5, :] = 0.0  # slice assignment on the handed-out arrays
    for c in hit.cache:
        c.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
    trimmed = s.lookup(toks(50))  # a trimmed hit, then write in place into its tail
    trimmed.cache[0].update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))
    again = s.lookup(toks(101))
    assert np.array_equal(np.array(again.cache[0].keys), before)
    assert again.cache[0].keys is not hit.cache[0].keys


def test_offer_wrong_length_or_unsupported_rejected():
    s = store()
    s.offer(toks(10), kv_cache(12), "prompt")
    s.offer(toks(10), [object()], "prompt")
    assert s.stats()["rejected_offers"] == 2 and s.stats()["ram"]["entries"] == 0


def test_clear_ram():
    s = store()
    s.offer(toks(100), kv_cache(100), "finished")
    s.clear("ram")
    assert s.lookup(toks(101)) is None and s.stats()["ram"]["bytes"] == 0


def _address(a: mx.array) -> int:
    return np.asarray(a).__array_interface__["data"][0]  # on the CPU backend: the buffer itself


def test_snapshot_shares_an_exact_cache_and_the_engine_cannot_reach_it():
    """A cache of exactly the rows stored (mlx-lm's `extract` gives such copies) is not copied
    again, and the engine updating that cache afterwards, in place or by growing it, leaves the
    stored state as it was."""
    n = 40
    caches = []
    for layer in kv_cache(n):
        c = KVCache()
        c.state = cut_layer("KVCache", tuple(layer.state), n, lambda x, rows: mx.array(x[..., :rows, :]))
        caches.append(c)
    mx.eval([c.state for c in caches])
    before = [np.array(c.keys) for c in caches]
    snap = snapshot(toks(n), caches)
    for c, layer in zip(caches, snap.layers):
        assert _address(layer.slots[0]) == _address(c.keys)  # shared, not copied
        assert layer.slots[0] is not c.keys
    for c in caches:
        c.keys[..., :1, :] = mx.zeros_like(c.keys[..., :1, :])  # an in-place write on the engine's object
        c.update_and_fetch(mx.ones((1, HEADS, 3, DIM)), mx.ones((1, HEADS, 3, DIM)))  # growth
        mx.eval(c.keys)
    for b, layer in zip(before, snap.layers):
        assert np.array_equal(np.array(layer.slots[0]), b)
    assert snap.nbytes == sum(b.nbytes * 2 for b in before) + n * 8


def test_snapshot_copies_a_cut_of_a_longer_buffer():
    n = 40  # mlx-lm's KVCache allocates 256 rows: the stored state must not hold the tail
    caches = kv_cache(n)
    snap = snapshot(toks(n), caches)
    for c, layer in zip(caches, snap.layers):
        assert c.keys.shape[-2] > n and layer.slots[0].shape[-2] == n
        assert _address(layer.slots[0]) != _address(c.keys)
