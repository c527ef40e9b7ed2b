"""Admin routes: per-request status and prefix-cache administration (no Ray: a `Backend` answers).

Like every route but /health, these need an API key when keys are configured (ApiKeyMiddleware,
api/service/auth.py, runs first); without keys the server is meant to sit on loopback, where they stay open.

| route | what it does |
|---|---|
| `GET /admin/requests` | running and queued requests of every replica: phase, prefill progress, tokens, TTFT, tokens/s, cache tier |
| `GET /admin/cache` | prefix-cache statistics (per tier: hits, bytes, errors, corrupt entries...) |
| `POST /admin/cache/clear?tier=ram|ssd|all` | empty a tier (default `all`) |
| `POST /admin/cache/flush` | wait until queued SSD writes are on disk |
| `POST /admin/reset` | deep reset: fail running requests, empty the cache, release the model's buffers |

Fan-out. A Serve handle sends each call to one replica of its choosing and has no public broadcast,
so `fan_out` calls until it has heard from `replicas` distinct replicas (by pid and host) or spent
`ATTEMPTS_PER_REPLICA` calls per replica; the answer says how many it reached. Every action is
idempotent except `reset`, which a replica asked twice simply runs twice.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.core.errors import ApiError, invalid, unavailable
from api.core.metrics import IngressMetrics, request_label

log = logging.getLogger("pomona.admin")

TIERS = ("ram", "ssd", "all")
ATTEMPTS_PER_REPLICA = 4
ADMIN_TIMEOUT_S = 60.0  # a flush may wait for a full SSD write queue; a reset for one engine step


class AdminBackend(Protocol):
    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]: ...


def _replica_key(answer: dict[str, Any]) -> str:
    replica = answer.get("replica") or {}
    return f"{replica.get('host')}:{replica.get('pid')}"


async def fan_out(backend: AdminBackend, action: str, replicas: int, tier: str = "all") -> list[dict[str, Any]]:
    """One answer per distinct replica reached (see the module docstring for why this loops)."""
    answers: dict[str, dict[str, Any]] = {}
    for _ in range(max(1, replicas) * ATTEMPTS_PER_REPLICA):
        answer = await asyncio.wait_for(backend.admin(action, tier), ADMIN_TIMEOUT_S)
        answers.setdefault(_replica_key(answer), answer)
        if len(answers) >= replicas:
            break
    return list(answers.values())


class AdminRoutes:
    def __init__(self, backend: AdminBackend, replicas: int, metrics: IngressMetrics) -> None:
        self.backend, self.replicas, self.metrics = backend, replicas, metrics

    def routes(self) -> list[Route]:
        return [Route("/admin/requests", self.requests, methods=["GET"]),
                Route("/admin/cache", self.cache, methods=["GET"]),
                Route("/admin/cache/clear", self.clear, methods=["POST"]),
                Route("/admin/cache/flush", self.flush, methods=["POST"]),
                Route("/admin/reset", self.reset, methods=["POST"])]

    async def _answer(self, request: Request, action: str, tier: str = "all") -> Response:
        try:
            answers = await fan_out(self.backend, action, self.replicas, tier)
        except ApiError as err:
            return self._error(request, err)
        except Exception:  # a replica that cannot answer (timeout, restarting): say so, keep serving
            log.warning("admin %s failed", action, exc_info=True)
            return self._error(request, unavailable("A model server replica did not answer the admin call; "
                                                    "retry shortly (it may be restarting)."))
        self.metrics.count(request_label(request.scope), 200)
        return JSONResponse({"object": "list", "replicas_expected": self.replicas,
                             "replicas_reached": len(answers), "data": answers})

    def _error(self, request: Request, err: ApiError) -> Response:
        self.metrics.count(request_label(request.scope), err.status)
        return JSONResponse(err.body(), status_code=err.status, headers=dict(err.headers))

    async def requests(self, request: Request) -> Response:
        return await self._answer(request, "requests")

    async def cache(self, request: Request) -> Response:
        return await self._answer(request, "cache")

    async def clear(self, request: Request) -> Response:
        tier = request.query_params.get("tier", "all")
        if tier not in TIERS:
            return self._error(request, invalid(f"tier must be one of {', '.join(TIERS)}; got {tier!r}.",
                                                param="tier"))
        return await self._answer(request, "clear", tier)

    async def flush(self, request: Request) -> Response:
        return await self._answer(request, "flush")

    async def reset(self, request: Request) -> Response:
        return await self._answer(request, "reset")
