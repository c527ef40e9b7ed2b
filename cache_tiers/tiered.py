"""The engine's `PrefixStore`: RAM first, then SSD; promote on SSD hits, demote RAM evictions.

Rules, each for a reason:
- The SSD is probed only when it could serve more than RAM did (it is asked only for block
  boundaries past the RAM hit), so a full RAM hit costs no disk access.
- A hit shorter than `min_restore_tokens` is reported as a miss: copying in a few tokens of
  state saves less than it costs, and a short hit would still make the engine take the slower
  cache-restore admission path.
- Offers of finished requests (warm-up prompts included) and checkpoints are written through to the SSD at once
  (they are what a restart or the next chat turn needs); "prompt" offers, usually superseded by
  the request's "finished" offer moments later, reach the SSD only when evicted from RAM or at
  `close`. Evicted entries always go down (the writer skips the bulky write when the entry is
  already there and only refreshes its markers).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Literal, Sequence

import numpy as np

from .quant import QuantPolicy, quantize
from .ram import RamTier
from .snapshot import Snapshot, restore, snapshot
from .ssd import SsdTier
from .stats import TierCounters
from .store import Hit, Match, OfferKind

log = logging.getLogger(__name__)

WRITE_THROUGH: frozenset[str] = frozenset({"finished", "checkpoint"})


class TieredStore:
    def __init__(self, ram: RamTier, ssd: SsdTier | None, block_size: int,
                 min_restore_tokens: int, ssd_error: str | None = None,
                 quant: QuantPolicy | None = None) -> None:
        self.ram = ram
        self.ssd = ssd
        self.block_size = block_size
        self.min_restore_tokens = min_restore_tokens
        self.ssd_error = ssd_error
        self.quant = quant
        self.totals = TierCounters()
        self.too_short = 0
        ram.on_evict = self._demote

    def find(self, tokens: Sequence[int]) -> Match | None:
        """The longest prefix RAM holds, or the SSD's markers promise past it; nothing read or counted."""
        toks = np.asarray(tokens, dtype=np.int64)
        n = len(toks)
        if n < 2:
            return None
        ram = self.ram.find(toks)
        num = ram.num_tokens if ram else 0
        lo = num // self.block_size + 1
        if self.ssd is not None and lo <= n // self.block_size:
            blocks = self.ssd.probe(toks, min_blocks=lo)
            if blocks:  # the entry may turn out shorter once read; `restore` then falls back to RAM
                match = Match(min(blocks * self.block_size, n - 1), "ssd", (blocks, ram))
                return self._minded(match)
        return None if ram is None else self._minded(Match(num, "ram", (0, ram)))

    def _minded(self, match: Match) -> Match:
        return replace(match, too_short=match.num_tokens < max(1, self.min_restore_tokens))

    def restore(self, tokens: Sequence[int], match: Match | None) -> Hit | None:
        """Copy what `find` found (reading the SSD entry now); counted as one lookup of `tokens`."""
        toks = np.asarray(tokens, dtype=np.int64)
        n = len(toks)
        self.totals.query(n)
        if n < 2:
            return None
        self.ram.counters.query(n)
        blocks, ram = match.source if match is not None else (0, None)
        snap, num, tier = (ram.snap, ram.num_tokens, "ram") if ram else (None, 0, "ram")
        if self.ssd is not None and num // self.block_size + 1 <= n // self.block_size:
            self.ssd.counters.query(n)  # the SSD was asked (by `find`'s probe) whatever it answered
        if blocks and self.ssd is not None:
            deep = self.ssd.load(toks, blocks)
            if deep is not None and deep.num_tokens > num:
                snap, num, tier = deep.snap, deep.num_tokens, "ssd"
        if snap is None or num < max(1, self.min_restore_tokens):
            self.too_short += snap is not None
            return None
        try:
            cache = restore(snap, num)
        except Exception as e:  # never fail a request over the cache
            log.warning("prefix cache: cannot restore a %s entry: %s", tier, e)
            (self.ram if tier == "ram" else self.ssd).counters.read_errors += 1  # type: ignore[union-attr]
            return None
        if tier == "ssd":
            self._promote(snap)
        (self.ram if tier == "ram" else self.ssd).counters.hit(num)  # type: ignore[union-attr]
        self.totals.hit(num)
        return Hit(cache=cache, num_tokens=num, tier=tier)

    def lookup(self, tokens: Sequence[int]) -> Hit | None:
        """`find` and `restore` in one (tests, benchmarks, warm-up tools)."""
        return self.restore(tokens, self.find(tokens))

    def offer(self, tokens: Sequence[int], cache: list[Any], kind: OfferKind) -> None:
        try:
            snap = snapshot(tokens, cache)
        except (TypeError, ValueError) as e:
            self.totals.rejected += 1
            log.debug("prefix cache: not storing offer: %s", e)
            return
        if self.quant is not None:
            snap = quantize(snap, self.quant)
        queued = False
        if self.ssd is not None and kind in WRITE_THROUGH:
            queued = self.ssd.offer(snap)
        result = self.ram.insert(snap, persisted=queued)
        if result == "too_large" and self.ssd is not None and not queued:
            self._demote(snap, False)

    def _promote(self, snap: Snapshot) -> None:
        if self.ram.insert(snap, persisted=False) == "kept":
            self.ram.counters.promotions += 1

    def _demote(self, snap: Snapshot, persisted: bool) -> None:
        if self.ssd is not None and self.ssd.offer(snap):
            self.ssd.counters.demotions += 1

    def held_prefixes(self, limit: int = 256) -> list[np.ndarray]:
        """Token ids of the most recently used RAM entries (cache-affinity routing reports them).
        SSD entries are not listed: enumerating the disk index is slow, and an SSD hit is promoted
        to RAM, so what is in use shows up here after its first hit."""
        return self.ram.recent_tokens(limit)

    def set_ram_budget(self, budget_bytes: int) -> None:
        """Shrink or grow the RAM tier at run time (one memory account with running KV state):
        entries over the new budget are evicted least-recent first and demoted to the SSD."""
        self.ram.resize(max(0, budget_bytes))

    def clear(self, tier: Literal["ram", "ssd", "all"] = "all") -> None:
        """Drop cached state (admin endpoint). Clearing RAM does not demote what it drops."""
        if tier in ("ram", "all"):
            self.ram.clear()
        if tier in ("ssd", "all") and self.ssd is not None:
            self.ssd.clear()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lookups": self.totals.queries,
            "lookup_tokens": self.totals.query_tokens,
            "hits": self.totals.hits,
            "hit_tokens": self.totals.hit_tokens,
            "rejected_offers": self.totals.rejected,
            "hits_below_min_restore": self.too_short,
            "ram": self.ram.counters.as_dict(entries=len(self.ram), bytes=self.ram.nbytes,
                                             budget_bytes=self.ram.budget),
        }
        if self.ssd is not None:
            out["ssd"] = self.ssd.stats()
        else:
            out["ssd"] = {"enabled": False, "error": self.ssd_error}
        return out

    def flush(self) -> None:
        """Wait until queued SSD writes are done (tests, admin)."""
        if self.ssd is not None:
            self.ssd.flush()

    def close(self) -> None:
        """Write what only RAM holds to the SSD, flush, and stop the writer."""
        if self.ssd is None:
            return
        for snap in self.ram.unpersisted():
            self.ssd.offer(snap, block=True)
        self.ssd.close()
