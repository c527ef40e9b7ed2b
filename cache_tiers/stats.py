"""Counters a tier keeps, reported by `PrefixStore.stats()`.

Queries and hits are counted both in requests and in tokens: a tier that hits often but only for
short prefixes saves little, and only the token counts show it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TierCounters:
    queries: int = 0  # lookups that reached this tier
    query_tokens: int = 0  # prompt tokens of those lookups
    hits: int = 0  # lookups this tier served
    hit_tokens: int = 0  # tokens served (restored instead of recomputed)
    evictions: int = 0
    promotions: int = 0  # entries moved up into this tier
    demotions: int = 0  # entries this tier received from the tier above
    rejected: int = 0  # offers or blocks not stored (unsupported cache, too large, parent not held...)
    write_drops: int = 0  # writes dropped because the queue was full
    writes: int = 0
    corrupt: int = 0  # entries that failed to decode: deleted, never served
    write_errors: int = 0
    read_errors: int = 0

    def hit(self, tokens: int) -> None:
        self.hits += 1
        self.hit_tokens += tokens

    def query(self, tokens: int) -> None:
        self.queries += 1
        self.query_tokens += tokens

    def as_dict(self, **extra: Any) -> dict[str, Any]:
        return {**asdict(self), **extra}
