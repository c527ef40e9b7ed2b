"""The LLM server deployment: one engine per replica, pinned to Apple Silicon nodes by a custom resource.

Nodes declare `apple_silicon` (see deployments/node.py); the replica asks for it in its actor
options (set by the app builder from serve_config.yaml), so Ray never places an engine elsewhere.
A custom resource rather than a node label: resources are Ray's stable scheduling API, show in
`ray status`, and a count of 1 per Mac doubles as "one engine per machine" (each engine wants all of
the unified memory). Label selectors are newer in Ray 2.60 and the affinity router planned on top
only needs per-replica routing stats, which this class publishes either way.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from ray import serve

from deployments.engine_host import EngineHost, StreamPacing
from api.service.model_status import ModelStatus
from api.service.settings import AppSettings

log = logging.getLogger("pomona.llm_server")


@serve.deployment(
    name="LLMServer",
    max_ongoing_requests=1000,  # the engine's own bounded queue decides overload (429), not Serve's
    health_check_period_s=10,
    health_check_timeout_s=60,
    graceful_shutdown_wait_loop_s=2,
    graceful_shutdown_timeout_s=60,
)
class LLMServer:
    async def __init__(self, settings: AppSettings) -> None:
        # Load before the replica counts as started, so no request reaches a half-loaded engine.
        self._settings = settings
        self._draining: asyncio.Task | None = None  # set by reconfigure (pomona serve's SIGTERM)
        # A hub model is downloaded first, off the MLX thread; the status board shows the phase meanwhile.
        self._status = ModelStatus.on_board(settings.served_name(), settings.engine.model)
        try:
            await self._status.prepare(settings.engine.model)
            self._host = EngineHost(settings.engine, pacing=StreamPacing(settings.stream_items_per_s, steps=settings.stream_pacing_steps),
                                    process=settings.engine_process,
                                    replica_key=serve.get_replica_context().replica_id.unique_id)
            await self._host.start()
        except Exception as exc:
            self._status.set(phase="failed", error=str(exc))
            self._status.stop()
            raise
        self._status.set(phase="ready")

    async def generate(self, prompt_tokens: list[int], params: dict[str, Any],
                       request_id: str, channel: str | None = None) -> AsyncIterator[Any]:
        """Stream a rejection or event batches (see engine_host's wire format); with `channel`,
        the first batch only, the rest on that ingress's step channel (deployments/channels.py).

        Ray Serve cancels this generator when the caller goes away; `EngineHost.stream` turns the
        cancellation into an engine abort, effective at the next step.
        """
        async for item in self._host.stream(prompt_tokens, params, request_id, channel):
            yield item

    async def channel(self, key: str, replica: str) -> AsyncIterator[Any]:
        """An ingress replica's step channel: one item per engine step for all its requests here.
        The request routers pin this call to `replica` (fleet/router.py); anywhere else it says so."""
        async for item in self._host.channel(key, replica):
            yield item

    def info(self) -> dict[str, Any]:
        return self._host.info()

    def stats(self) -> dict[str, Any]:
        return self._host.stats()

    async def record_routing_stats(self) -> dict[str, Any]:
        if self._draining is not None:
            return {"draining": True}  # its engine stops: nothing to route here for its cache
        return await self._host.routing_stats()

    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]:
        """Per-request status and cache administration (api/service/admin.py asks every replica)."""
        return await self._host.admin(action, tier)

    async def check_health(self) -> None:
        if self._draining is not None:
            return  # stopping on purpose; failing here would make Serve start a replacement
        await self._host.check_health()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """`user_config: {draining: true}` (what `pomona serve` applies on SIGTERM, deployments/serve_cmd.py)
        starts the drain at once, while Serve's proxy and the ingress still carry its 503s and error
        events: new requests are refused, running ones get `drain_s`, then the engine stops."""
        if (user_config or {}).get("draining") and self._draining is None:
            log.info("draining: running requests get %s s, new ones are refused", self._settings.drain_s)
            self._draining = asyncio.create_task(self._host.shutdown(self._settings.drain_s))

    async def __del__(self) -> None:
        if self._draining is not None:
            await self._draining
        await self._host.shutdown(self._settings.drain_s)
