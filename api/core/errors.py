"""API errors in OpenAI's shape, raised anywhere in the HTTP layer and rendered in one place."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("pomona.ingress")


class ApiError(Exception):
    """An error a client can act on: `message` says what went wrong and what to do instead.

    A plain class, not a frozen dataclass: the interpreter and contextlib assign `__traceback__`
    on exceptions, which a frozen dataclass refuses.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None,
                 headers: tuple[tuple[str, str], ...] = (), request_id: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers
        self.request_id = request_id  # set on server faults: the id their log line carries

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """The same error in Anthropic's shape (its routes, /v1/messages...), same status code."""
        kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        body: dict[str, Any] = {"type": "error", "error": {"type": kind, "message": self.message}}
        if self.request_id:
            body["request_id"] = self.request_id  # where Anthropic's API puts it
        return body


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "overloaded_error", 504: "api_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def body_for(path: str, err: ApiError) -> dict[str, Any]:
    """An error body in the shape the route's clients parse: Anthropic's on its routes, else OpenAI's."""
    return err.anthropic_body() if any(p in path for p in ANTHROPIC_PATHS) else err.body()


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error", None, "invalid_api_key")


def forbidden(message: str) -> ApiError:
    """A valid key without the scope the route needs (an inference key on an admin route)."""
    return ApiError(403, message, "permission_error", None, "insufficient_scope")


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit} bytes; send a shorter prompt or raise "
                         "limits.max_body_bytes in serve_config.yaml.", "invalid_request_error", None,
                    "request_too_large")


def overloaded(message: str, retry_after_s: float) -> ApiError:
    retry = max(1, int(round(retry_after_s)))
    return ApiError(429, message, "rate_limit_error", None, "overloaded", (("Retry-After", str(retry)),))


def unavailable(message: str, retry_after_s: int = 2) -> ApiError:
    return ApiError(503, message, "service_unavailable", None, "service_unavailable",
                    (("Retry-After", str(retry_after_s)),))


def server_error(message: str, code: str | None = "internal_error") -> ApiError:
    return ApiError(500, message, "server_error", None, code)


def internal_fault(request_id: str) -> ApiError:
    """A fault in the server's own code (not the request's): 500, with the id its log line carries.

    The id goes out in the message and in the headers OpenAI's and Anthropic's clients read
    (`x-request-id`, `request-id`), so a user can quote it and an operator can find the traceback."""
    return ApiError(500, f"The server hit an internal error (request id {request_id}); retrying is safe. If it "
                         "persists, report the request id: the server log has the error under it.",
                    "server_error", None, "internal_error",
                    (("x-request-id", request_id), ("request-id", request_id)), request_id)


def with_request_id(err: ApiError, request_id: str) -> ApiError:
    """A 5xx from the model server (a failed step, a replica error), tagged with the request's id and
    logged under it here (the engine logs its faults under the same id), as `internal_fault` tags the
    ingress's own faults. Client errors (4xx) come back unchanged."""
    if err.status < 500 or err.request_id:
        return err
    log.warning("request %s answered %d %s: %s", request_id, err.status, err.code, err.message)
    return ApiError(err.status, f"{err.message} (request id {request_id})", err.type, err.param, err.code,
                    err.headers + (("x-request-id", request_id), ("request-id", request_id)), request_id)


def timed_out(message: str) -> ApiError:
    """engine.request_timeout_s ran out: 504, as from a gateway whose upstream took too long."""
    return ApiError(504, message, "timeout_error", None, "timeout")
