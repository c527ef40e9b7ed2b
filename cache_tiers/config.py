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
    # When new blocks go to the SSD: "through", as they are offered (a crash loses nothing finished);
    # "idle", only while the engine runs no request (and as RAM evicts them, and at shutdown): no
    # block's bytes leave the device while a step runs. Why the choice: on the H200 one-off 1B prompts
    # over HTTP served 0.82-0.86x (32 concurrent) and 0.84-0.92x (128) with "through" against no SSD
    # tier (sessions 20-21; on the CPU the two match): CUDA's own cost, the device-to-host copy of
    # every offered row on the MLX thread (`codec.to_host`), which a Mac's unified memory does not
    # make. "through" stays the default until a device run A/Bs the two (docs/accelerators.md).
    ssd_write: str = "through"
    # The SSD writer reads private copies of new rows, not the arrays RAM keeps: "auto" on MLX's CUDA
    # backend only, where a host read moves an array out of device memory for good and a later RAM
    # hit of it paid 22x (cache_tiers/ssd.py, benchmarks/device/host_reads.py). Measured there (H200,
    # smollm2 shape, the prefix part in process, one run): a prefix hit's TTFT p50 45.8 ms with copies
    # against 57.2 ms without, plain steps 7.65 against 9.15 ms. true / false to force. "staged": as
    # true, and the copy the writer reads is made from the device copy by MLX's CPU stream, so the
    # device-to-host transfer runs in MLX's CPU worker, not on the engine's MLX thread (`codec.to_host`,
    # a synchronous cudaMemcpy there: what was left of the SSD tier's cost on 1B throughput, 0.84-0.86x).
    # Session 22, not yet measured on a device: an A/B (docs/accelerators.md).
    host_copies: bool | str = "auto"
    # Whether an SSD hit is read back: "auto", unless reading was measured to be more than 1.5x slower
    # per token than this engine's prefills (then it is computed again; engine/restore_choice.py:
    # on the H200 a 15,000-token SSD hit of the smollm2 shape took 1,085 ms, the prompt cold 458);
    # "always", every hit is read.
    ssd_reads: str = "auto"
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
        if self.ssd_write not in ("through", "idle"):
            raise ValueError(f'cache.ssd_write must be "through" or "idle", got {self.ssd_write!r}')
        if self.ssd_reads not in ("auto", "always"):
            raise ValueError(f'cache.ssd_reads must be "auto" or "always", got {self.ssd_reads!r}')
        if self.host_copies not in (True, False, "auto", "staged"):
            raise ValueError(f'cache.host_copies must be true, false, "auto" or "staged", got {self.host_copies!r}')
        if self.quantize_bits not in (None, 4, 8):
            raise ValueError("cache.quantize_bits must be 4, 8 or null")
        if self.quantize_group_size not in (32, 64, 128):  # what mx.quantize supports
            raise ValueError("cache.quantize_group_size must be 32, 64 or 128")
