"""Server-sent events and the per-request output tracker, shared by every dialect (no Ray).

Each batch from the LLM server becomes at most one SSE write: tokens that arrived together (the
client or the network was slower than generation) go out together, and nothing waits for more.
"""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from api.core.errors import ApiError, server_error, timed_out, unavailable
from api.core.metrics import IngressMetrics


def sse(obj: Mapping[str, Any]) -> str:
    """One server-sent event of a JSON object (OpenAI's framing: `data:` only, no event name)."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"  # OpenAI's end of stream; `sse_events` ends every stream with it


def error_event(err: ApiError) -> str:
    return sse(err.body())


def finish_error(finish: str | None, error: str | None, code: str | None = None) -> ApiError | None:
    """An engine ending that the client must see as an error rather than a normal finish."""
    if finish in ("error", "abort") and code == "timeout":
        return timed_out(error or "The request ran past the server's time limit; ask for fewer tokens or retry.")
    if finish in ("error", "abort") and code in ("reset", "shutdown"):
        return unavailable(error or "The server reset or stopped while running this request; retry it.")
    if finish == "error":
        return server_error(error or "The server failed while generating; retrying the request is safe.",
                            code="generation_failed")
    if finish == "abort":
        return unavailable(error or "The server stopped this request (it is shutting down); retry it.")
    return None


class Tracker:
    """Accumulates one request's output across batches and records its latencies."""

    def __init__(self, metrics: IngressMetrics, started: float) -> None:
        self.metrics, self.started = metrics, started
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.usage: dict[str, Any] = {}
        self.error: ApiError | None = None
        self.last: float | None = None
        self.offset = 0  # characters emitted so far: completions' logprobs text_offset
        self.batch_offset = 0

    @property
    def done(self) -> bool:
        return self.finish is not None

    def add(self, batch: list[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        """Fold in one batch; returns its new text and logprob items."""
        now = time.monotonic()
        tokens = sum(1 for e in batch if e.get("token") is not None)
        if self.last is None:
            self.metrics.ttft.observe(now - self.started)
        elif tokens:
            # Tokens that arrived together were generated over the whole gap: spread it evenly.
            self.metrics.inter_token((now - self.last) / tokens, tokens)
        if tokens or self.last is None:
            self.last = now
        text = "".join(e.get("text") or "" for e in batch)
        self.batch_offset = self.offset
        self.offset += len(text)
        lps = [e["lp"] for e in batch if e.get("lp") is not None]
        self.text.append(text)
        self.logprobs += lps
        final = batch[-1] if batch else {}
        if final.get("finish"):
            self.finish = final["finish"]
            self.usage = dict(final.get("usage") or {})
            self.error = finish_error(self.finish, final.get("error"), final.get("code"))
            self.metrics.usage(self.usage)
            self.metrics.e2e.observe(now - self.started)
        return text, lps


async def sse_events(first: list[Any], rest: AsyncIterator[Any], tracker: Tracker,
                     render: Callable[[str, list[dict[str, Any]], str | None, int], list[dict[str, Any]]],
                     usage_chunk: Callable[[dict[str, Any]], dict[str, Any]] | None,
                     preamble: list[dict[str, Any]]) -> AsyncIterator[str]:
    """SSE text for one request: preamble (chat's role delta) with the first batch, then one write per batch."""
    pending = [sse(c) for c in preamble]
    batch: list[Any] | None = first
    try:
        while batch is not None:
            text, lps = tracker.add(batch)
            finish = tracker.finish if tracker.error is None else None
            if tracker.error is not None:
                pending.append(error_event(tracker.error))
            elif text or lps or finish:
                pending += [sse(c) for c in render(text, lps, finish, tracker.batch_offset)]
            if tracker.done:
                break
            if pending:
                yield "".join(pending)
                pending = []
            batch = await rest.__anext__()
    except StopAsyncIteration:
        pending.append(error_event(server_error("The model server ended the stream early; retry the request.")))
    except ApiError as err:  # the model server failed after the first token: say so, then end the stream
        pending.append(error_event(err))
    if usage_chunk is not None and tracker.done and tracker.error is None:
        pending.append(sse(usage_chunk(tracker.usage)))
    pending.append(SSE_DONE)
    yield "".join(pending)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its source, so a client disconnect aborts generation.

    Starlette stops sending on disconnect (cancelling its task, or returning normally under ASGI
    < 2.4) but never closes the body iterator; left open, the request would keep running in the
    engine until garbage collection. `on_close` runs in every case.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Shielded: a disconnect cancels this task through anyio's cancel scope, which cancels
            # every await inside it again (level-triggered), so an unshielded `aclose` would raise
            # and `on_close` (which closes the runs: the in-flight gauge, the engine's request)
            # would never run.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._on_close()
