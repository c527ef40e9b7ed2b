"""SSD tier on the block store: persistence, isolation, corruption, failing disks, write queue,
promotion and demotion, when the SSD is asked."""

from __future__ import annotations

import errno
import shutil
import sqlite3

import diskcache
import mlx.core as mx
import pytest
from test_cache_support import (BLOCK, FlakyStorage, bkey, entry_bytes, kv_cache, kv_for, same_kv, settle, ssd_only, store,
                                toks)

import cache_tiers.keys as keys
import cache_tiers.tiered as tiered


def _ssd_only_hit(s, prompt):
    ssd_only(s)
    return s.lookup(prompt)


def test_blocks_and_the_tail_served_from_ssd(tmp_path):
    s = store(tmp_path)
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    hit = _ssd_only_hit(s, toks(100) + [5])
    assert hit.tier == "ssd" and hit.num_tokens == 100  # 6 blocks of 16 and the 4-token tail
    assert mx.array_equal(hit.cache[1].values, original[1].values[..., :100, :])
    s.clear("ram")  # a prompt sharing only part of the chain is served its common blocks
    hit = s.lookup(toks(40) + [9999] * 30)
    assert hit.tier == "ssd" and hit.num_tokens == 32
    s.close()


def test_writes_are_handed_over_a_tick_later(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.flush()
    assert s.stats()["ssd"]["writes"] == 0 and s.stats()["ssd"]["queued"] == 4  # offered, not handed over
    s.tick()  # the step the offer was made in: still not handed over
    s.flush()
    assert s.stats()["ssd"]["writes"] == 0
    s.tick()  # the next step hands it to the writer
    s.flush()
    assert s.stats()["ssd"]["writes"] == 4 and s.stats()["ssd"]["queued"] == 0
    assert s.stats()["ssd"]["queued_bytes"] == 0
    s.close()


def test_restart_persistence(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "prompt")
    s.offer(toks(80, 500), kv_cache(80), "finished")
    s.close()  # close hands over what is still queued
    s2 = store(tmp_path)
    assert s2.lookup(toks(70)).num_tokens == 64
    assert s2.lookup(toks(90, 500)).num_tokens == 80
    s2.close()


def test_close_writes_what_only_ram_held(tmp_path):
    s = store(tmp_path)
    s.ssd.writes_enabled = False  # offers not taken by the SSD: RAM keeps them as not persisted
    s.offer(toks(64), kv_cache(64), "finished")
    s.ssd.writes_enabled = True
    s.close()
    s2 = store(tmp_path)
    assert s2.lookup(toks(70)).tier == "ssd"
    s2.close()


def test_fingerprint_isolation(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.close()
    other = store(tmp_path, fingerprint="another-model")
    assert other.lookup(toks(70)) is None
    other.close()


def test_format_version_isolation(tmp_path, monkeypatch):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.close()
    monkeypatch.setattr(keys, "FORMAT_VERSION", keys.FORMAT_VERSION + 1)
    s2 = store(tmp_path)
    assert s2.lookup(toks(70)) is None
    s2.close()


def test_row_of_another_fingerprint_under_our_key_is_corrupt(tmp_path):
    """Keys already bind the fingerprint; the row's own header is checked too (a copied
    directory, a key scheme bug): never served, deleted."""
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    settle(s)
    other = store(tmp_path / "other", fingerprint="another-model")
    other.offer(toks(64), kv_cache(64), "finished")
    settle(other)
    key = bkey(toks(64), 0)
    foreign = other.ssd.storage.get(keys.block_key(other._chain(toks(64), "")[0]))
    s.ssd.storage.set(key, foreign)
    s.clear("ram")
    assert s.lookup(toks(70)) is None
    assert s.stats()["ssd"]["corrupt"] == 1 and not s.ssd.storage.contains(key)
    s.close()
    other.close()


def _colliding(monkeypatch):
    """Every block of every prompt gets the same digest: a hash collision on every key."""
    monkeypatch.setattr(tiered, "block_chain", lambda t, bs, seed: [b"x" * 16] * (len(t) // bs))


def test_hash_collision_never_serves_from_ssd(tmp_path, monkeypatch):
    _colliding(monkeypatch)
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    assert _ssd_only_hit(s, toks(64, 1000)) is None  # same keys, other tokens
    assert s.stats()["ssd"]["hits"] == 0


def test_hash_collision_at_another_position_never_serves_from_ssd(tmp_path, monkeypatch):
    """Same keys and same tokens, but block 0's row asked for as block 1: its parent tells them apart."""
    _colliding(monkeypatch)
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    hit = _ssd_only_hit(s, toks(16) * 2 + [1])
    assert hit is None or hit.num_tokens == BLOCK
    assert s.stats()["ssd"]["hit_tokens"] <= BLOCK


def test_hash_collision_never_serves_from_ram(monkeypatch):
    _colliding(monkeypatch)
    s = store()
    s.offer(toks(64), kv_cache(64), "finished")
    assert s.lookup(toks(64, 1000)) is None


@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickled", "bitflip"])
def test_corrupt_block_deleted_and_counted(tmp_path, damage):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(64), kv_cache(64), "finished")
    settle(s)
    key = bkey(toks(64), 0)
    good = storage.get(key)
    if damage == "truncate":
        storage.set(key, good[: len(good) // 2])
    elif damage == "bitflip":  # one flipped bit in the float data: still parses, must not serve
        storage.set(key, good[:-5] + bytes([good[-5] ^ 0x10]) + good[-4:])
    elif damage == "garbage":
        storage.set(key, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json" + b"\0" * 100)
    else:  # a row that plain diskcache would unpickle: must never be read
        with diskcache.Cache(str(tmp_path / "ssd")) as raw:
            raw.set(key, {"pickled": True})
    s.clear("ram")
    assert s.lookup(toks(70)) is None
    st = s.stats()["ssd"]
    assert st["corrupt"] == 1 and not storage.contains(key)
    assert s.lookup(toks(70)) is None  # and stays a clean miss
    assert s.stats()["ssd"]["corrupt"] == 1
    s.close()


def test_full_disk_disables_writes_reads_continue(tmp_path, caplog):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(64), kv_cache(64), "finished")
    settle(s)
    storage.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    s.offer(toks(64, 500), kv_cache(64), "finished")
    settle(s)
    st = s.stats()["ssd"]
    assert not st["writes_enabled"] and st["write_errors"] >= 1
    assert "SSD full" in caplog.text
    s.offer(toks(64, 900), kv_cache(64), "finished")  # not even queued any more
    assert s.stats()["ssd"]["queued"] == 0
    assert _ssd_only_hit(s, toks(70)).tier == "ssd"
    storage.fail_writes = None
    s.clear("ssd")  # room again: writes resume
    assert s.stats()["ssd"]["writes_enabled"]
    s.offer(toks(64, 900), kv_cache(64), "finished")
    assert _ssd_only_hit(s, toks(70, 900)).tier == "ssd"
    s.close()
    s.close()  # idempotent


def test_sqlite_full_also_detected(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    storage.fail_writes = sqlite3.OperationalError("database or disk is full")
    s.offer(toks(64), kv_cache(64), "finished")
    settle(s)
    assert not s.stats()["ssd"]["writes_enabled"]
    s.close()


def test_unreadable_storage_keeps_serving_ram(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(64), kv_cache(64), "finished")
    settle(s)
    storage.fail_reads = PermissionError(errno.EACCES, "read-only")
    storage.fail_writes = sqlite3.OperationalError("attempt to write a readonly database")
    assert s.lookup(toks(200)).tier == "ram"  # RAM serves; the SSD probe fails quietly
    s.offer(toks(64, 300), kv_cache(64), "finished")
    settle(s)
    st = s.stats()["ssd"]
    assert st["read_errors"] == 1 and st["write_errors"] == 4 and st["writes_enabled"]  # one per block
    s.close()


def test_unopenable_directory_runs_ram_only(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    s = store(ssd_dir=str(blocker / "ssd"))
    s.offer(toks(64), kv_cache(64), "finished")
    assert s.lookup(toks(70)).tier == "ram"
    assert s.stats()["ssd"]["enabled"] is False and s.stats()["ssd"]["error"]
    s.close()


def test_deleted_directory_keeps_serving(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64, dim=64), "finished")  # > 32 KiB a block: files, not SQLite rows
    settle(s)
    shutil.rmtree(tmp_path / "ssd")
    s.clear("ram")
    assert s.lookup(toks(70)) is None
    s.offer(toks(64, 100), kv_cache(64, dim=64), "finished")
    assert s.lookup(toks(70, 100)).tier == "ram"
    s.close()


def test_write_queue_drops_counted_and_written_once_the_writer_has_room(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    storage.gate.clear()  # stall the writer on its first write
    s = store(storage=storage, write_queue=2)
    s.offer(toks(64), kv_cache(64), "finished")  # 4 blocks, 2 taken
    assert s.stats()["ssd"]["write_drops"] == 2 and s.unwritten() == 2
    s.tick()  # the backlog is still full: nothing more is offered, nor counted as dropped again
    assert s.unwritten() == 2 and s.stats()["ssd"]["write_drops"] == 2
    storage.gate.set()
    settle(s)
    assert s.stats()["ssd"]["writes"] == 4 and s.unwritten() == 0
    s.set_ram_budget(0)  # all four are on disk: nothing to demote as they leave
    settle(s)
    st = s.stats()
    assert st["ram"]["evictions"] == 4 and st["ssd"]["demotions"] == 0 and st["ssd"]["writes"] == 4
    s.set_ram_budget(10**8)
    assert s.lookup(toks(70)).num_tokens == 64
    s.close()


def test_a_prompt_longer_than_the_backlog_is_written_root_to_leaf_as_steps_go(tmp_path):
    """One long prompt has more blocks than the writer's backlog takes (a 15,000-token agent prompt:
    234 blocks of 64, against `write_queue: 64`): each engine step offers the oldest blocks RAM
    has not written, as many as the backlog has room for, and a restart then serves all of it."""
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage, write_queue=3)
    original = kv_cache(164, seed=4)
    s.offer(toks(164), original, "finished")  # 10 blocks, 3 taken; the 4-token tail waits too
    assert s.unwritten() == 7 + 1
    seen = []
    for _ in range(40):
        s.tick()
        s.flush()  # the writer keeps up, as a step's time lets it
        on_disk = [storage.contains(bkey(toks(164), k)) for k in range(10)]
        assert on_disk == sorted(on_disk, reverse=True)  # a run from the root, never a gap
        seen.append(sum(on_disk))
        if seen[-1] == 10 and not s.unwritten():
            break
    assert seen[-1] == 10 and max(b - a for a, b in zip([3] + seen, seen)) <= 3  # at most the room a step
    s.close()
    again = store(tmp_path=None, storage=FlakyStorage(str(tmp_path / "ssd")))
    hit = again.lookup(toks(164) + [5])
    assert hit.tier == "ssd" and hit.num_tokens == 164 and same_kv(hit.cache, original, 164)
    again.close()


def test_close_writes_everything_ram_holds_whatever_the_backlog(tmp_path):
    s = store(tmp_path, write_queue=2)
    original = kv_cache(164, seed=5)
    s.offer(toks(164), original, "finished")
    s.close()  # no step ran: close hands the writer all of it, as it makes room
    again = store(tmp_path)
    hit = again.lookup(toks(164) + [5])
    assert hit.tier == "ssd" and hit.num_tokens == 164 and same_kv(hit.cache, original, 164)
    again.close()


def test_write_queue_byte_limit_drops_counted(tmp_path):
    from cache_tiers.config import CacheConfig
    from cache_tiers.factory import build_store

    storage = FlakyStorage(str(tmp_path / "ssd"))
    storage.gate.clear()
    s = build_store(CacheConfig(ram_bytes=10**8, block_size=BLOCK, min_restore_tokens=4), "fp-test",
                    storage=storage, queue_bytes=2 * entry_bytes(BLOCK))
    s.offer(toks(64), kv_cache(64), "finished")  # 4 blocks; 2 fit the byte limit
    st = s.stats()["ssd"]
    assert st["write_drops"] == 2 and st["queued_bytes"] == 2 * entry_bytes(BLOCK)
    storage.gate.set()
    settle(s)
    assert s.stats()["ssd"]["writes"] == 4 and s.stats()["ssd"]["queued_bytes"] == 0  # the two later
    s.close()


def test_demotion_and_promotion(tmp_path):
    s = store(tmp_path, ram_bytes=int(entry_bytes(64) * 1.2))  # one conversation's 4 blocks
    s.ssd.writes_enabled = False  # nothing written through: RAM holds the only copy
    s.offer(toks(64), kv_cache(64, seed=3), "prompt")
    s.ssd.writes_enabled = True
    original = kv_cache(64, seed=3)
    s.offer(toks(64, 500), kv_cache(64), "prompt")  # evicts the first, leaf first: demoted
    settle(s)
    st = s.stats()
    assert st["ssd"]["demotions"] == 4 and st["ram"]["evictions"] == 4
    hit = s.lookup(toks(70))
    assert hit.tier == "ssd" and hit.num_tokens == 64 and same_kv(hit.cache, original, 64)
    assert s.stats()["ram"]["promotions"] == 4
    assert s.lookup(toks(70)).tier == "ram"
    st = s.stats()
    assert st["ssd"]["hits"] == 1 and st["ssd"]["hit_tokens"] == 64 and st["ram"]["hits"] == 1
    s.close()


def test_ssd_consulted_only_when_it_could_do_better(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    settle(s)
    s.lookup(toks(70))
    assert s.stats()["ssd"]["queries"] == 0  # RAM already served every whole block
    s.lookup(toks(200))
    assert s.stats()["ssd"]["queries"] == 1  # RAM's run ends before the prompt's: asked


def test_ssd_extends_ram_run(tmp_path):
    """RAM holds the first blocks, the SSD the rest: one restore gathers both."""
    s = store(tmp_path)
    original = kv_cache(96, seed=4)
    s.offer(toks(96), original, "finished")
    settle(s)
    s.set_ram_budget(entry_bytes(2 * BLOCK))  # RAM keeps blocks 0-1 (leaf first)
    assert s.ram.reach(s._chain(toks(96), "")) == 2
    hit = s.lookup(toks(97))
    assert hit.tier == "ssd" and hit.num_tokens == 96 and same_kv(hit.cache, original, 96)
    s.close()


def test_clear_ssd(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.clear("ssd")
    s.clear("ram")
    assert s.lookup(toks(70)) is None and s.stats()["ssd"]["keys"] == 0
    s.close()


def test_shrinking_ram_budget_demotes(tmp_path):
    s = store(tmp_path)
    s.ssd.writes_enabled = False
    s.offer(toks(64), kv_cache(64), "prompt")
    s.offer(toks(64, 500), kv_cache(64), "prompt")
    s.ssd.writes_enabled = True
    s.lookup(toks(70))  # the first is now the most recent
    s.set_ram_budget(entry_bytes(64))
    settle(s)
    assert s.stats()["ram"]["blocks"] == 4 and s.stats()["ssd"]["demotions"] == 4
    assert s.lookup(toks(70)).tier == "ram"  # the recent one stayed
    assert s.lookup(toks(70, 500)).tier == "ssd"  # the other was demoted
    s.close()


def test_idle_writes_leave_the_ssd_alone_until_no_request_runs(tmp_path):
    """`cache.ssd_write: idle`: an offer and the steps after it write nothing; the idle engine's
    `tick(drain=True)` writes the blocks and a finished request's tail; close writes the rest."""
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage, ssd_write="idle")
    s.offer(toks(100), kv_for(toks(100)), "finished")  # 6 blocks and a 4-token tail
    for _ in range(3):
        s.tick()
    s.flush()
    assert s.stats()["ssd"]["writes"] == 0 and s.unwritten() == s.stats()["ssd"]["unwritten"] == 6 + 1
    assert s.stats()["ssd"]["write_drops"] == 0  # not offered is not dropped
    settle(s)  # ticks with drain, as an idle engine does
    assert s.stats()["ssd"]["writes"] == 7 and s.unwritten() == s.stats()["ssd"]["unwritten"] == 0
    s.offer(toks(120), kv_for(toks(120)), "finished")  # the next turn: one block and its tail, at close
    s.close()
    again = store(tmp_path=None, storage=FlakyStorage(str(tmp_path / "ssd")))
    hit = again.lookup(toks(120) + [5])
    assert hit.tier == "ssd" and hit.num_tokens == 120 and same_kv(hit.cache, kv_for(toks(120)), 120)
    again.close()


def test_ssd_write_is_through_or_idle():
    from cache_tiers.config import CacheConfig

    with pytest.raises(ValueError, match="ssd_write"):
        CacheConfig(ssd_write="later")


def test_close_writes_for_its_budget_at_most_and_says_what_is_left(tmp_path, caplog):
    """A shutdown must end before whoever stops the process gives up waiting: with the writer
    stalled, close stops after its budget and logs the blocks it could not write."""
    storage = FlakyStorage(str(tmp_path / "ssd"))
    storage.gate.clear()  # the writer blocks on its first write
    s = store(storage=storage, write_queue=2)
    s.offer(toks(164), kv_cache(164), "finished")
    import threading

    threading.Timer(1.0, storage.gate.set).start()  # the writer goes on once close's budget is spent
    with caplog.at_level("WARNING"):
        s.close(budget_s=0.3)
    written = sum(storage.contains(bkey(toks(164), k)) for k in range(10))
    assert 0 < written < 10  # the first hand-over's, not the rest: close stopped at its budget
    assert "blocks held in RAM only were not written to the SSD at shutdown" in caplog.text
