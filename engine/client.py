"""The engine's interface to whoever hosts it: declared once, kept by both implementations.

`engine.loop.AsyncEngine` runs the engine in this process; `deployments.engine_process.EngineProcess`
runs it in a process of its own and speaks for it across a socket. The replica's `EngineHost` takes
either (serve_config.yaml's `engine_process`), and the engine process's worker serves an
`AsyncEngine` with the same calls, so a change to one side of this seam is a change to this
protocol (tests/engine/test_engine_client.py holds both classes to it).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Protocol

from engine.types import Request, TokenEvent


class EngineClient(Protocol):
    model_name: str
    context_length: int

    @property
    def ready(self) -> bool:
        """Loaded and serving (a stopped engine still counts: its refusals say it is shutting down)."""

    @property
    def alive(self) -> bool:
        """Ready, and its thread or process still running (the health check)."""

    async def wait_ready(self, timeout: float | None = None) -> None: ...

    def stream(self, request: Request, text: bool = True) -> AsyncIterator[list[TokenEvent]]:
        """Events in batches; refusals raised before the first; leaving early aborts the request.
        `text=False`: a request without stop strings comes as tokens alone, its text for the caller
        to make (`engine.text.ConsumerText`) in another process."""

    def generate(self, request: Request) -> AsyncIterator[TokenEvent]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    async def ping(self) -> None: ...

    async def deep_reset(self) -> int: ...

    async def clear_cache(self, tier: str = "all") -> dict[str, Any]: ...

    async def cache_stats(self) -> dict[str, Any]: ...

    async def flush_cache(self) -> dict[str, Any]: ...

    async def held_prefixes(self, limit: int) -> list[Any]: ...

    async def requests_status(self) -> list[dict[str, Any]]: ...

    async def shutdown(self, drain_s: float = 0.0) -> None: ...
