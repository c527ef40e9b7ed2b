"""How tools reach the prompt, and which call syntax the model will answer in.

A `ToolSyntax` pairs one mlx-lm tool parser module (`mlx_lm.tool_parsers.<name>`: its markers and
its `parse_tool_call`) with two facts Pomona needs: whether the text between the markers is a JSON
object `{"name": ..., "arguments": {...}}` (then a grammar can constrain it and the arguments can
be streamed as they are generated), and whether the model's chat template renders tools itself.

Which parser: a forced name (the `tool_parser` setting), else the one mlx-lm inferred for the
tokenizer (from `tool_parser_type` in its config or from its chat template) when the template
renders tools, else the GENERIC FALLBACK below (also where mlx-lm found call markers but the
template has no tool list: the fallback prompt teaches its JSON block, so that is what to parse).

GENERIC FALLBACK (templates that know no tools, like the default SmolLM2's). Stable: the README
quotes it. The tool list goes into the system prompt, after the client's own system text if any
(into the first user message instead when the template refuses a system message we added):

    You can call tools (functions) to help answer. The tools, one JSON object per line:
    {"name": "get_weather", "description": "Current weather", "parameters": {...}}
    To call a tool, reply with one block per call, exactly in this form:
    <tool_call>
    {"name": "tool_name", "arguments": {"arg": "value"}}
    </tool_call>
    A tool's result comes back wrapped in <tool_response> and </tool_response>. If no tool is needed, answer normally.

The model's calls are parsed as mlx-lm's `json_tools` format with `<tool_call>` / `</tool_call>`
written as plain text. In the history, an assistant's calls become that same block text in its
content (after its text, one block per call, joined by newlines), and tool results become user
messages `<tool_response>\\n{content}\\n</tool_response>` (consecutive results share one user
message, one block each, joined by newlines), since such templates have no `tool` role.

Reasoning a client passes back on assistant messages is dropped from the history, as most
templates with thinking drop earlier turns' reasoning themselves.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Mapping, Sequence

import jinja2
import mlx_lm.tool_parsers

from api.core.conversation import Message, Tool, ToolCall

FALLBACK_START = "<tool_call>"
FALLBACK_END = "</tool_call>"
FALLBACK_INTRO = "You can call tools (functions) to help answer. The tools, one JSON object per line:"
FALLBACK_HOW = (
    "To call a tool, reply with one block per call, exactly in this form:\n"
    f'{FALLBACK_START}\n{{"name": "tool_name", "arguments": {{"arg": "value"}}}}\n{FALLBACK_END}\n'
    "A tool's result comes back wrapped in <tool_response> and </tool_response>. "
    "If no tool is needed, answer normally."
)
JSON_BODY_PARSERS = frozenset({"json_tools"})  # bodies that are `{"name": ..., "arguments": {...}}`

# apply_chat_template's own arguments: a client's chat_template_kwargs must not replace them (and
# `chat_template` would let a client swap the server's template).
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class TemplateError(ValueError):
    """The chat template refused the request's messages: the client's to fix (HTTP 400)."""


@dataclass(frozen=True)
class ToolSyntax:
    """One call syntax: an mlx-lm parser module's markers and parse function.

    `json_body`: the text between the markers is `{"name": ..., "arguments": {...}}`, so grammars
    apply and arguments stream incrementally. `native`: the chat template renders tools itself;
    otherwise the generic fallback puts them in the system prompt.
    """

    name: str
    start: str
    end: str
    parse: Callable[[str, list[dict] | None], dict | list]
    json_body: bool
    native: bool


@functools.lru_cache(maxsize=1)
def _parser_modules() -> dict[str, ModuleType]:
    """Every mlx-lm tool parser module, by name (importing them is cheap: regexes only)."""
    modules = {}
    for info in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__):
        module = importlib.import_module(f"mlx_lm.tool_parsers.{info.name}")
        if all(hasattr(module, a) for a in ("parse_tool_call", "tool_call_start", "tool_call_end")):
            modules[info.name] = module
    return modules


def available_parsers() -> tuple[str, ...]:
    return tuple(sorted(_parser_modules()))


def _mentions_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: any of them
        template = "\n".join(str(t) for t in template.values())
    if not template:  # a Python renderer (mlx-lm's chat_templates modules): trusted
        return bool(getattr(tokenizer, "has_chat_template", False))
    return re.search(r"\btools\b", template) is not None


def template_knows_tools(tokenizer: Any) -> bool:
    """Whether the model's template renders a tool list itself: it has mlx-lm tool calling and
    its template mentions `tools` (a template with a call syntax but no tool list would leave the
    model unaware of the tools)."""
    return bool(getattr(tokenizer, "has_tool_calling", False)) and _mentions_tools(tokenizer)


def _native_name(tokenizer: Any) -> str:
    """The mlx-lm module behind the tokenizer's parser. TokenizerWrapper exposes only the callable
    and the markers, and several modules share markers (`<tool_call>`: json_tools, qwen3_coder,
    glm47), so the callable itself decides among the modules whose markers match."""
    modules = _parser_modules()
    marked = [n for n, m in sorted(modules.items())
              if (m.tool_call_start, m.tool_call_end) == (tokenizer.tool_call_start, tokenizer.tool_call_end)]
    same = [n for n in marked if modules[n].parse_tool_call is tokenizer.tool_parser]
    # mlx-lm records the name it chose in the HF tokenizer's public init_kwargs; it breaks ties
    # between modules that re-export one parser (laguna is glm47).
    recorded = (getattr(tokenizer, "init_kwargs", None) or {}).get("tool_parser_type")
    for candidates in (same, marked):
        if recorded in candidates:
            return recorded
        if candidates:
            return candidates[0]
    return "custom"


def syntax_for(tokenizer: Any, forced: str | None = None) -> ToolSyntax:
    """The call syntax for this tokenizer: `forced` (an mlx-lm parser module name), else the
    tokenizer's own parser when its template renders tools, else the generic fallback.

    A forced parser is for a model whose format mlx-lm infers wrongly; on a template without a tool
    list the fallback prompt (which describes the JSON block) is still what the model sees.
    """
    if forced:  # the template still renders tools its own way when it can
        module = _parser_modules().get(forced)
        if module is None:
            raise ValueError(f"Unknown tool parser {forced!r}; available: {', '.join(available_parsers())}.")
        return ToolSyntax(forced, module.tool_call_start, module.tool_call_end, module.parse_tool_call,
                          forced in JSON_BODY_PARSERS, _mentions_tools(tokenizer))
    if template_knows_tools(tokenizer):
        name = _native_name(tokenizer)
        return ToolSyntax(name, tokenizer.tool_call_start, tokenizer.tool_call_end or "",
                          tokenizer.tool_parser, name in JSON_BODY_PARSERS, True)
    # No tool list in the template (even where mlx-lm found call markers in the vocabulary): the
    # fallback prompt teaches the JSON block, so that is the syntax to parse.
    json_tools = _parser_modules()["json_tools"]
    return ToolSyntax("json_tools", FALLBACK_START, FALLBACK_END, json_tools.parse_tool_call, True, False)



# --------------------------------------------------------------------------------------- rendering


def tool_dicts(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    """OpenAI-style function dicts: what chat templates and mlx-lm's parsers read."""
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in tools]


