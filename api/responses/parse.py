"""The OpenAI Responses request body -> `Conversation` (no HTTP, no store).

Shapes follow OpenAI's Responses API and the `openai` SDK's `client.responses.create`: `input` as a
string or items (messages, `function_call`, `function_call_output`, `reasoning`), `instructions`,
flat function tools (`{"type": "function", "name", "parameters", "strict"}`, strict unless
`"strict": false`, as on OpenAI), `tool_choice`, `text.format` (flat json_schema). Built-in tools
and server-side features Pomona lacks (`background`, `conversation`, `prompt`) are a 400 naming the
field; fields that change nothing a client gets back (`include`, `truncation`, `service_tier`, ...)
are accepted; any other unknown field is a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from api.core.conversation import Conversation, Message, OutputFormat, Tool, ToolCall, ToolChoice
from api.core.errors import invalid
from api.core.fields import (MAX_METADATA_KEY, MAX_METADATA_PAIRS, MAX_METADATA_VALUE, MAX_TOOLS, Limits, check_choice,
                             parse_response_format, read_cache_salt, read_field, sampling_fields, tool_from)

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
BUILT_IN_TOOLS = frozenset({"web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                            "code_interpreter", "computer_use_preview", "computer", "image_generation", "mcp",
                            "local_shell", "shell", "apply_patch", "custom", "tool_search", "namespace"})
REFUSED = {
    "background": "background responses are not supported; send the request without it and wait for the answer",
    "conversation": "conversations are not supported; chain responses with 'previous_response_id'",
    "prompt": "prompt templates are not supported; send 'input' and 'instructions'",
}
ACCEPTED = frozenset({  # OpenAI's fields that change nothing Pomona sends back, or are echoed only
    "include", "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
    "prompt_cache_options", "service_tier", "truncation", "stream_options", "max_tool_calls", "access_programs",
    "background_options", "context_management", "image", "moderation", "store", "previous_response_id",
})
ACCEPTED_TYPES = {"metadata": dict, "user": str, "safety_identifier": str, "prompt_cache_key": str,
                  "prompt_cache_retention": str, "service_tier": str, "stream_options": dict, "max_tool_calls": int}
FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                    "max_output_tokens", "temperature", "top_p", "text", "stream", "reasoning", "top_logprobs"})
EXTENSIONS = frozenset({"top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                        "stop", "ignore_eos", "logit_bias", "chat_template_kwargs",
                        "cache_salt"})  # as on /v1/chat/completions
EFFORTS = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


@dataclass(frozen=True)
class ParsedResponse:
    """A parsed request: the conversation for the pipeline, what to echo in the response object,
    and this turn's own messages (the new input, without instructions or the predecessor's)."""

    conversation: Conversation
    echo: dict[str, Any]
    turn: tuple[Message, ...]
    history: tuple[Message, ...]  # the predecessor's conversation, prepended
    store: bool
    previous_response_id: str | None


def store_fields(body: Mapping[str, Any]) -> tuple[bool, str | None]:
    """`store` (default true, as OpenAI) and `previous_response_id`, read before the rest: the route
    fetches the predecessor before parsing."""
    store = read_field(body, "store", bool, True)
    previous = read_field(body, "previous_response_id", str)
    if previous is not None and not previous:
        raise invalid("'previous_response_id' is empty; send a response id (\"resp_...\") or leave it out.",
                      param="previous_response_id")
    return store, previous


def parse_responses(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int,
                    history: tuple[Message, ...] = ()) -> ParsedResponse:
    _check_fields(body)
    store, previous = store_fields(body)
    model = read_field(body, "model", str)
    if not model:
        raise invalid("'model' is required; GET /v1/models lists the served model.", param="model")
    if read_field(body, "top_logprobs", int, 0):
        raise invalid("'top_logprobs' is not supported on /v1/responses; leave it out "
                      "(/v1/chat/completions returns logprobs).", param="top_logprobs")
    instructions = read_field(body, "instructions", str)
    turn = parse_input(body.get("input"), limits)
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    fmt, text_echo = parse_text(body.get("text"))
    reasoning, kwargs = parse_reasoning(body.get("reasoning"), read_field(body, "chat_template_kwargs", dict, {}))
    max_tokens = _max_output_tokens(body, min(limits.max_tokens or engine_max_tokens, engine_max_tokens))
    sampling = sampling_fields(body, limits, None)
    system = (Message("system", instructions),) if instructions else ()
    conv = Conversation(
        model=model, messages=system + history + turn, sampling=sampling, max_tokens=max_tokens, tools=tools,
        tool_choice=choice, parallel_tool_calls=read_field(body, "parallel_tool_calls", bool, True),
        output_format=fmt, chat_template_kwargs=tuple(sorted(kwargs.items())),
        stream=read_field(body, "stream", bool, False), format_param="text.format", tools_param="tools",
        cache_salt=read_cache_salt(body))
    metadata = body.get("metadata") or {}
    echo = {"instructions": instructions, "max_output_tokens": max_tokens,
            "parallel_tool_calls": conv.parallel_tool_calls, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "tools": [tool_echo(t) for t in tools], "tool_choice": choice_echo(choice),
            "text": text_echo, "reasoning": reasoning, "metadata": metadata,
            "user": body.get("user"), "truncation": body.get("truncation") or "disabled"}
    return ParsedResponse(conv, echo, turn, history, store, previous)


def _check_fields(body: Mapping[str, Any]) -> None:
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, {}, ""):
            raise invalid(f"'{name}': {why}.", param=name)
    for name in body:
        if name not in FIELDS and name not in ACCEPTED and name not in EXTENSIONS and name not in REFUSED:
            raise invalid(f"'{name}' is not a field of /v1/responses; remove it.", param=name)
    for name, kind in ACCEPTED_TYPES.items():  # accepted, not used: still the type OpenAI documents
        read_field(body, name, kind)
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        raise invalid("'include' must be an array of strings.", param="include")
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise invalid("'truncation' must be \"auto\" or \"disabled\".", param="truncation")
    check_metadata(body.get("metadata") or {})


def check_metadata(metadata: Mapping[str, Any]) -> None:
    """OpenAI's bounds on `metadata` (it is stored with the response, so it must not grow without
    bound): at most 16 pairs, string keys of up to 64 characters, string values of up to 512."""
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid(f"'metadata' may hold at most {MAX_METADATA_PAIRS} key-value pairs, got {len(metadata)}.",
                      param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid(f"'metadata' keys may be at most {MAX_METADATA_KEY} characters long.", param="metadata")
        if not isinstance(value, str):
            raise invalid("'metadata' values must be strings.", param="metadata")
        if len(value) > MAX_METADATA_VALUE:
            raise invalid(f"'metadata' values may be at most {MAX_METADATA_VALUE} characters long.",
                          param="metadata")


def _max_output_tokens(body: Mapping[str, Any], limit: int) -> int | None:
    value = read_field(body, "max_output_tokens", int)
    if value is not None and not 1 <= value <= limit:
        raise invalid(f"'max_output_tokens' must be between 1 and {limit}, got {value}.", param="max_output_tokens")
    return value


# ---------------------------------------------------------------------------------------------- input


def parse_input(value: Any, limits: Limits) -> tuple[Message, ...]:
    if isinstance(value, str):
        if not value:
            raise invalid("'input' is empty; send some text or input items.", param="input")
        return (Message("user", value),)
    if not isinstance(value, list) or not value:
        raise invalid("'input' is required: a string, or a non-empty array of input items "
                      "(messages, function_call, function_call_output).", param="input")
    if len(value) > limits.max_messages:
        raise invalid(f"'input' may hold at most {limits.max_messages} items.", param="input")
    messages: list[Message] = []
    reasoning: str | None = None  # a reasoning item belongs to the assistant turn after it
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"'{where}' must be an object (a message or a function_call / function_call_output "
                          "item).", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item, where)
        elif kind == "message":
            messages.append(_message(item, where, reasoning))
            reasoning = reasoning if messages[-1].role != "assistant" else None
        elif kind == "function_call":
            _add_call(messages, _call(item, where), reasoning)
            reasoning = None
        elif kind == "function_call_output":
            messages.append(_call_output(item, where, messages))
        else:
            raise invalid(f"'{where}.type' {kind!r} is not supported; send messages, function_call and "
                          "function_call_output items.", param=f"{where}.type")
    return tuple(messages)


def _message(item: Mapping[str, Any], where: str, reasoning: str | None) -> Message:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"'{where}.role' must be one of {sorted(ROLES)}, got {role!r}.", param=f"{where}.role")
    text = _content_text(item.get("content"), f"{where}.content")
    return Message(ROLES[role], text, reasoning=reasoning if role == "assistant" else None)  # type: ignore[arg-type]


def _content_text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid(f"'{where}' must be a string or an array of text parts.", param=where)
    parts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(part.get(key), str):
            raise invalid(f"'{where}[{j}]': only text parts ({{\"type\": \"input_text\", \"text\": ...}}) are "
                          "supported; images, files and audio are not.", param=f"{where}[{j}]")
        parts.append(part[key])
    return "".join(parts)


def _reasoning_text(item: Mapping[str, Any], where: str) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise invalid(f"'{where}': a reasoning item's content and summary are arrays of {{\"text\": ...}} parts.",
                      param=where)
    return "".join(p["text"] for p in parts)


def _call(item: Mapping[str, Any], where: str) -> ToolCall:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{where}.call_id' is required on a function_call item.", param=f"{where}.call_id")
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}.name' is required on a function_call item.", param=f"{where}.name")
    if isinstance(arguments, dict):  # some clients send the object, not OpenAI's JSON text
        arguments = json.dumps(arguments, ensure_ascii=False)
    try:
        if not isinstance(arguments, str) or not isinstance(json.loads(arguments or "{}"), dict):
            raise ValueError
    except ValueError:
        raise invalid(f"'{where}.arguments' must be JSON text of an object.", param=f"{where}.arguments")
    return ToolCall(call_id, name, arguments or "{}")


def _add_call(messages: list[Message], call: ToolCall, reasoning: str | None) -> None:
    """Calls join the assistant turn they follow (its text, or the calls before them, made in parallel)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        messages[-1] = Message("assistant", last.content, last.tool_calls + (call,), reasoning=last.reasoning)
    else:
        messages.append(Message("assistant", "", (call,), reasoning=reasoning))


