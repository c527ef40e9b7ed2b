"""The block store, model-free (issue 31's tests): blocks shared across conversations are stored
once, eviction goes leaf first, bytes are the held arrays, a restore equals the offered KV bit for
bit (RAM, SSD, after a restart), SSD faults on single blocks, replicas sharing a directory, tenants."""

from __future__ import annotations

import mlx.core as mx
import pytest
from test_cache_support import (BLOCK, bkey, entry_bytes, kv_cache, kv_for, row_file, same_kv,
                                settle, ssd_only, store, toks)

from cache_tiers.layer_state import leaves

P = toks(3 * BLOCK)  # a shared 3-block prefix (a system prompt and tools)
A = P + toks(2 * BLOCK, 1000)
B = P + toks(2 * BLOCK, 2000)


def held_bytes(ram) -> int:
    """What RAM really holds: every array of its blocks, states and tails, plus their token ids."""
    total = 0
    tails = [t for root in ram._root_tails.values() for t in root]
    for node in ram._nodes.values():
        total += sum(x.nbytes for x in leaves(node.block.arrays)) + node.block.tokens.nbytes
        if node.state is not None:
            total += sum(x.nbytes for _, layer in node.state.layers for x in leaves(layer.slots))
        tails += node.tails
    for tail in tails:
        total += sum(x.nbytes for x in leaves(tail.arrays)) + tail.tokens.nbytes
        if tail.state is not None:
            total += sum(x.nbytes for _, layer in tail.state.layers for x in leaves(layer.slots))
    return total


# -- sharing -----------------------------------------------------------------------------------

def test_blocks_shared_across_conversations_are_stored_once(tmp_path):
    s = store(tmp_path)
    s.offer(A, kv_for(A), "finished")
    s.offer(B, kv_for(B), "finished")
    st = s.stats()
    assert st["blocks_offered"] == 3 + 2 + 2  # B's offer cut only its own 2 blocks
    assert st["ram"]["blocks"] == 7 and st["ram"]["bytes"] == entry_bytes(7 * BLOCK)
    settle(s)
    assert s.stats()["ssd"]["writes"] == 7 and s.stats()["ssd"]["keys"] == 7
    for conv in (A, B):
        hit = s.lookup(conv + [1])
        assert hit.num_tokens == len(conv) and same_kv(hit.cache, kv_for(conv), len(conv))
    s.close()


# -- eviction ----------------------------------------------------------------------------------

def _shared_three(touch_a: bool):
    s = store()
    s.offer(P, kv_for(P), "prompt")  # the prefix first: its blocks are the oldest
    s.offer(A, kv_for(A), "finished")
    s.offer(B, kv_for(B), "finished")
    if touch_a:
        assert s.lookup(A + [1]).num_tokens == len(A)  # touches A's chain root to leaf
    assert s.ram.nbytes == entry_bytes(7 * BLOCK)
    return s


@pytest.mark.parametrize("touch_a", [False, True])
def test_eviction_is_leaf_first_then_least_recently_used(touch_a):
    s = _shared_three(touch_a)
    first, second = (B, A) if touch_a else (A, B)  # the older leaf chain goes first
    reach = []
    for k in range(1, 8):
        s.set_ram_budget(entry_bytes((7 - k) * BLOCK))
        reach.append((s.ram.reach(s._chain(first, "")), s.ram.reach(s._chain(second, ""))))
        assert s.stats()["ram"]["evictions"] == k and s.ram.nbytes <= s.ram.budget
    # the older chain loses its two leaves, then the other, and only then the shared prefix (which
    # is older than both: a prefix block is never evicted while a block extending it is held)
    assert reach == [(4, 5), (3, 5), (3, 4), (3, 3), (2, 2), (1, 1), (0, 0)]


def test_eviction_on_insert_spares_the_prefix_of_the_block_being_added():
    s = store(ram_bytes=entry_bytes(6 * BLOCK))
    s.offer(P, kv_for(P), "prompt")
    s.offer(A, kv_for(A), "finished")  # 5 blocks
    s.offer(B, kv_for(B), "finished")  # 2 more: A's two leaves go, never P's blocks
    assert s.ram.reach(s._chain(B, "")) == 5 and s.ram.reach(s._chain(A, "")) == 4
    assert s.stats()["ram"]["evictions"] == 1


