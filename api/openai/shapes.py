"""OpenAI's response shapes (chat chunks, text completions, usage, the model list, logprob
entries): engine output in, OpenAI's JSON objects out. No parsing, no HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence


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
