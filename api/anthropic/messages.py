"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Requests parse in api.anthropic.request; this module renders the shared pipeline's output
in Anthropic's shapes: a whole `message`, or its server-sent events (`message_start`, `ping`,
`content_block_start` / `_delta` / `_stop` per block, `message_delta`, `message_stop`; an `error`
event if the model server fails mid-stream).

Usage: `input_tokens` excludes the tokens served from Pomona's prefix cache, which are
`cache_read_input_tokens`, as Anthropic counts them (their sum is the prompt's length);
`cache_creation_input_tokens` is always 0 (caching is automatic and free). A stream's
`message_start` cannot know the cached share yet (the engine reports it at the end): it carries
the whole prompt as `input_tokens`, and `message_delta` carries the final split, which the SDK
applies over it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.anthropic.request import parse_messages_request
from api.core.conversation import (Completion, Conversation, OutputEvent, ReasoningDelta, TextDelta,
                                   ToolArgsDelta, ToolCall, ToolCallEnd, ToolCallStart, Usage)
from api.core.dialect import Context, RouteHost, respond
from api.core.errors import ApiError, server_error
from api.core.fields import Limits
from api.core.generation import Run, merged
from api.core.metrics import request_label

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def tool_use_id(call_id: str) -> str:
    """Pomona's call id in Anthropic's form; the same id in the stream and the whole message."""
    return call_id if call_id.startswith("toolu_") else "toolu_" + call_id.removeprefix("call_")


def signature(thinking: str) -> str:
    """An opaque signature for a thinking block (clients pass it back; Pomona does not check it)."""
    return "pomona-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def tool_input(call: ToolCall) -> dict[str, Any]:
    """The call's input object; {} for arguments that are not one (a call cut off by max_tokens
    keeps the text generated so far, api.output.parser), as `input` must be an object."""
    try:
        value = call.arguments_object()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(c: Completion) -> str:
    if c.finish == "stop" and c.stop_sequence:
        return "stop_sequence"
    return STOP_REASONS.get(c.finish, "end_turn")


def usage_body(u: Usage) -> dict[str, int]:
    return {"input_tokens": max(u.prompt_tokens - u.cached_tokens, 0), "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def content_blocks(c: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if c.reasoning:
        blocks.append({"type": "thinking", "thinking": c.reasoning, "signature": signature(c.reasoning)})
    if c.text or not c.tool_calls:  # never an empty content list: clients read content[0]
        blocks.append({"type": "text", "text": c.text})
    blocks += [{"type": "tool_use", "id": tool_use_id(t.id), "name": t.name, "input": tool_input(t)}
               for t in c.tool_calls]
    return blocks


def message_body(rid: str, model: str, content: list[dict[str, Any]], stop: str | None,
                 stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
    return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": stop_sequence, "usage": usage}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(err: ApiError) -> str:
    body = err.anthropic_body()
    return event("error", {"error": body["error"]})


# ---------------------------------------------------------------------------------------------- stream


class BlockWriter:
    """Output events -> content block events, one block open at a time, indices in order.

    A call's arguments stream as `input_json_delta` pieces as they are generated; a call whose
    syntax hands it over whole (no ToolArgsDelta) sends its arguments as one piece at its end.
    """

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "text", "thinking" or "tool_use"
        self.thinking = ""
        self.streamed_args = False

    def _start(self, kind: str, block: dict[str, Any]) -> str:
        out = self.close()
        self.index += 1
        self.open, self.thinking, self.streamed_args = kind, "", False
        return out + event("content_block_start", {"index": self.index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def close(self) -> str:
        if self.open is None:
            return ""
        out = self._delta({"type": "signature_delta", "signature": signature(self.thinking)}) \
            if self.open == "thinking" else ""
        self.open = None
        return out + event("content_block_stop", {"index": self.index})

    def feed(self, e: OutputEvent) -> str:
        if isinstance(e, (TextDelta, ReasoningDelta)) and not e.text:
            return ""
        if isinstance(e, TextDelta):
            head = "" if self.open == "text" else self._start("text", {"type": "text", "text": ""})
            return head + self._delta({"type": "text_delta", "text": e.text})
        if isinstance(e, ReasoningDelta):
            head = "" if self.open == "thinking" else self._start(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += e.text
            return head + self._delta({"type": "thinking_delta", "thinking": e.text})
        if isinstance(e, ToolCallStart):
            return self._start("tool_use", {"type": "tool_use", "id": tool_use_id(e.id), "name": e.name, "input": {}})
        if isinstance(e, ToolArgsDelta) and self.open == "tool_use" and e.text:
            self.streamed_args = True
            return self._delta({"type": "input_json_delta", "partial_json": e.text})
        if isinstance(e, ToolCallEnd) and self.open == "tool_use":
            tail = "" if self.streamed_args else self._delta(
                {"type": "input_json_delta", "partial_json": json.dumps(tool_input(e.call), ensure_ascii=False)})
            return tail + self.close()
        return ""

    def finish(self) -> str:
        if self.index < 0:  # nothing was said: one empty text block, as the whole message has
            return self._start("text", {"type": "text", "text": ""}) + self.close()
        return self.close()


# ---------------------------------------------------------------------------------------------- dialect


class AnthropicMessages:
    id_prefix = "msg_"

    def __init__(self, limits: Limits, engine_max_tokens: int) -> None:
        self.limits, self.engine_max_tokens = limits, engine_max_tokens

    def parse(self, body: dict[str, Any]) -> Conversation:
        return parse_messages_request(body, self.limits, self.engine_max_tokens)

    def error(self, err: ApiError) -> Response:
        return JSONResponse(err.anthropic_body(), status_code=err.status, headers=dict(err.headers))

    def whole(self, ctx: Context, completions: list[Completion]) -> dict[str, Any]:
        c = completions[0]  # n is always 1 here
        return message_body(ctx.rid, ctx.model, content_blocks(c), stop_reason(c), c.stop_sequence,
                            usage_body(c.usage))

    async def stream(self, ctx: Context, runs: list[Run]) -> AsyncIterator[str]:
        start = usage_body(Usage(prompt_tokens=len(ctx.prepared.tokens)))
        yield (event("message_start", {"message": message_body(ctx.rid, ctx.model, [], None, None, start)})
               + event("ping", {}))
        writer, run = BlockWriter(), runs[0]
        try:
            async for _, events in merged(runs):
                text = "".join(writer.feed(e) for e in events)
                if text:
                    yield text
        except ApiError as err:  # the model server failed after the first token: say so, then end
            yield error_event(err)
            return
        except Exception:
            yield error_event(server_error("The server failed while streaming; retry the request."))
            raise
        done = run.completion
        if done is None:  # Run raises when the engine stream ends early; this is a guard, not a path
            yield error_event(server_error("The model server ended the stream early; retry the request."))
            return
        yield (writer.finish()
               + event("message_delta", {"delta": {"stop_reason": stop_reason(done), "stop_sequence": done.stop_sequence},
                                         "usage": usage_body(done.usage)})
               + event("message_stop", {}))


# ---------------------------------------------------------------------------------------------- routes


def routes(server: RouteHost) -> list[Route]:
    dialect = AnthropicMessages(server.settings.limits, server.settings.engine.max_tokens_limit)

    async def messages(request: Request) -> Response:
        return await respond(request, dialect, server.pipeline, server.read_json, server.model_name)

    async def count_tokens(request: Request) -> Response:
        try:
            conv = parse_messages_request(await server.read_json(request), dialect.limits,
                                          dialect.engine_max_tokens, counting=True)
            n = await server.pipeline.count_tokens(conv)
        except ApiError as err:
            server.metrics.count(request_label(request.scope), err.status)
            return dialect.error(err)
        server.metrics.count(request_label(request.scope), 200)
        return JSONResponse({"input_tokens": n})

    return [Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"])]
