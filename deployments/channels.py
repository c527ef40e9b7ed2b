"""Step channels, ingress side: one Ray stream per LLM server replica carrying every request's events.

Ray Serve's path carries a few thousand stream items a second in all (benchmarks/device/token_path.py),
and each item costs the LLM server replica's GIL, which its MLX thread needs: on the H200 at 128
concurrent the engine made 0.58x its in-process rate over HTTP with paced per-request streams and
0.37x unpaced. So, as vLLM's engine core sends its frontend one output batch per step, each LLM
server replica sends each ingress replica one item per engine step: `{request_id: [events]}`.

A request still makes its own `generate` call, routed, counted and cancelled by Serve as before;
that call returns the first batch (or a rejection) and then stays open without items until the
request ends, so failover before the first event, aborts on disconnect and replica deaths reaching
the client as error events all work as they did. Everything after the first batch arrives on the
channel (`LLMServer.channel`, pinned to its replica by the request routers in fleet/router.py),
which this class reads and hands out to per-request queues.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import socket
import time
import uuid
from typing import Any

from deployments.engine_host import StepClock

log = logging.getLogger("pomona.ingress")


class ChannelLost(Exception):
    """The step channel to a replica ended with requests of this ingress still running there."""


class Inbox:
    """Where one request's event lists (or a failure) arrive. `urgent` is set by its last event or
    a failure: the consumer's pacing wait ends then, so a stream's end never waits for company."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.urgent = asyncio.Event()

    def put(self, item: Any) -> None:
        self.queue.put_nowait(item)
        if isinstance(item, BaseException) or (item and item[-1].get("finish")):
            self.urgent.set()


class StepChannels:
    """This ingress replica's channels, one per LLM server replica it has requests on."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle.options(stream=True)
        self.key = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._inboxes: dict[str, Inbox] = {}
        self._bound: dict[str, str] = {}  # request id -> replica
        self._subscriptions: dict[str, asyncio.Task] = {}  # replica -> the task reading its channel
        # One item per engine step arrives from each replica: their gaps are its step time as the
        # clients see it, what time-based pacing (deployments/engine_host.py) waits in units of.
        self._clocks: dict[str, StepClock] = {}

    def open(self, request_id: str) -> Inbox:
        """Where `request_id`'s event lists (or a ChannelLost) will arrive."""
        inbox = self._inboxes[request_id] = Inbox()
        return inbox

    def bind(self, request_id: str, replica: str) -> None:
        """`request_id` runs on `replica`: read that replica's channel (open it if need be)."""
        self._bound[request_id] = replica
        task = self._subscriptions.get(replica)
        if task is None or task.done():
            self._subscribe(replica)

    def _subscribe(self, replica: str) -> None:
        # In a fresh context, not the context of the request that happens to open the channel: Serve
        # cancels the handle calls made within a request when that request is cancelled (its client
        # left), and the channel carries every other request's events too.
        self._subscriptions[replica] = asyncio.get_running_loop().create_task(
            self._read(replica), context=contextvars.Context())

    def close(self, request_id: str) -> None:
        self._inboxes.pop(request_id, None)
        self._bound.pop(request_id, None)

    def step_s(self, replica: str) -> float | None:
        """`replica`'s step time as its channel delivers steps (None until two have arrived)."""
        clock = self._clocks.get(replica)
        return clock.step_s if clock is not None else None

    def running_on(self, replica: str) -> list[str]:
        return [rid for rid, r in self._bound.items() if r == replica]

    async def _read(self, replica: str) -> None:
        """Hand out the channel's items until it ends; reopen it if requests still run there."""
        error: BaseException | None = None
        stream = self._handle.channel.remote(self.key, replica=replica)  # keyword: the routers read it
        clock = self._clocks.setdefault(replica, StepClock())
        try:
            async for item in stream:
                clock.tick(time.monotonic())
                if "wrong_replica" in item:
                    raise ChannelLost(f"replica {replica} is gone (the channel reached {item['wrong_replica']})")
                for request_id, events in item.items():
                    inbox = self._inboxes.get(request_id)
                    if inbox is not None:
                        inbox.put(events)
        except asyncio.CancelledError:
            stream.cancel()
            self._ended(replica, ChannelLost("the step channel's reader was cancelled"))
            raise
        except Exception as exc:  # the replica died, or Ray failed: its requests learn it here too
            error = exc
        self._ended(replica, error)

    def _ended(self, replica: str, error: BaseException | None) -> None:
        if self._subscriptions.get(replica) is asyncio.current_task():
            del self._subscriptions[replica]
        still = self.running_on(replica)
        if not still:
            return
        if error is None:  # it ended idle just as a request arrived: read it again
            self._subscribe(replica)
            return
        log.warning("step channel to replica %s failed (%s); %d request(s) end with an error",
                    replica, error, len(still))
        for request_id in still:
            self._inboxes[request_id].put(ChannelLost(str(error)))
