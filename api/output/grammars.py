"""llguidance grammars for structured answers and enforced tool calls. Pure functions: no model.

The strings returned go into `SamplingParams.grammar`; the engine compiles them per tokenizer
(engine/constraints.py). Choices made here, for every grammar:

- JSON is written in one fixed layout, `json.dumps`'s: `", "` between items, `": "` after keys, no
  other whitespace (llguidance's `whitespace_flexible: False`). With free whitespace a sampling model
  can emit whitespace forever; the fixed layout is also mlx-lm's `json_tools` call format.
- Strings the schema leaves unbounded (no `maxLength`, `enum`, `const`, `pattern` or `format`) get
  `maxLength: max_string_length` (default `DEFAULT_MAX_STRING`), and so do the keys and strings of
  `json_object` answers. This does narrow what the schema accepts — a string longer than the bound is
  closed at the bound — and it is what lets a random (or derailed) model finish the object instead of
  writing one string until max_tokens. For the same reason integers without bounds get
  `|value| <= MAX_INTEGER` (15 digits; JavaScript loses integers past 2^53 anyway). Pass
  `max_string_length=None` for the exact schema (both bounds off).
- Tool calls are `start + "\n"? + {"name": ..., "arguments": ...} + "\n"? + end`, calls joined by "\n".
  A marker that is one special (added) token of the vocabulary must be matched as that token, not as
  text (llguidance keeps added tokens out of text): pass its id as `start_token` / `end_token`
  (`special_marker_id` finds it).
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Callable, Sequence

from llguidance import LLMatcher

from api.core.conversation import OutputFormat, Tool, ToolChoice

DEFAULT_MAX_STRING = 256
MAX_INTEGER = 10**15 - 1
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_UNBOUNDED_IF_ABSENT = ("maxLength", "enum", "const", "pattern", "format")
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # keys whose values are data, not schemas


# Bytes of schema text plus grammar text each cache below may hold. A schema may be as large as a
# request body (4 MiB by default): a bound by count let 512 of them hold gigabytes of the ingress.
SCHEMA_CACHE_BYTES = 32 * 2**20
TOOL_CACHE_BYTES = 32 * 2**20


class BytesLRU:
    """A least-recently-used cache of strings bounded by the characters of its keys and values.

    A value larger than the whole budget is returned but not kept. Errors are not cached (as with
    `functools.lru_cache`): a bad schema is refused each time. Thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[tuple[Any, ...], tuple[str, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[Any, ...], make: Callable[[], str]) -> str:
        with self._lock:
            hit = self._entries.get(key)
            if hit is not None:
                self._entries.move_to_end(key)
                return hit[0]
        value = make()  # outside the lock: compiling a grammar may take a while
        weight = len(value) + sum(len(k) for k in key if isinstance(k, str))
        if weight > self.max_bytes:
            return value
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (value, weight)
                self.size += weight
            while self.size > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.size -= dropped
        return value


def bytes_cached(cache: BytesLRU) -> Callable[[Callable[..., str]], Callable[..., str]]:
    """Memoise a function of hashable arguments in `cache` (positional arguments only)."""
    def wrap(fn: Callable[..., str]) -> Callable[..., str]:
        @functools.wraps(fn)
        def cached(*args: Any) -> str:
            return cache.get(args, lambda: fn(*args))
        cached.cache = cache  # type: ignore[attr-defined]  # for tests and inspection
        return cached
    return wrap


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot use; the message is llguidance's (HTTP 400)."""


def check_grammar(grammar: str) -> None:
    """Raise GrammarError when llguidance refuses the grammar (no tokenizer needed).

    Special tokens are only checked against a vocabulary when the engine compiles the grammar
    (a ValueError then, before generation)."""
    message = LLMatcher.validate_grammar(grammar)
    if message:
        raise GrammarError(message)


def _typed(node: dict[str, Any], name: str) -> bool:
    kind = node.get("type")
    return kind == name or (isinstance(kind, list) and name in kind)


def bound_strings(schema: Any, max_length: int | None) -> Any:
    """A copy of `schema` whose unbounded strings get `maxLength`, unbounded integers a range (see the
    module docstring)."""
    if max_length is None:
        return schema
    if isinstance(schema, list):
        return [bound_strings(s, max_length) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _NOT_SCHEMAS else bound_strings(v, max_length)) for k, v in schema.items()}
    if _typed(out, "string") and not any(k in out for k in _UNBOUNDED_IF_ABSENT):
        minimum = out.get("minLength", 0)
        out["maxLength"] = max(max_length, minimum if isinstance(minimum, int) else 0)
    if _typed(out, "integer") and "enum" not in out and "const" not in out:
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = max(MAX_INTEGER, _number(out.get("minimum", out.get("exclusiveMinimum"))))
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = min(-MAX_INTEGER, _number(out.get("maximum", out.get("exclusiveMaximum"))))
    return out


