"""Per-request samplers and logits processors for `BatchGenerator.insert`.

Every request keeps its own settings inside the shared batch. Requests whose settings are equal
share one sampler object, because `BatchGenerator` samples the whole batch in one call when all
samplers are the same object (the common all-greedy or all-default case) and falls back to one
call per row otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

import mlx.core as mx
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from engine.types import SamplingParams

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

REPETITION_CONTEXT = 256  # tokens of prompt + output the repetition penalty looks back over


@dataclass(frozen=True)
class Decoding:
    """What `BatchGenerator.insert` needs for one request."""

    sampler: Sampler
    logits_processors: tuple[LogitsProcessor, ...]
    stop_sequences: StopSequences


def _truncate(logprobs: mx.array, top_p: float, min_p: float, top_k: int) -> mx.array:
    if 0.0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p > 0.0:
        logprobs = apply_min_p(logprobs, min_p)
    # mlx-lm refuses top_k >= the vocabulary (inside a compiled function, which would poison the
    # global random state); a top_k that large keeps every token anyway.
    if 0 < top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, top_k)
    return logprobs


@lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, top_k: int, min_p: float) -> Sampler:
    """Unseeded sampling from the global random state. Cached so that equal settings give the
    *same* object, which lets the batch sample in one call."""

    def sample(logprobs: mx.array) -> mx.array:
        logprobs = _truncate(logprobs, top_p, min_p, top_k)
        return mx.random.categorical(logprobs * (1.0 / temperature))

    return sample


class SeededSampler:
    """A sampler with its own random key, so a seed reproduces the text whatever else is batched.
    The key is public: a speculative step draws for positions that may be rejected and puts the
    key back to where the accepted draws left it, so a seed gives the same text with speculation
    on and off."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.key = mx.random.key(params.seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self.params
        logprobs = _truncate(logprobs, p.top_p, p.min_p, p.top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub)


def _seeded_sampler(params: SamplingParams) -> Sampler:
    return SeededSampler(params)


def make_request_sampler(params: SamplingParams) -> Sampler:
    if params.greedy:
        return greedy_sampler
    if params.seed is not None:
        return _seeded_sampler(params)
    return _shared_sampler(params.temperature, params.top_p, params.top_k, params.min_p)


def _repetition_penalty(penalty: float) -> LogitsProcessor:
    """HF/vLLM semantics: divide positive logits (multiply negative ones) of tokens seen recently."""

    def process(context: mx.array, logits: mx.array) -> mx.array:
        if context.size == 0:
            return logits
        seen = context[-REPETITION_CONTEXT:]
        selected = logits[:, seen]
        logits[:, seen] = mx.where(selected < 0, selected * penalty, selected / penalty)
        return logits

    return process


def _output_penalties(presence: float, frequency: float, prompt_len: int) -> LogitsProcessor:
    """OpenAI semantics: penalties count the tokens generated so far, not the prompt.

    The context `BatchGenerator` passes holds the prompt followed by the output, so everything
    from `prompt_len` on is output.
    """

    def process(context: mx.array, logits: mx.array) -> mx.array:
        if context.size <= prompt_len:
            return logits
        generated = context[prompt_len:]
        if frequency:
            logits = logits.at[:, generated].subtract(frequency)
        if presence:
            logits[:, generated] = logits[:, generated] - presence
        return logits

    return process


def _logit_bias(bias: tuple[tuple[int, float], ...]) -> LogitsProcessor:
    """OpenAI semantics: each bias is added to its token's logit before sampling."""
    state: dict[str, mx.array] = {}

    def process(context: mx.array, logits: mx.array) -> mx.array:
        if "ids" not in state:  # ids past the model's vocabulary name no token: nothing to bias
            kept = [(t, b) for t, b in bias if t < logits.shape[-1]]
            state["ids"] = mx.array([t for t, _ in kept], dtype=mx.int32)
            state["values"] = mx.array([b for _, b in kept], dtype=logits.dtype)
        if state["ids"].size == 0:
            return logits
        return logits.at[:, state["ids"]].add(state["values"])

    return process


def make_logits_processors(params: SamplingParams, prompt_len: int,
                           constraint: LogitsProcessor | None = None) -> tuple[LogitsProcessor, ...]:
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        processors.append(_repetition_penalty(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(_output_penalties(params.presence_penalty, params.frequency_penalty, prompt_len))
    if params.logit_bias:
        processors.append(_logit_bias(params.logit_bias))
    if constraint is not None:  # last: whatever the others did, a forbidden token stays forbidden
        processors.append(constraint)
    return tuple(processors)


def make_stop_sequences(params: SamplingParams, eos_token_ids: Sequence[int],
                        force_eos: bool = False) -> StopSequences:
    """Token-level stops (EOS and `stop_token_ids`); stop *strings* are matched on text instead.
    `force_eos` keeps EOS a stop despite `ignore_eos` (a finished grammar allows nothing else)."""
    ids = set(params.stop_token_ids)
    if force_eos or not params.ignore_eos:
        ids.update(eos_token_ids)
    return StopSequences([[i] for i in sorted(ids)] or None)


def make_decoding(params: SamplingParams, prompt_len: int, eos_token_ids: Sequence[int],
                  constraint: LogitsProcessor | None = None) -> Decoding:
    """`constraint` is the request's grammar processor (`Request.constraint`), applied after the others."""
    return Decoding(
        sampler=make_request_sampler(params),
        logits_processors=make_logits_processors(params, prompt_len, constraint),
        stop_sequences=make_stop_sequences(params, eos_token_ids, force_eos=constraint is not None),
    )


def top_logprobs(logprobs: mx.array, token: int, n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """The chosen token's log-probability and the `n` most likely alternatives, best first."""
    chosen = logprobs[token].item()
    if n <= 0:
        return chosen, ()
    top = mx.argpartition(-logprobs, kth=n - 1)[:n]
    values = logprobs[top].tolist()
    pairs = sorted(zip(top.tolist(), values), key=lambda p: -p[1])
    return chosen, tuple((int(t), float(v)) for t, v in pairs)
