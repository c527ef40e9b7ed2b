"""The OpenAI-compatible Starlette application (no Ray: the LLM server is reached through a `Backend`).

Order of checks for a generation request: API key (middleware) -> body size -> JSON -> fields ->
model -> readiness -> prompt length -> the engine. Anything refused before the first token is an
HTTP status; after it, a final SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from api.anthropic import messages as anthropic_messages
from api.core.body import decode_body
from api.core.dialect import respond
from api.core.errors import (ApiError, body_for, internal_fault, invalid, not_found, overloaded, server_error,
                             too_large, unavailable)
from api.core.generation import Pipeline
from api.core.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, IngressMetrics, request_label
from api.openai.chat import OpenAIChat
from api.openai.completions import OpenAICompletions
from api.openai.shapes import models_list
from api.responses import routes as responses_routes
from api.service import model_status
from api.service.admin import AdminRoutes
from api.service.auth import ApiKeyMiddleware, KeyRing, cache_salt, error_response, tenant_of
from api.service.openapi import openapi_route
from api.service.settings import AppSettings
from api.service.tokenizer_pool import TokenizerPool

log = logging.getLogger("pomona.ingress")

POLL_S = 1.0  # while not ready
POLL_READY_S = 5.0  # once ready: each poll is a logged call on the LLM server
POLL_TIMEOUT_S = 5.0
# Polls in a row that may time out before a ready ingress answers 503. A replica busy with a long
# prefill, or a box whose cores the forward pass takes, can miss one poll's deadline while it
# serves every request it has; an error (no replica, a refusal) still counts at once.
POLL_MISSES = 3
STATS_TIMEOUT_S = 2.0


class Backend(Protocol):
    """What the HTTP layer needs from the LLM server (a Ray handle in production, an EngineHost in tests)."""

    def stream(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str) -> AsyncIterator[Any]: ...
    async def info(self) -> dict[str, Any]: ...
    async def stats(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Ready:
    """What becomes known once a replica answers: the model's limits and the tokenizer."""

    info: dict[str, Any]
    tokenizer: Any
    vocab_size: int

    @property
    def context_length(self) -> int:
        return int(self.info["context_length"])


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # a lying or absent Content-Length must not let a huge body through
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


