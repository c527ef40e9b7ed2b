"""Shared helpers for the cache-tier tests (no tests here): tiny caches and a failing storage."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache

from cache_tiers.config import CacheConfig
from cache_tiers.factory import build_store
from cache_tiers.keys import block_chain, block_key, chain_seed, state_key
from cache_tiers.storage import DiskcacheStorage
from cache_tiers.tiered import TieredStore

LAYERS, HEADS, DIM = 2, 2, 8
BLOCK = 16  # the block size `store` uses unless told
FINGERPRINT = "fp-test"


def kv_cache(n: int, layers: int = LAYERS, seed: int = 0, dim: int = DIM,
             dtype: mx.Dtype = mx.float32) -> list[KVCache]:
    """A per-layer KVCache list covering n tokens (buffer grows in 256-row steps, as in mlx-lm)."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, HEADS, n, dim)).astype(dtype),
                           mx.random.normal((1, HEADS, n, dim)).astype(dtype))
        out.append(c)
    return out


def kv_for(tokens: Sequence[int], layers: int = LAYERS, dim: int = DIM) -> list[KVCache]:
    """A KVCache list whose rows are a function of (token, position) only: two conversations that
    share a prefix get the same KV rows for it, as a real model would give them."""
    t = np.asarray(tokens, dtype=np.float32)
    pos = np.arange(len(t), dtype=np.float32)
    out = []
    for layer in range(layers):
        rows = (t[None, :, None] * 0.01 + pos[None, :, None] * 1e-4 + layer
                + np.arange(HEADS, dtype=np.float32)[:, None, None] * 0.1
                + np.arange(dim, dtype=np.float32)[None, None, :] * 1e-3)
        k = mx.array(rows[None])
        c = KVCache()
        c.update_and_fetch(k, -k)
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


def entry_bytes(n: int, layers: int = LAYERS, dim: int = DIM) -> int:
    """Bytes n stored float32 tokens hold: keys + values of exactly n rows, plus token ids."""
    return layers * 2 * HEADS * n * dim * 4 + n * 8


def block_bytes(layers: int = LAYERS, block: int = BLOCK, dim: int = DIM) -> int:
    return entry_bytes(block, layers, dim)


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def chain(tokens: Sequence[int], block: int = BLOCK, salt: str = "", fingerprint: str = FINGERPRINT) -> list[bytes]:
    return block_chain(tokens, block, chain_seed(fingerprint, salt=salt))


def bkey(tokens: Sequence[int], k: int, block: int = BLOCK, salt: str = "") -> str:
    """The SSD key of block k (0-based) of `tokens`' chain."""
    return block_key(chain(tokens, block, salt)[k])


def skey(tokens: Sequence[int], k: int, block: int = BLOCK, salt: str = "") -> str:
    """The SSD key of the exact state at the end of block k (0-based)."""
    return state_key(chain(tokens, block, salt)[k])


def store(tmp_path: Any = None, *, storage: Any = None, fingerprint: str = FINGERPRINT, host_copies: bool = False,
          **cfg: Any) -> TieredStore:
    defaults: dict[str, Any] = dict(ram_bytes=10**8, block_size=BLOCK, min_restore_tokens=4)
    if tmp_path is not None:
        defaults["ssd_dir"] = str(tmp_path / "ssd")
    defaults.update(cfg)
    s = build_store(CacheConfig(**defaults), fingerprint, storage=storage, host_copies=host_copies)
    assert isinstance(s, TieredStore)
    return s


def settle(s: TieredStore) -> None:
    """Everything offered so far on disk: the store hands SSD writes to its writer one `tick`
    later (an engine step), and what the writer's backlog had no room for as it drains, so a test
    drains the hand-over and waits for the writer until nothing is left (or nothing moves twice)."""
    stalled = 0
    while stalled < 2:
        left = s.unwritten()
        s.tick(drain=True)
        s.flush()
        if not s.unwritten():
            break
        stalled = stalled + 1 if s.unwritten() >= left else 0


def ssd_only(s: TieredStore) -> None:
    """Offers on disk, RAM emptied: the next lookup can only be served by the SSD."""
    settle(s)
    s.clear("ram")


def offered_to_ssd_only(tmp_path: Path, n: int = 100) -> tuple["FlakyStorage", TieredStore, list[KVCache]]:
    """A store over a FlakyStorage directory that was offered `n` tokens (finished), its RAM emptied:
    (the storage, the store, the offered cache)."""
    storage = FlakyStorage(str(tmp_path / "ssd"))
    s = store(storage=storage)
    original = kv_cache(n)
    s.offer(toks(n), original, "finished")
    ssd_only(s)
    return storage, s, original


def flip_a_data_bit(storage: Any, key: str) -> None:
    """Damage a stored row the way bit rot would: it still parses, and fails its checksum."""
    good = storage.get(key)
    storage.set(key, good[:-5] + bytes([good[-5] ^ 0x10]) + good[-4:])


def row_file(directory: Path, key: str) -> Path | None:
    """The file diskcache keeps a row's value in (None: the value is inline in SQLite)."""
    with sqlite3.connect(directory / "cache.db") as db:
        row = db.execute("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchone()
    assert row is not None, f"no row {key}"
    return None if row[0] is None else directory / row[0]


def same_kv(got: Sequence[Any], want: Sequence[Any], n: int) -> bool:
    """Keys and values of every layer equal, bit for bit, over the first n rows."""
    return all(g.offset == n and mx.array_equal(g.keys[..., :n, :], w.keys[..., :n, :]).item()
               and mx.array_equal(g.values[..., :n, :], w.values[..., :n, :]).item()
               and g.keys.dtype == w.keys.dtype for g, w in zip(got, want, strict=True))


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


def generate(model: Any, prompt: Sequence[int], n: int, cache: Any = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and each step's logprobs (mlx-lm's generate_step, as the engine's fallback
    path runs it), continuing from `cache` when given."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(list(prompt)), model, max_tokens=n, prompt_cache=cache,
                                 sampler=lambda x: mx.argmax(x, axis=-1)):
        tokens.append(int(tok))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return tokens, logprobs


def prefilled(model: Any, tokens: Sequence[int], cache: list[Any] | None = None) -> list[Any]:
    """`cache` (default: the model's fresh prompt cache) after one forward pass over `tokens`
    (deterministic: two calls give bit-identical caches, so one can be offered and the other
    kept as the reference a restore must equal)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model) if cache is None else cache
    model(mx.array([list(tokens)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def same_logprobs(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))
