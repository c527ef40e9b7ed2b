"""The model's forward on mlx-lm's public model API, with the logits of chosen positions only.

Both runners (engine/batch_generator.py, engine/step/step_runner.py) and the draft model
(engine/step/draft.py) call a model through here.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import llama


def last_logits(model: Any, inputs: mx.array, cache: list[Any]) -> mx.array:
    """The logits of the last input position, (batch, vocab), after running all of `inputs` into `cache`."""
    return logits_at(model, inputs, cache, [(b, inputs.shape[1] - 1) for b in range(inputs.shape[0])])


def logits_at(model: Any, inputs: mx.array, cache: list[Any], at: list[tuple[int, int]]) -> mx.array | None:
    """The logits at (row, position) pairs, (len(at), vocab), after running all of `inputs` into `cache`
    (None when `at` is empty: the forward only fills the cache).

    Why: a full call projects every position onto the vocabulary and MLX does not push a slice back
    through the matmul, so `model(inputs)[:, -1]` pays the head for the whole rest of the prompt
    (SmolLM2-135M, 66 positions on the CPU: ~40 ms of a ~300 ms prefill). mlx-lm's llama `Model` is
    its body and then the head, so the two are called apart here; other architectures (whose call
    may scale or cap logits) take the full call.
    """
    rows = mx.array([r for r, _ in at], dtype=mx.int32)
    positions = mx.array([p for _, p in at], dtype=mx.int32)
    if type(model) is llama.Model:
        hidden = model.model(inputs, cache=cache)
        if not at:
            return None
        head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
        return head(hidden[rows, positions][:, None, :])[:, 0, :]
    logits = model(inputs, cache=cache)
    return logits[rows, positions] if at else None
