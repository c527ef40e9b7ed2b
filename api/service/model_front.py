"""Routes each request to its model's OpenAI app by the body's `model` (several models, one endpoint).

Each served model keeps its own `OpenAIServer` (api/service/server.py: its backend handle, tokenizer, limits,
readiness); this ASGI front reads the body once, picks the server whose name (or `model_aliases`)
matches, and replays the body to it. GET /v1/models lists every model, /health is 200 only when
all are ready (each model's state in `models`), GET /admin/models merges every model's phases.
Anything else goes to the app of the model named by the query parameter `?model=` (admin routes:
`POST /admin/cache/flush?model=coder`), else to the first model's app; so does a body without a
known model, so auth (401) still comes before the unknown model's 404 `model_not_found`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Message, Receive, Scope, Send

from api.core.errors import body_for, unavailable
from api.openai.shapes import models_list
from api.service import model_status
from api.service.server import OpenAIServer


class ModelFront:
    def __init__(self, servers: list[OpenAIServer]) -> None:
        self.servers = servers
        self.apps = [s.app() for s in servers]
        self.limit = max(s.settings.limits.max_body_bytes for s in servers)

    def pick(self, name: Any) -> int | None:
        for i, server in enumerate(self.servers):
            if name in (server.model_name, server.settings.model) or (
                    isinstance(name, str) and server.settings.is_alias(name)):
                return i
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":
            return await self.apps[0](scope, receive, send)
        path, method = scope["path"][len(scope.get("root_path", "")):] or "/", scope["method"]
        if method == "GET" and path in ("/v1/models", "/health", "/admin/models"):
            answer = {"/v1/models": self._models, "/health": self._health, "/admin/models": self._phases}[path]

            async def route(scope: Scope, receive: Receive, send: Send) -> None:
                await (await answer(Request(scope, receive)))(scope, receive, send)
            # The first app would answer these for its own model only; the key check is repeated here.
            return await self._guarded(route, scope, receive, send, open_=path == "/health")
        named = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("model", [None])[-1]
        index = self.pick(named) or 0
        if method != "POST" or named is not None:
            return await self.apps[index](scope, receive, send)
        body, more = await _read(receive, self.limit)
        if not more:
            with contextlib.suppress(ValueError, AttributeError, UnicodeDecodeError):
                index = self.pick(json.loads(body).get("model")) or 0
        await self.apps[index](scope, _replay(body, more, receive), send)

    async def _guarded(self, route: Any, scope: Scope, receive: Receive, send: Send, open_: bool) -> None:
        first = self.servers[0]
        if open_ or not first.keys.configured:
            return await route(scope, receive, send)
        from api.service.auth import ApiKeyMiddleware

        await ApiKeyMiddleware(route, keys=first.keys, metrics=first.metrics,
                               metrics_open=first.settings.metrics_open)(scope, receive, send)

    async def _models(self, request: Request) -> JSONResponse:
        data = [m for s in self.servers for m in models_list(s.model_name, s.created)["data"]]
        return JSONResponse({"object": "list", "data": data})

    async def _health(self, request: Request) -> JSONResponse:
        states = []
        for s in self.servers:
            entries = await model_status.phases(s.backend, (s.model_name,))
            states.append({"model": s.model_name, "ready": s.ready is not None,
                           "detail": model_status.describe(entries) if s.ready is None else "ready"})
        if all(st["ready"] for st in states):
            return JSONResponse({"status": "ok", "models": states})
        err = unavailable("not ready: " + "; ".join(f"{st['model']}: {st['detail'] or 'no replica can serve yet'}"
                                                    for st in states if not st["ready"]))
        return JSONResponse({**body_for("", err), "models": states}, status_code=err.status, headers=dict(err.headers))

    async def _phases(self, request: Request) -> JSONResponse:
        entries = [e for s in self.servers for e in await model_status.phases(s.backend, (s.model_name,))]
        return JSONResponse({"models": entries})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        await receive()  # lifespan.startup
        async with contextlib.AsyncExitStack() as stack:
            try:
                for app in self.apps:  # each model's readiness poller
                    await stack.enter_async_context(app.router.lifespan_context(app))
            except Exception as exc:
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
        await send({"type": "lifespan.shutdown.complete"})


async def _read(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The body up to `limit` bytes; `more` says the client sent more (the model's app answers 413)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body"):
            return b"".join(chunks), False
        if size > limit:
            return b"".join(chunks), True


def _replay(body: bytes, more: bool, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": more}
        return await receive()  # the rest of an oversized body, or the disconnect
    return replay