class OpenAIServer:
    def __init__(self, settings: AppSettings, backend: Backend, load_tokenizer: Callable[[], Any],
                 api_keys: tuple[str, ...] = (), keys: KeyRing | None = None) -> None:
        """`keys`: every key with its tenant and scopes (AppSettings.key_ring); `api_keys` alone are
        inference keys, each its own tenant."""
        self.settings, self.backend, self._load_tokenizer = settings, backend, load_tokenizer
        self.keys = keys if keys is not None else KeyRing.of(api_keys)
        self.share_cache = settings.share_cache_across_tenants(self.keys)
        self.metrics = IngressMetrics()
        self.model_name = settings.served_name()
        self.created = int(time.time())
        self.ready: Ready | None = None
        self._tokenizer: Any = None
        self._vocab_size = 0
        self._load_lock = asyncio.Lock()
        self._tok_pool = TokenizerPool(settings.limits.max_tokenizer_queue)  # api/service/tokenizer_pool.py
        self._poller: asyncio.Task | None = None
        self._misses = 0  # polls timed out in a row while ready
        self.pipeline = Pipeline(self)

    # -- readiness -------------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Ask a replica for its info; load the tokenizer once (after the replica resolved the model)."""
        try:
            info = await asyncio.wait_for(self.backend.info(), POLL_TIMEOUT_S)
            async with self._load_lock:  # a poll and a request's refresh may overlap
                if self._tokenizer is None:
                    tokenizer = await self._tok_pool.run(self._load_tokenizer, bounded=False)
                    # Once per load: `get_vocab()` builds a dict of the whole vocabulary (~65 ms for
                    # 49K tokens), and this poll runs every few seconds beside the forward pass.
                    self._vocab_size = len(await self._tok_pool.run(tokenizer.get_vocab, bounded=False))
                    self._tokenizer = tokenizer
            self.ready = Ready(info=info, tokenizer=self._tokenizer, vocab_size=self._vocab_size)
            self._misses = 0
        except asyncio.TimeoutError:
            self._misses += 1
            if self.ready is not None and self._misses < POLL_MISSES:
                log.info("readiness poll timed out (%d in a row); still serving", self._misses)
                return
            self._not_ready(f"{self._misses} polls timed out")
        except Exception as exc:  # any other failure means "not ready now": keep polling
            log.debug("readiness poll failed", exc_info=True)
            self._not_ready(str(exc) or type(exc).__name__)

    def _not_ready(self, why: str) -> None:
        if self.ready is not None:
            log.warning("no LLM server replica answered (%s); answering 503 until one does", why)
        self.ready = None
        self._misses = 0

    async def _poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(POLL_S if self.ready is None else POLL_READY_S)

    async def on_tok(self, fn: Callable[[], Any]) -> Any:
        """A request's tokenizer / template work, on the one tokenizer thread; 429 when its queue is full."""
        return await self._tok_pool.run(fn)

    def tenant(self, request: Request) -> str:
        """The caller's tenant, as the key middleware found it (api/service/auth.py `tenant_of`)."""
        return tenant_of(request)

    def salt(self, request: Request, own: str) -> str:
        """The engine's cache salt for a request of this caller (api/service/auth.py `cache_salt`)."""
        return cache_salt(tenant_of(request), own, self.share_cache)

    def require_ready(self) -> Ready:
        if self.ready is None:
            raise unavailable("The model is not ready yet (loading, or its server is restarting); retry shortly.")
        return self.ready

    # -- routes ----------------------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/metrics", self.metrics_route, methods=["GET"]),
                  openapi_route(self.settings.limits, self.settings.engine.max_tokens_limit, self.model_name)]
        routes += anthropic_messages.routes(self) + responses_routes.routes(self)
        routes.append(model_status.admin_route(self.backend, (self.model_name,)))
        routes += AdminRoutes(self.backend, self.settings.llm_server.num_replicas, self.metrics).routes()  # type: ignore[arg-type]
        app = Starlette(routes=routes, lifespan=self._lifespan,
                        exception_handlers={HTTPException: self._http_error, Exception: self._crash})
        app.add_middleware(ApiKeyMiddleware, keys=self.keys, metrics=self.metrics,
                           metrics_open=self.settings.metrics_open)
        return app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self._poller = asyncio.create_task(self._poll())
        try:
            yield
        finally:
            self._poller.cancel()
            self._tok_pool.shutdown()

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            err = not_found(f"No route {request.method} {request.url.path}; see /v1/chat/completions, "
                            "/v1/completions, /v1/models, /health and /metrics.", code="not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"{request.method} is not allowed on {request.url.path}.", code="method_not_allowed")
        else:
            err = ApiError(exc.status_code, str(exc.detail))
        self.metrics.count(request_label(request.scope), err.status)
        return error_response(err, request.url.path)

    async def _crash(self, request: Request, exc: Exception) -> Response:
        """Any exception that is not an ApiError is a fault in our code, whatever its type: a 500 with
        a request id that the log line (with the traceback) carries too, never a 4xx."""
        rid = f"req_{uuid.uuid4().hex}"
        log.error("internal error on %s %s, request id %s: %s: %s", request.method, request.url.path, rid,
                  type(exc).__name__, exc, exc_info=exc)
        self.metrics.count(request_label(request.scope), 500)
        return error_response(internal_fault(rid), request.url.path)

    async def health(self, request: Request) -> Response:
        if self.ready is None:  # say what the replicas are doing: downloading (bytes), loading, failed
            entries = await model_status.phases(self.backend, (self.model_name,))
            err = unavailable("not ready: " + (model_status.describe(entries) or "no model server replica can serve yet"))
            return JSONResponse({**body_for("", err), "models": entries}, status_code=err.status, headers=dict(err.headers))
        return JSONResponse({"status": "ok", "model": self.model_name})

    async def models(self, request: Request) -> Response:
        self.metrics.count("/v1/models", 200)
        return JSONResponse(models_list(self.model_name, self.created))

    async def metrics_route(self, request: Request) -> Response:
        try:
            engine = await asyncio.wait_for(self.backend.stats(), STATS_TIMEOUT_S)
        except Exception as exc:  # metrics must render with the model server down: counted, logged once
            engine = None
            self.metrics.engine_stats_failed(exc)
        else:
            self.metrics.engine_stats_arrived()
        return PlainTextResponse(self.metrics.render(engine), media_type=METRICS_CONTENT_TYPE)

    async def chat(self, request: Request) -> Response:
        dialect = OpenAIChat(self.settings.limits, self.settings.engine.max_tokens_limit,
                             lambda: _decoder(self.require_ready()))
        return await respond(request, dialect, self.pipeline, self.read_json, self.model_name)

    async def completions(self, request: Request) -> Response:
        dialect = OpenAICompletions(self.settings.limits, self.settings.engine.max_tokens_limit,
                                    lambda: _decoder(self.require_ready()))
        return await respond(request, dialect, self.pipeline, self.read_json, self.model_name)

    # -- generation ------------------------------------------------------------------------------
    async def read_json(self, request: Request) -> dict[str, Any]:
        return decode_body(await read_body(request, self.settings.limits.max_body_bytes))

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.settings.model) and not self.settings.is_alias(name):
            raise not_found(f"The model {name!r} does not exist here; this server serves "
                            f"{self.model_name!r} (GET /v1/models; other names need the 'model_aliases' "
                            "setting).", param="model", code="model_not_found")

    async def first(self, stream: AsyncIterator[Any]) -> list[Any]:
        return await _first(stream)


async def _first(stream: AsyncIterator[Any]) -> list[Any]:
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        raise server_error("The model server ended the request without output; retry it.")
    if isinstance(first, dict) and "rejected" in first:
        raise _rejection(first["rejected"])
    return first


def _rejection(r: dict[str, Any]) -> ApiError:
    kind, message = r.get("kind"), r.get("message", "")
    if kind == "overloaded":
        return overloaded(message, float(r.get("retry_after_s") or 1.0))
    if kind == "context_length":
        return invalid(message, code="context_length_exceeded")
    if kind == "closed":
        return unavailable(message)
    return invalid(message)


def _decoder(ready: Ready) -> Callable[[int], str]:
    tok = ready.tokenizer
    return lambda token_id: tok.decode([token_id])
