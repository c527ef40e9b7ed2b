"""Speculative decoding for the own step (engine/step/step_runner.py): what to propose, and how many.

Imports no MLX, so the policy is tested with no model at all.

A decoding row feeds its last token plus up to k proposed tokens in one forward; the step samples
every position with the request's own sampler and keeps the proposals up to the first one that
differs from what was sampled before it (`accepted`), plus that sample. For greedy requests that is
exact. For sampled ones it is the speculative-sampling rule for a point-mass proposal: accepting
proposal x when a draw y ~ p equals x happens with probability p(x), and otherwise the draw y is a
sample of p with x removed and renormalised (P(y = z | y != x) = p(z) / (1 - p(x))), so the output
has the distribution of sampling without speculation (tests/engine/test_speculative.py checks it with a
chi-squared test).

Proposals come from prompt lookup: the request's own prompt and output, indexed by the n-grams that
end at each position; the longest suffix n-gram seen before proposes the tokens that followed its
latest earlier occurrence. Agents re-emit what their context holds (a file in an edit, quoted code,
tool arguments), which this predicts with no second model.
"""

from __future__ import annotations

import logging
import statistics
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

log = logging.getLogger(__name__)

METHODS = ("prompt_lookup", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """`engine.speculative` as a mapping. `max_tokens`: most proposals a row verifies in a step;
    `ngram_max`/`ngram_min`: the suffix lengths prompt lookup matches, longest first;
    `draft_model`: the draft model's path (method "draft")."""

    method: str = "prompt_lookup"
    max_tokens: int = 8
    # A GPU's verifying step built before the step in flight is read back, on the guess that the
    # proposals that step verifies all stand (engine/step/step_runner.py `_chains`); false: a
    # verifying step reads the step in flight first. No effect on a CPU (its step runs as built).
    # False until the device measures it: each failed guess costs the row a step, against the overlap
    # a verifying step gives up (session 29 had no device time left for the A/B, docs/accelerators.md).
    chain: bool = False
    # 5, not 3: replayed over recorded greedy outputs (benchmarks/engine/spec_replay.py, session 26),
    # a longer match first lifts code edits 3.28 -> 3.55 tokens a step at one row on the CPU's
    # policy (3.83 -> 4.08 on the GPU's), the agent turns 2.34 -> 2.38, with fewer proposals made.
    ngram_max: int = 5
    ngram_min: int = 1
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"engine.speculative.method must be one of {METHODS}, got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError('engine.speculative: method "draft" needs draft_model (a model path), '
                             "and draft_model needs method draft")
        if self.max_tokens < 1:
            raise ValueError("engine.speculative.max_tokens must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("engine.speculative needs 1 <= ngram_min <= ngram_max")
        if not isinstance(self.chain, bool):
            raise ValueError("engine.speculative.chain must be true or false")


def parse_speculative(value: Any) -> "str | SpecConfig":
    """`off`, `auto` or a mapping (YAML) as the config keeps it: "off", "auto" or a SpecConfig."""
    if value is None or value is False or value == "off":
        return "off"
    if value == "auto":
        return "auto"
    if isinstance(value, SpecConfig):
        return value
    if isinstance(value, Mapping):
        return SpecConfig(**value)
    raise ValueError('engine.speculative must be "off", "auto" or a mapping (method, max_tokens, ...)')


# Where `auto` turns speculation on: only where it was measured to pay. Measured on the 2-core box
# (docs/measurements.md, issue 34): prompt lookup pays on the CPU for one stream (1.4-2.3x) and a few;
# past 4 decoding rows the step runner proposes nothing there (engine/step/backend.py,
# SPEC_MAX_ROWS_CPU). On the H200 (SmolLM2-135M-Instruct 4-bit as Pomona serves it, engine in
# process, `bash benchmarks/device/device_http.sh spec`, benchmarks/results/device-s17/): one
# decoding row gained on every workload (code-edit 3.00x, random text 1.26-1.60x, the agent
# session's turns 1.39x); at 8 rows code-edit 2.37x and random 1.23x but the agent turns lost
# (0.62x), and at 32 random text lost (0.80x). So on a GPU a step verifies only while the rows'
# expected acceptance pays for the slower, non-overlapped step, as timed there (`SpecGate`),
# whatever the rows (it was one row under `auto` until session 23).
AUTO_ON_CPU = True
AUTO_ON_GPU = True


def resolve(value: "str | SpecConfig", on_cpu: bool) -> SpecConfig | None:
    """The speculation a runner uses (None: off)."""
    if value == "off":
        return None
    if value == "auto":
        return SpecConfig() if (AUTO_ON_CPU if on_cpu else AUTO_ON_GPU) else None
    return value  # type: ignore[return-value]


def accepted(proposals: Sequence[int], sampled: Sequence[int]) -> int:
    """How many proposals stand: proposal j (fed at position j + 1) stands while the token sampled
    at position j equals it. `sampled` has one more entry than `proposals` (the last position's)."""
    n = 0
    while n < len(proposals) and sampled[n] == proposals[n]:
        n += 1
    return n


class PromptLookup:
    """An index of a request's tokens by the n-grams ending before each position: n-gram -> the
    position right after its latest occurrence. Built incrementally (`sync`), so a step costs a
    few dictionary operations per row, not a scan of the context.

    The first sync indexes a whole prompt, on the MLX thread (the step's first proposals for the
    row): an agent's 20k-token prompt took 21-28 ms in a Python loop on the 2-core box, a stall of
    the whole batch once per request. So n-grams of up to `PACKED_MAX_N` tokens are keyed by one
    integer (the ids packed `ID_BITS` apiece: exact, no hashing) and a long run of new positions is
    indexed with NumPy, the dictionary filled from two lists in C; longer n-grams keep tuple keys.
    Either way a key names its n-gram exactly, and the latest occurrence wins, as in a plain loop.
    """

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._next: dict[int, dict[Any, int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self._indexed = 0  # positions i whose preceding n-grams are in the index
        self._packed = True  # every id so far fits ID_BITS (else tuple keys from then on)

    def sync(self, tokens: Sequence[int]) -> None:
        """Index every position up to len(tokens) - 1: the n-grams ending at the last token are not
        indexed (its continuation is unknown), so a lookup of the suffix finds an earlier match."""
        start, end = max(self._indexed, 1), len(tokens)
        if end - start >= BULK_POSITIONS and self._packed:
            self._sync_bulk(tokens, start, end)
        else:
            for i in range(start, end):
                for n in range(self.ngram_min, min(self.ngram_max, i) + 1):
                    self._next[n][self._key(tokens, i - n, i)] = i
        self._indexed = max(self._indexed, end)

    def _sync_bulk(self, tokens: Sequence[int], start: int, end: int) -> None:
        lo = max(0, start - self.ngram_max)
        ids = np.asarray(tokens[lo:end], dtype=np.int64)
        if ids.size and (int(ids.max()) >> ID_BITS or int(ids.min()) < 0):
            self._repack()  # an id past ID_BITS: tuple keys for every n-gram from now on
            return self.sync(tokens)
        for n in range(self.ngram_min, self.ngram_max + 1):
            first = max(start, n)
            if first >= end:
                continue
            at = np.arange(first, end)
            if n <= PACKED_MAX_N:
                def packed(offset: int, count: int) -> list[int]:
                    keys = np.zeros(end - first, dtype=np.int64)
                    for j in range(count):
                        keys |= ids[at - n + offset + j - lo] << (ID_BITS * j)
                    return keys.tolist()
                head = packed(0, min(n, PER_WORD))
                keys: Any = head if n <= PER_WORD else zip(head, packed(PER_WORD, n - PER_WORD))
                self._next[n].update(zip(keys, at.tolist()))
            else:
                for i in at.tolist():
                    self._next[n][tuple(tokens[i - n:i])] = i

    def _key(self, tokens: Sequence[int], a: int, b: int) -> Any:
        """The key of tokens[a:b]: packed ids for n-grams up to PACKED_MAX_N while every id fits (one
        integer up to PER_WORD ids, a pair of them past it), else a tuple."""
        ids = tokens[a:b]
        if b - a > PACKED_MAX_N or not self._packed:
            return tuple(ids)
        if max(ids) >> ID_BITS or min(ids) < 0:
            self._repack()
            return tuple(ids)
        head = 0
        for j, t in enumerate(ids[:PER_WORD]):
            head |= t << (ID_BITS * j)
        if b - a <= PER_WORD:
            return head
        tail = 0
        for j, t in enumerate(ids[PER_WORD:]):
            tail |= t << (ID_BITS * j)
        return head, tail

    def _repack(self) -> None:
        """Packed keys back to tuples (an id too large to pack arrived): keeps every entry."""
        self._packed = False

        def ids(word: int, count: int) -> tuple[int, ...]:
            return tuple((word >> (ID_BITS * j)) & ID_MASK for j in range(count))
        for n, table in self._next.items():
            if n <= PER_WORD:
                self._next[n] = {ids(k, n): v for k, v in table.items()}
            elif n <= PACKED_MAX_N:
                self._next[n] = {ids(k[0], PER_WORD) + ids(k[1], n - PER_WORD): v for k, v in table.items()}

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix n-gram's latest earlier occurrence."""
        if k <= 0:
            return []
        self.sync(tokens)
        end = len(tokens)
        for n in range(min(self.ngram_max, end), self.ngram_min - 1, -1):
            at = self._next[n].get(self._key(tokens, end - n, end))
            if at is not None:
                return list(tokens[at:min(at + k, end)])
        return []

    def propose_ahead(self, tokens: Sequence[int], ahead: Sequence[int], k: int) -> list[int]:
        """`propose` for `tokens` followed by `ahead`, tokens the host only expects (proposals of a
        step not read back yet): matched and continued through, never indexed, since a guess that
        fails must leave no trace in the index."""
        if not ahead:
            return self.propose(tokens, k)
        if k <= 0:
            return []
        self.sync(tokens)
        known = len(tokens)
        tail = list(tokens[max(0, known - self.ngram_max):]) + list(ahead)
        for n in range(min(self.ngram_max, known + len(ahead)), self.ngram_min - 1, -1):
            at = self._next[n].get(self._key(tail, len(tail) - n, len(tail)))
            if at is not None:  # an indexed position: before the end of `tokens`
                out = list(tokens[at:min(at + k, known)])
                return out + list(ahead[:k - len(out)])
        return []


# Token ids packed per n-gram key: 21 bits (vocabularies up to 2M ids; the largest are ~260k), three of
# them in a 63-bit integer, n-grams of 4-6 ids as a pair of such integers (a pair of two list's items
# is made in C by `zip`; a tuple of the ids, sliced per position, took twice the time: 20k tokens at
# n-grams 1-5 indexed in 16 ms with tuples there). Longer n-grams use tuple keys.
ID_BITS = 21
ID_MASK = (1 << ID_BITS) - 1
PER_WORD = 3
PACKED_MAX_N = 2 * PER_WORD
BULK_POSITIONS = 64  # from this many new positions a sync goes through NumPy (a step adds 1-9)


class Adaptive:
    """How many tokens a row proposes, from its recent acceptance and what a proposal costs.

    `q` estimates the chance that a proposal stands given that the ones before it did (decayed
    counts of accepted and tried positions), so proposal j stands with chance q**j. The step gives a
    `floor`: the acceptance chance a proposed token needs to pay for the position it adds to the
    forward (engine/step/step_runner.py: on a CPU a position costs about what a decoding row does, so
    the floor rises with the batch; on a GPU a step's positions are nearly free). k is the largest
    j with q**j >= floor (at most `limit`); when q falls under the floor, proposals stop for
    `backoff` steps, doubling each time, then one probe. A request whose output is not in its
    context ends up at 0.

    `padded`: a verifying step computes `limit` positions for this row whatever it proposes (a
    GPU's step verifies every row in one forward of a fixed width, engine/step/backend.py), so
    proposing fewer saves the step nothing and backing off only loses tokens: k is the limit at
    every step, and `expected` (the gate's estimate of what the row adds) weighs all of them by q.
    Replayed over recorded greedy outputs at one row (benchmarks/engine/spec_replay.py, session 26)
    that is 2.34 -> 2.67 tokens a step on the agent turns and 3.29 -> 3.83 on code edits."""

    def __init__(self, limit: int, decay: float = 0.7, backoff: int = 8, max_backoff: int = 256,
                 padded: bool = False) -> None:
        self.limit = limit
        self.decay = decay
        self.padded = padded
        self._accepted, self._tried = 1.2, 2.0  # a prior of 0.6 worth two positions
        self._base_backoff = backoff
        self._backoff = backoff
        self._max_backoff = max_backoff
        self._wait = 0  # steps left without proposals
        self._probe = False
        # How often a lookup asked for proposals found some (decayed, a prior of one found in one):
        # a row whose context holds no match proposes nothing, so it adds nothing a step can expect.
        self._found, self._asked = 1.0, 1.0
        # How often all of a step's proposals stood (decayed, a prior of one in two): a step built
        # on that guess before this one is read (`expected_chained`) is lost for the row otherwise.
        self._full, self._verified = 1.0, 2.0

    @property
    def q(self) -> float:
        return self._accepted / self._tried

    @property
    def waiting(self) -> bool:
        return self._wait > 0

    def budget(self, floor: float = 0.0) -> int:
        """The k for this step (0 while backing off); counts a step."""
        if self.padded:
            return self.limit
        if self._wait > 0:
            self._wait -= 1
            self._probe = self._wait == 0
            return 0
        if self._probe:
            return 1
        k = self._k(floor)
        if k == 0:
            self._wait = self._backoff
            self._backoff = min(self._max_backoff, 2 * self._backoff)
        return k

    def _k(self, floor: float) -> int:
        q = self.q
        if q < max(floor, 1e-6):
            return 0
        k, chance = 1, q * q
        while k < self.limit and chance >= floor:
            k += 1
            chance *= q
        return k

    def expected(self, floor: float = 0.0) -> float:
        """The tokens this row's proposals would add to a step now, expected (no step counted):
        sum of q**j over the k it would propose, times how often its lookups find something."""
        if self._wait > 0:
            return 0.0
        q = self.q
        k = self.limit if self.padded else 1 if self._probe else self._k(floor)
        return (self._found / self._asked) * sum(q ** j for j in range(1, k + 1))

    def expected_chained(self, floor: float = 0.0) -> float:
        """`expected` where each verifying step is built on the guess that the one before it
        accepted all of the row's proposals (engine/step/step_runner.py `_chains`): when the guess
        fails (chance 1 - f) the row's part of the next step is dropped, so a step yields
        (1 + expected) / (2 - f) tokens of the row on average; what that adds over a plain step's
        one token (negative where chaining costs the row more than its proposals bring)."""
        return (1 + self.expected(floor)) / (2 - self._full / self._verified) - 1

    def record_lookup(self, found: bool) -> None:
        """A lookup for this row's proposals found some (or none)."""
        self._found = self.decay * self._found + found
        self._asked = self.decay * self._asked + 1

    def record(self, proposed: int, taken: int) -> None:
        if proposed <= 0:
            return
        tried = taken + (1 if taken < proposed else 0)
        self._accepted = self.decay * self._accepted + taken
        self._tried = self.decay * self._tried + tried
        self._full = self.decay * self._full + (taken == proposed)
        self._verified = self.decay * self._verified + 1
        if self._probe:
            self._probe = False
            if taken:  # the context pays again: the next back-off starts short
                self._backoff = self._base_backoff


class SpecGate:
    """Whether a step that verifies proposals pays for the overlap it gives up, from steps measured.

    Why: a row proposes once the host knows its last token, so a verifying step read the step in
    flight first and was built while the device waited (engine/step/step_runner.py `step`). Where
    the step is bound by the host building it (a GPU), a verifying step then cost up to two plain
    ones: on the H200 at 8 rows the agent turns' proposals (few accepted) lost 0.62-0.81x while code
    edits (most accepted) gained 2.37x (docs/accelerators.md). Chained (`SpecConfig.chain`) it keeps
    the overlap, but a row whose guess fails loses its next step (`Adaptive.expected_chained`), and
    a verifying step still computes more. So the runner times steps of both
    kinds by their decoding rows (per power-of-two bucket) and verifies while the tokens the rows'
    proposals are expected to add (`Adaptive.expected`, or `expected_chained`) pay for the slower step:
    (rows + expected) / verifying period >= rows / plain period. A kind timed fewer than
    `min_samples` times at a size is tried (a plain step first), and every `explore_every` declined
    steps one verifies anyway, so a period measured long ago under another load is measured again.

    A kind's period is the median of its last `window` steps, not a moving average: a GPU backend
    builds its kernels for a shape the first time it meets it, so the first verifying steps of each
    size can take many times a steady one, and an average would carry that for hundreds of steps
    while exploration adds one sample every `explore_every` (on the H100 in session 25 a single
    stream's code edits, verified at every step before the gate at 3.0x, gained 1.03x, the first
    workload that engine ran).
    """

    def __init__(self, explore_every: int = 64, window: int = 9, min_samples: int = 3) -> None:
        self.explore_every = explore_every
        self.min_samples = min_samples
        self._window = window
        self._periods: dict[tuple[bool, int], deque[float]] = {}  # (verifying, rows bucket) -> seconds
        self._declined = 0
        self.declined_steps = 0  # for the step report

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << (max(rows, 1) - 1).bit_length()

    def record(self, verifying: bool, rows: int, seconds: float) -> None:
        """One step's period (from the previous step's end to its own) of that kind."""
        key = (verifying, self.bucket(rows))
        self._periods.setdefault(key, deque(maxlen=self._window)).append(seconds)

    def period(self, verifying: bool, rows: int) -> float | None:
        """The kind's steady period at that size (None: timed fewer than `min_samples` times)."""
        seen = self._periods.get((verifying, self.bucket(rows)))
        if seen is None or len(seen) < self.min_samples:
            return None
        return statistics.median(seen)

    def report(self) -> dict[str, float]:
        """Each kind's period in ms by rows bucket ("plain/8", "verify/8"), for the step report."""
        return {f"{'verify' if verifying else 'plain'}/{rows}": round(1000 * statistics.median(seen), 3)
                for (verifying, rows), seen in sorted(self._periods.items()) if seen}

    def pays(self, rows: int, expected: float) -> bool:
        """Verify this step? `expected`: the tokens the rows' proposals should add."""
        if expected <= 0:
            return False
        plain, verify = self.period(False, rows), self.period(True, rows)
        if plain is None:
            return False  # time plain steps of this size first
        if verify is None or (rows + expected) * plain >= rows * verify:
            self._declined = 0
            return True
        self._declined += 1
        if self._declined >= self.explore_every:
            self._declined = 0
            return True
        self.declined_steps += 1
        return False


class PendingLookup:
    """A prompt's index while a worker thread builds it: proposes nothing until the index is ready,
    then is that index. Why: a long prompt's first sync is milliseconds of Python (7-9 ms for 20k
    tokens on the 2-core box) that would otherwise run on the MLX thread while the whole batch waits;
    the row meanwhile decodes as without speculation (the first token comes from the prefill anyway)."""

    def __init__(self, future: "Future[PromptLookup]", ngram_min: int, ngram_max: int) -> None:
        self._future = future
        self._shape = (ngram_min, ngram_max)
        self._index: PromptLookup | None = None

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        index = self._ready()
        return index.propose(tokens, k) if index is not None else []

    def propose_ahead(self, tokens: Sequence[int], ahead: Sequence[int], k: int) -> list[int]:
        index = self._ready()
        return index.propose_ahead(tokens, ahead, k) if index is not None else []

    def _ready(self) -> "PromptLookup | None":
        if self._index is None:
            if not self._future.done():
                return None
            try:
                self._index = self._future.result()
            except Exception:  # a fault of the index's build: index here instead, proposals are never wrong
                log.exception("prompt lookup: building a prompt's index failed; indexing it on the step")
                self._index = PromptLookup(*self._shape)
        return self._index


# Prompts from this many tokens get their index built off the MLX thread (`PendingLookup`); shorter
# ones are indexed at their first proposal (well under a millisecond), so they propose from the start.
BACKGROUND_INDEX_TOKENS = 2048
_indexer: ThreadPoolExecutor | None = None
_indexer_lock = threading.Lock()


def _index(ngram_min: int, ngram_max: int, tokens: list[int]) -> PromptLookup:
    lookup = PromptLookup(ngram_min, ngram_max)
    lookup.sync(tokens)
    return lookup


def _executor() -> ThreadPoolExecutor:
    """One worker per process, made on first use: indexes are built in arrival order (no MLX call)."""
    global _indexer
    with _indexer_lock:
        if _indexer is None:
            _indexer = ThreadPoolExecutor(1, thread_name_prefix="pomona-lookup-index")
        return _indexer


@dataclass
class SpecState:
    """One request's speculation: its lookup index, its k controller and its counters."""

    lookup: "PromptLookup | PendingLookup"
    adaptive: Adaptive
    proposed: int = 0  # tokens proposed and verified
    accepted: int = 0  # of those, accepted
    undo: list[Any] | None = None  # per position, what to restore when it is rejected (processor/sampler states)
    draft_cache: list[Any] | None = None  # method draft: the draft model's cache for this request
    draft_fed: list[int] | None = None  # the tokens that cache covers

    def stats(self) -> dict[str, int]:
        return {"spec_proposed_tokens": self.proposed, "spec_accepted_tokens": self.accepted}


def new_state(config: SpecConfig, *prompt: Sequence[int], padded: bool = False) -> SpecState:
    """A request's state; its prompt (the parts it starts from, in order) is indexed off the MLX
    thread when long. `padded`: the step verifies a row at a fixed width (`Adaptive`); a draft
    model's proposals cost a draft forward each, so they stay adaptive."""
    if sum(map(len, prompt)) >= BACKGROUND_INDEX_TOKENS and config.method == "prompt_lookup":
        tokens = [t for part in prompt for t in part]
        future = _executor().submit(_index, config.ngram_min, config.ngram_max, tokens)
        lookup: PromptLookup | PendingLookup = PendingLookup(future, config.ngram_min, config.ngram_max)
    else:
        lookup = PromptLookup(config.ngram_min, config.ngram_max)
    return SpecState(lookup, Adaptive(config.max_tokens, padded=padded and config.method == "prompt_lookup"))
