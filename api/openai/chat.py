"""The OpenAI chat-completions dialect: its request body -> `Conversation`, and its answers.

Tools, `tool_choice`, `parallel_tool_calls`, `response_format`, `n`, `logit_bias`, reasoning
(`reasoning_content`) and history with assistant `tool_calls` / `role: "tool"` results, in the
shapes OpenAI's API and SDK use. Streaming follows OpenAI's delta shape: per call an `index`, its
`id` and name in the first delta, then `arguments` in pieces as they are generated.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Mapping

from starlette.responses import JSONResponse, Response

from engine.types import MAX_LOGPROBS

from api.core.conversation import (Completion, Conversation, Message, OutputEvent, ReasoningDelta, TextDelta, Tool,
                                   ToolArgsDelta, ToolCall, ToolCallStart, ToolChoice)
from api.core.dialect import Context
from api.core.errors import ApiError, invalid, server_error
from api.core.fields import (MAX_TOOLS, Limits, check_choice, message_array, parse_response_format, read_field,
                             sampling_fields, text_content, tool_from)
from api.core.generation import Run, merged
from api.core.streaming import SSE_DONE, error_event, sse
from api.openai.common import common_fields
from api.openai.shapes import LogprobFormatter, chat_chunk, usage_body

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_CHOICES = 16


# ---------------------------------------------------------------------------------------------- parsing


def parse_chat(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int) -> Conversation:
    common = common_fields(body, limits, engine_max_tokens, chat=True)
    want = read_field(body, "logprobs", bool, False)
    top = read_field(body, "top_logprobs", int)
    if top is not None and not want:
        raise invalid("'top_logprobs' needs \"logprobs\": true.", param="top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise invalid(f"'top_logprobs' must be between 0 and {MAX_LOGPROBS}.", param="top_logprobs")
    n = read_field(body, "n", int, 1)
    if not 1 <= n <= MAX_CHOICES:
        raise invalid(f"'n' must be between 1 and {MAX_CHOICES}.", param="n")
    tools = parse_tools(body.get("tools"))
    kwargs = read_field(body, "chat_template_kwargs", dict, {})
    return Conversation(
        model=common["model"], messages=parse_messages(body.get("messages"), limits),
        sampling=sampling_fields(body, limits, (top or 0) if want else None),
        max_tokens=common["max_tokens"], tools=tools, tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=read_field(body, "parallel_tool_calls", bool, True),
        output_format=parse_response_format(body.get("response_format")),
        reasoning_inline=not read_field(body, "separate_reasoning", bool, True),
        chat_template_kwargs=tuple(sorted(kwargs.items())), stream=common["stream"], n=n,
        include_usage=common["include_usage"], logprobs=want, cache_salt=common["cache_salt"])


def parse_tools(value: Any, where: str = "tools") -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(f"'{where}' must be an array of at most {MAX_TOOLS} function tools.", param=where)
    tools = tuple(_tool(t, f"{where}[{i}]") for i, t in enumerate(value))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid(f"'{where}': tool names must be unique.", param=where)
    return tools


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
        raise invalid(f"'{where}' must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"}}}}; "
                      "only function tools are supported.", param=where)
    fn = item["function"]
    return tool_from(fn.get("name"), fn.get("description"), fn.get("parameters"), fn.get("strict"), f"{where}.function")


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto")
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict):
        choice = ToolChoice("named", value["function"].get("name"))
    else:
        raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}.", param="tool_choice")
    return check_choice(choice, tools, "tool_choice")


def parse_messages(value: Any, limits: Limits) -> tuple[Message, ...]:
    value = message_array(value, limits, "send at least one message.")
    return tuple(_message(m, i) for i, m in enumerate(value))


def _message(item: Any, index: int) -> Message:
    where = f"messages[{index}]"
    if not isinstance(item, dict):
        raise invalid(f"'{where}' must be an object with \"role\" and \"content\".", param=where)
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:  # a list or object role is unhashable: check type first
        raise invalid(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}.", param=f"{where}.role")
    calls = _tool_calls(item.get("tool_calls"), where) if role == "assistant" else ()
    content = item.get("content")
    if content is None and (calls or role == "assistant"):
        content = ""  # an assistant turn that only called tools sends content null
    text = text_content(content, f"{where}.content")
    if role == "tool":
        call_id = item.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"'{where}.tool_call_id' is required on a tool result.", param=f"{where}.tool_call_id")
        return Message("tool", text, tool_call_id=call_id, name=item.get("name") if isinstance(item.get("name"), str)
                       else None)
    reasoning = item.get("reasoning_content", item.get("reasoning"))
    return Message(ROLES[role], text, calls, reasoning=reasoning if isinstance(reasoning, str) else None)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(f"'{where}.tool_calls' must be an array.", param=f"{where}.tool_calls")
    calls = []
    for i, call in enumerate(value):
        here = f"{where}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid(f"'{here}' must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                          "\"arguments\"}}}}.", param=here)
        calls.append(ToolCall(str(call.get("id") or f"call_{i}"), fn["name"], _arguments(fn.get("arguments"), here)))
    return tuple(calls)


def _arguments(value: Any, where: str) -> str:
    """Arguments JSON text; some clients send an object instead of OpenAI's string."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, str):
        try:
            json.loads(value or "{}")
        except ValueError:
            raise invalid(f"'{where}.function.arguments' must be JSON text.", param=f"{where}.function.arguments")
        return value or "{}"
    raise invalid(f"'{where}.function.arguments' must be a JSON string.", param=f"{where}.function.arguments")


