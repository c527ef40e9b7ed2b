"""Hosts an `AsyncEngine` behind a plain-data interface (no Ray): what the LLM server deployment exposes.

The data crossing to the ingress is api/core/wire.py's format: rejections, lists of events, sampling dicts.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from api.core.wire import event_to_wire, rejection, request_from_wire
from engine.client import EngineClient
from engine.config import EngineConfig
from engine.types import ContextLengthError, EngineClosedError, InvalidRequestError, OverloadedError
from modelio.models import openblas_loaded

log = logging.getLogger("pomona.llm_server")

HEALTH_PROBE_TIMEOUT_S = 20.0  # longer than the slowest bounded step (one prefill chunk)
# Ray Serve's proxy -> ingress -> replica path carries about 1,300-2,600 stream items/s in all
# (benchmarks/device/token_path.py), whatever each item holds; a replica stepping 128 requests every 12 ms
# would need 10,000. Below this budget nothing waits; above it each stream sends fewer, fuller items.
DEFAULT_STREAM_ITEMS_PER_S = 1000.0
MAX_PACING_INTERVAL_S = 0.2  # the most any token waits for company, however many streams run
CHANNEL_IDLE_S = 5.0  # a step channel with no request for this long ends (Serve's drain waits for it)
CHANNEL_GATHER_S = 0.001  # after the first event of a step, let the other requests' events join the item


class Outbox:
    """Events for one ingress replica's step channel, gathered between the channel's sends.

    Each request's pump puts its events here; the channel takes everything at once, so an engine
    step that advanced 128 requests becomes one Ray item, not 128 (deployments/channels.py reads it).
    """

    def __init__(self) -> None:
        self.pending: dict[str, list[dict[str, Any]]] = {}
        self.ready = asyncio.Event()
        self.open = 0  # requests of this ingress running here
        self.generation = 0  # a newer subscription replaces an older one (the ingress re-subscribed)

    def put(self, request_id: str, events: list[dict[str, Any]]) -> None:
        self.pending.setdefault(request_id, []).extend(events)
        self.ready.set()

    def take(self) -> dict[str, list[dict[str, Any]]]:
        out, self.pending = self.pending, {}
        self.ready.clear()
        return out


@dataclass(frozen=True)
class StreamPacing:
    """How often one stream may send an item: by time (every `steps` engine steps), and optionally
    within a replica-wide budget of items per second.

    Each stream sends at most one item every `interval(active, step_s)` seconds, carrying every
    token made meanwhile. By time, a client sees its new tokens within `steps` steps however many
    streams run: at 128 streams on a 25 ms step, one item per stream every 50 ms. The budget
    (`items_per_s`, all streams together) was the rule before: it let each of 128 streams send every
    128 ms, five steps (H200, 1B: chunk gap p50 128 ms against a 25 ms step; issue 35), so it is
    off by default and stays for a host whose Serve proxy cannot carry a stream per two steps.
    Both 0: no pacing, one item per engine step per request, as fast as the engine makes them.
    """

    items_per_s: float = DEFAULT_STREAM_ITEMS_PER_S
    max_interval_s: float = MAX_PACING_INTERVAL_S
    steps: float = 0.0

    def interval(self, active: int, step_s: float | None = None) -> float:
        """The wait between one stream's items; `step_s`: the engine's step time as the stream
        sees it (None before it is known: no time rule yet)."""
        by_time = self.steps * step_s if self.steps > 0 and step_s else 0.0
        by_budget = max(active, 1) / self.items_per_s if self.items_per_s > 0 else 0.0
        return min(max(by_time, by_budget), self.max_interval_s)


class StepClock:
    """The time between a replica's engine steps, as seen where their events arrive: an average of
    the gaps between arrivals, gaps longer than `idle_s` (the engine was idle) left out."""

    def __init__(self, idle_s: float = 0.5) -> None:
        self.idle_s = idle_s
        self.step_s: float | None = None
        self._last: float | None = None

    def tick(self, now: float) -> None:
        if self._last is not None and 0 < now - self._last < self.idle_s:
            gap = now - self._last
            self.step_s = gap if self.step_s is None else 0.8 * self.step_s + 0.2 * gap
        self._last = now


class EngineHost:
    """The engine plus the conversions around it; one per LLM server replica."""

    def __init__(self, config: EngineConfig, engine_factory: Callable[[EngineConfig], EngineClient] | None = None,
                 pacing: StreamPacing = StreamPacing(), replica_key: str = "", process: bool = False) -> None:
        """`process`: the engine in its own process (deployments/engine_process.py), else in this one."""
        if engine_factory is None:
            if process:
                from deployments.engine_process import EngineProcess as engine_factory
            else:
                from engine.loop import AsyncEngine as engine_factory
        self.config = config
        self.engine: EngineClient = engine_factory(config)
        self.pacing = pacing
        self._active = 0  # streams between their first event and their end: they share the budget
        self.replica_key = replica_key  # what a step channel names to reach this replica
        self._outboxes: dict[str, Outbox] = {}
        self._closed = False  # shut down: channels end once their requests have
        self.items: collections.Counter[str] = collections.Counter()  # Ray stream items sent, by kind

    @property
    def active_streams(self) -> int:
        """Streams running now: they share the pacing budget."""
        return self._active

    async def start(self) -> None:
        await self.engine.wait_ready()
        blas = self.engine.stats().get("openblas", openblas_loaded())  # the engine's process, if its own
        if blas is False:
            log.warning("OpenBLAS is not preloaded in this process: MLX on the Linux CPU runs ~15x slower. "
                        "Install libopenblas0-pthread and keep blas_preload: auto in serve_config.yaml.")
        log.info("engine ready: model=%s context=%d OMP_NUM_THREADS=%s openblas=%s", self.engine.model_name,
                 self.engine.context_length, os.environ.get("OMP_NUM_THREADS"), blas)

    def info(self) -> dict[str, Any]:
        if not self.engine.ready:
            raise RuntimeError("the engine is still loading")
        return {"model": self.engine.model_name, "context_length": self.engine.context_length,
                "max_tokens_limit": self.config.max_tokens_limit,
                "default_max_tokens": self.config.default_max_tokens, "pid": os.getpid()}

    async def stream(self, prompt_tokens: Sequence[int], params: Mapping[str, Any],
                     request_id: str, channel: str | None = None) -> AsyncIterator[Any]:
        """Yield everything available, paced by `self.pacing`; abort when the consumer leaves.

        The engine's `stream` coalesces: asked for its next batch, it returns every event made
        since the last ask. A Ray streaming `yield` returns at once, so unpaced, each engine step
        becomes one item per request. Pacing waits out the stream's interval before asking again,
        so the events of the steps in between travel as one item. The first batch never waits.

        With `channel` (an ingress replica's key), only the first batch is yielded here, as
        `{"replica": key, "events": [...]}`; the rest goes to that ingress's step channel
        (`channel()`), and this stream stays open until the request ends: Serve still counts,
        routes and cancels it as one request.
        """
        try:
            request = request_from_wire(prompt_tokens, params, request_id)
        except ValueError as exc:
            yield rejection(exc)
            return
        batches = self.engine.stream(request)
        self._active += 1
        try:
            try:
                first = await batches.__anext__()
            except (OverloadedError, ContextLengthError, EngineClosedError, InvalidRequestError) as exc:
                # Only the engine's refusals are the client's; any other exception is ours and
                # propagates (the ingress answers 500, never a 400 for our own fault).
                yield rejection(exc)
                return
            wire = [event_to_wire(e) for e in first]
            finished = bool(first) and first[-1].finished
            self.items["request"] += 1
            if channel is None:
                yield wire
                if not finished:
                    async for item in self._paced(batches):
                        self.items["request"] += 1
                        yield item
            else:
                yield {"replica": self.replica_key, "events": wire}
                if not finished:
                    await self._pump(batches, request_id, channel)
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away (Ray Serve cancels this generator): free the slot at the next step.
            self.engine.abort(request_id)
            raise
        finally:
            self._active -= 1
            await _close_quietly(batches)

    async def _paced(self, batches: AsyncIterator[Any]) -> AsyncIterator[list[dict[str, Any]]]:
        sent = time.monotonic()
        while True:
            wait = sent + self.pacing.interval(self._active, self._step_s()) - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                batch = await batches.__anext__()
            except StopAsyncIteration:
                return
            sent = time.monotonic()
            yield [event_to_wire(e) for e in batch]
            if batch and batch[-1].finished:
                return

    def _step_s(self) -> float | None:
        """The engine's own step time (its stats' moving average), for the per-request path."""
        ms = self.engine.stats().get("step_time_ms") if hasattr(self.engine, "stats") else None
        return ms / 1000.0 if isinstance(ms, (int, float)) and ms > 0 else None

    async def _pump(self, batches: AsyncIterator[Any], request_id: str, channel: str) -> None:
        """The request's events into its ingress's outbox, until its last one is there."""
        box = self._outboxes.setdefault(channel, Outbox())
        box.open += 1
        completed = False
        try:
            async for batch in batches:
                box.put(request_id, [event_to_wire(e) for e in batch])
                if batch and batch[-1].finished:
                    completed = True
                    return
        finally:
            box.open -= 1
            if not completed:
                box.pending.pop(request_id, None)  # cancelled: nobody reads these
            if box.open == 0 and not box.pending and box.generation == 0:
                self._outboxes.pop(channel, None)  # never subscribed (its ingress is gone)

    async def channel(self, key: str, replica: str) -> AsyncIterator[dict[str, Any]]:
        """One ingress replica's step channel: `{request_id: events}` per engine step, for every
        request that ingress runs here. Ends after `CHANNEL_IDLE_S` without requests (or at once
        once the engine is closed), and when a newer subscription of the same key replaces it.
        A channel meant for another replica (the one named died) says so and ends."""
        if replica != self.replica_key:
            yield {"wrong_replica": self.replica_key}
            return
        box = self._outboxes.setdefault(key, Outbox())
        box.generation += 1
        mine = box.generation
        try:
            while box.generation == mine:
                if not box.pending:
                    if box.open == 0 and self._closed:
                        return
                    try:
                        await asyncio.wait_for(box.ready.wait(), CHANNEL_IDLE_S)
                    except asyncio.TimeoutError:
                        if box.open == 0 and not box.pending:
                            return
                        continue
                    box.ready.clear()  # a put from here on sets it again; take() gets that one too
                    if box.open > 1:  # others of this step may follow: one item for all of them
                        await asyncio.sleep(CHANNEL_GATHER_S)
                if box.generation == mine and box.pending:
                    self.items["channel"] += 1
                    yield box.take()
        finally:
            if box.generation == mine and box.open == 0 and not box.pending:
                self._outboxes.pop(key, None)

    async def routing_stats(self) -> dict[str, Any]:
        """Published to request routers (fleet/router.py): load, and the prefix blocks held."""
        stats = self.engine.stats()
        return {"waiting": int(stats.get("waiting", 0)), "running": int(stats.get("running", 0)),
                "block_size": self.config.cache.block_size, "prefix_blocks": await self.prefix_blocks()}

    async def prefix_blocks(self) -> list[str]:
        """Block hashes (fleet/keys.py) of what the prefix store's RAM tier holds.
        The store lives on the MLX thread, so its entries are listed there; hashing runs here."""
        from fleet.keys import MAX_REPORTED_ENTRIES, held_hashes

        if not self.engine.ready:
            return []  # still loading
        entries = await self.engine.held_prefixes(MAX_REPORTED_ENTRIES)
        return held_hashes(entries, self.config.cache.block_size)

    def stats(self) -> dict[str, Any]:
        stats = self.engine.stats()
        if "openblas" not in stats:  # the engine's own process says so; else this one's (reads /proc: not per call)
            stats["openblas"] = openblas_loaded()
        stats["stream_items"] = {"request": self.items["request"], "channel": self.items["channel"]}
        return stats

    async def check_health(self) -> None:
        """Raise unless the engine is loaded and its MLX thread answers (a dead thread never does)."""
        if not self.engine.ready:
            raise RuntimeError("the engine is not ready")
        await asyncio.wait_for(self.engine.ping(), HEALTH_PROBE_TIMEOUT_S)

    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]:
        """Status and cache administration for api/service/admin.py; tagged with this replica's pid."""
        engine = self.engine
        if action == "requests":
            result: dict[str, Any] = {"requests": await engine.requests_status()}
        elif action == "cache":
            result = {"cache": await engine.cache_stats()}
        elif action == "clear":
            result = {"cache": await engine.clear_cache(tier)}
        elif action == "flush":
            result = {"cache": await engine.flush_cache()}
        elif action == "reset":
            result = {"failed_requests": await engine.deep_reset()}
        else:
            raise ValueError(f"unknown admin action {action!r}")
        # engine_pid: the engine's own process (engine_process: true), else this replica's
        engine_pid = self.engine.stats().get("engine_pid", os.getpid())
        return {"replica": {"pid": os.getpid(), "host": socket.gethostname(), "engine_pid": engine_pid}, **result}

    async def shutdown(self, drain_s: float) -> None:
        try:
            await self.engine.shutdown(drain_s=drain_s)
        finally:
            self._closed = True
            for box in self._outboxes.values():
                box.ready.set()  # wake idle channels: they end now, not CHANNEL_IDLE_S later


async def _close_quietly(gen: Any) -> None:
    try:
        await gen.aclose()
    except (RuntimeError, asyncio.CancelledError):  # already running/closed elsewhere
        pass
