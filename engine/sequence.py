"""The live state of one admitted request, owned by the engine on its MLX thread."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.text import TextStream, TokensOnly
from engine.types import FinishReason, Request, RequestStatus, Usage


@dataclass
class Sequence:
    request: Request
    text: TextStream | TokensOnly
    status: RequestStatus = RequestStatus.WAITING
    cached_tokens: int = 0
    cache_tier: str | None = None
    prefill_done: int = 0
    output_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    deadline: float | None = None
    checkpointed: int = 0  # prompt tokens already offered to the prefix store mid-prefill
    last_token_at: float | None = field(default=None, repr=False)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def prefill_left(self) -> int:
        return max(0, self.prompt_len - self.cached_tokens - self.prefill_done)

    def advance(self, status: RequestStatus) -> None:
        # Ordered statuses: a request never moves backwards (a late prefill response after the
        # first token, say, must not turn a decoding request back into a prefilling one).
        if status > self.status:
            self.status = status

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_len,
            completion_tokens=self.output_tokens,
            cached_tokens=self.cached_tokens,
            cache_tier=self.cache_tier,
        )

    def finish(self, reason: FinishReason) -> None:
        self.advance(reason.status)

    def describe(self, now: float | None = None) -> dict:
        """A JSON-ready summary for the per-request status endpoint."""
        now = time.monotonic() if now is None else now
        phase = {RequestStatus.WAITING: "queued", RequestStatus.PREFILLING: "prefill",
                 RequestStatus.DECODING: "decode"}.get(self.status, "finished")
        ttft = None if self.first_token_at is None else self.first_token_at - self.request.arrival_time
        decoding_s = None if self.first_token_at is None else max(now - self.first_token_at, 1e-9)
        return {
            "id": self.request_id,
            "phase": phase,
            "prompt_tokens": self.prompt_len,
            "prefill_progress": [self.cached_tokens + self.prefill_done, self.prompt_len],
            "output_tokens": self.output_tokens,
            "ttft_s": ttft,
            "tokens_per_s": None if decoding_s is None else self.output_tokens / decoding_s,
            "cached_tokens": self.cached_tokens,
            "constrained": self.request.params.grammar is not None,  # a grammar (schema, forced tool call)
            "cache_tier": self.cache_tier,
            "age_s": now - self.request.arrival_time,
        }