# ---------------------------------------------------------------------------------------------- answers


def _call_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def delta_of(event: OutputEvent) -> dict[str, Any] | None:
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    if isinstance(event, ToolArgsDelta):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    return None  # ToolCallEnd: the client has the whole call already


def merge_deltas(events: list[OutputEvent]) -> list[dict[str, Any]]:
    """Deltas of one batch, neighbours of the same kind joined: one chunk each, fewer SSE writes."""
    out: list[dict[str, Any]] = []
    for event in events:
        delta = delta_of(event)
        if delta is None:
            continue
        last = out[-1] if out else None
        if last is not None and isinstance(event, (TextDelta, ReasoningDelta)) and set(last) == set(delta):
            key = next(iter(delta))
            last[key] += delta[key]
        elif (last is not None and isinstance(event, ToolArgsDelta) and "tool_calls" in last
              and last["tool_calls"][0]["index"] == event.index):
            last["tool_calls"][0]["function"]["arguments"] += event.text
        else:
            out.append(delta)
    return out


class OpenAIChat:
    id_prefix = "chatcmpl-"

    def __init__(self, limits: Limits, engine_max_tokens: int, decode: Any) -> None:
        self.limits, self.engine_max_tokens, self.decode = limits, engine_max_tokens, decode

    def parse(self, body: dict[str, Any]) -> Conversation:
        return parse_chat(body, self.limits, self.engine_max_tokens)

    def error(self, err: ApiError) -> Response:
        return JSONResponse(err.body(), status_code=err.status, headers=dict(err.headers))

    def whole(self, ctx: Context, completions: list[Completion]) -> dict[str, Any]:
        conv, fmt = ctx.conversation, LogprobFormatter(self.decode())
        choices = []
        for i, c in enumerate(completions):
            message: dict[str, Any] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None}
            if c.tool_calls:
                message["tool_calls"] = [_call_body(call) for call in c.tool_calls]
            if c.reasoning:
                message["reasoning_content"] = c.reasoning
            lps = {"content": fmt.chat(c.logprobs)} if conv.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lps, "finish_reason": c.finish})
        usage = _total_usage(completions)
        return {"id": ctx.rid, "object": "chat.completion", "created": ctx.created, "model": ctx.model,
                "choices": choices, "usage": usage}

    async def stream(self, ctx: Context, runs: list[Run]) -> AsyncIterator[str]:
        conv, fmt = ctx.conversation, LogprobFormatter(self.decode())

        def chunk(i: int, delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> str:
            body = chat_chunk(ctx.rid, ctx.created, ctx.model, delta, finish, lps, with_usage=conv.include_usage)
            body["choices"][0]["index"] = i
            return sse(body)
        yield "".join(chunk(i, {"role": "assistant", "content": ""}) for i in range(len(runs)))
        try:
            async for i, events in merged(runs):
                deltas = merge_deltas(events)
                lps = runs[i].batch_logprobs
                if conv.logprobs and lps:
                    deltas = deltas or [{}]
                parts = [chunk(i, d, lps=fmt.chat(lps) if conv.logprobs and not k else None)
                         for k, d in enumerate(deltas)]
                done = runs[i].completion
                if done is not None:
                    parts.append(chunk(i, {}, done.finish))
                if parts:
                    yield "".join(parts)
        except ApiError as err:  # the model server failed after the first token: say so, then end
            yield error_event(err) + SSE_DONE
            return
        except Exception:
            yield error_event(server_error("The server failed while streaming; retry the request.")) + SSE_DONE
            raise
        tail = ""
        if conv.include_usage:
            usage = _total_usage([r.completion for r in runs if r.completion is not None])
            tail = sse({"id": ctx.rid, "object": "chat.completion.chunk", "created": ctx.created,
                           "model": ctx.model, "choices": [], "usage": usage})
        yield tail + SSE_DONE


def _total_usage(completions: list[Completion]) -> dict[str, Any]:
    """n choices share one prompt: it counts once, as in OpenAI's usage."""
    if not completions:
        return usage_body({})
    first = completions[0].usage
    return usage_body({"prompt_tokens": first.prompt_tokens, "cached_tokens": first.cached_tokens,
                          "completion_tokens": sum(c.usage.completion_tokens for c in completions)})
