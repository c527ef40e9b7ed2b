"""API errors in OpenAI's shape, raised anywhere in the HTTP layer and rendered in one place."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error a client can act on: `message` says what went wrong and what to do instead.

    A plain class, not a frozen dataclass: the interpreter and contextlib assign `__traceback__`
    on exceptions, which a frozen dataclass refuses.
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",  # noqa: A002
                 param: str | None = None, code: str | None = None,
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def __str__(self) -> str:
        return f"{self.status} {self.type}: {self.message}"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


def not_found(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(404, message, "invalid_request_error", param, code)


def unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "authentication_error", None, "invalid_api_key")


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


def timed_out(message: str) -> ApiError:
    """engine.request_timeout_s ran out: 504, as from a gateway whose upstream took too long."""
    return ApiError(504, message, "timeout_error", None, "timeout")
