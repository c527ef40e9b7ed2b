"""Draft-model proposals for the own step's speculation (`engine.speculative: {method: draft,
draft_model: PATH}`): a small mlx-lm model with the target's tokenizer proposes each row's next
tokens greedily; the step verifies them as it verifies prompt lookup's (engine/step/speculative.py),
so the output is the target's whatever the draft says.

Each request keeps its own mlx-lm cache of the draft, fed the request's tokens as they become
known; what the draft consumed past the tokens the step accepted is trimmed at the next proposal
(mlx-lm's public `trim_prompt_cache`). A request's first proposal feeds the draft its whole prompt.
Rows are drafted one after the other, k forwards each: an option for one or a few streams where
a draft model predicts well, not for a large batch (the issue measured a draft model as a net
loss on the CPU; `auto` never picks it).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine.forward import last_logits
from engine.step.speculative import SpecState

DRAFT_PREFILL_CHUNK = 2048  # bounds one pass's memory when the draft catches up on a prompt


def load_draft(path: str, dtype: str | None, cpu_fast_paths: bool) -> Any:
    """The draft model (as Pomona loads any model: float32 on a CPU, as stored on a GPU)."""
    from modelio.models import load_model, resolve_model

    return load_model(resolve_model(path), dtype, cpu_fast_paths).model


def check_vocab(draft: Any, target: Any) -> None:
    """Refuse a draft whose vocabulary differs from the target's (its ids would mean other tokens)."""
    a, b = getattr(getattr(draft, "args", None), "vocab_size", None), getattr(getattr(target, "args", None), "vocab_size", None)
    if a is not None and b is not None and a != b:
        raise ValueError(f"the draft model's vocabulary ({a}) differs from the model's ({b}): "
                         "a draft model needs the same tokenizer")


class DraftProposer:
    def __init__(self, model: Any, limit: int) -> None:
        self.model = model
        self.limit = limit  # most proposals a row makes (what may differ at the tail of what was fed)
        self.forwards = 0

    def propose(self, state: SpecState, known: Sequence[int], k: int) -> list[int]:
        """Up to k greedy draft tokens to follow `known` (prompt and output so far)."""
        if k <= 0:
            return []
        if state.draft_cache is None:
            state.draft_cache, state.draft_fed = make_prompt_cache(self.model), []
        cache, fed = state.draft_cache, state.draft_fed
        # Only the last few fed tokens can differ from what is known (proposals not accepted).
        common = max(0, len(fed) - self.limit - 2)
        while common < min(len(fed), len(known)) and fed[common] == known[common]:
            common += 1
        if common < len(fed):
            trim_prompt_cache(cache, len(fed) - common)
            del fed[common:]
        pending = list(known[common:])  # at least the last known token, never fed yet
        head, token_input = pending[:-1], pending[-1:]
        for i in range(0, len(head), DRAFT_PREFILL_CHUNK):
            self.model(mx.array([head[i:i + DRAFT_PREFILL_CHUNK]]), cache=cache)
            self.forwards += 1
        fed.extend(pending)
        out: list[int] = []
        for j in range(k):
            logits = last_logits(self.model, mx.array([token_input]), cache)
            self.forwards += 1
            token = int(mx.argmax(logits[0]).item())
            out.append(token)
            if j < k - 1:
                token_input = [token]
                fed.append(token)
        return out
