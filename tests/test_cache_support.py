"""Shared helpers for the cache-tier tests (no tests here): tiny caches and a failing storage."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache

from cache_tiers.storage import DiskcacheStorage
from cache_tiers.tiered import TieredStore
from cache_tiers.factory import build_store
from cache_tiers.config import CacheConfig

LAYERS, HEADS, DIM = 2, 2, 8


def kv_cache(n: int, layers: int = LAYERS, seed: int = 0) -> list[KVCache]:
    """A per-layer KVCache list covering n tokens (buffer grows in 256-row steps, as in mlx-lm)."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, HEADS, n, DIM)), mx.random.normal((1, HEADS, n, DIM)))
        out.append(c)
    return out


def rotating_cache(n: int, max_size: int, layers: int = LAYERS) -> list[RotatingKVCache]:
    out = []
    for _ in range(layers):
        c = RotatingKVCache(max_size=max_size, keep=0)
        for _ in range(n):  # one token at a time: the in-place, rotating path
            c.update_and_fetch(mx.random.normal((1, HEADS, 1, DIM)), mx.random.normal((1, HEADS, 1, DIM)))
        out.append(c)
    return out


def entry_bytes(n: int, layers: int = LAYERS) -> int:
    """Bytes a stored n-token float32 entry holds: keys + values sliced to n, plus token ids."""
    return layers * 2 * HEADS * n * DIM * 4 + n * 8


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def store(tmp_path: Any = None, *, storage: Any = None, **cfg: Any) -> TieredStore:
    defaults: dict[str, Any] = dict(ram_bytes=10**8, block_size=16, min_restore_tokens=4)
    if tmp_path is not None:
        defaults["ssd_dir"] = str(tmp_path / "ssd")
    defaults.update(cfg)
    s = build_store(CacheConfig(**defaults), "fp-test", storage=storage)
    assert isinstance(s, TieredStore)
    return s


class FlakyStorage:
    """A real diskcache directory behind a switch that injects failures or stalls writes."""

    def __init__(self, directory: str, size_limit: int = 2**30) -> None:
        self.inner = DiskcacheStorage(directory, size_limit)
        self.fail_writes: BaseException | None = None
        self.fail_reads: BaseException | None = None
        self.gate = threading.Event()
        self.gate.set()

    def get(self, key: str) -> bytes | None:
        if self.fail_reads:
            raise self.fail_reads
        return self.inner.get(key)

    def contains(self, key: str) -> bool:
        if self.fail_reads:
            raise self.fail_reads
        return self.inner.contains(key)

    def set(self, key: str, value: bytes) -> None:
        self.gate.wait()
        if self.fail_writes:
            raise self.fail_writes
        self.inner.set(key, value)

    def __getattr__(self, name: str) -> Any:  # delete, clear, volume, count, close
        return getattr(self.inner, name)
