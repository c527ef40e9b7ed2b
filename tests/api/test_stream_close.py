"""Every started run is closed, however the client leaves (api/core/generation.py `start_all`,
api/core/streaming.py `SSEResponse`): a run counts itself in the in-flight gauge and holds the
engine's request until it is closed (tests/e2e/test_reliability_overload.py's soak saw the gauge
stay at 1 after random disconnects)."""

from __future__ import annotations

import asyncio
from typing import Any

import anyio
import pytest

from api.core.generation import start_all
from api.core.streaming import SSEResponse


class FakeRun:
    def __init__(self, closed: list[int], i: int) -> None:
        self.closed, self.i = closed, i

    async def close(self) -> None:
        self.closed.append(self.i)


class SlowPipeline:
    """Choice 0 starts at once, the others never (until cancelled)."""

    def __init__(self) -> None:
        self.closed: list[int] = []

    async def start(self, prepared: Any, rid: str, choice: int = 0) -> FakeRun:
        if choice:
            await asyncio.Event().wait()
        return FakeRun(self.closed, choice)


def test_a_client_leaving_while_choices_start_closes_those_that_started() -> None:
    async def run() -> list[int]:
        pipeline = SlowPipeline()
        task = asyncio.ensure_future(start_all(pipeline, None, "r", 3))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pipeline.closed

    assert asyncio.run(run()) == [0]


def test_one_choice_starts_without_a_task_in_between() -> None:
    async def run() -> list[FakeRun]:
        return await start_all(SlowPipeline(), None, "r", 1)  # type: ignore[arg-type]

    assert [r.i for r in asyncio.run(run())] == [0]


def test_the_sse_response_closes_its_runs_when_its_task_is_cancelled() -> None:
    """anyio cancels every await inside a cancelled scope again: the body's own cleanup awaits, and
    an unshielded close after it would never run."""
    closed: list[str] = []

    async def body():
        # No await between items: the cancellation lands in `send` (a slow client), never inside
        # the body, whose own frame would then run its cleanup still cancelled (and skip it). Where
        # it lands decided the outcome before, and CI saw ["runs"] once.
        try:
            while True:
                yield "data: x\n\n"
        finally:
            await anyio.sleep(0)  # cleanup that awaits (as a dialect's stream does)
            closed.append("body")

    async def on_close() -> None:
        await anyio.sleep(0)
        closed.append("runs")

    async def send(message: dict) -> None:
        await anyio.sleep(0.01)

    async def receive() -> dict:
        await anyio.sleep(10)
        return {"type": "http.disconnect"}

    async def main() -> None:
        response = SSEResponse(body(), on_close=on_close)
        scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "method": "GET", "path": "/"}
        async with anyio.create_task_group() as group:
            group.start_soon(response, scope, receive, send)
            await anyio.sleep(0.05)
            group.cancel_scope.cancel()

    anyio.run(main)
    assert closed == ["body", "runs"]