def _number(value: Any) -> float:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _schema_text(schema: Any) -> str:
    # Not sort_keys: property order is generation order.
    try:
        return json.dumps(schema, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the schema is not JSON: {exc}") from None


@bytes_cached(BytesLRU(SCHEMA_CACHE_BYTES))
def _schema_grammar(schema_json: str, max_string: int | None) -> str:
    schema = json.loads(schema_json)
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        return LLMatcher.grammar_from_json_schema(bound_strings(schema, max_string), defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def _string_regex(max_string: int | None) -> str:
    count = "*" if max_string is None else "{0,%d}" % max_string
    return r'/"(\\(["\\\/bfnrt]|u[0-9a-fA-F]{4})|[^"\\\x00-\x1F\x7F])' + count + '"/'


@lru_cache(maxsize=16)
def _object_grammar(max_string: int | None) -> str:
    """Any JSON object, in the fixed layout, strings (keys included) bounded. llguidance's JSON
    compiler cannot bound keys (no `propertyNames`), so this one is lark; numbers are bounded too."""
    lark = "\n".join([
        "start: object",
        'object: "{" (pair (", " pair)*)? "}"',
        'pair: STRING ": " value',
        'array: "[" (value (", " value)*)? "]"',
        'value: object | array | STRING | NUMBER | "true" | "false" | "null"',
        f"STRING: {_string_regex(max_string)}",
        r"NUMBER: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,15})?([eE][+-]?[0-9]{1,3})?/",
    ])
    return LLMatcher.grammar_from_lark(lark)


def answer_grammar(fmt: OutputFormat, max_string_length: int | None = DEFAULT_MAX_STRING) -> str | None:
    """The grammar of an answer in `fmt`: None for text, any JSON object, or the schema's JSON."""
    if fmt.kind == "text":
        return None
    if fmt.kind == "json_object":
        return _object_grammar(max_string_length)
    if fmt.schema is None:
        raise GrammarError("json_schema needs a schema")
    return _schema_grammar(_schema_text(fmt.schema), max_string_length)


# ------------------------------------------------------------------------------------------- tools


def _call_schema(tool: Tool, constrain_arguments: bool) -> dict[str, Any]:
    arguments = tool.parameters if constrain_arguments else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def _marker(text: str, token: int | None) -> str:
    return f"<[{token}]>" if token is not None else json.dumps(text)


@bytes_cached(BytesLRU(TOOL_CACHE_BYTES))
def _tool_lark(body_json: str, mode: str, parallel: bool, start: str, end: str, allow_text: bool,
               start_token: int | None, end_token: int | None) -> str:
    head, tail = _marker(start, start_token), _marker(end, end_token)
    many = mode == "auto" or (parallel and mode == "required")
    rules = [f"body: %json {body_json}", "TEXT: /(.|\\n)*/"]
    if not allow_text and mode != "auto":
        call = f'call: {head} "\\n"? body "\\n"? {tail}'
        rules += ['start: call ("\\n" call)*' if many else "start: call", call]
    elif start_token is not None:  # a special token never occurs inside TEXT: the marker starts the call
        call = f'call: {head} "\\n"? body "\\n"? {tail}'
        first = "start: TEXT (call TEXT)*" if mode == "auto" else ("start: (TEXT call)+" if many else "start: TEXT call")
        rules += [first, call]
    else:  # text up to the first start marker (lazy), then the call is constrained
        call = f'call: call_hd "\\n"? body "\\n"? {tail}'
        rules += [call, f"call_hd[lazy]: TEXT {head}"]
        if mode == "auto":  # llguidance ends a lazy lexeme at its first match: TEXT cannot run past a marker
            rules.append("start: call* TEXT")
        else:
            rules.append("start: call+" if many else "start: call")
    return LLMatcher.grammar_from_lark("\n".join(rules))


def tool_grammar(tools: Sequence[Tool], choice: ToolChoice, parallel: bool, start: str, end: str,
                 allow_text: bool, *, start_token: int | None = None, end_token: int | None = None,
                 max_string_length: int | None = DEFAULT_MAX_STRING) -> str | None:
    """The grammar that enforces `choice` over `tools`, or None when nothing is enforced.

    "required": one or more calls (one unless `parallel`), each to any tool, arguments per its schema;
    "named": exactly one call to `choice.name`; "auto" with some `strict` tools: free text, and a call
    body is constrained once `start` appears (strict tools' arguments per schema, others any object);
    "none", or "auto" with no strict tool: None. `allow_text` lets text come before the call(s) under
    "required"/"named" (auto always allows it). `start_token`/`end_token`: see the module docstring.
    """
    if choice.mode == "none" or not tools or (choice.mode == "auto" and not any(t.strict for t in tools)):
        return None
    selected = list(tools)
    if choice.mode == "named":
        selected = [t for t in tools if t.name == choice.name]
        if not selected:
            raise GrammarError(f"tool_choice names the function {choice.name!r}, which is not in tools")
    strict_only = choice.mode == "auto"
    calls = [bound_strings(_call_schema(t, not strict_only or t.strict), max_string_length) for t in selected]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": JSON_LAYOUT}
    return _tool_lark(_schema_text(schema), choice.mode, parallel, start, end, allow_text, start_token, end_token)


def special_marker_id(tokenizer: Any, marker: str) -> int | None:
    """The id of `marker` when it is one added (special) token of the tokenizer's vocabulary, else None.

    llguidance treats every added token as special, so the test is the tokenizer's added vocabulary."""
    if not marker:
        return None
    token = tokenizer.get_added_vocab().get(marker)
    return int(token) if token is not None else None


@lru_cache(maxsize=16)
def no_call_grammar(start: str, start_token: int | None = None) -> str:
    """Free text that never contains the call marker: `tool_choice: "none"` with the tools still in
    the prompt (so an agent's next turn reuses its cached prefix). A special-token marker cannot
    occur in text at all; a text marker is excluded with llguidance's regex complement (`& ~`)."""
    if start_token is not None:
        return LLMatcher.grammar_from_lark("start: TEXT\nTEXT: /(.|\\n)*/")
    marker = json.dumps(start)[1:-1].replace("/", "\\/")
    escaped = "".join("\\" + c if c in r".^$*+?()[]{}|\-" else c for c in marker)
    return LLMatcher.grammar_from_lark(f"start: TEXT\nTEXT: /(.|\\n)*/ & ~/(.|\\n)*{escaped}(.|\\n)*/")
