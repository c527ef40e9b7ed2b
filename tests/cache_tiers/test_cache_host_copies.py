"""Host copies (MLX's CUDA backend, `SsdTier(host_copies=True)`): the SSD writer reads private copies
of new rows, never the arrays RAM keeps (a host read there would move them out of device memory),
the copies are freed together once written, with MLX's buffer cache emptied, and what reaches the
disk is the same bytes either way. Run on the CPU, where the copies cost nothing but a copy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_cache_support import FlakyStorage, bkey, chain, kv_cache, same_kv, settle, ssd_only, store, toks

import cache_tiers.codec as codec
import cache_tiers.ssd as ssd_mod


def _ptr(a: mx.array) -> int:
    """Where `a`'s bytes are (on the CPU numpy's view of an array is its buffer)."""
    bits = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8, 8: mx.uint64}[a.itemsize]
    return np.asarray(mx.view(a, bits)).ctypes.data


def _bits(a: mx.array) -> bytes:
    bits = {2: mx.uint16, 4: mx.uint32, 1: mx.uint8, 8: mx.uint64}[a.itemsize]
    return np.asarray(mx.view(a, bits)).tobytes()


@pytest.mark.parametrize("make", [
    lambda: mx.random.normal((2, 3, 16, 8)).astype(mx.bfloat16),
    lambda: mx.random.normal((2, 3, 16, 8)).astype(mx.float16),
    lambda: mx.view(mx.array([0x7FC00001, 0xFFC12345, 0, 0x80000000], dtype=mx.uint32), mx.float32),  # NaN payloads, -0.0
    lambda: mx.array([1, 2**32 - 1, 7], dtype=mx.uint32),  # quantized weights' packing
])
def test_private_copy_is_bit_exact_in_a_buffer_of_its_own(make):
    a = make()
    mx.eval(a)
    c = codec.private_copy(a)
    mx.eval(c)
    assert c.dtype == a.dtype and c.shape == a.shape
    assert _bits(c) == _bits(a)
    assert _ptr(c) != _ptr(a)


def _handed(monkeypatch) -> list[codec.HostEntry]:
    """Every entry `tick` hands to the writer."""
    seen: list[codec.HostEntry] = []
    real = codec.to_host

    def recording(prepared: codec.Prepared) -> codec.HostEntry:
        entry = real(prepared)
        seen.append(entry)
        return entry

    monkeypatch.setattr(codec, "to_host", recording)
    return seen


@pytest.mark.parametrize("host_copies", [True, "staged", False])
def test_the_writer_reads_copies_never_the_arrays_ram_keeps(tmp_path, monkeypatch, host_copies):
    seen = _handed(monkeypatch)
    s = store(tmp_path, host_copies=host_copies)
    s.offer(toks(64), kv_cache(64, dtype=mx.bfloat16), "finished")
    settle(s)
    kept = {_ptr(a) for b in s.ram.blocks(chain(toks(64))) for a in b.arrays}
    read = {t.ctypes.data for e in seen for name, t in e.tensors.items() if name != "tokens"}
    assert len(kept) == 4 and len(read) == 4
    # With host copies nothing the writer reads is RAM's; without (a Mac, the CPU) it reads RAM's own.
    assert kept.isdisjoint(read) if host_copies else kept == read
    s.close()


def test_rows_written_from_copies_are_the_same_bytes(tmp_path):
    original = kv_cache(100, dtype=mx.bfloat16)
    keys = [bkey(toks(100), k) for k in range(6)]
    rows = {}
    for sub, copies in (("copies", True), ("staged", "staged"), ("own", False)):
        s = store(tmp_path / sub, host_copies=copies)
        s.offer(toks(100), original, "finished")
        s.close()
        s = store(tmp_path / sub, host_copies=True)
        rows[sub] = [s.ssd.storage.get(k) for k in keys]
        hit = s.lookup(toks(100) + [5])
        assert hit.tier == "ssd" and hit.num_tokens == 100 and same_kv(hit.cache, original, 100)
        s.close()
    assert all(rows["copies"]) and rows["copies"] == rows["own"] == rows["staged"]


def test_written_copies_are_freed_together_with_the_buffer_cache(tmp_path, monkeypatch):
    cleared = []
    monkeypatch.setattr(ssd_mod.mx, "clear_cache", lambda: cleared.append(1))
    one_block = codec.prepare_block(_first_block(tmp_path)).nbytes
    monkeypatch.setattr(ssd_mod, "RELEASE_BYTES", 3 * one_block)
    disk = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=disk, host_copies=True)

    def handed_then_written(n: int) -> None:
        """Offer the first n tokens; the writer takes nothing until both ticks have handed them over
        (else a fast writer can finish some in between, and a release comes a tick earlier)."""
        disk.gate.clear()
        s.offer(toks(n), kv_cache(n), "finished")
        s.tick()
        s.tick()
        disk.gate.set()
        s.flush()
        s.tick()

    handed_then_written(32)  # 2 blocks: written, held, below the release size
    assert s.ssd.held_copies == 2 and not cleared
    handed_then_written(64)  # 2 more: 4 written blocks pass it
    assert s.ssd.held_copies == 0 and len(cleared) == 1 and s.ssd.releases == 1
    handed_then_written(80)  # one more block: freed once idle
    assert s.ssd.held_copies == 1 and len(cleared) == 1
    s.tick(drain=True)
    assert s.ssd.held_copies == 0 and len(cleared) == 2
    s.close()


def _first_block(tmp_path):
    s = store(tmp_path / "probe")
    s.offer(toks(16), kv_cache(16), "finished")
    block = s.ram.blocks(chain(toks(16)))[0]
    s.close()
    return block


def test_a_copy_is_never_freed_before_its_row_is_written(tmp_path, monkeypatch):
    cleared = []
    monkeypatch.setattr(ssd_mod.mx, "clear_cache", lambda: cleared.append(1))
    disk = FlakyStorage(str(tmp_path / "ssd"))
    disk.gate.clear()  # the writer blocks in its first write
    s = store(storage=disk, host_copies=True)
    s.offer(toks(48), kv_cache(48), "finished")
    s.tick(drain=True)
    s.tick(drain=True)
    assert s.ssd.held_copies == 3 and not cleared  # handed over, not written: kept
    disk.gate.set()
    s.flush()
    s.tick(drain=True)
    assert s.ssd.held_copies == 0 and cleared
    ssd_only(s)
    assert s.lookup(toks(48) + [1]).num_tokens == 48
    s.close()


def test_host_copies_auto_follows_the_backend_and_can_be_forced(tmp_path):
    from cache_tiers.config import CacheConfig
    from cache_tiers.factory import build_store

    def copies(setting, backend):
        s = build_store(CacheConfig(ssd_dir=str(tmp_path / f"{setting}-{backend}"), host_copies=setting), "fp",
                        host_copies=backend)
        try:
            return s.ssd.host_copies
        finally:
            s.close()

    assert copies("auto", True) and not copies("auto", False)
    assert copies(True, False) and not copies(False, True)
    assert copies("staged", False) == "staged"
    with pytest.raises(ValueError, match="host_copies"):
        CacheConfig(host_copies="yes")


def test_staged_copies_come_from_the_cpu_stream_and_keep_the_device_copy_until_written(tmp_path, monkeypatch):
    """`host_copies: staged`: what the writer reads is a copy made by MLX's CPU stream of a device
    copy (here both on the CPU): bit-exact, in a buffer of neither RAM's array nor the device copy's,
    and the held copy is the one the writer reads (freed with the rest once written)."""
    block = _first_block(tmp_path)
    streams = []
    real = codec.private_copy
    monkeypatch.setattr(codec, "private_copy", lambda a, stream=None: streams.append(stream) or real(a, stream))
    staged = codec.prepare_block(block, codec.STAGED)
    monkeypatch.setattr(codec, "private_copy", real)
    assert streams and streams[0::2] == [None] * (len(streams) // 2) and streams[1::2] == [mx.cpu] * (len(streams) // 2)
    plain = codec.prepare_block(block, True)
    names = [n for n in staged.arrays if n != "tokens"]
    assert names
    for name in names:
        a, b = staged.arrays[name], plain.arrays[name]
        mx.eval(a, b)
        assert _bits(a) == _bits(b)
    own = {_ptr(a) for a in block.arrays}
    assert own.isdisjoint(_ptr(staged.arrays[n]) for n in names)
    s = store(tmp_path / "s", host_copies="staged")
    s.offer(toks(32), kv_cache(32), "finished")
    s.tick()
    s.tick()
    assert s.ssd.held_copies == 2
    s.flush()
    s.tick(drain=True)
    assert s.ssd.held_copies == 0
    ssd_only(s)
    assert s.lookup(toks(32) + [1]).num_tokens == 32
    s.close()
