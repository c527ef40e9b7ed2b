"""Anthropic Messages request bodies -> `Conversation` (no HTTP, no model).

Decisions, so an agent client pointed at Pomona works unmodified:
- Fields Anthropic adds often (`cache_control`, `service_tier`, `container`, `metadata`,
  `inference_geo`, unknown top-level fields) are accepted and ignored: Pomona caches prefixes
  by itself. What would change the answer and cannot be honoured is refused with a 400 naming
  the field: server tools (`web_search_...`, `bash_...`), non-empty `mcp_servers`, image or
  document blocks, a final assistant turn (prefill).
- `max_tokens` is required, as Anthropic requires it; a value above the server's limit is
  clamped to it (clients size it for Claude, e.g. 32000), and read as a cap on the room left in
  the context (`Conversation.max_tokens_cap`, applied by api.core.generation).
- `thinking` never fails: enabled/adaptive/disabled set the template's `enable_thinking`;
  templates without thinking ignore it. `budget_tokens` is not enforced.
- Text blocks of one turn (and of `system`) are joined with a blank line.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from api.core.conversation import Conversation, Message, OutputFormat, Tool, ToolCall, ToolChoice
from api.core.errors import invalid
from api.core.fields import (MAX_TOOLS, Limits, check_choice, check_stop_lengths, message_array, read_cache_salt,
                             read_field, sampling_fields, tool_from)

JOIN = "\n\n"
# Pomona's own sampling extensions, accepted beside Anthropic's temperature / top_p / top_k.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "ignore_eos", "logit_bias")
CHOICES = {"auto": "auto", "any": "required", "tool": "named", "none": "none"}
THINKING = {"enabled": True, "adaptive": True, "between_tools": True, "disabled": False}
USER_BLOCKS = ("text", "tool_result")
ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")


def parse_messages_request(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int,
                           counting: bool = False) -> Conversation:
    """A /v1/messages body (or, with `counting`, a /v1/messages/count_tokens body: no max_tokens)."""
    model = read_field(body, "model", str)
    if not model:
        raise invalid("'model' is required; GET /v1/models lists the served model.", param="model")
    _refuse_unsupported(body)
    tools = parse_tools(body.get("tools"))
    choice, parallel = parse_tool_choice(body.get("tool_choice"), tools)
    kwargs = dict(read_field(body, "chat_template_kwargs", dict, {}))  # Pomona extension, as on chat
    thinking = _thinking(body.get("thinking"))
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    system = _system(body.get("system"))
    messages = parse_messages(body.get("messages"), limits)
    return Conversation(
        model=model, messages=((Message("system", system),) if system else ()) + messages,
        sampling=_sampling(body, limits), max_tokens=None if counting else _max_tokens(body, limits, engine_max_tokens),
        max_tokens_cap=True,
        tools=tools, tool_choice=choice, parallel_tool_calls=parallel, output_format=_output_format(body),
        chat_template_kwargs=tuple(sorted(kwargs.items())), stream=False if counting else read_field(
            body, "stream", bool, False),
        format_param="output_config.format", cache_salt=read_cache_salt(body))


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    servers = body.get("mcp_servers")
    if servers not in (None, []):
        raise invalid("'mcp_servers': Pomona does not connect to MCP servers. Run the MCP client on your side "
                      "and send its tools as custom tools in 'tools'.", param="mcp_servers")


def _max_tokens(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int) -> int:
    value = read_field(body, "max_tokens", int)
    if value is None:
        raise invalid("'max_tokens' is required: the most tokens to generate, e.g. 1024.", param="max_tokens")
    if value < 1:
        raise invalid(f"'max_tokens' must be at least 1, got {value}.", param="max_tokens")
    # Clients size max_tokens for Claude (Claude Code sends 32000): clamp to this server's limit.
    return min(value, limits.max_tokens or engine_max_tokens, engine_max_tokens)


def _sampling(body: Mapping[str, Any], limits: Limits) -> Any:
    fields = {k: body[k] for k in SAMPLING if k in body}
    fields["stop"] = _stop_sequences(body.get("stop_sequences"), limits)
    return sampling_fields(fields, limits, None)


def _stop_sequences(value: Any, limits: Limits) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("'stop_sequences' must be an array of strings.", param="stop_sequences")
    if any(s == "" for s in value):
        raise invalid("'stop_sequences' must not hold empty strings.", param="stop_sequences")
    if len(value) > limits.max_stop:
        raise invalid(f"'stop_sequences' may hold at most {limits.max_stop} strings, got {len(value)}.",
                      param="stop_sequences")
    check_stop_lengths(value, limits, "stop_sequences")
    return list(dict.fromkeys(value))


def _thinking(value: Any) -> bool | None:
    """enable_thinking for the template, or None (its default). Never an error for a known shape."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise invalid("'thinking' must be an object such as {\"type\": \"enabled\", \"budget_tokens\": 2048} "
                      "or {\"type\": \"disabled\"}.", param="thinking")
    return THINKING.get(value.get("type")) if isinstance(value.get("type"), str) else None


