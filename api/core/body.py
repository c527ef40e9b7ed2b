"""The request body as JSON: bytes -> one JSON object, or a 400 that says what is wrong with it.

Every dialect reads its body through `decode_body` before any field is looked at, so a body that no
parser should walk (too deep, lone surrogates, NaN) is refused once, here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from api.core.errors import invalid

MAX_JSON_DEPTH = 100  # deeper bodies are refused: recursive code (schemas, templates) must not run out of stack
_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


def decode_body(raw: bytes) -> dict[str, Any]:
    """Bytes -> JSON object, refusing non-UTF-8, malformed JSON, NaN/Infinity, non-objects, nesting
    deeper than MAX_JSON_DEPTH and lone UTF-16 surrogates (`"\\ud800"`, which no tokenizer encodes)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid(f"The request body is not valid UTF-8 (byte {exc.start}); send UTF-8 encoded JSON.")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        body = None  # nested past the parser's own limit: refused below as too deep
    except ValueError as exc:
        raise invalid(f"The request body is not valid JSON: {exc}. Send a JSON object.")
    if body is None or _too_deep(body):
        raise invalid(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels; "
                      "send a flatter body (a tool schema rarely needs more than a few levels).")
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object, e.g. {\"model\": ..., \"messages\": [...]}.")
    if _ESCAPED_SURROGATE.search(text) and _has_lone_surrogate(body):  # only \\u escapes can make one
        raise invalid("The request body holds a lone UTF-16 surrogate escape (such as \\ud800) in a string; "
                      "send valid Unicode (surrogates only in pairs).")
    return body


def _children(value: Any) -> Any:
    return value.values() if isinstance(value, dict) else value


def _too_deep(body: Any) -> bool:
    level = [body] if isinstance(body, (dict, list)) else []
    for _ in range(MAX_JSON_DEPTH):  # breadth first, one level at a time: no recursion
        level = [c for v in level for c in _children(v) if isinstance(c, (dict, list))]
        if not level:
            return False
    return True


def _has_lone_surrogate(body: Any) -> bool:
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(value, (dict, list)):
            stack += list(value.keys()) + list(value.values()) if isinstance(value, dict) else value
    return False


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")

