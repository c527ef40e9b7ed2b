"""Prefix-cache settings: the `engine.cache` block of serve_config.yaml (the engine passes it through)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheConfig:
    """Prefix-cache tiers. `ram_bytes=None` means a fraction (`ram_fraction`) of the machine's memory."""

    enabled: bool = True
    ram_bytes: int | None = None
    ram_fraction: float = 0.1
    ssd_dir: str | None = None  # None: no SSD tier
    ssd_bytes: int = 8 * 2**30
    block_size: int = 64  # tokens per block: the unit both tiers store, share and evict
    # Shorter prefixes are recomputed, not restored. 16 serves the chat template's default system
    # prompt (SmolLM2: 24 tokens) from the cache, as mlx_lm.server does.
    min_restore_tokens: int = 16
    write_queue: int = 4096  # blocks and states waiting for the SSD writer, at most (and 1 GiB)
    # While other requests run, an SSD hit's rows are made MLX arrays for about this long per engine
    # step at most (a block at least), the rest in the steps after: the copy of a long hit is not
    # one step that everyone waits for. null: all of it in the step that finds it read.
    ssd_handover_ms: float | None = 20.0
    quantize_bits: int | None = None  # 4 or 8: quantize stored entries
    quantize_group_size: int = 64
    quantize_min_tokens: int = 256

    def __post_init__(self) -> None:
        if self.ssd_dir is not None:  # "~/.cache/..." in YAML means the serving user's home
            object.__setattr__(self, "ssd_dir", os.path.expanduser(self.ssd_dir))
        if self.ram_bytes is not None and self.ram_bytes < 0:
            raise ValueError("cache.ram_bytes must be >= 0")
        if not 0.0 <= self.ram_fraction <= 0.9:
            raise ValueError("cache.ram_fraction must be in [0, 0.9]")
        if self.block_size < 1:
            raise ValueError("cache.block_size must be >= 1")
        if self.ssd_handover_ms is not None and (isinstance(self.ssd_handover_ms, bool)
                                                 or not isinstance(self.ssd_handover_ms, (int, float))
                                                 or self.ssd_handover_ms <= 0):
            raise ValueError("cache.ssd_handover_ms must be a number of milliseconds > 0, or null")
        if self.quantize_bits not in (None, 4, 8):
            raise ValueError("cache.quantize_bits must be 4, 8 or null")
        if self.quantize_group_size not in (32, 64, 128):  # what mx.quantize supports
            raise ValueError("cache.quantize_group_size must be 32, 64 or 128")
