"""Measure the store's costs for one cache shape: `python -m benchmarks.cache_tiers [tokens] [dir]`.

Defaults to SmolLM2-135M's KV shape (30 layers, 3 KV heads, head dim 64, float32: 46 KB/token).
Reports the median of a few runs of each step, so a reader can tell what the engine's thread pays
(snapshot, RAM restore, SSD load) from what the writer thread pays (encode, write).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from typing import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from cache_tiers import codec
from cache_tiers.snapshot import restore, snapshot
from cache_tiers.storage import DiskcacheStorage


def _cache(n: int, layers: int = 30, heads: int = 3, dim: int = 64) -> list[KVCache]:
    out = []
    for _ in range(layers):
        c = KVCache()
        c.update_and_fetch(mx.random.normal((1, heads, n, dim)), mx.random.normal((1, heads, n, dim)))
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def _ms(fn: Callable[[], object], runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main(n: int = 2000, directory: str | None = None) -> None:
    tokens = list(range(n))
    cache = _cache(n)
    snap = snapshot(tokens, cache)
    host = codec.to_host(snap)
    data = codec.encode(host, "fp")
    storage = DiskcacheStorage(directory or tempfile.mkdtemp(), 2**34)
    print(f"{n} tokens, {snap.nbytes / 1e6:.1f} MB held, {len(data) / 1e6:.1f} MB serialized")
    print(f"snapshot (offer, MLX thread)      {_ms(lambda: snapshot(tokens, cache)):8.1f} ms")
    print(f"RAM restore (lookup, MLX thread)  {_ms(lambda: mx.eval([c.keys for c in restore(snap, n - 1)])):8.1f} ms")
    print(f"to_host (MLX thread)              {_ms(lambda: codec.to_host(snap)):8.1f} ms")
    print(f"encode (writer)                   {_ms(lambda: codec.encode(host, 'fp')):8.1f} ms")
    keys = iter(range(10**6))
    print(f"diskcache set (writer)            {_ms(lambda: storage.set(f'e/{next(keys)}', data)):8.1f} ms")
    storage.set("e/x", data)
    print(f"diskcache get (lookup)            {_ms(lambda: storage.get('e/x')):8.1f} ms")
    print(f"decode + from_host (lookup)       {_ms(lambda: codec.from_host(codec.decode(data, 'fp'))):8.1f} ms")
    load = lambda: restore(codec.from_host(codec.decode(storage.get("e/x"), "fp")), n - 1)  # noqa: E731
    print(f"SSD load total (get..restore)     {_ms(load):8.1f} ms")
    storage.close()
    _end_to_end(tokens, cache, directory)


def _end_to_end(tokens: list[int], cache: list[KVCache], directory: str | None) -> None:
    """Through the public store: offer + background write, then an SSD hit with a longer prompt."""
    from cache_tiers.config import CacheConfig

    from cache_tiers.factory import build_store

    s = build_store(CacheConfig(ram_bytes=2**32, ssd_dir=tempfile.mkdtemp(dir=directory and
                                                                          directory + "/..")), "fp")
    t = time.perf_counter()
    s.offer(tokens, cache, "finished")
    offered = time.perf_counter()
    s.flush()  # type: ignore[attr-defined]
    flushed = time.perf_counter()
    s.clear("ram")  # type: ignore[attr-defined]
    t2 = time.perf_counter()
    hit = s.lookup(tokens + [1, 2, 3])
    mx.eval([c.keys for c in hit.cache])
    looked = time.perf_counter()
    print(f"store.offer 'finished' (MLX thread) {(offered - t) * 1e3:6.1f} ms; background write "
          f"done after {(flushed - t) * 1e3:.1f} ms")
    print(f"store.lookup SSD hit of {hit.num_tokens} tokens, evaluated  {(looked - t2) * 1e3:6.1f} ms")
    s.close()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000, sys.argv[2] if len(sys.argv) > 2 else None)