def fallback_system_text(tools: Sequence[Tool]) -> str:
    """The generic fallback's tool instructions (the module docstring shows the format)."""
    lines = [json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                        ensure_ascii=False) for t in tools]
    return "\n".join([FALLBACK_INTRO, *lines, FALLBACK_HOW])


def fallback_call_text(call: ToolCall) -> str:
    """One call as the fallback block, as the model is asked to write it."""
    body = json.dumps({"name": call.name, "arguments": _arguments(call)}, ensure_ascii=False)
    return f"{FALLBACK_START}\n{body}\n{FALLBACK_END}"


def _arguments(call: ToolCall) -> Any:
    try:
        return call.arguments_object()
    except json.JSONDecodeError as exc:
        raise TemplateError(f"The arguments of tool call {call.id!r} ({call.name}) in the history are "
                            f"not JSON ({exc}); send them as a JSON object string.") from None


def _native_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """OpenAI-style message dicts. Arguments go as objects: templates such as Qwen's apply
    `tojson` to `tool_call.function.arguments` (mlx_lm.server decodes them the same way)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.name, "arguments": _arguments(c)}}
                               for c in m.tool_calls]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
        out.append(d)
    return out


def _fallback_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages for a template without tools: calls as block text, results as user messages."""
    out: list[dict[str, Any]] = []
    after_result = False
    for m in messages:
        if m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if after_result:  # consecutive results: one user turn (templates want turns to alternate)
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        elif m.tool_calls:
            calls = "\n".join(fallback_call_text(c) for c in m.tool_calls)
            out.append({"role": m.role, "content": f"{m.content}\n{calls}" if m.content else calls})
        else:
            out.append({"role": m.role, "content": m.content})
        after_result = m.role == "tool"
    return out


