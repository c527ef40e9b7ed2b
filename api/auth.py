"""API keys at the door: every path but /health needs one when keys are configured.

OpenAI's clients send the key as a bearer token, Anthropic's as `x-api-key`; either works on
every route. Keys are hashed and compared in constant time, all of them, so timing reveals nothing.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import ApiError, body_for, unauthorized
from api.metrics import IngressMetrics

OPEN_PATHS = frozenset({"/health"})


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    return JSONResponse(body_for(path, err), status_code=err.status, headers=dict(err.headers))


class ApiKeyMiddleware:
    """Bearer-token check on every path but /health; keys are compared in constant time."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], metrics: IngressMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    def allowed(self, token: str) -> bool:
        # Hash first so every comparison has the same length; check every key so timing reveals nothing.
        digest = hashlib.sha256(token.encode()).digest()
        ok = False
        for known in self.digests:
            ok |= hmac.compare_digest(digest, known)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.digests or _route_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # Anthropic's clients send the key as x-api-key; OpenAI's as a bearer token. Either works anywhere.
        token = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip()
        if token and self.allowed(token):
            return await self.app(scope, receive, send)
        self.metrics.count(scope["path"], 401)
        sent = auth or headers.get("x-api-key")
        message = ("Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'." if not sent
                   else "The API key is not valid: check the key you send in 'Authorization: Bearer <key>' "
                        "or 'x-api-key'.")
        await error_response(unauthorized(message), _route_path(scope))(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path inside the app: Serve mounts it under the application's route_prefix (root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path
