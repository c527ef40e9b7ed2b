"""The engine's vocabulary: requests, sampling settings, and what streams back.

Everything here is a frozen dataclass validated on construction, so a bad value is refused where it
enters (the HTTP layer turns `ValueError` into a 400) instead of failing deep inside a batch step.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any


class EngineError(Exception):
    """Base of the errors the engine reports to callers; `code` maps onto an HTTP status upstream."""

    code = "engine_error"


class OverloadedError(EngineError):
    """The waiting queue is full. Callers should retry after `retry_after_s`."""

    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ContextLengthError(EngineError, ValueError):
    """Prompt plus max_tokens does not fit in the model's context."""

    code = "context_length_exceeded"


class InvalidRequestError(EngineError, ValueError):
    """The request asks for what this engine cannot do (above a limit, a grammar that does not
    compile): the caller's to change. Any other exception from the engine is the server's fault."""

    code = "invalid_request"


class EngineClosedError(EngineError):
    """The engine is shutting down or has stopped; no new requests are taken."""

    code = "engine_closed"


class RequestStatus(enum.IntEnum):
    """Ordered: a request only ever moves to a larger value; every value >= FINISHED_STOPPED is final."""

    WAITING = 0
    PREFILLING = 1
    DECODING = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    @property
    def status(self) -> RequestStatus:
        return _FINISH_STATUS[self]


_FINISH_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5
MAX_STOP_STRINGS = 16
# Characters per stop string: the text check does work per token that grows with a stop's length
# (engine/text.py), so the engine refuses any longer; the HTTP layer's own bound is lower (limits).
MAX_STOP_LENGTH = 4096
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _finite(name: str, value: float) -> None:
    _check(isinstance(value, (int, float)) and not isinstance(value, bool), f"{name} must be a number")
    _check(math.isfinite(value), f"{name} must be finite, got {value}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; each request in a shared batch keeps its own.

    Defaults follow OpenAI's API: temperature 1.0 means sampling; 0 means greedy.
    `logprobs` is the number of top alternatives to report per token (0 = only the chosen token's
    log-probability, None = none at all). `logit_bias` holds (token id, bias) pairs added to the logits.
    `grammar` is an llguidance grammar (what `llguidance.LLMatcher` accepts, e.g. the output of
    `api.output.grammars`); None means unconstrained. A request with a grammar always ends at EOS once
    the grammar is complete, even with `ignore_eos`.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
               "max_tokens must be an integer")
        _check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty"):
            _finite(name, getattr(self, name))
        _check(0.0 <= self.temperature <= 2.0, f"temperature must be in [0, 2], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(0.01 <= self.repetition_penalty <= 10.0,
               f"repetition_penalty must be in [0.01, 10], got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               "seed must be an integer")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
               "stop must be a tuple of non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        _check(all(len(s) <= MAX_STOP_LENGTH for s in self.stop),
               f"stop strings may be at most {MAX_STOP_LENGTH} characters long")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be between 0 and {MAX_LOGPROBS}")
        _check_logit_bias(self.logit_bias)
        _check(self.grammar is None or (isinstance(self.grammar, str) and self.grammar != ""),
               "grammar must be a non-empty string or None")

    @property
    def greedy(self) -> bool:
        # Below this, 1/temperature overflows float32 logits; such a temperature means argmax.
        return self.temperature < GREEDY_BELOW


def _check_logit_bias(bias: object) -> None:
    _check(isinstance(bias, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in bias),
           "logit_bias must be a tuple of (token id, bias) pairs")
    seen = set()
    for token, value in bias:  # type: ignore[union-attr]
        _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
               f"logit_bias keys must be token ids >= 0, got {token!r}")
        _check(token not in seen, f"logit_bias lists token {token} more than once")
        seen.add(token)
        _finite(f"logit_bias[{token}]", value)
        _check(-MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS,
               f"logit_bias values must be in [-100, 100], got {value} for token {token}")


_request_ids = itertools.count()


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{next(_request_ids)}-{time.monotonic_ns() % 10**9}"


@dataclass(frozen=True)
class Request:
    """An immutable description of one generation; its live state is kept by the engine.

    `constraint` is the compiled grammar's logits processor (`engine.constraints.GrammarConstraint`)
    when `params.grammar` is set: built off the MLX thread (`AsyncEngine.stream` does it), one per request.
    """

    prompt_tokens: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=new_request_id)
    priority: int = 0  # lower runs first under the priority policy
    arrival_time: float = field(default_factory=time.monotonic)
    constraint: Any = field(default=None, compare=False, repr=False)
    # Partitions the prefix cache (as vLLM's `cache_salt`): state is shared only between requests with
    # the same salt. The ingress sets it from the caller's tenant (plus any salt the request adds),
    # so one tenant's cached prefixes, and the timing and cached-token counts they would show, are
    # never served to another. "" is the one implicit tenant of a server without keys.
    cache_salt: str = ""

    def __post_init__(self) -> None:
        _check(isinstance(self.cache_salt, str), "cache_salt must be a string")
        _check(isinstance(self.prompt_tokens, tuple), "prompt_tokens must be a tuple of token ids")
        _check(len(self.prompt_tokens) > 0, "the prompt is empty: send at least one token")
        _check(all(isinstance(t, int) and t >= 0 for t in self.prompt_tokens), "prompt tokens must be ids >= 0")
        _check(isinstance(self.request_id, str) and self.request_id != "", "request_id must be a non-empty string")
        _check(isinstance(self.priority, int), "priority must be an integer")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    cache_tier: str | None = None  # "ram", "ssd" or None when nothing came from the prefix store

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TokenEvent:
    """One step's output for one request.

    `text` is the newly releasable text (possibly empty while a stop string or a multi-byte
    character is held back). The last event of a request has `finish_reason` and `usage` set;
    with `FinishReason.ERROR` it also carries `error`; `stop_string` is the stop string (one of
    `SamplingParams.stop`) that ended it, if one did.
    """

    request_id: str
    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    error: str | None = None
    error_code: str | None = None  # "timeout", "internal_error", "reset" or "shutdown" with ERROR/ABORT
    stop_string: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