def _with_tool_text(dicts: list[dict[str, Any]], text: str, into_user: bool) -> list[dict[str, Any]]:
    """The fallback's tool text after the client's system text, or as a system message of its own;
    `into_user`: before the first user message's text instead, for templates without a system role."""
    out = [dict(d) for d in dicts]
    if into_user:
        at = next((i for i, d in enumerate(out) if d["role"] == "user"), None)
        if at is not None:
            out[at]["content"] = "\n\n".join(t for t in (text, out[at]["content"]) if t)
            return out
        out.insert(0, {"role": "user", "content": text})
    elif out and out[0]["role"] == "system":
        out[0]["content"] = "\n\n".join(t for t in (out[0]["content"], text) if t)
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def render_prompt(tokenizer: Any, messages: Sequence[Message], tools: Sequence[Tool], syntax: ToolSyntax,
                  template_kwargs: Mapping[str, Any], add_generation_prompt: bool = True) -> str:
    """The prompt text through the model's own chat template (tools natively or by the fallback).

    Raises TemplateError when the template refuses the messages (its `raise_exception`, or a
    render error) or a client's template argument collides with ours; a broken template itself
    (a syntax error) is the server's fault and propagates as it is.
    """
    clash = sorted(_RESERVED_KWARGS & set(template_kwargs))
    if clash:
        raise TemplateError(f"chat_template_kwargs may not set {', '.join(clash)}: the server sets them. "
                            "Remove them (tools go in `tools`).")
    kwargs = {**template_kwargs, "tokenize": False, "add_generation_prompt": add_generation_prompt}
    if syntax.native:
        return _apply(tokenizer, _native_messages(messages), tools=tool_dicts(tools) or None, **kwargs)
    dicts = _fallback_messages(messages)
    if not tools:
        return _apply(tokenizer, dicts, **kwargs)
    text = fallback_system_text(tools)
    try:
        return _apply(tokenizer, _with_tool_text(dicts, text, into_user=False), **kwargs)
    except TemplateError:
        if any(m.role == "system" for m in messages):
            raise  # the client's own system message is refused: theirs to change
        # A system message only we added was refused (templates without a system role, e.g.
        # Gemma 2's): the tool text goes to the first user turn instead.
        return _apply(tokenizer, _with_tool_text(dicts, text, into_user=True), **kwargs)


def _apply(tokenizer: Any, dicts: list[dict[str, Any]], **kwargs: Any) -> str:
    try:
        return tokenizer.apply_chat_template(dicts, **kwargs)
    except jinja2.TemplateSyntaxError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"The model's chat template refused these messages: {exc}. Change the messages "
                            "to a form this model accepts (for example: one system message, first; user "
                            "and assistant turns alternating).") from None
