"""The plain-data format between the LLM server replica (deployments/engine_host.py) and the ingress.

Everything crossing that process boundary is plain dicts and lists, so the ingress and the LLM server
need not agree on class versions and a pickled event stays small.

Wire format of `EngineHost.stream()`: first either a rejection `{"rejected": {"kind", "message",
"retry_after_s"}}` (nothing was generated; the ingress answers with an HTTP status), or lists of
events `{"text", "token", "lp", "finish", "usage", "error", "code", "stop_str"}`; the last event of
the last list has `finish`. Sampling settings travel as `sampling_to_wire`'s dict (`logit_bias` as
[token, bias] pairs, `grammar` as the llguidance grammar string), plus the request's prefix-cache
partition under `SALT_KEY` (`Request.cache_salt`: the caller's tenant and the request's own salt,
api/service/auth.py); `request_from_wire` rebuilds the engine's `Request` from them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from engine.types import (ContextLengthError, EngineClosedError, FinishReason, OverloadedError, Request,
                          SamplingParams, TokenEvent, TokenLogprob, Usage)

SALT_KEY = "cache_salt"  # beside the sampling settings in a request's wire params


def event_to_wire(event: TokenEvent) -> dict[str, Any]:
    lp = event.logprob
    return {
        "text": event.text,
        "token": event.token_id,
        "lp": None if lp is None else {"id": lp.token_id, "lp": lp.logprob, "top": [list(t) for t in lp.top]},
        "finish": None if event.finish_reason is None else event.finish_reason.value,
        "usage": None if event.usage is None else {
            "prompt_tokens": event.usage.prompt_tokens, "completion_tokens": event.usage.completion_tokens,
            "cached_tokens": event.usage.cached_tokens, "cache_tier": event.usage.cache_tier},
        "error": event.error,
        "code": event.error_code,  # "timeout", "reset", ...: the ingress picks the HTTP status from it
        "stop_str": event.stop_string,  # the stop string that ended the request, if one did
    }


def event_from_wire(request_id: str, wire: Mapping[str, Any]) -> TokenEvent:
    """`event_to_wire`'s inverse (the engine's own process sends its events this way)."""
    lp, usage, finish = wire.get("lp"), wire.get("usage"), wire.get("finish")
    return TokenEvent(
        request_id=request_id, token_id=wire.get("token"), text=wire.get("text") or "",
        logprob=None if lp is None else TokenLogprob(lp["id"], lp["lp"], tuple((int(t), float(v)) for t, v in lp["top"])),
        finish_reason=None if finish is None else FinishReason(finish),
        usage=None if usage is None else Usage(**usage),
        error=wire.get("error"), error_code=wire.get("code"), stop_string=wire.get("stop_str"))


def rejection(exc: Exception) -> dict[str, Any]:
    """An exception raised before the first event -> a wire rejection the ingress maps to a status."""
    if isinstance(exc, OverloadedError):
        kind, retry = "overloaded", exc.retry_after_s
    elif isinstance(exc, ContextLengthError):
        kind, retry = "context_length", 0.0
    elif isinstance(exc, EngineClosedError):
        kind, retry = "closed", 1.0
    else:
        kind, retry = "invalid", 0.0
    return {"rejected": {"kind": kind, "message": str(exc), "retry_after_s": retry}}


def request_from_wire(prompt_tokens: Any, params: Mapping[str, Any], request_id: str, priority: int = 0) -> Request:
    """The engine's `Request` from the ingress's wire params (sampling settings and the cache salt).
    Raises ValueError for settings the engine refuses."""
    salt = params.get(SALT_KEY) or ""
    if not isinstance(salt, str):
        raise ValueError("cache_salt must be a string")
    return Request(prompt_tokens=tuple(prompt_tokens), params=sampling_from_wire(params), request_id=request_id,
                   priority=priority, cache_salt=salt)


def sampling_from_wire(params: Mapping[str, Any]) -> SamplingParams:
    values = {k: v for k, v in params.items() if k != SALT_KEY}
    for name in ("stop", "stop_token_ids"):
        if name in values:
            values[name] = tuple(values[name])
    if "logit_bias" in values:  # pairs come back as lists (JSON) or a {token: bias} mapping
        bias = values["logit_bias"]
        pairs = bias.items() if isinstance(bias, Mapping) else bias
        values["logit_bias"] = tuple((int(t), float(b)) for t, b in pairs)
    return SamplingParams(**values)


def sampling_to_wire(params: SamplingParams) -> dict[str, Any]:
    return asdict(params)
