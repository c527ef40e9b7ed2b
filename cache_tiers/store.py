"""The one interface the engine sees of the prefix cache.

The engine's MLX thread is the only caller, except `flush` (any thread: it only waits for the
SSD writer). Admission asks twice in two different ways, never the same question twice: `find` is
the search (which tier holds how much of a prompt; it copies nothing and counts nothing, so the
scheduler can plan with it), `restore` is the copy of what the plan admitted, counted as the
request's one lookup. `offer` hands over state the engine no longer mutates (after a prompt's
prefill, and at a request's end with prompt + output, so the next chat turn reuses it). `tick`
runs once per engine step: work an offer started (device copies, the SSD's host views) is
finished there a step later, so no offer makes a step wait.

Every call takes the request's `salt` (its tenant, `Request.cache_salt`): state is shared only
between requests with the same salt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

Tier = Literal["ram", "ssd"]
OfferKind = Literal["prompt", "finished", "checkpoint"]


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


@dataclass(frozen=True)
class Match:
    """Where the longest cached prefix of a prompt is, found by `PrefixStore.find`; no copy yet.

    `num_tokens` is what a restore would serve: whole blocks, at most `len(tokens) - 1` (an SSD
    row read later may turn out missing: the restore then serves less). `too_short`: below `min_restore_tokens`, so restoring
    it would cost more than it saves; it is kept only so the lookup is counted as such. `source` is
    the store's own reference (the chain and what each tier holds of it). `ram_tokens`: the part
    RAM serves without the SSD (the engine weighs reading the rest against computing it).
    """

    num_tokens: int
    tier: Tier
    source: Any = None
    too_short: bool = False
    ram_tokens: int = 0  # of `num_tokens`, what RAM holds now (an SSD match reads the rest)

    @property
    def usable(self) -> int:
        return 0 if self.too_short else self.num_tokens


class PrefixStore(Protocol):
    def find(self, tokens: Sequence[int], salt: str = "", read_ssd: bool = True) -> Match | None:
        """Where the longest cached prefix of `tokens` is; copies nothing, counts nothing.
        `read_ssd=False`: what RAM alone holds (the engine chose not to read the SSD's rows)."""

    def restore(self, tokens: Sequence[int], match: Match | None, salt: str = "") -> Hit | None:
        """A private copy of what `find` found for these `tokens` (None: nothing, too short, or
        gone since); counted as one lookup of `tokens`."""

    def held(self, tokens: Sequence[int], salt: str = "") -> int:
        """How many leading tokens of `tokens` the store holds in RAM as whole blocks now (a multiple
        of its block size): an offer made next on this thread may leave them out (`offer`'s `start`)."""

    def offer(self, tokens: Sequence[int], cache: list[Any], kind: OfferKind, salt: str = "", start: int = 0) -> None:
        """Remember `cache`, which covers exactly `tokens[start:]` (`start`: at most what `held` said,
        0 for a cache with exact layers). The store takes what it lacks (it copies as it needs); the
        caller must not mutate `cache` afterwards."""

    def prefetch(self, match: Match | None, tokens: Sequence[int]) -> Any | None:
        """Start reading, off the MLX thread, what `match` needs from a slow tier (the SSD); None
        when nothing does. The handle's `done()` says when `complete` may take it, and
        `on_done(callback)` calls back (from any thread) when that happens."""

    def complete(self, prefetch: Any, budget_s: float | None = None) -> bool:
        """MLX thread, once the prefetch is done: hold what it read where `find` sees it at once
        (RAM); the restore then reports the tier it came from. True once all of it is held; with
        `budget_s`, it may stop after about that long and return False (the next call goes on)."""

    def tick(self, drain: bool = False) -> None:
        """Once per engine step (MLX thread): finish what earlier offers started; `drain`: all of it
        (an idle engine, before a flush)."""

    def unwritten(self) -> int:
        """Entries RAM holds that the SSD has not taken yet (its writer takes them as it has room,
        at `tick`): a flush that must leave everything on disk ticks and flushes until this is 0."""

    def held_prefixes(self, limit: int = 256) -> list[Any]:
        """Token arrays of the most recently used entries (prefix-affinity routing reports them)."""

    def set_ram_budget(self, budget_bytes: int) -> None:
        """Resize the RAM tier at run time (the engine's memory account gives it what is free)."""

    def clear(self, tier: Literal["ram", "ssd", "all"] = "all") -> None:
        """Drop cached state of one tier or all (admin)."""

    def flush(self) -> None:
        """Wait until queued SSD writes are on disk. Safe from any thread."""

    def stats(self) -> dict[str, Any]:
        """Per-tier counters: queries/hits in tokens, entries, bytes, evictions, promotions..."""

    def close(self) -> None:
        """Flush pending writes and release resources."""


class NullStore:
    """No prefix caching: every lookup misses, offers are dropped."""

    def find(self, tokens: Sequence[int], salt: str = "", read_ssd: bool = True) -> Match | None:
        return None

    def restore(self, tokens: Sequence[int], match: Match | None, salt: str = "") -> Hit | None:
        return None

    def held(self, tokens: Sequence[int], salt: str = "") -> int:
        return 0

    def offer(self, tokens: Sequence[int], cache: list[Any], kind: OfferKind, salt: str = "", start: int = 0) -> None:
        return None

    def prefetch(self, match: Match | None, tokens: Sequence[int]) -> Any | None:
        return None

    def complete(self, prefetch: Any, budget_s: float | None = None) -> bool:
        return True

    def tick(self, drain: bool = False) -> None:
        return None

    def unwritten(self) -> int:
        return 0

    def held_prefixes(self, limit: int = 256) -> list[Any]:
        return []

    def set_ram_budget(self, budget_bytes: int) -> None:
        return None

    def clear(self, tier: Literal["ram", "ssd", "all"] = "all") -> None:
        return None

    def flush(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None
