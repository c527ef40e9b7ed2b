"""The ingress deployment: the Starlette app of api/service/server.py, talking to LLM servers through a handle."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from modelio.models import tokenizer_for
from api.core.errors import ApiError, overloaded, server_error, unavailable
from deployments.channels import ChannelLost, Inbox, StepChannels
from deployments.engine_host import StreamPacing
from deployments.failover import retry_before_first
from api.service.server import OpenAIServer
from api.service.settings import AppSettings

log = logging.getLogger("pomona.ingress")


def log_keys(served: Any, keys: Any) -> None:
    """What auth the ingress enforces, once at start (never the keys)."""
    if not keys.configured:
        log.warning("ingress for %s: no API key configured: every route is open (keep the server on loopback)",
                    served)
        return
    log.info("ingress for %s: %d inference key(s), %d admin key(s)", served, keys.inference_keys, keys.admin_keys)
    if not keys.inference_keys:
        log.warning("only admin keys are configured: the inference routes refuse every request (add api_keys)")


def _ray_error(exc: BaseException) -> ApiError:
    if isinstance(exc, BackPressureError):
        return overloaded("Every model server replica is at capacity; retry after a short delay.", 1.0)
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError,
                        ChannelLost)):
        return unavailable("The model server replica went away (restarting or overloaded); retry the request.")
    log.error("model server call failed: %s", exc)
    return server_error("The model server failed on this request; retrying is safe.")


RAY_FAILURES = (RayActorError, RayTaskError, BackPressureError, DeploymentUnavailableError, ActorUnavailableError,
                ChannelLost)


class HandleBackend:
    """`Backend` over a Ray Serve deployment handle; maps Ray's failures to API errors.

    With `step_channels`, events after a request's first batch arrive on deployments/channels.py's
    per-replica channels, and this ingress paces its SSE writes (Serve's proxy hop carries one item
    per write) with `pacing`, shared by all its streams.
    """

    def __init__(self, handle: DeploymentHandle, step_channels: bool = False,
                 pacing: StreamPacing = StreamPacing()) -> None:
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self.on_failover: Callable[[], None] | None = None  # set by the ingress: counts in /metrics
        self._channels = StepChannels(handle) if step_channels else None
        self._pacing = pacing
        self._active = 0

    async def stream(self, prompt_tokens: list[int], params: dict[str, Any],
                     request_id: str) -> AsyncIterator[Any]:
        """A replica that dies before the first event is replaced once (deployments/failover.py)."""
        async for item in retry_before_first(
                lambda attempt: self._stream_once(prompt_tokens, params,
                                                  request_id if not attempt else f"{request_id}-retry{attempt}"),
                on_retry=self.on_failover):
            yield item

    async def _stream_once(self, prompt_tokens: list[int], params: dict[str, Any],
                           request_id: str) -> AsyncIterator[Any]:
        if self._channels is not None:
            async for item in self._stream_channel(prompt_tokens, params, request_id, self._channels):
                yield item
            return
        responses = self._streaming.generate.remote(prompt_tokens, params, request_id)
        finished = False
        try:
            async for item in responses:
                finished = isinstance(item, dict) or bool(item and item[-1].get("finish"))
                yield item
        except (RequestCancelledError, GeneratorExit):
            raise
        except RAY_FAILURES as exc:
            raise _ray_error(exc) from exc
        finally:
            if not finished:
                responses.cancel()  # Serve cancels the LLM server's generator -> engine abort

    async def _stream_channel(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str,
                              channels: StepChannels) -> AsyncIterator[Any]:
        """The first batch from the request's own stream, the rest from its replica's step channel."""
        inbox = channels.open(request_id)
        responses = self._streaming.generate.remote(prompt_tokens, params, request_id, channels.key)
        finished, watcher = False, None
        self._active += 1
        try:
            first = await responses.__anext__()
            if "replica" not in first:  # a rejection
                finished = True
                yield first
                return
            finished = _finished(first["events"])
            replica = first["replica"]
            if not finished:  # read the channel while the first events go out
                channels.bind(request_id, replica)
            yield first["events"]
            if finished:
                return
            watcher = asyncio.ensure_future(_failures_into(responses, inbox))
            sent = time.monotonic()
            while not finished:
                wait = sent + self._pacing.interval(self._active, channels.step_s(replica)) - time.monotonic()
                if wait > 0 and not inbox.urgent.is_set():
                    try:  # paced, but the last event (or a failure) goes at once
                        await asyncio.wait_for(inbox.urgent.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                batch = await _gather(inbox.queue)
                sent = time.monotonic()
                finished = _finished(batch)
                yield batch
        except (RequestCancelledError, GeneratorExit):
            raise
        except RAY_FAILURES as exc:
            raise _ray_error(exc) from exc
        finally:
            self._active -= 1
            channels.close(request_id)
            if watcher is not None:
                watcher.cancel()
            if not finished:
                responses.cancel()  # Serve cancels the LLM server's generator -> engine abort

    async def info(self) -> dict[str, Any]:
        return await self._handle.info.remote()

    async def stats(self) -> dict[str, Any]:
        return await self._handle.stats.remote()

    async def model_status(self) -> list[dict[str, Any]]:
        """Every replica's model phase (downloading, loading, ...) from api/service/model_status.py's board."""
        from api.service.model_status import read_board

        return await read_board()

    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]:
        """One replica's status or cache administration (api/service/admin.py fans out)."""
        try:
            return await self._handle.admin.remote(action, tier)
        except RAY_FAILURES as exc:
            raise _ray_error(exc) from exc


def _finished(events: list[dict[str, Any]]) -> bool:
    return bool(events) and bool(events[-1].get("finish"))


async def _gather(queue: asyncio.Queue) -> list[dict[str, Any]]:
    """Every event list queued so far, as one (at least one: waits for it). A failure queued
    behind events is put back, so the events reach the client before the error does."""
    out: list[dict[str, Any]] = []
    item = await queue.get()
    while True:
        if isinstance(item, BaseException):
            if out:
                queue.put_nowait(item)
                return out
            raise item
        out.extend(item)
        if queue.empty():
            return out
        item = queue.get_nowait()


async def _failures_into(responses: Any, inbox: Inbox) -> None:
    """The request's own stream yields nothing after its first item: it only ends, or fails
    (the replica died, Ray failed); a failure goes to the queue its events arrive on."""
    try:
        async for _ in responses:
            pass
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        inbox.put(exc)


@serve.deployment(name="Ingress", max_ongoing_requests=2000)
@serve.ingress()
class Ingress:
    def __init__(self, llm: DeploymentHandle, settings: AppSettings) -> None:
        # Read here, on the replica's node (its env and key files). A source that yields no key raises:
        # the replica does not start, and Serve reports the message (no serving without the keys).
        keys = settings.key_ring()
        backend = HandleBackend(llm, step_channels=settings.step_channel,
                                pacing=StreamPacing(settings.stream_items_per_s, steps=settings.stream_pacing_steps))
        self._server = OpenAIServer(settings, backend, functools.partial(tokenizer_for, settings.model), keys=keys)
        backend.on_failover = self._server.metrics.failover
        log_keys(settings.served_name(), keys)

    def __serve_build_asgi_app__(self) -> Starlette:
        return self._server.app()
