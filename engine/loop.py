"""The one MLX thread and the asyncio bridge to it.

Every MLX call (model loading, the batch step, cache copies) happens on one dedicated thread that
owns the `Engine`. Asyncio callers talk to it through a thread-safe command queue; the thread hands
each step's events back with one `call_soon_threadsafe` per event loop per step, so the cost of the
hand-off does not grow with the number of tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Callable

from cache_tiers.store import PrefixStore
from engine.config import EngineConfig
from engine.constraints import build_constraint
from engine.engine import Engine
from engine.restore_choice import rates_file
from engine.stats import ThreadTimes
from engine.text import ConsumerText, text_in_engine
from engine.types import (ContextLengthError, EngineClosedError, FinishReason, InvalidRequestError, Request,
                          SamplingParams, TokenEvent)

log = logging.getLogger("pomona.engine")

IDLE_WAIT_S = 0.5
# Idle with SSD writes still to hand over (more than the writer's backlog takes at once): the loop
# comes back this soon to hand over the next ones as the writer drains.
WRITE_WAIT_S = 0.02
CLOSED = "The server is shutting down; retry on another replica."
STATS_EVERY_S = 0.25


@dataclass(frozen=True)
class Loaded:
    """What the MLX thread needs to build an engine: produced by a loader on that thread."""

    model: Any
    tokenizer: Any
    context_length: int
    name: str
    fingerprint: str


Loader = Callable[[EngineConfig], Loaded]
StoreFactory = Callable[[EngineConfig, Loaded], PrefixStore]


def default_loader(config: EngineConfig) -> Loaded:
    from modelio.models import load_model, resolve_model

    loaded = load_model(resolve_model(config.model), config.dtype, config.cpu_fast_paths)
    return Loaded(loaded.model, loaded.tokenizer, loaded.context_length, config.model, loaded.fingerprint)


def default_store(config: EngineConfig, loaded: Loaded) -> PrefixStore:
    from cache_tiers.store import NullStore

    if not config.cache.enabled:
        return NullStore()
    from cache_tiers.factory import build_store
    from engine.mlx_settings import cuda_backend

    return build_store(config.cache, loaded.fingerprint, host_copies=cuda_backend())


class _Stream:
    """One request's mailbox on the asyncio side: what arrived since the consumer last took, and
    the future it waits on while nothing has.

    Not an `asyncio.Queue`: a step hands every running request one event, and what the consuming
    loop spends on each token runs in the interpreter the MLX thread shares (on a GPU that thread
    builds every step in Python). The queue's put and get machinery (a waiter deque, a loop check,
    a wakeup per item) was part of it: the engine worker's consumption of 128 streams took 15.0 us
    of its loop's CPU a token with the queue, 12.5-13.9 with this (the 2-core box, tiny model).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[Any] = []
        self.waiter: asyncio.Future | None = None

    def put(self, item: Any) -> None:
        """On `loop`'s thread."""
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> list[Any]:
        """Everything that arrived, at least one item (waits for it)."""
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class AsyncEngine:
    def __init__(self, config: EngineConfig, loader: Loader = default_loader,
                 store_factory: StoreFactory = default_store) -> None:
        self.config = config
        self._loader, self._store_factory = loader, store_factory
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        # Requests whose grammar compiles (not yet queued): id -> aborted meanwhile. The MLX thread
        # does not know them yet, so an abort is kept here and honoured when the compile ends.
        self._compiling: dict[str, bool] = {}
        self._lock = threading.Lock()
        self._ready = concurrent.futures.Future()
        self._stats: dict[str, Any] = {"ready": False}
        self._times = ThreadTimes()  # the MLX thread's own accounting (it alone writes it)
        self._closing = False
        self._stopped = False  # the MLX thread has gone: commands would never be answered
        self.tokenizer: Any = None
        self.context_length = 0
        self.model_name = config.model
        self._thread = threading.Thread(target=self._run, name="pomona-mlx", daemon=True)
        self._thread.start()

    # -- asyncio API --------------------------------------------------------------------------
    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(asyncio.wrap_future(self._ready), timeout)

    @property
    def ready(self) -> bool:
        return self._ready.done() and self._ready.exception() is None

    @property
    def alive(self) -> bool:
        """Ready and its MLX thread still running (a health check that costs nothing)."""
        return self.ready and self._thread.is_alive()

    def check(self, request: Request) -> None:
        """Refuse a request that can never run, before it is queued."""
        if self._closing:
            raise EngineClosedError(CLOSED)
        need = len(request.prompt_tokens) + request.params.max_tokens
        if self.context_length and need > self.context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {self.context_length} tokens, but the request "
                f"needs {need} ({len(request.prompt_tokens)} in the prompt + {request.params.max_tokens} "
                "for the completion). Shorten the prompt or lower max_tokens.")
        if request.params.max_tokens > self.config.max_tokens_limit:
            raise InvalidRequestError(f"max_tokens must be at most {self.config.max_tokens_limit} on this server")

    async def stream(self, request: Request, text: bool = True) -> AsyncIterator[list[TokenEvent]]:
        """Events in batches: everything available whenever the consumer asks (no added delay).

        Raises before the first batch if the request is refused (overload, context length, an
        invalid grammar: InvalidRequestError). Leaving the iteration early (a client disconnect)
        aborts the request in the engine.

        `text=False`: a request without stop strings comes as its tokens alone (empty text), for a
        caller that makes the text in another process (`ConsumerText`): the engine's own process
        (deployments/engine_worker.py) leaves it to the replica, so that detokenizing, about half
        of what that process's event loop spends on a token, holds no lock the MLX thread needs.
        """
        self.check(request)
        rid = request.request_id
        compiling = request.params.grammar is not None and request.constraint is None
        if compiling:
            with self._lock:
                if rid in self._streams or rid in self._compiling:
                    raise ValueError(f"request id {rid!r} is already in use")
                self._compiling[rid] = False
            try:
                request = await self._constrain(request)
            except BaseException:  # refused, or the caller left: nothing was queued
                with self._lock:
                    self._compiling.pop(rid, None)
                raise
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:  # leaving `_compiling` and queueing in one step: no abort falls between
            aborted = self._compiling.pop(rid, False) if compiling else False
            if not aborted:
                if self._stopped:  # a grammar compiled while the engine stopped
                    raise EngineClosedError(CLOSED)
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in use")
                self._streams[rid] = stream
                self._commands.put(("add", request))
        if aborted:  # aborted while its grammar compiled: it never runs
            yield [TokenEvent(rid, None, "", finish_reason=FinishReason.ABORT)]
            return
        # Requests without stop strings are detokenized here, on the caller's thread, not the MLX one.
        consumer = None if not text or text_in_engine(request.params.stop) \
            else ConsumerText(lambda: self.tokenizer.detokenizer)
        finished = False
        try:
            while not finished:
                batch = await stream.take()
                for item in batch:
                    if isinstance(item, BaseException):
                        raise item
                finished = batch[-1].finished
                yield batch if consumer is None else consumer.fill(batch)
        finally:
            if not finished:
                self.abort(request.request_id)
            with self._lock:
                self._streams.pop(request.request_id, None)

    async def _constrain(self, request: Request) -> Request:
        """Compile the request's grammar in a worker thread, so the MLX thread never waits for it."""
        await asyncio.wrap_future(self._ready)  # the tokenizer arrives with the model
        try:
            constraint = await asyncio.to_thread(build_constraint, self.tokenizer, request.params.grammar,
                                                 request.prompt_tokens)
        except ValueError as exc:  # llguidance refused the grammar (or this tokenizer): the request's
            raise InvalidRequestError(str(exc)) from exc
        return replace(request, constraint=constraint)

    async def generate(self, request: Request) -> AsyncIterator[TokenEvent]:
        async for batch in self.stream(request):
            for event in batch:
                yield event

    def abort(self, request_id: str) -> None:
        """Thread-safe; takes effect at the start of the next step, or, for a request whose grammar
        is still compiling, when the compile ends (it is then never queued)."""
        with self._lock:
            if request_id in self._compiling:
                self._compiling[request_id] = True
                return
        self._commands.put(("abort", request_id))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run `fn(engine)` on the MLX thread (cache administration, status) and await its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:  # the thread marks itself stopped under this lock, then answers what is queued
            if self._stopped:
                raise EngineClosedError(CLOSED)
            self._commands.put(("call", (fn, future)))
        return await asyncio.wrap_future(future)

    async def deep_reset(self) -> int:
        """Fail running requests, empty the prefix store, release MLX buffers; returns how many failed."""

        def reset(engine: Engine) -> int:
            events = engine.deep_reset()
            self._deliver(events)
            return len(events)

        return await self.call(reset)

    async def clear_cache(self, tier: str = "all") -> dict[str, Any]:
        """Empty one prefix-cache tier ("ram", "ssd" or "all"); returns the cache stats after."""
        if tier not in ("ram", "ssd", "all"):
            raise ValueError('tier must be "ram", "ssd" or "all"')

        def clear(engine: Engine) -> dict[str, Any]:
            engine.store.clear(tier)  # type: ignore[arg-type]
            return engine.store.stats()

        return await self.call(clear)

    async def ping(self) -> None:
        """Answered by the MLX thread between two steps: a dead or stuck thread never answers."""
        await self.call(lambda engine: None)

    async def cache_stats(self) -> dict[str, Any]:
        return await self.call(lambda engine: engine.store.stats())

    async def flush_cache(self) -> dict[str, Any]:
        """Wait until everything RAM holds is on disk too; returns the cache stats after. The waits
        run off the MLX thread (the store's `flush` is safe anywhere), so decoding goes on meanwhile;
        what the writer's bounded backlog could not take yet is handed over as it drains."""
        def hand_over(engine: Engine) -> tuple[Any, int]:
            engine.store.tick(drain=True)
            return engine.store, engine.store.unwritten()

        left, stalled = None, 0
        while stalled < 2:  # (twice no progress: the writer stopped)
            store, now = await self.call(hand_over)
            await asyncio.to_thread(store.flush)
            if now == 0:
                break
            stalled = stalled + 1 if left is not None and now >= left else 0
            left = now
        return await self.cache_stats()

    async def held_prefixes(self, limit: int) -> list[Any]:
        """Token arrays of the prefix store's most recently used entries (prefix-affinity routing)."""
        return await self.call(lambda engine: engine.store.held_prefixes(limit))

    async def requests_status(self) -> list[dict[str, Any]]:
        return await self.call(lambda engine: engine.running_status())

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    async def shutdown(self, drain_s: float = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to `drain_s`, then stop."""
        self._closing = True
        deadline = time.monotonic() + drain_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._commands.put(("stop", None))
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)
        if self._thread.is_alive():  # the process may end under it: say so rather than nothing
            log.warning("the engine's MLX thread did not stop within 30 s of the shutdown")

    # -- the MLX thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            engine = self._build()
        except BaseException as exc:  # report loading failures to every waiter
            log.exception("engine failed to start")
            self._ready.set_exception(exc)
            self._refuse_queued()
            return
        self._ready.set_result(None)
        last_stats = 0.0
        times = self._times
        while True:
            # Idle, or only waiting for SSD reads (their end posts a "wake"): block on commands.
            wait = IDLE_WAIT_S if not engine.store.unwritten() else WRITE_WAIT_S
            handled = self._handle_commands(engine, block=not engine.has_work() or engine.waiting_on_loads(), wait=wait)
            if handled is None:
                break
            t0, cpu0 = time.perf_counter(), time.thread_time()
            events = engine.step() if engine.has_work() else []
            t1 = time.perf_counter()
            times.step += t1 - t0
            times.step_cpu += time.thread_time() - cpu0
            # Publish before delivering final events, so a caller who saw its request end also
            # sees the counters that include it.
            if handled or time.monotonic() - last_stats > STATS_EVERY_S or any(e.finished for e in events):
                self._publish_stats(engine)
                last_stats = time.monotonic()
            self._deliver(events)
            times.deliver += time.perf_counter() - t1
            if not engine.has_work():
                engine.idle()
        for request_id in list(engine.seqs):
            self._deliver(engine.abort_request(request_id, FinishReason.ABORT, CLOSED, code="shutdown"))
        self._refuse_queued()
        engine.close()  # after the refusals: the SSD flush may take a while

    def _refuse_queued(self) -> None:
        """Stop taking commands and fail the ones still queued (behind the stop, or sent while the
        engine was loading and failed): their callers would otherwise wait forever."""
        with self._lock:
            self._stopped = True
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._post(arg.request_id, EngineClosedError(CLOSED))
            elif kind == "call" and arg[1].set_running_or_notify_cancel():
                arg[1].set_exception(EngineClosedError(CLOSED))

    def _build(self) -> Engine:
        loaded = self._loader(self.config)
        self.tokenizer, self.context_length, self.model_name = loaded.tokenizer, loaded.context_length, loaded.name
        if self.config.max_model_len:
            self.context_length = min(self.context_length, self.config.max_model_len)
        store = self._store_factory(self.config, loaded)
        rates = rates_file(self.config.cache.ssd_dir, loaded.fingerprint) if self.config.cache.enabled else None
        engine = Engine(loaded.model, loaded.tokenizer, self.config, store, consumer_text=True, rates_path=rates)
        engine.wake = lambda: self._commands.put(("wake", None))
        self._warm_up(engine)
        self._publish_stats(engine)
        return engine

    def _warm_up(self, engine: Engine) -> None:
        """Prefill the configured prompts so that the first real request already hits the cache."""
        for i, prompt in enumerate(self.config.warmup_prompts):
            tokens = tuple(self.tokenizer.encode(prompt))
            engine.add_request(Request(tokens, SamplingParams(max_tokens=1, temperature=0.0),
                                       request_id=f"warmup-{i}"))
            while engine.has_work():
                engine.step()

    def _handle_commands(self, engine: Engine, block: bool, wait: float = IDLE_WAIT_S) -> int | None:
        """Handle queued commands (waiting up to `wait` s for one if `block`); returns how many, or
        None when told to stop."""
        try:
            command = self._commands.get(timeout=wait) if block else self._commands.get_nowait()
        except queue.Empty:
            return 0
        handled = 0
        while True:
            kind, arg = command
            if kind == "stop":
                return None
            started = time.perf_counter()
            self._handle(engine, kind, arg)
            self._times.commands += time.perf_counter() - started
            handled += 1
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return handled

    def _handle(self, engine: Engine, kind: str, arg: Any) -> None:
        if kind == "add":
            try:
                engine.add_request(arg)
            except Exception as exc:
                self._post(arg.request_id, exc)
        elif kind == "abort":
            self._deliver(engine.abort_request(arg))
        elif kind == "wake":
            pass  # a prefix read ended: the loop steps now and takes it
        elif kind == "call":
            fn, future = arg
            # A caller that timed out (the health probe, 20 s, behind a long step) has cancelled its
            # future: setting a result then raises InvalidStateError, which killed the MLX thread.
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(engine)
            except Exception as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _post(self, request_id: str, item: Any) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.put, item)

    def _deliver(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, TokenEvent]]] = {}
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed; its requests are gone
                pass

    def _publish_stats(self, engine: Engine) -> None:
        self._stats = {**engine.status(), "ready": True, "model": self.model_name,
                       "mlx_thread_seconds": self._times.as_dict()}


def _put_all(items: list[tuple[_Stream, TokenEvent]]) -> None:
    for stream, event in items:
        stream.put(event)
