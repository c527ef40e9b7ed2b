"""The request fields every dialect shares, and their validation: one place, owned by no dialect.

The bounds (`Limits`), typed field reads, sampling settings (temperature ... logit_bias, stop
strings, seed), the caller's `cache_salt`, text content, a function tool and a tool choice, and
a structured-output format. OpenAI chat, text completions, Anthropic Messages and Responses each
read their own field names and hand the values here, so one rule (a stop string's length, a tool
name's alphabet) holds on every route. Each refusal is an `ApiError` (400) naming the client's field.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import Any, Mapping, Sequence

from engine.types import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams

from api.core.conversation import OutputFormat, Tool, ToolChoice
from api.core.errors import invalid

MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own bound
MAX_CACHE_SALT = 256  # characters of a request's own `cache_salt` (vLLM's field)
# Stop strings: every token, the engine's text check walks each stop string once (engine/text.py),
# so a stop's length is work on the MLX thread for every request in the batch; 256 covers any
# sentinel or end marker a client sends. The configurable bound is capped at the engine's own.
DEFAULT_MAX_STOP_CHARS = 256
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's alphabet; Anthropic's is a subset
MAX_TOOLS = 128
# Responses `metadata`: OpenAI's own bounds (16 pairs, keys up to 64 characters, values up to 512).
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


@dataclass(frozen=True)
class Limits:
    """Bounds on what one request may ask for; each refusal tells the client the bound."""

    max_body_bytes: int = 4 * 2**20
    max_prompt_tokens: int | None = None  # None: the model's context length
    max_tokens: int | None = None  # None: the engine's max_tokens_limit
    max_stop: int = 8
    max_stop_chars: int = DEFAULT_MAX_STOP_CHARS  # characters per stop string
    max_messages: int = 1024
    # Requests waiting for the one tokenizer / chat-template thread (count_tokens included); past
    # it 429 + Retry-After, so a burst of huge bodies cannot delay everyone's first token without bound.
    # 512, not 64: the engine's own queue (engine.max_waiting 256 + max_running 32) is the admission
    # control and this only a backstop behind it. Clients whose requests end in the same step send
    # their next ones together, and an ingress that forwards them at once (HAProxy) puts the whole
    # burst here: at 128 concurrent on the H100 a bound of 64 refused 61 of 384 requests (session 28).
    max_tokenizer_queue: int = 512

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError("limits.max_body_bytes must be >= 1024")
        if not 0 <= self.max_stop <= MAX_STOP_STRINGS:
            raise ValueError(f"limits.max_stop must be in [0, {MAX_STOP_STRINGS}]")
        for name in ("max_prompt_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"limits.{name} must be >= 1 or null")
        if self.max_messages < 1:
            raise ValueError("limits.max_messages must be >= 1")
        if not 1 <= self.max_stop_chars <= MAX_STOP_LENGTH:
            raise ValueError(f"limits.max_stop_chars must be in [1, {MAX_STOP_LENGTH}]")
        if self.max_tokenizer_queue < 1:
            raise ValueError("limits.max_tokenizer_queue must be >= 1")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "Limits":
        values = dict(values or {})
        unknown = set(values) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown limits settings: {sorted(unknown)}")
        return cls(**values)


def message_array(value: Any, limits: Limits, empty_hint: str) -> list[Any]:
    """`messages` as a non-empty array within `limits.max_messages` (chat and Anthropic's API)."""
    if not isinstance(value, list):
        raise invalid("'messages' must be an array of {\"role\", \"content\"} objects.", param="messages")
    if not value:
        raise invalid(f"'messages' is empty; {empty_hint}", param="messages")
    if len(value) > limits.max_messages:
        raise invalid(f"'messages' may hold at most {limits.max_messages} messages.", param="messages")
    return value


_KINDS: dict[type, str] = {int: "an integer", float: "a number", bool: "a boolean", str: "a string",
                          list: "an array", dict: "an object"}


def read_field(body: Mapping[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """Read an optional field, checking its JSON type (bool is not a number here)."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if kind is float and ok and not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number.", param=name)
    if not ok:
        raise invalid(f"'{name}' must be {_KINDS[kind]}, got {type(value).__name__}.", param=name)
    return value



def stop_strings(body: Mapping[str, Any], limits: Limits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise invalid("'stop' must be a string or an array of strings.", param="stop")
    if any(s == "" for s in items):
        raise invalid("'stop' strings must not be empty.", param="stop")
    if len(items) > limits.max_stop:
        raise invalid(f"'stop' may hold at most {limits.max_stop} strings, got {len(items)}.", param="stop")
    check_stop_lengths(items, limits, "stop")
    return tuple(dict.fromkeys(items))


def check_stop_lengths(items: Sequence[str], limits: Limits, param: str) -> None:
    longest = max((len(s) for s in items), default=0)
    if longest > limits.max_stop_chars:
        raise invalid(f"'{param}' strings may be at most {limits.max_stop_chars} characters long, got one of "
                      f"{longest}; send a shorter stop string.", param=param)


def read_cache_salt(body: Mapping[str, Any]) -> str:
    """The request's own `cache_salt` (vLLM's name): requests share cached prefixes only with
    requests of the same salt (and, where keys are set, the same tenant). "" or absent: none."""
    salt = read_field(body, "cache_salt", str, "")
    if len(salt) > MAX_CACHE_SALT:
        raise invalid(f"'cache_salt' may be at most {MAX_CACHE_SALT} characters long.", param="cache_salt")
    return salt



def sampling_fields(body: Mapping[str, Any], limits: Limits, logprobs: int | None) -> SamplingParams:
    seed = read_field(body, "seed", int)
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise invalid(f"'seed' must be in [0, {MAX_SEED}].", param="seed")
    values = dict(
        temperature=read_field(body, "temperature", float, 1.0), top_p=read_field(body, "top_p", float, 1.0),
        top_k=read_field(body, "top_k", int, 0), min_p=read_field(body, "min_p", float, 0.0),
        repetition_penalty=read_field(body, "repetition_penalty", float, 1.0),
        presence_penalty=read_field(body, "presence_penalty", float, 0.0),
        frequency_penalty=read_field(body, "frequency_penalty", float, 0.0),
        seed=seed, stop=stop_strings(body, limits), logprobs=logprobs,
        ignore_eos=read_field(body, "ignore_eos", bool, False),  # vLLM-style extension, for benchmarks
        logit_bias=logit_bias(body.get("logit_bias")),
    )
    if values["top_k"] < 0:  # OpenAI-compatible servers use -1 for "off"
        values["top_k"] = 0 if values["top_k"] == -1 else values["top_k"]
    try:
        return SamplingParams(max_tokens=1, **values)
    except ValueError as exc:  # the engine's range checks; its messages start with the field name
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise invalid(f"{message}.", param=param if param in values else None)


def logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map, bias in [-100, 100]; ids are checked against the vocabulary
    once the tokenizer is known (api.core.generation)."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids (as strings) to numbers.", param="logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries.", param="logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit()):
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}.", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {bias!r}.", param="logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))



def text_content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"'{where}': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported.",
                              param=where)
            parts.append(part["text"])
        return "".join(parts)
    raise invalid(f"'{where}' must be a string or an array of text parts.", param=where)


def tool_from(name: Any, description: Any, parameters: Any, strict: Any, where: str) -> Tool:
    """A validated tool (shared with the other dialects, whose field names differ)."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise invalid(f"'{where}.name' must be 1-64 letters, digits, '_', '.' or '-'.", param=f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise invalid(f"'{where}.description' must be a string.", param=f"{where}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise invalid(f"'{where}.parameters' must be a JSON schema object.", param=f"{where}.parameters")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"'{where}.strict' must be a boolean.", param=f"{where}.strict")
    return Tool(name, description or "", parameters, bool(strict))


def check_choice(choice: ToolChoice, tools: tuple[Tool, ...], param: str) -> ToolChoice:
    if choice.mode in ("required", "named") and not tools:
        raise invalid(f"'{param}' asks for a tool call but the request has no tools.", param=param)
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise invalid(f"'{param}' names {choice.name!r}, which is not among the request's tools.", param=param)
    return choice


def parse_response_format(value: Any, param: str = "response_format") -> OutputFormat:
    if value is None:
        return OutputFormat()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return OutputFormat()
    if kind == "json_object":
        return OutputFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid(f"'{param}.json_schema.schema' must be a JSON schema object.", param=param)
        return OutputFormat("json_schema", spec["schema"], spec.get("name") if isinstance(spec.get("name"), str)
                            else None)
    raise invalid(f"'{param}.type' must be \"text\", \"json_object\" or \"json_schema\".", param=param)
