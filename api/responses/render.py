"""OpenAI Responses answers: the response object and its server-sent events (no HTTP, no store).

Output items, in generation order: `reasoning` (the model's reasoning as `reasoning_text` content;
no summary is made), `message` (one `output_text` part), `function_call` (`call_id` is Pomona's
call id, which a `function_call_output` names). A stream is OpenAI's event sequence, every event
with a `sequence_number`: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its parts and deltas (`response.output_text.delta`,
`response.reasoning_text.delta`, `response.function_call_arguments.delta` in pieces as generated)
and `response.output_item.done`, then `response.completed` (`response.incomplete` when cut by
`max_output_tokens`). A failure after the first token ends the stream with `error` and
`response.failed`. Pomona does not count cache writes or reasoning tokens: both are reported as 0.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from api.core.conversation import (Completion, Message, OutputEvent, ReasoningDelta, TextDelta, ToolArgsDelta,
                                   ToolCallEnd, ToolCallStart, Usage)
from api.core.errors import ApiError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_body(u: Usage) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


def response_object(rid: str, created: int, model: str, echo: dict[str, Any], *, status: str,
                    output: list[dict[str, Any]], usage: Usage | None, previous: str | None,
                    store: bool) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": model, "output": output, "usage": usage_body(usage) if usage is not None else None,
            "previous_response_id": previous, "store": store, "background": False, **echo}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status != "in_progress" else []}


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}


def call_item(call_id: str, name: str, arguments: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def status_of(c: Completion) -> str:
    return "incomplete" if c.finish == "length" else "completed"


def output_items(c: Completion) -> list[dict[str, Any]]:
    """A whole answer's items: reasoning, the message (unless the answer is only calls, or was cut
    off while reasoning), then calls."""
    item_status = status_of(c)
    items = [reasoning_item(c.reasoning, item_status)] if c.reasoning else []
    if c.text or not (c.tool_calls or c.reasoning):
        items.append(message_item(c.text, item_status))
    items += [call_item(call.id, call.name, call.arguments, "completed") for call in c.tool_calls]
    return items


def input_items(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """A turn's input messages as OpenAI's input items, for `GET /v1/responses/{id}/input_items`:
    user / system turns as input messages, an assistant turn as its reasoning, message and
    function_call items, a tool result as a function_call_output item."""
    items: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "tool":
            items.append({"id": new_id("fco"), "type": "function_call_output", "call_id": m.tool_call_id,
                          "output": m.content, "status": "completed"})
        elif m.role != "assistant":
            items.append({"id": new_id("msg"), "type": "message", "role": m.role, "status": "completed",
                          "content": [{"type": "input_text", "text": m.content}]})
        else:
            items += [reasoning_item(m.reasoning, "completed")] if m.reasoning else []
            items += [message_item(m.content, "completed")] if m.content or not m.tool_calls else []
            items += [call_item(c.id, c.name, c.arguments, "completed") for c in m.tool_calls]
    return items


def item_page(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> dict[str, Any] | None:
    """One page of `items` in OpenAI's list shape (`order` "asc" or "desc", `after` an item id);
    None when `after` names no item."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [i.get("id") for i in ordered]
        if after not in ids:
            return None
        start = ids.index(after) + 1
    data = ordered[start:start + limit]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": start + limit < len(ordered)}


class EventWriter:
    """Turns `OutputEvent`s into Responses SSE text, keeping the items as they were streamed."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self._open: int | None = None  # output index of the open message / reasoning item
        self._text: dict[int, str] = {}  # output index -> text so far (message or reasoning)
        self._calls: dict[int, int] = {}  # the call's event index -> its output index

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def start(self, response: dict[str, Any]) -> str:
        return self.event("response.created", response=response) + self.event("response.in_progress",
                                                                               response=response)

    def feed(self, events: list[OutputEvent]) -> str:
        return "".join(self._one(e) for e in events)

    def _one(self, e: OutputEvent) -> str:
        if isinstance(e, (TextDelta, ReasoningDelta)):
            kind = "message" if isinstance(e, TextDelta) else "reasoning"
            out = self._open_text(kind)
            index = self._open
            assert index is not None
            self._text[index] += e.text
            delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            return out + self.event(delta, item_id=self.items[index]["id"], output_index=index, content_index=0,
                                    delta=e.text, **extra)
        if isinstance(e, ToolCallStart):
            out = self.close_open("completed")
            self._calls[e.index] = len(self.items)
            self.items.append(call_item(e.id, e.name, "", "in_progress"))
            return out + self.event("response.output_item.added", output_index=len(self.items) - 1,
                                    item=self.items[-1])
        if isinstance(e, ToolArgsDelta):
            index = self._calls[e.index]
            self.items[index]["arguments"] += e.text
            return self.event("response.function_call_arguments.delta", item_id=self.items[index]["id"],
                              output_index=index, delta=e.text)
        assert isinstance(e, ToolCallEnd)
        return self._end_call(self._calls[e.index], e.call.arguments, "completed")

    def _end_call(self, index: int, arguments: str, status: str) -> str:
        item = self.items[index]
        item.update(arguments=arguments, status=status)
        return (self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=arguments)
                + self.event("response.output_item.done", output_index=index, item=item))

    def _open_text(self, kind: str) -> str:
        if self._open is not None and self.items[self._open]["type"] == kind:
            return ""
        out = self.close_open("completed")
        index = len(self.items)
        self.items.append(message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress"))
        self._open, self._text[index] = index, ""
        part = text_part("") if kind == "message" else {"type": "reasoning_text", "text": ""}
        item_id = self.items[index]["id"]
        return (out + self.event("response.output_item.added", output_index=index, item=self.items[index])
                + self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                             part=part))

    def close_open(self, status: str) -> str:
        """Close the open message or reasoning item (calls close at their own end)."""
        index, self._open = self._open, None
        if index is None:
            return ""
        item, text = self.items[index], self._text[index]
        done = message_item(text, status, item["id"]) if item["type"] == "message" else \
            reasoning_item(text, status, item["id"])
        self.items[index] = done
        part = done["content"][0]
        common = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            text_done = self.event("response.output_text.done", text=text, logprobs=[], **common)
        else:
            text_done = self.event("response.reasoning_text.done", text=text, **common)
        return (text_done + self.event("response.content_part.done", part=part, **common)
                + self.event("response.output_item.done", output_index=index, item=done))

    def finish(self, status: str) -> str:
        """Close what is still open at the end (a call cut by the length limit ends incomplete)."""
        out = self.close_open(status)
        for index in self._calls.values():
            if self.items[index]["status"] == "in_progress":
                out += self._end_call(index, self.items[index]["arguments"], "incomplete")
        return out

    def end(self, response: dict[str, Any]) -> str:
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=response)

    def failed(self, err: ApiError, response: dict[str, Any]) -> str:
        failed = {**response, "status": "failed", "output": self.items,
                  "error": {"code": "server_error", "message": err.message}}
        return (self.event("error", code=err.code, message=err.message, param=err.param)
                + self.event("response.failed", response=failed))