def _output_format(body: Mapping[str, Any]) -> OutputFormat:
    """`output_config.format` (or the older beta's top-level `output_format`): a JSON schema."""
    config = read_field(body, "output_config", dict, {})
    fmt, param = config.get("format"), "output_config.format"
    if fmt is None and body.get("output_format") is not None:
        fmt, param = body["output_format"], "output_format"
    if fmt is None:
        return OutputFormat()
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise invalid(f"'{param}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}.", param=param)
    return OutputFormat("json_schema", fmt["schema"])


# ---------------------------------------------------------------------------------------------- tools


def parse_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(f"'tools' must be an array of at most {MAX_TOOLS} tools.", param="tools")
    tools = tuple(_tool(t, f"tools[{i}]") for i, t in enumerate(value))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("'tools': tool names must be unique.", param="tools")
    return tools


def _tool(item: Any, where: str) -> Tool:
    if not isinstance(item, dict):
        raise invalid(f"'{where}' must be an object with \"name\", \"description\" and \"input_schema\".",
                      param=where)
    kind = item.get("type")
    if kind not in (None, "custom"):
        name = item.get("name") if isinstance(item.get("name"), str) else "?"
        raise invalid(f"'{where}' is the server tool {kind!r} (name {name!r}), which Pomona cannot run. Remove "
                      "it, or define a custom tool (name, description, input_schema) and run it on your side.",
                      param=where)
    if "input_schema" not in item:
        raise invalid(f"'{where}.input_schema' is required: the JSON schema of the tool's input.",
                      param=f"{where}.input_schema")
    tool = tool_from(item.get("name"), item.get("description"), item["input_schema"], item.get("strict"), where)
    if tool.parameters.get("type", "object") != "object":
        raise invalid(f"'{where}.input_schema' must be an object schema ({{\"type\": \"object\", ...}}).",
                      param=f"{where}.input_schema")
    return tool


