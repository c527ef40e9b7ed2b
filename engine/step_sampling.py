"""Logits processors and sampling for the own step's rows (engine/step_runner.py).

A slot here is the step runner's per-sequence record: its `decoding` (sampler, processors),
`context` (the tokens its processors see, on the device) and `known` tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from engine.sampling import Sampler


def process_logits(slots: list[Any], index: list[int], logits: mx.array, inputs: mx.array) -> mx.array:
    """Each sequence's logits processors (its row of `logits` at `index`), with its tokens so far
    (the input of this step last)."""
    if not any(s.decoding.logits_processors for s in slots):
        return logits
    rows = [logits[i:i + 1] for i in range(logits.shape[0])]
    for s, i in zip(slots, index):
        if s.decoding.logits_processors:
            s.context = mx.concatenate([s.context, inputs[i:i + 1]])
            for process in s.decoding.logits_processors:
                rows[i] = process(s.context, rows[i])
    return mx.concatenate(rows, axis=0)


def sample(slots: list[Any], index: list[int], logprobs: mx.array) -> mx.array:
    """One call per distinct sampler (one for the whole batch in the common case)."""
    groups: dict[int, tuple[Sampler, list[int]]] = {}
    for s, i in zip(slots, index):
        groups.setdefault(id(s.decoding.sampler), (s.decoding.sampler, []))[1].append(i)
    count = logprobs.shape[0]
    if len(groups) == 1:
        sampler, rows = next(iter(groups.values()))
        # Rows that do not decode (free, prefilling) may ride along only where they cannot change
        # what a decoding row draws: a seeded sampler's draw depends on the shape it is given.
        if sampler is greedy_sampler or len(rows) == count:
            return sampler(logprobs).astype(mx.int32)
    tokens = mx.zeros((count,), mx.int32)
    for sampler, rows in groups.values():
        at = mx.array(rows, dtype=mx.int32)
        tokens[at] = sampler(logprobs[at]).astype(mx.int32)
    return tokens


def first_token(s: Any, row: mx.array) -> tuple[mx.array, mx.array]:
    """Sample a prompt's first output token from its last position's logits (1, vocab), after
    its processors, with the whole prompt as their context."""
    if s.decoding.logits_processors:
        s.context = mx.array(s.known, dtype=mx.int32)
        for process in s.decoding.logits_processors:
            row = process(s.context, row)
    lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
    s.sampled = 1
    return s.decoding.sampler(lp).astype(mx.int32).reshape(1), lp
