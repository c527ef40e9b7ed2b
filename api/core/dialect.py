"""One route body for every dialect: read, parse, prepare, start, then stream or answer whole.

A dialect (OpenAI chat and text completions, Anthropic Messages, OpenAI Responses) supplies only its
parser, its error shape and its two renderings; ordering of checks, metrics, n choices and closing the engine streams
on every path (including a client that disconnects mid-stream) live here once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.config import EngineConfig

from api.core.conversation import Completion, Conversation, TextPrompt
from api.core.errors import ApiError, with_request_id
from api.core.fields import Limits
from api.core.generation import Pipeline, Prepared, Run, close_all, start_all
from api.core.metrics import IngressMetrics, request_label
from api.core.streaming import SSEResponse


@dataclass(frozen=True)
class Context:
    """What every rendering of one request needs besides the model's output."""

    rid: str
    created: int
    model: str
    prepared: Prepared

    @property
    def conversation(self) -> Conversation | TextPrompt:
        return self.prepared.conversation


class Dialect(Protocol):
    """What `respond` needs from a dialect; its rooms (api/openai, api/anthropic, api/responses)
    implement it and never import one another."""

    id_prefix: str

    def parse(self, body: dict[str, Any]) -> Conversation | TextPrompt: ...
    def error(self, err: ApiError) -> Response: ...
    def stream(self, ctx: Context, runs: list[Run]) -> AsyncIterator[str]: ...
    def whole(self, ctx: Context, completions: list[Completion]) -> dict[str, Any]: ...


class RouteSettings(Protocol):
    """The settings every dialect's routes read (api.service.settings.AppSettings holds them); a
    dialect that reads more declares its own, wider protocol."""

    @property
    def limits(self) -> Limits: ...
    @property
    def engine(self) -> EngineConfig: ...


class RouteHost(Protocol):
    """What a dialect's route builder needs from the server that mounts it
    (api.service.server.OpenAIServer): the dialect rooms never import the service."""

    pipeline: Pipeline
    metrics: IngressMetrics
    model_name: str

    @property
    def settings(self) -> RouteSettings: ...
    async def read_json(self, request: Request) -> dict[str, Any]: ...
    def tenant(self, request: Request) -> str: ...


async def respond(request: Request, dialect: Dialect, pipeline: Pipeline,
                  read_json: Callable[[Request], Awaitable[dict[str, Any]]],
                  served_name: str) -> Response:
    route, metrics = request_label(request.scope), pipeline.host.metrics
    rid = f"{dialect.id_prefix}{uuid.uuid4().hex}"
    try:
        conv = dialect.parse(await read_json(request))
        prepared = await pipeline.prepare(conv, pipeline.host.salt(request, conv.cache_salt))
        runs = await start_all(pipeline, prepared, rid, conv.n)
    except ApiError as err:
        metrics.count(route, err.status)
        return dialect.error(with_request_id(err, rid))  # a 5xx names the id the model server logged
    ctx = Context(rid, int(time.time()), served_name, prepared)
    if conv.stream:
        metrics.count(route, 200)  # a stream's status goes out before its body
        async def close() -> None:
            await close_all(runs)
        return SSEResponse(dialect.stream(ctx, runs), on_close=close)
    try:
        completions = await asyncio.gather(*(run.drain() for run in runs))
    except ApiError as err:
        metrics.count(route, err.status)
        return dialect.error(with_request_id(err, rid))
    finally:
        await close_all(runs)
    metrics.count(route, 200)
    return JSONResponse(dialect.whole(ctx, list(completions)))
