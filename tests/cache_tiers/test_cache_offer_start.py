"""Offers that leave out what RAM holds (`offer(..., start)`, `held`): a conversation's turn hands the
store only its KV past the blocks already held, and the store keeps exactly what a whole offer gives."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache
from test_cache_support import BLOCK, bkey, kv_for, same_kv, ssd_only, store, toks


def _past(cache: list[KVCache], start: int) -> list[KVCache]:
    """The layers' rows from `start` on, as a runner copies them past what the store holds."""
    out = []
    for c in cache:
        k, v, n = c.state
        d = KVCache()
        d.state = (mx.contiguous(k[..., start:n, :]), mx.contiguous(v[..., start:n, :]), n - start)
        out.append(d)
    return out


def test_held_counts_whole_blocks_in_ram_of_this_salt():
    s = store()
    assert s.held(toks(100)) == 0
    s.offer(toks(40), kv_for(toks(40)), "finished")
    assert s.held(toks(100)) == 32  # two whole blocks of 16; the 8-token tail does not count
    assert s.held(toks(100), salt="other tenant") == 0
    s.close()


def test_an_offer_past_what_ram_holds_keeps_what_a_whole_offer_keeps(tmp_path):
    first, second = toks(40), toks(100)
    whole = store(tmp_path / "whole")
    whole.offer(first, kv_for(first), "finished")
    whole.offer(second, kv_for(second), "finished")
    part = store(tmp_path / "part")
    part.offer(first, kv_for(first), "finished")
    start = part.held(second)
    assert start == 32
    part.offer(second, _past(kv_for(second), start), "finished", start=start)
    for s in (whole, part):
        hit = s.lookup(second + [7])
        assert hit.num_tokens == 100 and same_kv(hit.cache, kv_for(second), 100)
        assert s.stats()["ram"]["blocks"] == 6
    # and on disk the same rows, byte for byte
    ssd_only(whole)
    ssd_only(part)
    for k in range(6):
        assert whole.ssd.storage.get(bkey(second, k)) == part.ssd.storage.get(bkey(second, k))
    whole.close()
    part.close()


def test_the_copy_handed_over_grows_with_the_new_tokens_not_the_conversation():
    """What the runner copies for each turn's offer: turn t's tokens past the blocks held."""
    s = store()
    conversation: list[int] = []
    copied = []
    for turn in range(6):
        conversation = conversation + toks(50, 1000 * (turn + 1))  # 50 new tokens a turn
        start = s.held(conversation)
        s.offer(conversation, _past(kv_for(conversation), start), "finished", start=start)
        copied.append(len(conversation) - start)
    assert all(c < 50 + BLOCK for c in copied)  # the new tokens and at most a block before them
    hit = s.lookup(conversation + [1])
    assert hit.num_tokens == len(conversation) and same_kv(hit.cache, kv_for(conversation), len(conversation))
    s.close()


def test_an_offer_past_a_gap_keeps_nothing_and_is_counted():
    s = store()
    s.offer(toks(40), kv_for(toks(40)), "finished")
    start = s.held(toks(100))
    s.clear("ram")  # evicted between `held` and the offer
    s.offer(toks(100), _past(kv_for(toks(100)), start), "finished", start=start)
    assert s.lookup(toks(101)) is None and s.stats()["rejected_offers"] == 1
    s.close()


@pytest.mark.parametrize("start", [5, 100, -16])
def test_a_start_off_the_block_grid_or_the_tokens_is_refused(start):
    s = store()
    s.offer(toks(100), kv_for(toks(100)), "finished", start=start)
    assert s.lookup(toks(101)) is None and s.stats()["rejected_offers"] == 1
    s.close()


def test_a_cache_with_exact_layers_must_start_at_the_first_token():
    s = store()
    kv = _past(kv_for(toks(48)), 16)
    state = ArraysCache(1)
    state[0] = mx.zeros((1, 4))
    s.offer(toks(48), [kv[0], state], "finished", start=16)
    assert s.stats()["rejected_offers"] == 1
    s.close()


def test_held_and_the_offer_after_it_hash_the_chain_once(monkeypatch):
    import cache_tiers.tiered as tiered

    calls = []
    real = tiered.block_chain
    monkeypatch.setattr(tiered, "block_chain", lambda *a: calls.append(1) or real(*a))
    s = store()
    s.offer(toks(40), kv_for(toks(40)), "finished")
    calls.clear()
    start = s.held(toks(100))
    s.offer(toks(100), _past(kv_for(toks(100)), start), "finished", start=start)
    assert len(calls) == 1
    assert s.held(toks(100), salt="b") == 0 and len(calls) == 2  # another salt: its own chain
    s.close()
