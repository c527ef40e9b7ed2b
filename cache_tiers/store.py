"""The one interface the engine sees of the prefix cache.

The engine's MLX thread is the only caller. `lookup` answers at admission with a private copy of
the longest useful cached prefix; `offer` hands over state the engine no longer mutates (after a
prompt's prefill, and at a request's end with prompt + output, so the next chat turn reuses it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

Tier = Literal["ram", "ssd"]
OfferKind = Literal["prompt", "finished", "checkpoint", "warmup"]


@dataclass(frozen=True)
class Hit:
    """A cached prefix ready to be fed to `BatchGenerator.insert(caches=...)`.

    `cache` is a fresh list of mlx-lm cache objects (one per layer) that nobody else references,
    covering exactly `tokens[:num_tokens]` of the looked-up prompt. `num_tokens` is always at most
    `len(tokens) - 1`, because mlx-lm needs at least one token to feed.
    """

    cache: list[Any]
    num_tokens: int
    tier: Tier


class PrefixStore(Protocol):
    def lookup(self, tokens: Sequence[int]) -> Hit | None:
        """Longest cached prefix of `tokens` worth restoring, or None."""

    def offer(self, tokens: Sequence[int], cache: list[Any], kind: OfferKind) -> None:
        """Remember `cache`, which covers exactly `tokens`. The store takes ownership (it copies
        or slices as it needs); the caller must not mutate `cache` afterwards."""

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the RAM tier could restore now (0: none); copies
        nothing, counts nothing. The scheduler asks it to decide who waits for whom."""

    def stats(self) -> dict[str, Any]:
        """Per-tier counters: queries/hits in tokens, entries, bytes, evictions, promotions..."""

    def close(self) -> None:
        """Flush pending writes and release resources."""


class NullStore:
    """No prefix caching: every lookup misses, offers are dropped."""

    def lookup(self, tokens: Sequence[int]) -> Hit | None:
        return None

    def offer(self, tokens: Sequence[int], cache: list[Any], kind: OfferKind) -> None:
        return None

    def cached_length(self, tokens: Sequence[int]) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None
