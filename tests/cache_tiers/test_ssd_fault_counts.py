"""SSD-tier fault accounting on a real diskcache directory (no server): each fault under its own
counter, exactly; the damaged block removed; serving and later writes continue.

The end-to-end versions (a running server, the directory damaged behind its back) are in
tests/e2e/test_reliability_ssd.py; these pin down each counter on the tier itself.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
from pathlib import Path

import pytest
from test_cache_support import FlakyStorage, bkey, kv_cache, row_file, settle, ssd_only, store, toks

FAULTS = ("corrupt", "read_errors", "write_errors", "lost_files", "stats_errors")


def faults(s) -> dict[str, int]:
    ssd = s.stats()["ssd"]
    return {name: ssd[name] for name in FAULTS}


def only(**counts: int) -> dict[str, int]:
    return {name: counts.get(name, 0) for name in FAULTS}


def stored(tmp_path: Path, n: int = 64, dim: int = 8):
    """n tokens on disk (dim 64: each block > 32 KiB, a .val file; dim 8: a SQLite row), RAM empty."""
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    s.offer(toks(n), kv_cache(n, dim=dim), "finished")
    ssd_only(s)
    return s, storage


def served_from_ssd_again(s, dim: int = 8) -> bool:
    """After a fault: the request recomputes, its cache is offered again, and the SSD serves it."""
    s.offer(toks(64), kv_cache(64, dim=dim), "finished")
    ssd_only(s)
    hit = s.lookup(toks(70))
    return hit is not None and hit.tier == "ssd" and hit.num_tokens == 64


def test_tampered_sqlite_row_is_corrupt_deleted_and_not_counted_again(tmp_path):
    s, storage = stored(tmp_path)
    key = bkey(toks(64), 1)
    assert row_file(tmp_path / "ssd", key) is None  # a small block: its bytes are in SQLite
    with sqlite3.connect(tmp_path / "ssd" / "cache.db") as db:  # the row's bytes, behind diskcache's back
        assert db.execute("UPDATE Cache SET value = ? WHERE key = ?", (b"\xff\x00garbage", key)).rowcount == 1
    hit = s.lookup(toks(70))
    assert hit is None or hit.num_tokens == 16  # never past the damaged block
    assert faults(s) == only(corrupt=1)
    assert not storage.contains(key)  # the bad row is gone...
    s.lookup(toks(70))
    assert faults(s) == only(corrupt=1)  # ...so it is not met (nor counted) again
    assert served_from_ssd_again(s)


def test_tampered_block_is_corrupt_and_deleted(tmp_path):
    s, storage = stored(tmp_path)
    key = bkey(toks(64), 0)
    storage.set(key, b"\x00" * 64)
    assert s.lookup(toks(70)) is None
    assert faults(s) == only(corrupt=1) and not storage.contains(key)
    assert served_from_ssd_again(s)


def test_block_file_removed_is_a_lost_file(tmp_path):
    s, storage = stored(tmp_path, dim=64)
    files = list((tmp_path / "ssd").rglob("*.val"))
    assert len(files) == 4  # one per block
    key = bkey(toks(64), 0)
    row_file(tmp_path / "ssd", key).unlink()
    assert s.lookup(toks(70)) is None
    assert faults(s) == only(lost_files=1) and not storage.contains(key)
    s.lookup(toks(70))
    assert faults(s) == only(lost_files=1)
    assert served_from_ssd_again(s, dim=64)


def test_evicted_block_is_not_a_fault(tmp_path):
    s, storage = stored(tmp_path)
    storage.delete(bkey(toks(64), 0))  # what LRU eviction does
    assert s.lookup(toks(70)) is None
    assert faults(s) == only()


def test_failing_disk_is_a_read_error_and_a_write_error(tmp_path):
    s, storage = stored(tmp_path)
    storage.fail_reads = OSError(5, "Input/output error")
    storage.fail_writes = OSError(5, "Input/output error")
    assert s.lookup(toks(70)) is None
    s.offer(toks(16, 300), kv_cache(16), "finished")  # one block: one write
    settle(s)
    assert faults(s) == only(read_errors=1, write_errors=1)
    storage.fail_reads = storage.fail_writes = None
    assert s.lookup(toks(70)).tier == "ssd"  # the disk is back: the stored blocks serve again


def test_unsizable_directory_leaves_keys_out_and_logs_once(tmp_path, caplog):
    s, storage = stored(tmp_path)

    def broken() -> int:
        raise sqlite3.OperationalError("disk I/O error")
    storage.count = broken  # FlakyStorage forwards count to the real directory; break it here
    with caplog.at_level(logging.WARNING, logger="cache_tiers.ssd"):
        first, second = s.stats()["ssd"], s.stats()["ssd"]
    assert "keys" not in first and "bytes" not in first  # never a made-up -1
    assert first["stats_errors"] == 1 and second["stats_errors"] == 2
    assert caplog.text.count("cannot read the SSD directory's size") == 1
    del storage.count
    assert s.stats()["ssd"]["keys"] > 0


def test_deleted_directory_counts_lost_files(tmp_path):
    s, storage = stored(tmp_path, dim=64)
    shutil.rmtree(tmp_path / "ssd")
    assert s.lookup(toks(70)) is None
    assert faults(s) == only(lost_files=1)


def test_deleted_directory_writes_resume(tmp_path):
    s, storage = stored(tmp_path, dim=64)
    shutil.rmtree(tmp_path / "ssd")
    assert s.lookup(toks(70)) is None
    assert served_from_ssd_again(s, dim=64)
