"""The ingress deployment: the Starlette app of http_app.py, talking to LLM servers through a handle."""

from __future__ import annotations

import functools
import logging
from typing import Any, AsyncIterator, Callable

from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from modelio.models import tokenizer_for
from api.errors import ApiError, overloaded, server_error, unavailable
from deployments.failover import retry_before_first
from api.server import OpenAIServer
from api.settings import AppSettings

log = logging.getLogger("pomona.ingress")


def _ray_error(exc: BaseException) -> ApiError:
    if isinstance(exc, BackPressureError):
        return overloaded("Every model server replica is at capacity; retry after a short delay.", 1.0)
    if isinstance(exc, (ActorDiedError, ActorUnavailableError, RayActorError, DeploymentUnavailableError)):
        return unavailable("The model server replica went away (restarting or overloaded); retry the request.")
    log.error("model server call failed: %s", exc)
    return server_error("The model server failed on this request; retrying is safe.")


class HandleBackend:
    """`Backend` over a Ray Serve deployment handle; maps Ray's failures to API errors."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._streaming = handle.options(stream=True)
        self.on_failover: Callable[[], None] | None = None  # set by the ingress: counts in /metrics

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
        responses = self._streaming.generate.remote(prompt_tokens, params, request_id)
        finished = False
        try:
            async for item in responses:
                finished = isinstance(item, dict) or bool(item and item[-1].get("finish"))
                yield item
        except (RequestCancelledError, GeneratorExit):
            raise
        except (RayActorError, RayTaskError, BackPressureError, DeploymentUnavailableError,
                ActorUnavailableError) as exc:
            raise _ray_error(exc) from exc
        finally:
            if not finished:
                responses.cancel()  # Serve cancels the LLM server's generator -> engine abort

    async def info(self) -> dict[str, Any]:
        return await self._handle.info.remote()

    async def stats(self) -> dict[str, Any]:
        return await self._handle.stats.remote()

    async def model_status(self) -> list[dict[str, Any]]:
        """Every replica's model phase (downloading, loading, ...) from api/model_status.py's board."""
        from api.model_status import read_board

        return await read_board()

    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]:
        """One replica's status or cache administration (api/admin.py fans out)."""
        try:
            return await self._handle.admin.remote(action, tier)
        except (RayActorError, RayTaskError, BackPressureError, DeploymentUnavailableError,
                ActorUnavailableError) as exc:
            raise _ray_error(exc) from exc


@serve.deployment(name="Ingress", max_ongoing_requests=2000)
@serve.ingress()
class Ingress:
    def __init__(self, llm: DeploymentHandle, settings: AppSettings) -> None:
        keys = settings.all_api_keys()  # read here: env and key file of the replica's node
        backend = HandleBackend(llm)
        self._server = OpenAIServer(settings, backend, functools.partial(tokenizer_for, settings.model), api_keys=keys)
        backend.on_failover = self._server.metrics.failover
        log.info("ingress for %s: %d API key(s) configured", settings.served_name(), len(keys))

    def __serve_build_asgi_app__(self) -> Starlette:
        return self._server.app()
