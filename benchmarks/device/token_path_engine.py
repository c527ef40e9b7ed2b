"""A model-free engine for benchmarks/device/token_path.py: `AsyncEngine`'s streaming interface, no MLX.

One asyncio task steps every `step_s` seconds and hands each running request one token, the way
`AsyncEngine` hands a step's events to each request's queue; `stream()` returns everything queued
since the consumer last asked, as `AsyncEngine.stream` does. So `EngineHost` (and its pacing) runs
unchanged on top, and what the probe measures is the serving path alone.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from engine.types import FinishReason, Request, TokenEvent, Usage


class SyntheticEngine:
    """Emits token i of every running request at step i; a request ends after `max_tokens`."""

    model_name = "synthetic"
    context_length = 1 << 20
    ready = True

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._queues: dict[str, tuple[asyncio.Queue, int, int]] = {}  # id -> (queue, made, max_tokens)
        self._ticker: asyncio.Task | None = None
        self.steps = 0

    async def wait_ready(self) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._queues), "waiting": 0, "steps": self.steps}

    async def held_prefixes(self, limit: int) -> list[Any]:
        return []  # no prefix cache: nothing for a router to prefer

    def abort(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def shutdown(self, drain_s: float = 0.0) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    async def _tick(self) -> None:
        next_at = time.monotonic()
        while self._queues:
            next_at += self.step_s
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            self.steps += 1
            for rid, (queue, made, limit) in list(self._queues.items()):
                made += 1
                done = made >= limit
                queue.put_nowait(TokenEvent(
                    request_id=rid, token_id=made % 1000, text=" tok",
                    finish_reason=FinishReason.LENGTH if done else None,
                    usage=Usage(prompt_tokens=1, completion_tokens=made) if done else None))
                if done:
                    del self._queues[rid]
                else:
                    self._queues[rid] = (queue, made, limit)
        self._ticker = None

    async def stream(self, request: Request) -> AsyncIterator[list[TokenEvent]]:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request.request_id] = (queue, 0, request.params.max_tokens)
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick())
        finished = False
        try:
            while not finished:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = batch[-1].finished
                yield batch
        finally:
            if not finished:
                self.abort(request.request_id)
