"""The engine serving tiny hybrid (state-space + attention) models with the tiered prefix store.

Their caches cannot be cut back, so an entry serves only prompts that extend it whole. The engine
checkpoints a prefill at absolute block boundaries (engine/checkpoints.py): a different
conversation with the same system prompt, a retry of the same prompt, a later turn and a restarted
server all resume from one, with the greedy output a cold run gives.

Needs Engine._checkpoint_due to ask the runner's `CheckpointPolicy` (the engine.py patch of
issue 21's hybrid prefix caching).
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from cache_tiers.config import CacheConfig
from engine.checkpoints import CheckpointPolicy
from engine.loop import default_store
from engine.types import Request, SamplingParams, Usage
from engine_helpers import collect, make_engine, run
from hybrid_models import hybrid_model_dir  # noqa: F401 (a fixture)
from tiny_model import CORPUS

BLOCK, EVERY = 16, 32
# Prefill steps of 48 tokens: without segments ending at the checkpoint positions, steps would end
# at 48, 96, 144... and no checkpoint could land on 128.
SETTINGS = dict(checkpoint_every=EVERY, prefill_chunk=48)
SYSTEM = "<|im_start|>system\n" + CORPUS[:480] + "<|im_end|>\n<|im_start|>user\n"
ARCHS = ["qwen3_next", "mamba2"]


def _prompt(engine, question: str) -> tuple[int, ...]:
    return tuple(engine.tokenizer.encode(SYSTEM + question + "<|im_end|>\n<|im_start|>assistant\n"))


def _ask(engine, tokens: tuple[int, ...], max_tokens: int = 10) -> tuple[list[int], Usage]:
    events = run(collect(engine, Request(tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                logprobs=0))))[1]
    return [e.token_id for e in events], events[-1].usage


def _cached_engine(path, tmp_path, **settings):
    cache = CacheConfig(ssd_dir=str(tmp_path / "ssd"), block_size=BLOCK, min_restore_tokens=8,
                        ram_bytes=256 * 2**20)
    return make_engine(path, store_factory=default_store, cache=cache, **SETTINGS, **settings)


@pytest.fixture(scope="module", params=ARCHS)
def model(request, hybrid_model_dir):  # noqa: F811
    """(model directory, a cold engine without a prefix cache for the reference outputs)."""
    path = hybrid_model_dir(request.param)
    cold = make_engine(path, **SETTINGS)
    yield path, cold
    run(cold.shutdown())


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def _checkpoints(start: int, length: int) -> set[int]:
    """Where a prefill of prompt positions [start, length) checkpoints: multiples of EVERY, and the
    last block boundary that leaves a token to feed."""
    ends = set(range(EVERY, length, EVERY)) | {(length - 1) // BLOCK * BLOCK}
    return {p for p in ends if p > start}


def _best(entries: dict[tuple[int, ...], set[int]], prompt: tuple[int, ...]) -> int:
    """The longest checkpoint of earlier prompts that is a prefix of `prompt` (and leaves a token)."""
    return max([p for earlier, ends in entries.items() for p in ends
                if p <= common_prefix(np.array(earlier), np.array(prompt)) and p < len(prompt)], default=0)


def test_policy_segments_at_absolute_boundaries():
    policy = CheckpointPolicy(EVERY, BLOCK)
    parts = policy.segments(list(range(20, 150)), 20)  # a prefill resuming at an unaligned 20
    ends = np.cumsum([len(p) for p in parts]) + 20
    assert list(ends) == [32, 64, 96, 128, 144, 150]  # every 32, then the last block before 150
    assert [p for s in parts for p in s] == list(range(20, 150))
    assert CheckpointPolicy(EVERY).segments([1, 2, 3], 20) == [[1, 2, 3]]  # trimmable: one segment
    assert policy.due(144, 128, 150) and not policy.due(136, 128, 150) and not policy.due(150, 144, 150)


def test_shared_system_prompt_retry_and_restart_resume_from_checkpoints(model, tmp_path):
    path, cold = model
    eng = _cached_engine(path, tmp_path)
    first, second, third = (_prompt(eng, q) for q in ("Who is the fox?", "Where is Paris?", "What is 42?"))
    try:
        out, usage = _ask(eng, first)
        assert out == _ask(cold, first)[0] and usage.cached_tokens == 0
        entries = {first: _checkpoints(0, len(first))}
        # another conversation, same system prompt: from the last checkpoint inside the shared part
        out, usage = _ask(eng, second)
        assert out == _ask(cold, second)[0]
        assert usage.cache_tier == "ram" and usage.cached_tokens == _best(entries, second) > 0
        entries[second] = _checkpoints(usage.cached_tokens, len(second))
        # the same prompt again: from the checkpoint at its last block boundary
        out, usage = _ask(eng, first)
        assert out == _ask(cold, first)[0]
        assert usage.cached_tokens == (len(first) - 1) // BLOCK * BLOCK
    finally:
        run(eng.shutdown())
    eng = _cached_engine(path, tmp_path)  # a restart: only the SSD remembers
    try:
        out, usage = _ask(eng, third)
        assert out == _ask(cold, third)[0]
        assert usage.cache_tier == "ssd" and usage.cached_tokens == _best(entries, third) > 0
    finally:
        run(eng.shutdown())


def test_later_turn_checkpoints_at_absolute_positions(model, tmp_path):
    """A turn restored from the previous turn's end (not block-aligned) still checkpoints at
    multiples of EVERY, which a sibling turn asking something else then resumes from."""
    path, cold = model
    eng = _cached_engine(path, tmp_path)
    try:
        first = _prompt(eng, "Who is the fox?")
        answer, _ = _ask(eng, first)
        turn = first + tuple(answer) + tuple(eng.tokenizer.encode("<|im_end|>\n<|im_start|>user\n" + CORPUS[500:800]))
        second = turn + tuple(eng.tokenizer.encode("Tell me."))
        out, usage = _ask(eng, second)
        start = usage.cached_tokens
        assert start == len(first) + len(answer) and start % BLOCK  # the previous turn's end
        sibling = turn + tuple(eng.tokenizer.encode("Something else entirely, please."))
        out, usage = _ask(eng, sibling)
        assert out == _ask(cold, sibling)[0]
        assert usage.cached_tokens == _best({second: _checkpoints(start, len(second))}, sibling) > start
    finally:
        run(eng.shutdown())


def test_checkpoints_of_prompts_prefilled_together(model, tmp_path):
    """Prompts of different lengths prefilled in one batch (mlx-lm pads the shorter ones) leave
    checkpoints that later prompts resume from with the cold run's output."""
    path, cold = model
    eng = _cached_engine(path, tmp_path, prefill_group_ratio=None)  # prefill all of them together

    async def together(prompts):
        return await asyncio.gather(*(collect(eng, Request(p, SamplingParams(max_tokens=10, temperature=0.0,
                                                                             logprobs=0))) for p in prompts))
    try:
        batch = [tuple(eng.tokenizer.encode(CORPUS[i:j])) for i, j in ((0, 300), (100, 700), (40, 520))]
        for prompt, (_, events) in zip(batch, run(together(batch))):
            assert [e.token_id for e in events] == _ask(cold, prompt)[0]
        entries = {prompt: _checkpoints(0, len(prompt)) for prompt in batch}
        for prompt in batch:
            later = prompt[:-3] + tuple(eng.tokenizer.encode(" Something else?"))
            out, usage = _ask(eng, later)
            assert out == _ask(cold, later)[0]
            assert usage.cached_tokens == _best(entries, later) > 0
    finally:
        run(eng.shutdown())
