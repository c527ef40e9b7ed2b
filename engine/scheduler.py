"""Admission policy: who waits, who runs next. Imports no MLX, so it is tested with no model at all.

The scheduler sees the running batch only through a `BatchView` of counts and the prefix store
only through its `find` (where a prompt's cached prefix is; no copy), and answers with a plan: the
requests to admit now, each with its cached prefix (looked up once, here) and its path. Admission
respects these limits:
- the cap on running sequences (`max_running`);
- the number of prompts in prefill at once (`prefill_batch`);
- a token budget over prompts in prefill (`max_batch_tokens`), always letting one prompt through so
  a prompt longer than the budget still runs (alone);
- length grouping: mlx-lm pads the chunks of prompts prefilled together to the longest chunk, so
  a short prompt joins a running prefill only when the padding is small, or when waiting for that
  prefill to end would cost more than the padding (it has more than two chunks left);
- on the CPU (wherever length grouping is on), a prompt with more than one chunk left to compute
  does not join a running prefill: a CPU prefills a token at the same cost alone or batched, so two
  long prompts prefilled together only delay the first one's first token (two cold 558-token
  prompts: both first tokens after 4.3 s, against 2.1 s and 4.3 s one after the other), and every
  step of a doubled prefill stalls the running decodes twice as long.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable

from cache_tiers.store import Match
from engine.config import EngineConfig, SchedulingPolicy
from engine.types import OverloadedError, Request, TokenEvent

Find = Callable[[tuple[int, ...], str], "Match | None"]  # (prompt tokens, cache salt)
# What a `Find` answers for a request whose cached prefix is being read from a slow tier (the
# engine's `_find`): it waits, and the requests behind it are considered in its place.
LOADING = Match(num_tokens=0, tier="ssd")

CPU_GROUP_RATIO = 2.0  # "auto" on the CPU backend: a prompt joins a prefill within this length ratio


def kv_footprint(tokens: int, window: int | None) -> int:
    """KV positions a sequence of `tokens` holds at most: all of them, or a ring's `window` (+1,
    the token being written) when its cache is bounded."""
    return tokens if window is None else min(tokens, window + 1)


@dataclass(frozen=True)
class BatchView:
    """What the scheduler needs to know about the running batch."""

    running: int = 0  # all admitted, unfinished sequences (prefilling + decoding)
    prefilling: int = 0
    prefill_tokens_left: int = 0  # prompt tokens still to prefill, summed
    prefill_min_left: int = 0  # the shortest remaining prompt among those prefilling
    prefill_max_left: int = 0
    kv_tokens_free: int | None = None  # None: no memory account; else tokens that may be reserved
    # Prompts being prefilled, and how many leading tokens a waiting prompt must share with one of
    # them to wait for its cached prefix instead of computing the same tokens again (None: no cache).
    prefilling_prompts: tuple[tuple[int, ...], ...] = ()
    share_tokens: int | None = None
    # Requests whose prompt is fully fed but whose first token has not come back yet: a newcomer's
    # prefill admitted now would run inside the steps they are waiting on.
    first_token_pending: int = 0
    # The most KV positions one sequence keeps (a bounded, rotating cache); None: all of them.
    kv_window: int | None = None


@dataclass(frozen=True)
class Admission:
    """One request to start now: where its cached prefix is, and which way its first token comes.

    `direct`: a long cached context with a short rest (a follow-up turn, a question on a shared
    document) is prefilled outside the batch and its first token sampled at once; anything else
    joins the batched prefill.
    """

    request: Request
    match: Match | None = None
    direct: bool = False


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan. `Scheduler.schedule` fills `admit`; the engine's own `schedule`
    (`Engine.schedule`) adds what only it knows of the step: the requests that ran out of time,
    and whether the batch runs this step at all."""

    admit: tuple[Admission, ...] = ()
    # The final events of requests past their deadline (`request_timeout_s`), checked at most every
    # `EXPIRY_CHECK_S`: they are aborted before the plan is made, so none of them is admitted or
    # counted in the batch the plan sees.
    expired: tuple[TokenEvent, ...] = ()
    # The batch does not run this step: a direct first-token admission just ran its prefill while
    # the batch waited, and prefix hits that arrived meanwhile join the batch before its next
    # decode step (at most `prefill_batch` such admissions in a row).
    batch_waits: bool = False

    @property
    def direct(self) -> bool:
        return any(a.direct for a in self.admit)


@dataclass(order=True)
class _Entry:
    key: tuple[int, float, int]
    request: Request = field(compare=False)


def group_ratio(config: EngineConfig, on_cpu: bool) -> float | None:
    ratio = config.prefill_group_ratio
    if ratio == "auto":
        return CPU_GROUP_RATIO if on_cpu else None
    return None if ratio is None else float(ratio)


