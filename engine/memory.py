"""One memory account for running KV state and the RAM cache tier.

Running requests reserve their worst case (prompt + max_tokens, or a ring's window where the step
keeps a bounded cache: `scheduler.kv_footprint`) of KV bytes at admission; the RAM
tier may use what is left, up to its own budget. When memory is tight the cache gives way first:
its budget shrinks (entries are demoted to the SSD tier) before a request is kept waiting, and a
running request is never stopped to make room for the cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from cache_tiers.store import PrefixStore


def kv_bytes_per_token(model: Any) -> int:
    """KV bytes one token costs in this model, measured with a one-token forward pass.

    Measuring beats computing from the config: it covers every cache type a model builds. mlx-lm's
    KVCache allocates rows in steps, so the bytes are divided by the rows allocated, not by one.
    """
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    total = 0
    for c in cache:
        rows = 0
        for array in c.state if isinstance(c.state, (list, tuple)) else [c.state]:
            if isinstance(array, mx.array) and array.ndim == 4:
                rows = max(rows, array.shape[2])
        total += c.nbytes // max(rows, 1)
    return max(total, 1)


class MemoryAccount:
    def __init__(self, budget_bytes: int, bytes_per_token: int, store: PrefixStore) -> None:
        self.budget_bytes = budget_bytes
        self.bytes_per_token = bytes_per_token
        self._store = store
        # The RAM tier's configured budget: the most it is ever given back (None: no RAM tier).
        self._ram_base = store.stats().get("ram", {}).get("budget_bytes")

    def free_tokens(self, reserved_tokens: int) -> int:
        """Tokens of KV that may still be reserved by new requests."""
        return max(0, self.budget_bytes // self.bytes_per_token - reserved_tokens)

    def rebalance(self, reserved_tokens: int) -> None:
        """Give the RAM tier what running requests leave, capped at its configured budget."""
        if self._ram_base is None:
            return
        left = max(0, self.budget_bytes - reserved_tokens * self.bytes_per_token)
        self._store.set_ram_budget(min(self._ram_base, left))
