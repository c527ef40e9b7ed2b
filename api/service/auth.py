"""API keys at the door: who is calling (their tenant) and what their key may do (its scopes).

Two scopes. An **inference** key calls the generation routes (`/v1/chat/completions`,
`/v1/completions`, `/v1/messages...`, `/v1/responses...`) and belongs to one tenant. An **admin**
key calls the `/admin/*` routes and `/metrics` (unless `metrics_open`). `/v1/models` and
`/openapi.json` take either; `/health` needs none. A key listed in both places has both scopes.

With no key configured at all, every route is open and every caller is the one implicit tenant ""
(keep such a server on loopback). Once any key is configured, every route but /health needs a key
of the right scope: a missing or unknown key is 401, a known key of the wrong scope 403.

OpenAI's clients send the key as a bearer token, Anthropic's as `x-api-key`; either works on
every route. Keys are hashed and compared in constant time, all of them, so timing reveals nothing.
The caller's `Principal` is put on the ASGI scope (`principal(scope)` reads it) for the routes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from api.core.errors import ApiError, body_for, forbidden, unauthorized
from api.core.metrics import IngressMetrics, route_label

INFERENCE, ADMIN = "inference", "admin"
OPEN_PATHS = frozenset({"/health"})
EITHER_SCOPE_PATHS = frozenset({"/v1/models", "/openapi.json"})
SCOPE_KEY = "pomona.principal"  # the ASGI scope entry the middleware sets (a custom key: never clashes)
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
KEY_TENANT_PREFIX = "key-"


@dataclass(frozen=True)
class Principal:
    """Who is calling: a tenant id (stored responses and the prefix cache are partitioned by it) and
    the scopes of the key they sent."""

    tenant: str
    scopes: frozenset[str]


# No keys configured: one implicit tenant, every scope (today's behaviour on a loopback server).
ANONYMOUS = Principal("", frozenset({INFERENCE, ADMIN}))


def key_tenant(key: str) -> str:
    """The tenant of a key listed on its own: a digest, so the id (which may reach logs and the
    store) never reveals the key. Rotating such a key starts a new tenant; group keys under a
    named tenant (`tenants:`) to keep stored responses across a rotation."""
    return KEY_TENANT_PREFIX + hashlib.sha256(key.encode()).hexdigest()[:16]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class KeyRing:
    """Every configured key with its tenant and scopes; `lookup` compares against all of them."""

    def __init__(self, inference: Mapping[str, str] | None = None, admin: Iterable[str] = ()) -> None:
        """`inference`: key -> tenant id; `admin`: admin keys (a key in both has both scopes)."""
        inference = dict(inference or {})
        admin = set(admin)
        entries: list[tuple[bytes, Principal]] = []
        for key in sorted(set(inference) | admin):
            scopes = frozenset(({INFERENCE} if key in inference else set()) | ({ADMIN} if key in admin else set()))
            # An admin-only key still gets a tenant of its own: it owns nothing, and sees nothing of others.
            entries.append((_digest(key), Principal(inference.get(key) or key_tenant(key), scopes)))
        self._entries = tuple(entries)
        self.inference_keys = len(inference)
        self.admin_keys = len(admin)

    @classmethod
    def of(cls, keys: Iterable[str]) -> "KeyRing":
        """Inference keys, each its own tenant (the `api_keys` list)."""
        return cls({k: key_tenant(k) for k in keys})

    @property
    def configured(self) -> bool:
        return bool(self._entries)

    def lookup(self, token: str) -> Principal | None:
        # Hash first so every comparison has the same length; check every key so timing reveals nothing.
        digest = _digest(token)
        found: Principal | None = None
        for known, principal in self._entries:
            if hmac.compare_digest(digest, known):
                found = principal
        return found

    def allowed(self, token: str) -> bool:
        return self.lookup(token) is not None


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    return JSONResponse(body_for(path, err), status_code=err.status, headers=dict(err.headers))


def needed_scope(path: str, metrics_open: bool) -> str | None:
    """The scope a route needs: None for open routes, "" for either scope."""
    if path in OPEN_PATHS or (metrics_open and path == "/metrics"):
        return None
    if path == "/metrics" or path == "/admin" or path.startswith("/admin/"):
        return ADMIN
    if path in EITHER_SCOPE_PATHS or not path.startswith("/v1/"):
        return ""  # unknown paths: any valid key, then the 404
    return INFERENCE


def principal(scope: Scope) -> Principal:
    """The caller, as the middleware found them (ANONYMOUS where no keys are configured)."""
    return scope.get(SCOPE_KEY, ANONYMOUS)


def tenant_of(request: Any) -> str:
    """The tenant of a Starlette request (or anything with an ASGI `scope`)."""
    return principal(request.scope).tenant


class ApiKeyMiddleware:
    """Key check and scope check on every path but /health (see the module docstring)."""

    def __init__(self, app: ASGIApp, keys: KeyRing, metrics: IngressMetrics, metrics_open: bool = False) -> None:
        self.app, self.metrics, self.keys, self.metrics_open = app, metrics, keys, metrics_open

    def allowed(self, token: str) -> bool:
        return self.keys.allowed(token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys.configured:
            return await self.app(scope, receive, send)
        path = _route_path(scope)
        need = needed_scope(path, self.metrics_open)
        if need is None:
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        # Anthropic's clients send the key as x-api-key; OpenAI's as a bearer token. Either works anywhere.
        token = token.strip() if scheme.lower() == "bearer" else headers.get("x-api-key", "").strip()
        found = self.keys.lookup(token) if token else None
        if found is None:
            sent = auth or headers.get("x-api-key")
            message = ("Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'." if not sent
                       else "The API key is not valid: check the key you send in 'Authorization: Bearer <key>' "
                            "or 'x-api-key'.")
            err = unauthorized(message)
        elif need and need not in found.scopes:
            err = forbidden(_scope_message(need, path))
        else:
            scope[SCOPE_KEY] = found
            return await self.app(scope, receive, send)
        # The label is a known route or "other": a raw path would let anyone grow /metrics without bound.
        self.metrics.count(route_label(path), err.status)
        await error_response(err, path)(scope, receive, send)


def _scope_message(need: str, path: str) -> str:
    if need == ADMIN:
        return (f"This API key is an inference key; {path} needs an admin key. Admin keys are configured "
                "apart (admin_api_keys, admin_api_keys_file or POMONA_ADMIN_API_KEYS on the server): ask "
                "the server's operator.")
    return (f"This API key is an admin key; {path} needs an inference key (api_keys, api_keys_file, "
            "POMONA_API_KEYS or tenants: on the server). Send an inference key.")


def _route_path(scope: Scope) -> str:
    """The path inside the app: Serve mounts it under the application's route_prefix (root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


SALT_SEPARATOR = "\x1f"  # the ASCII unit separator: in no tenant name, so the two parts never run together


def cache_salt(tenant: str, own: str, share_across_tenants: bool) -> str:
    """The prefix-cache partition of a request (the engine's `Request.cache_salt`): the caller's
    tenant (left out when the operator shares the cache across tenants) and the request's own
    `cache_salt` field. "" (no keys, no salt of its own): the one shared partition, as before."""
    tenant = "" if share_across_tenants else tenant
    if not tenant and not own:
        return ""
    return f"{tenant}{SALT_SEPARATOR}{own}"