# -- bytes -------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantize", [False, True])
def test_ram_bytes_equal_the_held_arrays(quantize):
    cfg = dict(quantize_bits=8, quantize_group_size=32, quantize_min_tokens=1) if quantize else {}
    s = store(**cfg)
    for conv, n in ((A, 75), (B, 80), (toks(10, 5000), 10), (toks(37, 7000), 37)):
        s.offer(conv[:n], kv_cache(n, dim=64), "finished")
        assert s.ram.nbytes == held_bytes(s.ram) == s.stats()["ram"]["bytes"]
    if not quantize:
        assert s.ram.nbytes == entry_bytes(75 + 2 * BLOCK + 10 + 37, dim=64)
    s.set_ram_budget(s.ram.nbytes // 2)
    assert s.ram.nbytes == held_bytes(s.ram) <= s.ram.budget


# -- bit for bit -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_restore_of_n_blocks_equals_the_offered_kv_bit_for_bit(tmp_path, dtype):
    n = 6 * BLOCK
    original = kv_cache(n, seed=5, dtype=dtype)
    s = store(tmp_path)
    s.offer(toks(n), original, "finished")
    for blocks in (1, 3, 6):
        hit = s.lookup(toks(blocks * BLOCK + 1))
        assert hit.tier == "ram" and hit.num_tokens == blocks * BLOCK
        assert same_kv(hit.cache, original, blocks * BLOCK)
    s.close()
    for blocks in (6, 2):  # a restart: a new store on the same directory
        s = store(tmp_path)
        hit = s.lookup(toks(blocks * BLOCK + 1))
        assert hit.tier == "ssd" and hit.num_tokens == blocks * BLOCK
        assert same_kv(hit.cache, original, blocks * BLOCK)
        assert s.stats()["ram"]["promotions"] == blocks
        again = s.lookup(toks(blocks * BLOCK + 1))
        assert again.tier == "ram" and same_kv(again.cache, original, blocks * BLOCK)
        s.close()


def test_the_ssd_keeps_the_tail_past_the_last_block_and_serves_it_after_ram_is_gone(tmp_path):
    s = store(tmp_path)
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    settle(s)
    assert s.stats()["ssd"]["keys"] == 6 + 1  # six blocks and the 4-token tail
    assert s.lookup(toks(101)).num_tokens == 100
    s.clear("ram")
    hit = s.lookup(toks(101))
    assert hit.tier == "ssd" and hit.num_tokens == 100 and same_kv(hit.cache, original, 100)
    s.clear("ram")  # a prompt that leaves the tail part-way is served up to there
    hit = s.lookup(toks(98) + [7, 7, 7])
    assert hit.tier == "ssd" and hit.num_tokens == 98 and same_kv(hit.cache, original, 98)
    s.close()


# -- SSD faults on one block -------------------------------------------------------------------

N = 4 * BLOCK
DIM_FILE = 64  # 2 layers x 16 rows x 64 floats x 2 heads x K,V > 32 KiB: each block is a file


def _on_disk(tmp_path, n: int = N):
    s = store(tmp_path)
    original = kv_cache(n, dim=DIM_FILE, seed=7)
    s.offer(toks(n), original, "finished")
    ssd_only(s)
    return s, original


def _faults(s) -> tuple[int, int, int]:
    st = s.stats()["ssd"]
    return st["corrupt"], st["lost_files"], st["read_errors"]


@pytest.mark.parametrize("k", [0, 2])
def test_corrupt_block_file_is_deleted_counted_and_never_served(tmp_path, k):
    s, original = _on_disk(tmp_path)
    path = row_file(tmp_path / "ssd", bkey(toks(N), k))
    assert path is not None and path.exists()
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x10  # one flipped bit in the float data: still parses, fails its CRC
    path.write_bytes(bytes(data))
    hit = s.lookup(toks(N + 1))
    assert hit is None or (hit.num_tokens <= k * BLOCK and same_kv(hit.cache, original, hit.num_tokens))
    assert _faults(s) == (1, 0, 0) and not s.ssd.storage.contains(bkey(toks(N), k))
    hit = s.lookup(toks(N + 1))  # a clean miss or the blocks before it, counted once
    assert (hit.num_tokens if hit else 0) == k * BLOCK and _faults(s) == (1, 0, 0)
    s.offer(toks(N), original, "finished")  # recomputed and offered again: written again
    ssd_only(s)
    hit = s.lookup(toks(N + 1))
    assert hit.tier == "ssd" and hit.num_tokens == N and same_kv(hit.cache, original, N)
    s.close()


def test_lost_block_file_is_counted_and_dropped(tmp_path):
    s, original = _on_disk(tmp_path)
    key = bkey(toks(N), 1)
    row_file(tmp_path / "ssd", key).unlink()
    hit = s.lookup(toks(N + 1))
    assert hit is None or (hit.num_tokens <= BLOCK and same_kv(hit.cache, original, hit.num_tokens))
    assert _faults(s) == (0, 1, 0) and not s.ssd.storage.contains(key)
    assert s.lookup(toks(N + 1)).num_tokens == BLOCK and _faults(s) == (0, 1, 0)
    s.close()


def test_missing_middle_block_serves_up_to_the_gap_later(tmp_path):
    """A block evicted from the middle of a chain (diskcache's own LRU): the chain is never served
    past the gap, it is not a fault, and the blocks before it serve."""
    s, original = _on_disk(tmp_path, 6 * BLOCK)
    s.ssd.storage.delete(bkey(toks(6 * BLOCK), 2))
    first = s.lookup(toks(6 * BLOCK + 1))
    assert first is None or (first.num_tokens <= 2 * BLOCK and same_kv(first.cache, original, first.num_tokens))
    hit = s.lookup(toks(6 * BLOCK + 1))
    assert hit.num_tokens == 2 * BLOCK and same_kv(hit.cache, original, 2 * BLOCK)
    assert _faults(s) == (0, 0, 0)
    s.close()


def test_missing_middle_block_served_up_to_the_gap_at_once(tmp_path):
    s, original = _on_disk(tmp_path, 6 * BLOCK)
    s.ssd.storage.delete(bkey(toks(6 * BLOCK), 2))
    hit = s.lookup(toks(6 * BLOCK + 1))
    assert hit is not None and hit.num_tokens == 2 * BLOCK and same_kv(hit.cache, original, 2 * BLOCK)
    s.close()


# -- two replicas, one directory ---------------------------------------------------------------

def test_two_replicas_share_one_directory(tmp_path):
    a, b = store(tmp_path), store(tmp_path)
    original = kv_cache(N, seed=9)
    a.offer(toks(N), original, "finished")
    settle(a)
    written = a.stats()["ssd"]
    assert written["writes"] == 4
    hit = b.lookup(toks(N + 1))  # B never saw the prompt: A's blocks serve it
    assert hit.tier == "ssd" and hit.num_tokens == N and same_kv(hit.cache, original, N)
    c = store(tmp_path)  # a third replica computes the same prompt itself and offers it
    c.offer(toks(N), kv_cache(N, seed=9), "finished")
    b.clear("ram")
    b.offer(toks(N), kv_cache(N, seed=9), "finished")
    settle(b)
    settle(c)
    for other in (b, c):
        st = other.stats()["ssd"]
        assert st["writes"] == 0 and st["bytes_written"] == 0 and st["keys"] == 4
    assert a.stats()["ssd"]["bytes"] == written["bytes"]
    for s in (a, b, c):
        s.close()


# -- tenants -----------------------------------------------------------------------------------

def test_salts_never_hit_across_and_hit_within(tmp_path):
    s = store(tmp_path)
    s.offer(A, kv_for(A), "finished", salt="tenant-a")
    for tier in ("ram", "ssd"):
        if tier == "ssd":
            ssd_only(s)
        assert s.lookup(A + [1], salt="tenant-b") is None
        assert s.lookup(A + [1]) is None  # no salt is a tenant of its own
        hit = s.lookup(A + [1], salt="tenant-a")
        assert hit.tier == tier and hit.num_tokens == len(A)
    s.offer(A, kv_for(A), "finished", salt="tenant-b")  # the same tokens: stored again, apart
    assert s.stats()["blocks_offered"] == 2 * len(A) // BLOCK
    s.close()


def test_ram_tier_holds_a_block_once_whoever_adds_it():
    """RamTier.add of a digest it holds (the same block cut by two conversations, or promoted
    again from the SSD) only touches it: one node, its bytes once."""
    s = store()
    s.offer(A, kv_for(A), "finished")
    other = store()
    other.offer(B, kv_for(B), "finished")  # the same 3 prefix blocks, cut by another store
    shared = other.ram.blocks(other._chain(P, ""))
    before = s.ram.nbytes
    for block in shared:
        assert s.ram.add(block, persisted=False)
    assert len(s.ram) == 5 and s.ram.nbytes == before == held_bytes(s.ram)
    s.set_ram_budget(0)  # every block leaves exactly once (a double-counted child would keep its parent)
    assert len(s.ram) == 0 and s.ram.nbytes == 0 and s.stats()["ram"]["evictions"] == 5


def test_a_prompt_that_diverges_inside_a_held_block_is_served_up_to_there():
    """A next turn re-sends the prompt but not always the output as generated: the block holding the
    prompt's end and the output's start serves the turn up to where they part, as a token trie would."""
    prompt, output = toks(40), toks(30, 9000)
    follow = prompt + output[:5] + toks(10, 5000)  # the client rendered the answer its own way
    s, offered = store(), kv_cache(70)
    s.offer(prompt + output, offered, "finished")
    hit = s.lookup(follow)
    assert hit.num_tokens == 45  # 2 whole blocks of 16, then 13 rows of the third
    assert all(mx.array_equal(h.keys, o.keys[..., :45, :]) and mx.array_equal(h.values, o.values[..., :45, :])
               for h, o in zip(hit.cache, offered))
    assert s.lookup(toks(20) + toks(10, 7000)).num_tokens == 20  # inside the second block