def parse_tool_choice(value: Any, tools: tuple[Tool, ...]) -> tuple[ToolChoice, bool]:
    """Anthropic's tool_choice -> (ToolChoice, parallel_tool_calls)."""
    if value is None:
        return ToolChoice("auto"), True
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in CHOICES:
        raise invalid("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                      "{\"type\": \"tool\", \"name\": ...}.", param="tool_choice")
    name = value.get("name")
    if kind == "tool" and not isinstance(name, str):
        raise invalid("'tool_choice.name' is required with {\"type\": \"tool\"}.", param="tool_choice.name")
    disable = read_field(value, "disable_parallel_tool_use", bool, False)
    choice = check_choice(ToolChoice(CHOICES[kind], name if kind == "tool" else None), tools, "tool_choice")  # type: ignore[arg-type]
    return choice, not disable


# ---------------------------------------------------------------------------------------------- messages


def _system(value: Any) -> str:
    if value is None or isinstance(value, str):
        return value or ""
    if not isinstance(value, list):
        raise invalid("'system' must be a string or an array of text blocks.", param="system")
    return JOIN.join(_text_block(b, f"system[{i}]") for i, b in enumerate(value))


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise invalid(f"'{where}' must be a text block {{\"type\": \"text\", \"text\": ...}}; only text is "
                      "supported here.", param=where)
    return block["text"]


def parse_messages(value: Any, limits: Limits) -> tuple[Message, ...]:
    value = message_array(value, limits, "send at least one user message.")
    out: list[Message] = []
    for i, item in enumerate(value):
        out += _message(item, f"messages[{i}]", out)
    if isinstance(value[-1], dict) and value[-1].get("role") == "assistant":
        raise invalid("The last message is an assistant turn: prefilling the answer is not supported here. "
                      "End 'messages' with a user turn.", param=f"messages[{len(value) - 1}]")
    return tuple(out)


def _message(item: Any, where: str, before: list[Message]) -> list[Message]:
    if not isinstance(item, dict):
        raise invalid(f"'{where}' must be an object with \"role\" and \"content\".", param=where)
    role, content = item.get("role"), item.get("content")
    if role not in ("user", "assistant"):
        raise invalid(f"'{where}.role' must be \"user\" or \"assistant\", got {role!r}; system text goes in the "
                      "top-level 'system' field.", param=f"{where}.role")
    if isinstance(content, str):
        return [Message(role, content)]
    if not isinstance(content, list):
        raise invalid(f"'{where}.content' must be a string or an array of content blocks.", param=f"{where}.content")
    blocks = [_block(b, f"{where}.content[{j}]", role) for j, b in enumerate(content)]
    return _assistant(blocks) if role == "assistant" else _user(blocks, before)


def _block(block: Any, where: str, role: str) -> dict[str, Any]:
    kind = block.get("type") if isinstance(block, dict) else None
    allowed = ASSISTANT_BLOCKS if role == "assistant" else USER_BLOCKS
    if not isinstance(kind, str) or kind not in allowed:
        raise invalid(f"'{where}' is a {kind!r} block; only {', '.join(allowed)} blocks are supported in "
                      f"{role} turns (no images or documents). Send its content as text.", param=where)
    if kind == "text":
        _text_block(block, where)
    elif kind == "thinking" and not isinstance(block.get("thinking"), str):
        raise invalid(f"'{where}.thinking' must be a string.", param=f"{where}.thinking")
    elif kind == "tool_use":
        return {**block, "type": "tool_use", "call": _tool_use(block, where)}
    elif kind == "tool_result":
        return {**block, "result": _tool_result(block, where)}
    return block


def _tool_use(block: dict[str, Any], where: str) -> ToolCall:
    name, call_id, args = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not name:
        raise invalid(f"'{where}.name' must be the tool's name.", param=f"{where}.name")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{where}.id' must be the call's id (\"toolu_...\").", param=f"{where}.id")
    if isinstance(args, str):  # some clients send the JSON text, as OpenAI does
        try:
            args = json.loads(args or "{}")
        except ValueError:
            args = None
    if not isinstance(args, dict):
        raise invalid(f"'{where}.input' must be a JSON object.", param=f"{where}.input")
    return ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))


def _tool_result(block: dict[str, Any], where: str) -> Message:
    call_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"'{where}.tool_use_id' must name the tool_use block it answers.", param=f"{where}.tool_use_id")
    if isinstance(content, list):
        text = JOIN.join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif isinstance(content, str) or content is None:
        text = content or ""
    else:
        raise invalid(f"'{where}.content' must be a string or an array of text blocks.", param=f"{where}.content")
    if read_field(block, "is_error", bool, False):
        text = f"Error: {text}"  # the template has no error flag: say it in the text the model reads
    return Message("tool", text, tool_call_id=call_id)


def _user(blocks: list[dict[str, Any]], before: list[Message]) -> list[Message]:
    """Tool results first (each a tool message, in order), then the turn's text as a user message."""
    names = {c.id: c.name for m in before for c in m.tool_calls}
    out = [Message("tool", b["result"].content, tool_call_id=b["result"].tool_call_id,
                   name=names.get(b["result"].tool_call_id)) for b in blocks if b["type"] == "tool_result"]
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    if texts or not out:
        out.append(Message("user", JOIN.join(texts)))
    return out


def _assistant(blocks: list[dict[str, Any]]) -> list[Message]:
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    thoughts = [b["thinking"] for b in blocks if b["type"] == "thinking" and b["thinking"]]
    calls = tuple(b["call"] for b in blocks if b["type"] == "tool_use")
    return [Message("assistant", JOIN.join(texts), calls, reasoning=JOIN.join(thoughts) if thoughts else None)]
