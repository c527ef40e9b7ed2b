"""The own step's per-sequence and per-step records (engine/step/step_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.runner import PromptProgress
from engine.sampling import Decoding
from engine.step.speculative import SpecState


@dataclass(eq=False)
class Slot:
    request_id: str
    row: int
    decoding: Decoding
    matcher: Any
    max_tokens: int
    rest: list[int]  # the prompt tokens to feed (the uncached rest)
    known: list[int]  # token values known here: cached prefix, prompt fed, outputs read back
    length: int  # KV positions written, in-flight steps included
    fed: int = 0  # of `rest`
    sampled: int = 0  # output tokens sampled, in-flight ones included
    generated: int = 0  # output tokens read back
    context: mx.array | None = None  # prompt + outputs, for logits processors
    spec: SpecState | None = None  # speculation (engine/step/speculative.py), None when off
    cached: int = 0  # prompt tokens restored from the prefix cache (not fed)

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.rest)


@dataclass
class Work:
    """One started step: what to read back from it next step."""

    outputs: list[tuple[Slot, int]]  # (slot, index into tokens/logprobs)
    tokens: mx.array
    logprobs: mx.array  # (len(tokens), vocab)
    decoding: int
    prefill_tokens: int
    progress: list[PromptProgress] = field(default_factory=list)
    # Rows that verified proposals (their last token and `proposals` fed): slot -> proposals; its
    # output index is the first of len(proposals) + 1 sampled positions.
    verified: dict[Slot, list[int]] = field(default_factory=dict)
    # Positions each decoding or verifying row advanced by (its length and sampled count), so a
    # row's part can be taken back when it was built on a guess that failed (`void`).
    widths: dict[Slot, int] = field(default_factory=dict)
    # Per verifying row, its processors' and sampler's states before each position
    # (`sample_positions`): what a rejected position restores. Kept with the step, not the row,
    # since a step built before this one is read verifies the row again.
    undo: dict[Slot, list[Any]] = field(default_factory=dict)
    # Rows whose part of this step was built on the guess that the step before it accepted all
    # of their proposals, and it did not: their part is dropped when this step is read.
    void: set[Slot] = field(default_factory=set)


def merge(a: Work, b: Work) -> Work:
    """A decode step's work and its prefill chunks' (whose outputs index after the decode rows)."""
    shift = a.tokens.shape[0]
    kept = dict(verified={**a.verified, **b.verified}, widths={**a.widths, **b.widths}, undo={**a.undo, **b.undo})
    if not b.outputs:
        return Work(a.outputs, a.tokens, a.logprobs, a.decoding + b.decoding, b.prefill_tokens, b.progress, **kept)
    return Work(a.outputs + [(s, i + shift) for s, i in b.outputs], mx.concatenate([a.tokens, b.tokens]),
                mx.concatenate([a.logprobs, b.logprobs], axis=0), a.decoding + b.decoding, b.prefill_tokens,
                b.progress, **kept)