def _call_output(item: Mapping[str, Any], where: str, messages: list[Message]) -> Message:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{where}.call_id' is required on a function_call_output item.", param=f"{where}.call_id")
    text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    return Message("tool", text, tool_call_id=call_id, name=names.get(call_id))


# ---------------------------------------------------------------------------------------------- tools, text


def parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(f"'tools' must be an array of at most {MAX_TOOLS} function tools.", param="tools")
    tools = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind in BUILT_IN_TOOLS:
            raise invalid(f"'{where}': the built-in tool {kind!r} is not available on this server; only function "
                          "tools ({\"type\": \"function\", \"name\", \"parameters\"}) are.", param=where)
        if kind != "function":
            raise invalid(f"'{where}' must be {{\"type\": \"function\", \"name\", \"parameters\"}}.", param=where)
        strict = item.get("strict")
        tools.append(tool_from(item.get("name"), item.get("description"), item.get("parameters"),
                               True if strict is None else strict, where))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("'tools': tool names must be unique.", param="tools")
    return tuple(tools)


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto")
    if value in ("auto", "none", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        choice = ToolChoice("named", value["name"])
    else:
        raise invalid("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"name\": ...}.", param="tool_choice")
    return check_choice(choice, tools, "tool_choice")


def parse_text(value: Any) -> tuple[OutputFormat, dict[str, Any]]:
    """`text.format` -> OutputFormat, and the `text` object to echo."""
    if value is None:
        return OutputFormat(), {"format": {"type": "text"}}
    if not isinstance(value, dict) or set(value) - {"format", "verbosity"}:
        raise invalid("'text' must be an object with \"format\" (and optionally \"verbosity\").", param="text")
    fmt = value.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise invalid("'text.format.schema' must be a JSON schema object.", param="text.format.schema")
        name = fmt.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid("'text.format.name' must be a string.", param="text.format.name")
        parsed = OutputFormat("json_schema", schema, name)
        echo = {"type": "json_schema", "name": name or "response", "schema": schema,
                "strict": bool(fmt.get("strict", True))}
    else:
        parsed = parse_response_format(fmt, param="text.format")
        echo = {"type": parsed.kind}
    out: dict[str, Any] = {"format": echo}
    if value.get("verbosity") is not None:
        if value["verbosity"] not in ("low", "medium", "high"):
            raise invalid("'text.verbosity' must be \"low\", \"medium\" or \"high\".", param="text.verbosity")
        out["verbosity"] = value["verbosity"]
    return parsed, out


def parse_reasoning(value: Any, kwargs: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`reasoning.effort` -> the template's `enable_thinking` (templates without it ignore it)."""
    if value is None:
        return None, kwargs
    if not isinstance(value, dict):
        raise invalid("'reasoning' must be an object, e.g. {\"effort\": \"low\"}.", param="reasoning")
    effort = value.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORTS):
        raise invalid(f"'reasoning.effort' must be one of {sorted(EFFORTS)}.", param="reasoning.effort")
    if effort is not None:
        kwargs = {"enable_thinking": EFFORTS[effort], **kwargs}  # the client's own kwargs win
    return {"effort": effort, "summary": value.get("summary")}, kwargs


def tool_echo(t: Tool) -> dict[str, Any]:
    return {"type": "function", "name": t.name, "description": t.description or None,
            "parameters": t.parameters, "strict": t.strict}


def choice_echo(choice: ToolChoice) -> Any:
    return {"type": "function", "name": choice.name} if choice.mode == "named" else choice.mode