class Scheduler:
    def __init__(self, config: EngineConfig, on_cpu: bool = True) -> None:
        config = self.config = config.for_backend(on_cpu)
        self.group_ratio = group_ratio(config, on_cpu)
        hold = config.first_token_first
        self.first_token_first = on_cpu if hold == "auto" else bool(hold)
        self.direct_limit = config.direct_first_token_limit(on_cpu)
        self._heap: list[_Entry] = []
        self._order = itertools.count()
        self._cancelled: set[str] = set()
        self._ids: set[str] = set()

    def __len__(self) -> int:
        return len(self._ids)

    def add_request(self, request: Request) -> None:
        """Queue `request`; refuse it when the waiting queue is full."""
        if len(self._ids) >= self.config.max_waiting:
            raise OverloadedError(
                f"The server is at capacity ({self.config.max_waiting} requests waiting). "
                "Retry after a short delay, or lower your request rate.",
                retry_after_s=1.0,
            )
        if request.request_id in self._ids:
            raise ValueError(f"request id {request.request_id!r} is already waiting")
        priority = request.priority if self.config.policy is SchedulingPolicy.PRIORITY else 0
        heapq.heappush(self._heap, _Entry((priority, request.arrival_time, next(self._order)), request))
        self._ids.add(request.request_id)

    def finish_requests(self, request_ids: set[str]) -> list[Request]:
        """Drop waiting requests (aborted or timed out); returns those that were waiting."""
        dropped = [e.request for e in self._heap if e.request.request_id in request_ids]
        for request in dropped:
            self._ids.discard(request.request_id)
            self._cancelled.add(request.request_id)
        return dropped

    def schedule(self, view: BatchView, find: Find | None = None) -> SchedulerOutput:
        """The requests to admit now, in queue order, each with its prefix match and path.
        `find` is asked at most once per request considered (never for one that stays queued
        behind a limit that does not depend on its cache)."""
        if view.first_token_pending and self.first_token_first:
            return SchedulerOutput()  # at most two short steps; newcomers then prefill together
        found: dict[str, Match | None] = {}

        def match(request: Request) -> Match | None:
            if request.request_id not in found:
                found[request.request_id] = find(request.prompt_tokens, request.cache_salt) if find is not None else None
            return found[request.request_id]

        admitted: list[Admission] = []
        running, prefilling = view.running, view.prefilling
        tokens, shortest, longest = view.prefill_tokens_left, view.prefill_min_left, view.prefill_max_left
        kv_free = view.kv_tokens_free
        in_prefill, deferred = list(view.prefilling_prompts), []
        while self._heap and running < self.config.max_running and prefilling < self.config.prefill_batch:
            head = self._heap[0].request
            if head.request_id in self._cancelled:
                heapq.heappop(self._heap)
                self._cancelled.discard(head.request_id)
                continue
            if (_shares_prefix(head.prompt_tokens, in_prefill, view.share_tokens)
                    and _usable(match(head)) < (view.share_tokens or 0)):
                deferred.append(heapq.heappop(self._heap))  # its prefix is cached when that prefill ends
                continue
            size = len(head.prompt_tokens)
            if prefilling and (not self._fits(size, tokens, shortest, longest)
                               or self._prefills_alone(size, lambda: _usable(match(head)))):
                break  # FCFS / priority order: the head waits rather than being overtaken
            reserve = kv_footprint(size + head.params.max_tokens, view.kv_window)
            if kv_free is not None and reserve > kv_free and running > 0:
                break  # not enough memory; running requests finishing will free it
            if match(head) is LOADING:
                deferred.append(heapq.heappop(self._heap))  # admitted once its prefix is read
                continue
            heapq.heappop(self._heap)
            self._ids.discard(head.request_id)
            admitted.append(Admission(head, match(head), self._direct(size, _usable(match(head)), idle=running == 0)))
            running, prefilling, tokens = running + 1, prefilling + 1, tokens + size
            shortest = size if shortest == 0 else min(shortest, size)
            longest = max(longest, size)
            in_prefill.append(head.prompt_tokens)
            if kv_free is not None:
                kv_free -= reserve
        for entry in deferred:
            heapq.heappush(self._heap, entry)
        return SchedulerOutput(tuple(admitted))

    def _direct(self, size: int, cached: int, idle: bool) -> bool:
        """A long cached context with a short rest. A hit on a short shared start (the chat
        template's system prompt) leaves a mostly new prompt: computed alone, its rest costs ~40%
        more per token on a CPU than in a batched prefill, and its own prefill dominates anyway.

        The rest's bound (`direct_limit`) protects running requests, whose decode steps wait out a
        direct prefill. With nobody running (an agent's next turn on a Mac serving one agent) any
        rest goes direct: the batch path would only add its chunk-by-chunk steps and a copy of the
        whole prompt's cache before the first token (a 300-800-token tool result on 4-8k cached
        tokens: seconds on a CPU)."""
        rest = size - cached
        if not self.direct_limit:
            return False  # the direct path is off
        return cached > 0 and cached >= rest and (rest <= self.direct_limit or idle)

    def _prefills_alone(self, size: int, cached: Callable[[], int]) -> bool:
        """A long prompt on the CPU: more than one chunk left once its cached prefix is counted."""
        if self.group_ratio is None:
            return False
        chunk = self.config.prefill_chunk
        if size <= chunk:
            return False
        return size - cached() > chunk

    def _fits(self, size: int, tokens: int, shortest: int, longest: int) -> bool:
        if tokens + size > self.config.max_batch_tokens:
            return False
        if self.group_ratio is None:
            return True
        chunk = self.config.prefill_chunk
        if longest > 2 * chunk:
            return True
        low = min(size, shortest or size, chunk)
        high = min(max(size, longest), chunk)
        return high <= self.group_ratio * max(low, 1)


def _usable(match: Match | None) -> int:
    return 0 if match is None else match.usable


def _shares_prefix(prompt: tuple[int, ...], others: list[tuple[int, ...]], share: int | None) -> bool:
    """Whether `prompt` starts with the same `share` tokens as a prompt being prefilled (and has
    more after them: an identical prompt still gains, since all but its last token are reused)."""
    if share is None or len(prompt) <= share:
        return False
    head = prompt[:share]
    return any(len(other) >= share and other[:share] == head for other in others)
