"""SSD tier: persistence, isolation, corruption, failing disks, write queue, promotion/demotion."""

from __future__ import annotations

import errno
import shutil
import sqlite3

import diskcache
import mlx.core as mx
import pytest
from test_cache_support import FlakyStorage, entry_bytes, kv_cache, store, toks

import cache_tiers.keys as keys
from cache_tiers.keys import block_chain, chain_seed, entry_key


def _ssd_only_hit(s, prompt):
    s.flush()
    s.clear("ram")
    return s.lookup(prompt)


def test_entries_cut_to_block_boundary_and_served(tmp_path):
    s = store(tmp_path)
    original = kv_cache(100)
    s.offer(toks(100), original, "finished")
    hit = _ssd_only_hit(s, toks(100) + [5])
    assert hit.tier == "ssd" and hit.num_tokens == 96  # 6 blocks of 16
    assert mx.array_equal(hit.cache[1].values, original[1].values[..., :96, :])
    # a prompt sharing only part of the entry is served by trimming it
    s.clear("ram")
    hit = s.lookup(toks(40) + [9999] * 30)
    assert hit.tier == "ssd" and hit.num_tokens == 40


def test_restart_persistence(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "prompt")  # not written through: flushed at close
    s.offer(toks(80, 500), kv_cache(80), "finished")
    s.close()
    s2 = store(tmp_path)
    assert s2.lookup(toks(70)).num_tokens == 64
    assert s2.lookup(toks(90, 500)).num_tokens == 80
    s2.close()


def test_fingerprint_isolation(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.close()
    from cache_tiers.factory import build_store
    from cache_tiers.config import CacheConfig

    other = build_store(CacheConfig(ram_bytes=10**8, ssd_dir=str(tmp_path / "ssd"), block_size=16,
                                    min_restore_tokens=4), "another-model")
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


def test_hash_collision_never_serves(tmp_path, monkeypatch):
    import cache_tiers.ssd as ssd_mod

    monkeypatch.setattr(ssd_mod, "block_chain", lambda t, bs, seed: [b"x" * 16] * (len(t) // bs))
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    assert _ssd_only_hit(s, toks(64, 1000)) is None  # same keys, other tokens
    assert s.stats()["ssd"]["hits"] == 0 and s.stats()["ssd"]["corrupt"] == 0


def _stored_entry_key(tokens, block_size=16):
    chain = block_chain(tokens, block_size, chain_seed("fp-test"))
    return entry_key(chain[len(tokens) // block_size - 1])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickled", "bitflip"])
def test_corrupt_entry_deleted_and_counted(tmp_path, damage):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(64), kv_cache(64), "finished")
    s.flush()
    key = _stored_entry_key(toks(64))
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
    s.close()


def test_full_disk_disables_writes_reads_continue(tmp_path, caplog):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(64), kv_cache(64), "finished")
    s.flush()
    storage.fail_writes = OSError(errno.ENOSPC, "No space left on device")
    s.offer(toks(64, 500), kv_cache(64), "finished")
    s.flush()
    st = s.stats()["ssd"]
    assert not st["writes_enabled"] and st["write_errors"] == 1
    assert "SSD full" in caplog.text
    s.offer(toks(64, 900), kv_cache(64), "finished")  # not even queued any more
    assert s.stats()["ssd"]["queued"] == 0
    assert _ssd_only_hit(s, toks(70)).tier == "ssd"
    storage.fail_writes = None
    s.clear("ssd")  # room again: writes resume
    assert s.stats()["ssd"]["writes_enabled"]
    s.close()
    s.close()  # idempotent


def test_sqlite_full_also_detected(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    storage.fail_writes = sqlite3.OperationalError("database or disk is full")
    s.offer(toks(64), kv_cache(64), "finished")
    s.flush()
    assert not s.stats()["ssd"]["writes_enabled"]
    s.close()


def test_unreadable_storage_keeps_serving_ram(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(64), kv_cache(64), "finished")
    s.flush()
    storage.fail_reads = PermissionError(errno.EACCES, "read-only")
    storage.fail_writes = sqlite3.OperationalError("attempt to write a readonly database")
    assert s.lookup(toks(200)).tier == "ram"  # RAM serves; SSD probe fails quietly
    s.offer(toks(64, 300), kv_cache(64), "finished")
    s.flush()
    st = s.stats()["ssd"]
    assert st["read_errors"] == 1 and st["write_errors"] == 1 and st["writes_enabled"]
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
    s.offer(toks(64), kv_cache(64, layers=4), "finished")  # > 32 KiB: a file, not a SQLite row
    s.flush()
    shutil.rmtree(tmp_path / "ssd")
    s.clear("ram")
    assert s.lookup(toks(70)) is None
    s.offer(toks(64, 100), kv_cache(64), "finished")
    assert s.lookup(toks(70, 100)).tier == "ram"
    s.close()


def test_write_queue_drops_counted(tmp_path):
    storage = FlakyStorage(str(tmp_path / "ssd"))
    storage.gate.clear()  # stall the writer on its first write
    s = store(storage=storage, write_queue=1)
    for i in range(4):
        s.offer(toks(64, 1000 * i), kv_cache(64), "finished")
    assert s.stats()["ssd"]["write_drops"] >= 2
    storage.gate.set()
    s.close()


def test_demotion_and_promotion(tmp_path):
    s = store(tmp_path, ram_bytes=int(entry_bytes(64) * 1.5))
    s.offer(toks(64), kv_cache(64, seed=3), "prompt")  # RAM only
    s.offer(toks(64, 500), kv_cache(64), "prompt")  # evicts the first: demoted
    s.flush()
    assert s.stats()["ssd"]["demotions"] == 1 and s.stats()["ram"]["evictions"] == 1
    hit = s.lookup(toks(70))
    assert hit.tier == "ssd" and hit.num_tokens == 64
    assert s.stats()["ram"]["promotions"] == 1
    assert s.lookup(toks(70)).tier == "ram"
    st = s.stats()
    assert st["ssd"]["hits"] == 1 and st["ssd"]["hit_tokens"] == 64 and st["ram"]["hits"] == 1
    s.close()


def test_ssd_consulted_only_when_it_could_do_better(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.flush()
    s.lookup(toks(70))
    assert s.stats()["ssd"]["queries"] == 0  # RAM already served every full block


def test_clear_ssd(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "finished")
    s.clear("ssd")
    s.clear("ram")
    assert s.lookup(toks(70)) is None and s.stats()["ssd"]["keys"] == 0
    s.close()


def test_shrinking_ram_budget_demotes(tmp_path):
    s = store(tmp_path)
    s.offer(toks(64), kv_cache(64), "prompt")
    s.offer(toks(64, 500), kv_cache(64), "prompt")
    s.lookup(toks(70))  # the first is now the most recent
    s.set_ram_budget(entry_bytes(64))
    s.flush()
    assert s.stats()["ram"]["entries"] == 1 and s.stats()["ssd"]["demotions"] == 1
    assert s.lookup(toks(70, 500)).tier == "ssd"
    s.close()
