"""The fields OpenAI's chat and text completions share: the model, streaming, `max_tokens` /
`max_completion_tokens`, `user`, `cache_salt`, and the fields neither serves (refused, never ignored).

Only the OpenAI room reads these names; the fields every dialect shares are api.core.fields.
"""

from __future__ import annotations

from typing import Any, Mapping

from api.core.errors import invalid
from api.core.fields import Limits, read_cache_salt, read_field

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


def _check_unsupported(body: Mapping[str, Any], chat: bool) -> None:
    for name, why in (UNSUPPORTED if chat else {**UNSUPPORTED, **CHAT_ONLY}).items():
        if body.get(name) not in (None, [], {}, ""):
            raise invalid(f"'{name}': {why}.", param=name)
    if read_field(body, "best_of", int, 1) != 1:
        raise invalid("'best_of' must be 1.", param="best_of")
    if chat:  # n and response_format are the chat dialect's (api/openai/chat.py)
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

