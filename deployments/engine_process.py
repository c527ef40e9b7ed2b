"""`AsyncEngine`'s interface, with the engine in a child process (deployments/engine_worker.py).

`EngineHost` takes this in place of an in-process `AsyncEngine` (serve_config.yaml's
`engine_process: true`): requests, aborts, administration and stats cross a Unix socket
(deployments/engine_ipc.py), and the MLX thread no longer shares an interpreter with Ray Serve's
threads. Everything the replica gave before still holds: refusals raise the same exceptions before
the first event, and an engine that dies ends every open request with an error event and fails the
health check, so Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Any, AsyncIterator

from api.core.wire import event_from_wire, sampling_to_wire
from deployments.engine_ipc import config_to_wire, pack, receive, refusal_from_wire
from engine.config import EngineConfig
from engine.loop import CLOSED
from engine.text import ConsumerText, text_in_engine
from engine.types import EngineClosedError, FinishReason, Request, TokenEvent

log = logging.getLogger("pomona.engine_process")

START_TIMEOUT_S = 60.0  # from spawn to the worker's connection (imports; the model loads after it)
STOP_TIMEOUT_S = 30.0
GONE = "The engine is not running on this replica; retry the request (the server replaces the replica)."


class EngineProcess:
    """Spawns the worker at once; `wait_ready` connects, sends the settings and waits for the model."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_name = config.model
        self.context_length = 0
        self._dir = tempfile.mkdtemp(prefix="pomona-engine-")  # 0700: only this user reaches the socket
        path = os.path.join(self._dir, "engine.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(1)
        self._listener.setblocking(False)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        # Spawned, never forked: a forked child of a process that loaded OpenBLAS can deadlock.
        self.process = subprocess.Popen([sys.executable, "-m", "deployments.engine_worker", path],
                                        env=env, stdin=subprocess.DEVNULL)
        self._writer: asyncio.StreamWriter | None = None
        self._outbox: list[bytes] = []  # frames of this loop pass, written together (`_send`)
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats: dict[str, Any] = {"ready": False}
        self._started: asyncio.Task | None = None
        self._reader_task: asyncio.Task | None = None
        self._ready = False
        self._openblas: bool | None = None
        self._process_info: dict[str, Any] = {}  # what the worker said of its process, for stats()
        self._tokenizer: Any = None  # the model's tokenizer, for the text of requests without stop strings
        self._gone: str | None = None  # why the worker is gone, once it is
        self._closing = False  # shutdown() was called: refusals say the server is shutting down

    # -- start --------------------------------------------------------------------------------
    async def wait_ready(self, timeout: float | None = None) -> None:
        if self._started is None:
            self._started = asyncio.ensure_future(self._start())
        await asyncio.wait_for(asyncio.shield(self._started), timeout)

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        try:
            while True:  # short waits: a worker that dies before connecting is reported at once
                try:
                    conn, _ = await asyncio.wait_for(loop.sock_accept(self._listener), 0.5)
                    break
                except asyncio.TimeoutError:
                    if self.process.poll() is not None or loop.time() > deadline:
                        self._gone = (f"the engine process did not start (exit code {self.process.poll()}); "
                                      "see the replica's log")
                        raise RuntimeError(self._gone) from None
        finally:
            self._listener.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=conn)
        self._writer.write(pack(["config", config_to_wire(self.config)]))
        answer = await receive(reader)
        if not answer or answer[0] != "ready":
            why = answer[1] if answer else f"it exited with code {await asyncio.to_thread(self.process.wait)}"
            self._gone = f"the engine failed to start: {why}"
            raise RuntimeError(self._gone)
        info = answer[1]
        # The text of requests without stop strings is made here, not in the engine's process (see
        # `stream`): the tokenizer alone, once the engine has the model (a hub model is local by then).
        from modelio.models import tokenizer_for

        self._tokenizer = await asyncio.to_thread(tokenizer_for, self.config.model)
        self.model_name, self.context_length = info["model_name"], info["context_length"]
        self._openblas = info.get("openblas")  # OpenBLAS preloaded in the engine's process (Linux)
        self._process_info = {"openblas": self._openblas, "engine_switch_interval_ms": info.get("switch_interval_ms")}
        self._stats = {"ready": True, "model": self.model_name, "engine_pid": info.get("pid"), **self._process_info}
        self._ready = True
        self._reader_task = asyncio.create_task(self._read(reader))

    @property
    def ready(self) -> bool:
        """Loaded, and not lost (a worker stopped by `shutdown` still counts, as AsyncEngine's does:
        the replica answers "shutting down" then, not "loading")."""
        return self._ready and (self._gone is None or self._closing)

    @property
    def alive(self) -> bool:
        return self.ready and self.process.poll() is None

    # -- requests -----------------------------------------------------------------------------
    async def stream(self, request: Request, text: bool = True) -> AsyncIterator[list[TokenEvent]]:
        """As `AsyncEngine.stream`: batches of events, refusals raised before the first.

        A request without stop strings comes from the engine's process as tokens alone and gets its
        text here (`ConsumerText`, as `AsyncEngine.stream` makes it in process): detokenizing is
        about half of what that process's event loop spent on a token, in the interpreter whose
        MLX thread builds the steps (benchmarks/engine/worker_cost.py); this process has no MLX
        thread. A request with stop strings has its text made by the engine, which ends it there.
        `text=False` leaves a request without stop strings as tokens alone here too.
        """
        if self._gone is not None or self._writer is None or self._closing:
            raise self._closed()
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        consumer = None if not text or text_in_engine(request.params.stop) \
            else ConsumerText(lambda: self._tokenizer.detokenizer)
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = queue
        self._send(["add", rid, list(request.prompt_tokens), sampling_to_wire(request.params), request.priority,
                    request.cache_salt])
        finished = False
        try:
            while not finished:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                batch: list[TokenEvent] = []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    batch.extend(item)
                finished = bool(batch) and batch[-1].finished
                yield batch if consumer is None else consumer.fill(batch)
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self.abort(rid)

    async def generate(self, request: Request) -> AsyncIterator[TokenEvent]:
        async for batch in self.stream(request):
            for event in batch:
                yield event

    def abort(self, request_id: str) -> None:
        if self._gone is None and self._writer is not None:
            self._send(["abort", request_id])

    def _send(self, message: list[Any]) -> None:
        """Frames sent in one pass of the event loop leave in one write, after it.

        Requests that one step's endings set free (each client's next request; a closed loop's)
        are sent in one pass, and should reach the MLX thread together, as they do with the
        engine in process: mlx-lm's BatchGenerator lets prompts join the running batch in groups,
        each group a prefill pass and a merge. Written frame by frame, they reached the worker
        over several reads of its event loop, which waits for the GIL behind the MLX thread, and
        a step boundary could fall between them: on the H200 at 128 concurrent (1B model) they
        reached the MLX thread in twice as many command batches as in process, twice as many
        prompt groups joined the batch, and a step took 1.7x as long
        (benchmarks/results/accelerators-http-runs.md, session 14).
        """
        assert self._writer is not None
        self._outbox.append(pack(message))
        if len(self._outbox) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._flush)
            except RuntimeError:  # no event loop running here: write now
                self._flush()

    def _flush(self) -> None:
        data, self._outbox = b"".join(self._outbox), []
        if data and self._writer is not None and not self._writer.is_closing():
            self._writer.write(data)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        """Dispatch the worker's frames until its socket ends; then fail whatever is still open."""
        try:
            while (message := await receive(reader)) is not None:
                self._dispatch(message)
        except Exception:  # a frame we cannot read: the two sides disagree, so stop the worker
            log.exception("reading the engine process's frames failed; stopping it")
            self.process.kill()
        code = await asyncio.to_thread(self.process.wait)
        self._lost(f"the engine process exited (code {code})")

    def _dispatch(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "events":
            for rid, wires in message[1].items():
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait([event_from_wire(rid, w) for w in wires])
        elif kind == "stats":
            self._stats = {**message[1], **self._process_info, "engine_pid": self.process.pid}
        elif kind == "refused":
            queue = self._streams.get(message[1])
            if queue is not None:
                queue.put_nowait(refusal_from_wire(*message[2:]))
        elif kind == "reply":
            future = self._calls.pop(message[1], None)
            if future is not None and not future.done():
                _, _, ok, value = message
                future.set_result(value) if ok else future.set_exception(refusal_from_wire(*value))
        else:
            raise ValueError(f"unknown frame {kind!r} from the engine process")

    def _lost(self, why: str) -> None:
        """Every open request ends with an error event; every pending call fails; health checks fail."""
        if self._gone is None:
            self._gone = why
            if why and not why.endswith("(code 0)"):
                log.error("%s: failing %d open requests", why, len(self._streams))
        for rid, queue in self._streams.items():
            queue.put_nowait([TokenEvent(rid, None, "", finish_reason=FinishReason.ERROR, error_code="internal_error",
                                         error=f"{why[0].upper()}{why[1:]}; retry the request.")])
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self._closed())
        self._calls.clear()

    def _closed(self) -> EngineClosedError:
        return EngineClosedError(CLOSED if self._closing else GONE)

    # -- administration -----------------------------------------------------------------------
    async def _call(self, name: str, *args: Any) -> Any:
        if self._gone is not None or self._writer is None:
            raise self._closed()
        call_id = next(self._call_ids)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = future
        self._send(["call", call_id, name, list(args)])
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    async def ping(self) -> None:
        await self._call("ping")

    async def deep_reset(self) -> int:
        return await self._call("deep_reset")

    async def clear_cache(self, tier: str = "all") -> dict[str, Any]:
        if tier not in ("ram", "ssd", "all"):
            raise ValueError('tier must be "ram", "ssd" or "all"')
        return await self._call("clear_cache", tier)

    async def cache_stats(self) -> dict[str, Any]:
        return await self._call("cache_stats")

    async def flush_cache(self) -> dict[str, Any]:
        return await self._call("flush_cache")

    async def held_prefixes(self, limit: int) -> list[Any]:
        return await self._call("held_prefixes", limit)

    async def requests_status(self) -> list[dict[str, Any]]:
        return await self._call("requests_status")

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)

    async def shutdown(self, drain_s: float = 0.0) -> None:
        """Drain and stop the engine there, then close the socket (the worker exits at its end)."""
        if self._closing:
            return
        try:
            if self._gone is None and self._writer is not None:
                call = asyncio.ensure_future(self._call("shutdown", drain_s))
                self._closing = True  # after the call is sent: refuse new requests here from now on
                await asyncio.wait_for(call, drain_s + STOP_TIMEOUT_S)
        except (EngineClosedError, asyncio.TimeoutError, ConnectionError) as exc:
            log.warning("engine process shutdown: %s", exc or type(exc).__name__)
        finally:
            if self._writer is not None:
                self._flush()
                self._writer.close()
            await asyncio.to_thread(self._reap)
            shutil.rmtree(self._dir, ignore_errors=True)

    def _reap(self) -> None:
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit in %.0f s: killing it", STOP_TIMEOUT_S)
            self.process.kill()
            self.process.wait()
