"""`build_store`: the one place that turns a `CacheConfig` into a `PrefixStore`."""

from __future__ import annotations

import logging
import os

from cache_tiers.config import CacheConfig

from .quant import QuantPolicy
from .ram import RamTier
from .ssd import SsdTier
from .storage import DiskcacheStorage, Storage
from .store import NullStore, PrefixStore
from .tiered import TieredStore

log = logging.getLogger(__name__)


def total_memory_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:  # psutil missing: POSIX fallback
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ram_budget(config: CacheConfig, total_memory: int | None = None) -> int:
    """`ram_bytes` if set, else `ram_fraction` of the machine's memory."""
    if config.ram_bytes is not None:
        return config.ram_bytes
    return int(config.ram_fraction * (total_memory or total_memory_bytes()))


def build_store(config: CacheConfig, fingerprint: str, *, storage: Storage | None = None,
                total_memory: int | None = None, queue_bytes: int = 2**30, host_copies: bool = False) -> PrefixStore:
    """A tiered store for one model (`fingerprint`: modelio names the weights, config and dtype).

    `host_copies`: what `config.host_copies` "auto" means here (true on MLX's CUDA backend, where a
    host read moves an array out of device memory: ssd.py says why).

    `storage` replaces the diskcache directory (tests inject failures through it). An SSD
    directory that cannot be opened (read-only, missing mount) does not stop the engine: the
    store runs RAM-only and reports the error in `stats()["ssd"]`.
    """
    if not config.enabled:
        return NullStore()
    ssd: SsdTier | None = None
    error: str | None = None
    if storage is None and config.ssd_dir is not None:
        try:
            storage = DiskcacheStorage(config.ssd_dir, config.ssd_bytes)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            log.warning("prefix cache: SSD tier disabled, cannot open %s: %s", config.ssd_dir, e)
    if storage is not None:
        copies: bool | str = host_copies if config.host_copies == "auto" else \
            config.host_copies if config.host_copies == "staged" else bool(config.host_copies)
        ssd = SsdTier(storage, fingerprint, config.block_size, config.write_queue, queue_bytes, copies)
    ram = RamTier(ram_budget(config, total_memory))
    quant = None
    if config.quantize_bits is not None:
        quant = QuantPolicy(config.quantize_bits, config.quantize_group_size, config.quantize_min_tokens)
    return TieredStore(ram, ssd, config.block_size, config.min_restore_tokens, fingerprint=fingerprint,
                       ssd_error=error, quant=quant, ssd_write=config.ssd_write)
