"""RAM tier: a byte-budgeted LRU of snapshots, indexed by a token trie for longest-prefix search.

Why not mlx-lm's `LRUPromptCache`: read in mlx-lm 0.32.2, `fetch_nearest_cache` never refreshes an
entry's position, so its order is insertion order rather than recency; it counts `c.nbytes`, which
includes the unused 256-row buffer tail; it evicts silently, with no hook to demote to the SSD;
its exact hit returns the whole cache (mlx-lm then has no token to feed); and it deep-copies on
every fetch. Here entries are immutable snapshots sliced to their offset, bytes are the bytes
held, recency is refreshed on every use, and each eviction is handed to `on_evict`.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Literal

import numpy as np

from .snapshot import Snapshot, usable_length
from .stats import TierCounters
from .trie import TokenTrie

EvictHook = Callable[[Snapshot, bool], None]  # (snapshot, already queued for the SSD)
InsertResult = Literal["kept", "covered", "too_large"]


@dataclass(eq=False)
class _Record:
    serial: int
    snap: Snapshot
    persisted: bool  # handed to the SSD tier when offered (write-through)
    key: tuple[int, ...]


@dataclass(frozen=True)
class RamMatch:
    snap: Snapshot
    num_tokens: int  # prompt tokens it can serve (already capped at len - 1)


class RamTier:
    def __init__(self, budget_bytes: int, on_evict: EvictHook | None = None) -> None:
        self.budget = budget_bytes
        self.on_evict = on_evict
        self.counters = TierCounters()
        self._trie: TokenTrie[_Record] = TokenTrie()
        self._lru: OrderedDict[int, _Record] = OrderedDict()
        self._serials = itertools.count()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def find(self, tokens: np.ndarray) -> RamMatch | None:
        """The entry serving the most of `tokens`; exact-length prefixes win ties (no trim)."""
        n = len(tokens)
        path, depth, node = self._trie.walk(tokens.tolist())
        best: RamMatch | None = None
        for _, rec in reversed(path):
            usable = usable_length(rec.snap, rec.snap.num_tokens, n)
            if usable > 0:
                best = RamMatch(rec.snap, usable)
                self._touch(rec)
                break
        reach = min(depth, n - 1)
        if reach > (best.num_tokens if best else 0):
            rec = self._trie.find_below(node, lambda r: r.snap.trimmable)
            if rec is not None:
                best = RamMatch(rec.snap, reach)
                self._touch(rec)
        return best

    def insert(self, snap: Snapshot, persisted: bool = False) -> InsertResult:
        """Keep `snap` unless a longer trimmable entry already covers it ("covered") or it alone
        exceeds the budget ("too_large"). Shorter entries a trimmable `snap` covers are dropped:
        serving them from `snap` costs one slice, keeping them costs their bytes."""
        key = tuple(snap.tokens.tolist())
        path, depth, node = self._trie.walk(key)
        if depth == len(key):
            covering = self._trie.find_below(node, lambda r: r.snap.trimmable and r.key != key)
            if covering is not None:
                self._touch(covering)
                self.counters.superseded += 1
                return "covered"
        if snap.nbytes > self.budget:
            self.counters.rejected += 1
            return "too_large"
        if snap.trimmable:
            for _, rec in path:
                if rec.key != key:
                    self._drop(rec)
                    self.counters.superseded += 1
        rec = _Record(next(self._serials), snap, persisted, key)
        prev = self._trie.add(key, rec)
        if prev is not None:
            self._forget(prev)
            rec.persisted = rec.persisted or prev.persisted
        self._lru[rec.serial] = rec
        self.nbytes += snap.nbytes
        self._enforce_budget()
        return "kept"

    def recent_tokens(self, limit: int) -> list[np.ndarray]:
        """Token ids of up to `limit` entries, most recently used first: what a request router
        needs to know this replica holds (the routing stats report their block hashes)."""
        return [rec.snap.tokens for rec in itertools.islice(reversed(self._lru.values()), max(0, limit))]

    def unpersisted(self) -> list[Snapshot]:
        """Entries never handed to the SSD (flushed there at close so a restart finds them)."""
        return [r.snap for r in self._lru.values() if not r.persisted]

    def resize(self, budget_bytes: int) -> None:
        """New byte budget (e.g. when running requests need memory); evicts, and so demotes, down to it."""
        self.budget = budget_bytes
        self._enforce_budget()

    def clear(self) -> None:
        self._trie.clear()
        self._lru.clear()
        self.nbytes = 0

    def _enforce_budget(self) -> None:
        while self.nbytes > self.budget and self._lru:
            _, rec = self._lru.popitem(last=False)
            self._trie.remove(rec.key)
            self.nbytes -= rec.snap.nbytes
            self.counters.evictions += 1
            if self.on_evict is not None:
                self.on_evict(rec.snap, rec.persisted)

    def _touch(self, rec: _Record) -> None:
        self._lru.move_to_end(rec.serial)

    def _forget(self, rec: _Record) -> None:
        self._lru.pop(rec.serial, None)
        self.nbytes -= rec.snap.nbytes

    def _drop(self, rec: _Record) -> None:
        self._trie.remove(rec.key)
        self._forget(rec)
