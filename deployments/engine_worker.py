"""The engine's own process: an `AsyncEngine` served over a Unix socket to the replica that spawned it.

    python -m deployments.engine_worker SOCKET_PATH     (started by deployments/engine_process.py)

Why a process of its own: inside a Ray Serve replica the MLX thread shares one interpreter with
Serve's threads (its event loops, the streaming and metrics machinery), and on MLX's CUDA backend,
where the step is bound by the Python that builds and launches it, each step took ~1.45x as long
behind Serve as in a plain process with the same requests; the same engine beside 4-12 busy
processes lost at most 4 % (benchmarks/results/accelerators-http-runs.md, session 13). vLLM splits
its engine core from its API server for the same reason.

The process ends when the replica closes the socket or dies (end of stream): nothing outlives it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

from api.core.wire import event_to_wire, sampling_from_wire
from deployments.engine_ipc import config_from_wire, pack, receive, refusal_to_wire
from engine.client import EngineClient
from engine.types import Request

log = logging.getLogger("pomona.engine_worker")

STOP_TIMEOUT_S = 10.0  # how long a shutdown waits for the last events to be queued
STATS_EVERY_S = 0.1  # the replica's stats() (metrics, routing load) are at most this stale
CALLS = frozenset({"held_prefixes", "requests_status", "cache_stats", "clear_cache", "flush_cache",
                   "deep_reset", "ping", "shutdown"})


class Worker:
    """Runs the replica's requests on the engine and sends their events back, one frame per step."""

    def __init__(self, engine: EngineClient, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.writer = writer
        self.outbox: dict[str, list[dict[str, Any]]] = {}
        self.flush_scheduled = False
        self.tasks: dict[str, asyncio.Task] = {}
        self.started: set[str] = set()  # requests whose first events came: the engine has them

    def send(self, message: list[Any]) -> None:
        self.writer.write(pack(message))

    def handle(self, message: list[Any]) -> None:
        kind = message[0]
        if kind == "add":
            _, request_id, tokens, sampling, priority, salt = message
            self.tasks[request_id] = asyncio.create_task(self.run(request_id, tokens, sampling, priority, salt))
        elif kind == "abort":
            self.abort(message[1])
        elif kind == "call":
            asyncio.create_task(self.call(*message[1:]))
        else:
            log.error("unknown frame %r from the replica", kind)

    def abort(self, request_id: str) -> None:
        """An abort at any stage. A request not yet in the engine's queue (its task not started, or
        its grammar compiling) is cancelled here: the engine would not know its id yet, and the
        abort would be lost, the request then running to max_tokens with nobody listening. One
        already queued is aborted by the engine at its next step."""
        task = self.tasks.get(request_id)
        if task is not None and request_id not in self.started:
            task.cancel()
        self.engine.abort(request_id)

    async def run(self, request_id: str, tokens: list[int], sampling: dict[str, Any], priority: int,
                  salt: str = "") -> None:
        first = True
        try:
            request = Request(tuple(tokens), sampling_from_wire(sampling), request_id=request_id, priority=priority,
                              cache_salt=salt)
            async for batch in self.engine.stream(request, text=False):  # the replica makes the text
                if first:
                    self.started.add(request_id)
                first = False
                self.outbox.setdefault(request_id, []).extend(event_to_wire(e) for e in batch)
                if not self.flush_scheduled:
                    # The MLX thread hands a step's events to every stream in one callback, so every
                    # request of the step runs before this: the step leaves as one frame.
                    self.flush_scheduled = True
                    asyncio.get_running_loop().call_soon(self.flush)
        except Exception as exc:
            if first:
                self.send(["refused", request_id, *refusal_to_wire(exc)])
            else:  # the engine ends every started request with a final event; this is a fault of ours
                log.exception("request %s failed after its first event", request_id)
                self.outbox.setdefault(request_id, []).append(_error_wire(f"{type(exc).__name__}: {exc}"))
                self.flush()
        finally:
            self.tasks.pop(request_id, None)
            self.started.discard(request_id)

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.outbox:
            out, self.outbox = self.outbox, {}
            self.send(["events", out])

    async def call(self, call_id: int, name: str, args: list[Any]) -> None:
        try:
            if name not in CALLS:
                raise ValueError(f"unknown engine call {name!r}")
            result = await getattr(self.engine, name)(*args)
            if name == "shutdown":
                await self.settle()
        except Exception as exc:
            self.send(["reply", call_id, False, [*refusal_to_wire(exc)]])
        else:
            self.flush()  # events produced before the reply reach the replica before it
            self.send(["reply", call_id, True, result])

    async def settle(self) -> None:
        """Wait for every request's last events to reach the outbox.

        The engine's shutdown returns once its thread has handed the final (abort) events to the
        streams, but each stream's task has yet to run and queue them: a reply sent first lets the
        replica close the socket with those events unsent, and its open requests then end with an
        error instead of the "shutdown" abort (seen once in CI).
        """
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=STOP_TIMEOUT_S)

    async def publish_stats(self) -> None:
        last = None
        while True:
            stats = self.engine.stats()
            if stats != last:
                self.send(["stats", stats])
                last = stats
            await asyncio.sleep(STATS_EVERY_S)


def _error_wire(message: str) -> dict[str, Any]:
    return {"text": "", "token": None, "lp": None, "finish": "error", "usage": None, "error": message,
            "code": "internal_error", "stop_str": None}


async def serve(path: str) -> None:
    from engine.loop import AsyncEngine
    from modelio.models import openblas_loaded

    reader, writer = await asyncio.open_unix_connection(path)
    hello = await receive(reader)
    if not hello or hello[0] != "config":
        raise RuntimeError("the replica sent no engine settings")
    config = config_from_wire(hello[1])
    if config.switch_interval_ms is not None:  # before the MLX thread exists: the whole process's
        sys.setswitchinterval(config.switch_interval_ms / 1000)
    engine = AsyncEngine(config)
    try:
        await engine.wait_ready()
    except Exception as exc:
        writer.write(pack(["failed", f"{type(exc).__name__}: {exc}"]))
        await writer.drain()
        return
    writer.write(pack(["ready", {"model_name": engine.model_name, "context_length": engine.context_length,
                                 "pid": os.getpid(), "openblas": openblas_loaded(),
                                 "switch_interval_ms": sys.getswitchinterval() * 1000}]))
    worker = Worker(engine, writer)
    stats = asyncio.create_task(worker.publish_stats())
    while (message := await receive(reader)) is not None:
        worker.handle(message)
        if writer.transport.get_write_buffer_size() > 1 << 20:
            await writer.drain()  # the replica is behind: wait for it rather than buffer without bound
    stats.cancel()
    await engine.shutdown(drain_s=0)  # the replica is gone: nobody reads the rest


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine[%(process)d] %(message)s")
    asyncio.run(serve(argv[0]))
    sys.stdout.flush()
    sys.stderr.flush()
    # MLX's CUDA backend can abort at interpreter exit once a second thread used it
    # (benchmarks/results/accelerators-engine-runs.md): leave without the interpreter's teardown.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
