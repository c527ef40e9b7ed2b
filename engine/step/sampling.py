"""Logits processors and sampling for the own step's rows (engine/step/step_runner.py).

A slot here is the step runner's per-sequence record: its `decoding` (sampler, processors),
`context` (the tokens its processors see, on the device) and `known` tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import greedy_sampler

from engine.sampling import Sampler, SeededSampler


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


def sample_positions(rows: list[tuple[Any, list[int], mx.array]]) -> tuple[mx.array, mx.array]:
    """Process and sample every position of speculative rows: (slot, inputs, logits (n, vocab)),
    inputs its last token then its proposals. Returns the tokens (sum of n) and log-probabilities,
    rows in order.

    Position j is processed as if the proposals before it were accepted (its processors see the
    context up to input j, as a plain decode of that token would), and drawn as a plain decode
    draws: greedy rows by argmax, unseeded rows in one call per sampler (independent draws), a
    seeded row one position at a time, so its key sequence is the one decoding without
    speculation uses. Per position, what its processors' and sampler's states were before it goes
    to the slot's `spec.undo`, for the step runner to restore the states of rejected positions.
    """
    lps = []
    for s, inputs, logits in rows:
        procs = s.decoding.logits_processors
        undo: list[list[Any]] = [[None, None] for _ in inputs]
        if procs:
            base, ids, out = s.context, mx.array(inputs, dtype=mx.int32), []
            for j in range(len(inputs)):
                undo[j][0] = [p.snapshot() if hasattr(p, "snapshot") else None for p in procs]
                context = mx.concatenate([base, ids[:j + 1]])
                row = logits[j:j + 1]
                for process in procs:
                    row = process(context, row)
                out.append(row)
            s.context = mx.concatenate([base, ids])
            logits = mx.concatenate(out, axis=0)
        lps.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        s.spec.undo = undo
    logprobs = mx.concatenate(lps, axis=0) if len(lps) > 1 else lps[0]
    groups: dict[int, tuple[Sampler, list[int]]] = {}
    sequential: list[tuple[Any, int, int]] = []
    at = 0
    for s, inputs, _ in rows:
        if isinstance(s.decoding.sampler, SeededSampler):
            sequential.append((s, at, len(inputs)))
        else:
            groups.setdefault(id(s.decoding.sampler), (s.decoding.sampler, []))[1].extend(range(at, at + len(inputs)))
        at += len(inputs)
    if len(groups) == 1 and not sequential and next(iter(groups.values()))[0] is greedy_sampler:
        return greedy_sampler(logprobs).astype(mx.int32), logprobs
    tokens = mx.zeros((at,), mx.int32)
    for sampler, indices in groups.values():
        index = mx.array(indices, dtype=mx.int32)
        tokens[index] = sampler(logprobs[index]).astype(mx.int32)
    for s, first, n in sequential:
        drawn = []
        for j in range(n):
            s.spec.undo[j][1] = s.decoding.sampler.key
            drawn.append(s.decoding.sampler(logprobs[first + j:first + j + 1]).astype(mx.int32).reshape(1))
        tokens[first:first + n] = mx.concatenate(drawn)
    return tokens, logprobs
