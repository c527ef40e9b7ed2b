"""OpenAI request parsing and validation, and the response shapes, in one place (no Ray, no HTTP).

Parsing turns an untrusted JSON body into a frozen `ParsedRequest` or raises `ApiError` (400) naming
the offending field. Builders turn engine output into OpenAI's JSON objects.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping, Sequence

from engine.types import MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams

from api.errors import ApiError, invalid

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's own bound for /v1/completions
MAX_SEED = 2**63 - 1
# Fields that would change what the client gets back; ignoring them silently would be a lie.
UNSUPPORTED = {
    "functions": "the legacy 'functions' field is not supported; send the same functions as 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; use 'tool_choice'",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix (insertion) is not supported",
}
# Chat features that /v1/completions (a plain prompt, no chat template) cannot honour.
CHAT_ONLY = {
    "tools": "tool calling needs a chat template: use /v1/chat/completions",
    "tool_choice": "tool calling needs a chat template: use /v1/chat/completions",
}
MAX_LOGIT_BIAS = 300  # entries; OpenAI's own bound
MAX_CACHE_SALT = 256  # characters of a request's own `cache_salt` (vLLM's field)
# Stop strings: every token, the engine's text check walks each stop string once (engine/text.py),
# so a stop's length is work on the MLX thread for every request in the batch; 256 covers any
# sentinel or end marker a client sends. The configurable bound is capped at the engine's own.
DEFAULT_MAX_STOP_CHARS = 256
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
    max_tokenizer_queue: int = 64

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


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request. `max_tokens` None means: the default, bounded by the room left in context."""

    kind: str  # "completion" (chat requests parse into api.conversation.Conversation)
    model: str
    sampling: SamplingParams  # its max_tokens is a placeholder until the prompt length is known
    prompt: str | tuple[int, ...] = ""
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    user: str | None = None
    cache_salt: str = ""  # the request's own prefix-cache partition (vLLM's `cache_salt`); "" none


# ---------------------------------------------------------------------------------------------- parsing


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


def _check_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    for name, why in (UNSUPPORTED if chat else {**UNSUPPORTED, **CHAT_ONLY}).items():
        if body.get(name) not in (None, [], {}, ""):
            raise invalid(f"'{name}': {why}.", param=name)
    if read_field(body, "best_of", int, 1) != 1:
        raise invalid("'best_of' must be 1.", param="best_of")
    if chat:  # n and response_format are the chat dialect's (api/openai_chat.py)
        return
    if read_field(body, "n", int, 1) != 1:
        raise invalid("'n' must be 1 on /v1/completions; use /v1/chat/completions for several choices, "
                      "or send several requests.", param="n")
    if read_field(body, "echo", bool, False):
        raise invalid("'echo' is not supported; remove it.", param="echo")
    fmt = read_field(body, "response_format", dict)
    if fmt is not None and fmt.get("type", "text") != "text":
        raise invalid("/v1/completions takes only response_format {\"type\": \"text\"}; structured output "
                      "is served on /v1/chat/completions.", param="response_format")


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


def _max_tokens(body: Mapping[str, Any], limit: int) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = read_field(body, name, int)
    if value is None:
        return None
    if value < 1:
        raise invalid(f"'{name}' must be at least 1, got {value}.", param=name)
    if value > limit:
        raise invalid(f"'{name}' must be at most {limit}, got {value}.", param=name)
    return value


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
    once the tokenizer is known (api.generation)."""
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


def common_fields(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int,
                  chat: bool = False) -> dict[str, Any]:
    _check_unsupported(body, chat)
    model = read_field(body, "model", str)
    if not model:
        raise invalid("'model' is required; GET /v1/models lists the served model.", param="model")
    stream = read_field(body, "stream", bool, False)
    options = read_field(body, "stream_options", dict)
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed with \"stream\": true.", param="stream_options")
    include_usage = read_field(options or {}, "include_usage", bool, False)
    limit = min(limits.max_tokens or engine_max_tokens, engine_max_tokens)
    return dict(model=model, stream=stream, include_usage=include_usage,
                max_tokens=_max_tokens(body, limit), user=read_field(body, "user", str),
                cache_salt=read_cache_salt(body))


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


def parse_completion(body: Mapping[str, Any], limits: Limits, engine_max_tokens: int) -> ParsedRequest:
    common = common_fields(body, limits, engine_max_tokens)
    logprobs = read_field(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise invalid(f"'logprobs' must be between 0 and {MAX_COMPLETION_LOGPROBS}.", param="logprobs")
    sampling = sampling_fields(body, limits, logprobs)
    return ParsedRequest(kind="completion", sampling=sampling, prompt=_prompt(body.get("prompt")),
                         logprobs=logprobs is not None, **common)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' is empty; send some text.", param="prompt")
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if min(value) < 0:
            raise invalid("'prompt' token ids must be >= 0.", param="prompt")
        return tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise invalid("Send one prompt per request (batches of prompts are not supported).", param="prompt")
    raise invalid("'prompt' must be a non-empty string or array of token ids.", param="prompt")


# ---------------------------------------------------------------------------------------------- responses


def sse(obj: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage_body(usage: Mapping[str, int]) -> dict[str, Any]:
    prompt, completion = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": usage.get("cached_tokens", 0)}}


def _envelope(obj: str, rid: str, created: int, model: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], finish: str | None = None,
               logprobs: list[dict[str, Any]] | None = None, with_usage: bool = False) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": {"content": logprobs} if logprobs is not None else None,
              "finish_reason": finish}
    chunk = {**_envelope("chat.completion.chunk", rid, created, model), "choices": [choice]}
    if with_usage:
        chunk["usage"] = None  # OpenAI sends null on every chunk but the last when usage is asked for
    return chunk


def completion_response(rid: str, created: int, model: str, text: str, finish: str | None,
                        usage: Mapping[str, int] | None, logprobs: dict[str, Any] | None,
                        stream: bool = False) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
    out = {**_envelope("text_completion", rid, created, model), "choices": [choice]}
    if not stream:
        out["usage"] = usage_body(usage or {})
    return out


def completion_usage_chunk(rid: str, created: int, model: str, usage: Mapping[str, int]) -> dict[str, Any]:
    return {**_envelope("text_completion", rid, created, model), "choices": [], "usage": usage_body(usage)}


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "pomona"}]}


def error_event(err: ApiError) -> str:
    return sse(err.body())


@dataclass(frozen=True)
class LogprobFormatter:
    """Token ids -> OpenAI logprob entries; `decode` maps one token id to its text."""

    decode: Callable[[int], str]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        return [{**self._entry(lp["id"], lp["lp"]),
                 "top_logprobs": [self._entry(t, v) for t, v in lp.get("top", ())]} for lp in items]

    def completion(self, items: Sequence[Mapping[str, Any]], offset: int) -> dict[str, Any]:
        tokens, offsets = [], []
        for lp in items:
            offsets.append(offset)
            tokens.append(self.decode(lp["id"]))
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp["lp"] for lp in items],
                "top_logprobs": [{self.decode(t): v for t, v in lp.get("top", ())} for lp in items],
                "text_offset": offsets}
