"""SSD hits read off the MLX thread (`TieredStore.prefetch` / `complete`): the reader thread reads
and parses, the caller only takes what was read into RAM; the restore after it serves the same
rows, bit for bit, reported as the SSD hit it is; damaged rows are dropped as a restore drops them."""

from __future__ import annotations

import threading

import mlx.core as mx
from test_cache_support import (FlakyStorage, bkey, flip_a_data_bit, kv_cache, offered_to_ssd_only, same_kv, settle,
                                ssd_only, store, toks)


def _prefetched_hit(s, prompt):
    match = s.find(prompt)
    p = s.prefetch(match, prompt)
    assert p is not None
    p.future.result(timeout=30)
    assert s.complete(p)
    taken = p.blocks_taken
    return taken, s.restore(prompt, s.find(prompt))


def test_a_prefetch_reads_on_another_thread_and_serves_what_a_restore_would(tmp_path, monkeypatch):
    s = store(tmp_path)
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    ssd_only(s)
    readers: list[str] = []
    for name in ("read_blocks", "read_tail"):
        read = getattr(s.ssd, name)
        monkeypatch.setattr(s.ssd, name, lambda *a, _read=read: readers.append(threading.current_thread().name) or _read(*a))
    prompt = toks(100) + [5]
    taken, hit = _prefetched_hit(s, prompt)
    assert taken == 6 and len(readers) == 2 and all(name != threading.current_thread().name for name in readers)
    assert hit.tier == "ssd" and hit.num_tokens == 100  # the blocks and the tail past them
    assert same_kv(hit.cache, original, 100)
    stats = s.stats()
    assert (stats["ssd"]["hits"], stats["ssd"]["hit_tokens"], stats["ram"]["promotions"]) == (1, 100, 7)  # as a restore counts
    again = s.restore(prompt, s.find(prompt))  # the next one is RAM's own hit
    assert again.tier == "ram" and s.prefetch(s.find(prompt), prompt) is None
    s.close()


def test_a_prefetch_starts_past_what_ram_holds(tmp_path):
    s = store(tmp_path)
    s.offer(toks(100), kv_cache(100), "finished")
    settle(s)
    s.clear("ram")
    s.offer(toks(32), kv_cache(32), "finished")  # RAM holds the first two blocks again
    p = s.prefetch(s.find(toks(100) + [5]), toks(100) + [5])
    assert (p.first, p.last) == (2, 6)
    p.future.result(timeout=30)
    assert s.complete(p) and p.blocks_taken == 4
    assert s.restore(toks(100) + [5], s.find(toks(100) + [5])).num_tokens == 100
    s.close()


def test_a_damaged_row_ends_the_prefetched_run_and_is_deleted(tmp_path):
    storage, s, original = offered_to_ssd_only(tmp_path)
    key = bkey(toks(100), 3)
    flip_a_data_bit(storage, key)
    taken, hit = _prefetched_hit(s, toks(100) + [5])
    assert taken == 3 and hit.tier == "ssd" and hit.num_tokens == 48  # the blocks before it still serve
    assert mx.array_equal(hit.cache[0].keys[..., :48, :], original[0].keys[..., :48, :])
    assert s.stats()["ssd"]["corrupt"] == 1 and not storage.contains(key)
    assert not storage.contains(bkey(toks(100), 4))  # the chain's rows past it go with it
    s.close()


def test_nothing_to_prefetch_for_a_ram_hit_or_without_an_ssd(tmp_path):
    s = store(tmp_path)
    s.offer(toks(100), kv_cache(100), "finished")
    assert s.prefetch(s.find(toks(100) + [5]), toks(100) + [5]) is None  # RAM holds it all
    s.close()
    ram_only = store()
    ram_only.offer(toks(100), kv_cache(100), "finished")
    assert ram_only.prefetch(ram_only.find(toks(100) + [5]), toks(100) + [5]) is None


def test_a_budgeted_hand_over_takes_a_block_a_call_and_ends_with_what_a_whole_one_gives(tmp_path):
    s = store(tmp_path)
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    ssd_only(s)
    prompt = toks(100) + [5]
    p = s.prefetch(s.find(prompt), prompt)
    p.future.result(timeout=30)
    progress = []
    while not s.complete(p, budget_s=1e-9):  # always at least one block, then out of time
        progress.append(p.blocks_taken)
        assert s.ram.reach(s._chain(prompt[:96], "")) == p.blocks_taken  # held as soon as taken
    assert progress == [1, 2, 3, 4, 5] and p.blocks_taken == 6 and s.complete(p, budget_s=1e-9)
    hit = s.restore(prompt, s.find(prompt))
    assert hit.tier == "ssd" and hit.num_tokens == 100 and same_kv(hit.cache, original, 100)
    s.close()


def test_a_hand_over_stops_when_ram_lets_its_blocks_go_between_calls(tmp_path):
    s = store(tmp_path)
    s.offer(toks(100), kv_cache(100), "finished")
    ssd_only(s)
    prompt = toks(100) + [5]
    p = s.prefetch(s.find(prompt), prompt)
    p.future.result(timeout=30)
    assert not s.complete(p, budget_s=1e-9) and not s.complete(p, budget_s=1e-9) and p.blocks_taken == 2
    s.clear("ram")  # evicted between two steps
    assert s.complete(p, budget_s=1e-9) and p.blocks_taken == 2 and len(s.ram) == 0  # nothing orphaned held
    hit = s.restore(prompt, s.find(prompt))  # the restore reads what it needs itself
    assert hit is not None and hit.tier == "ssd" and hit.num_tokens == 100
    s.close()


def test_the_hand_over_setting_is_checked():
    import pytest

    from cache_tiers.config import CacheConfig

    assert CacheConfig().ssd_handover_ms == 20.0 and CacheConfig(ssd_handover_ms=None).ssd_handover_ms is None
    for bad in (0, -1, "fast", True):
        with pytest.raises(ValueError, match="ssd_handover_ms"):
            CacheConfig(ssd_handover_ms=bad)
