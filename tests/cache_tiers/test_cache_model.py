"""With a tiny real model: continuing from a cached prefix (RAM blocks and tail, SSD blocks, SSD
blocks after a restart) generates what a cold start does, token for token, and with logprobs
bit-identical to continuing from the very cache that was offered.

Why two references: a cold run prefills the whole prompt in one pass, a warm one prefills only the
rest on top of restored rows; the matmuls differ in shape, so their logprobs agree to ~1e-5, not
bit for bit (greedy tokens agree). A restore, though, must hand back exactly the rows offered, so
continuing from it equals continuing from a twin of the offered cache (the same forward pass, never
stored; trimmed to the restored length) bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import KVCache, RotatingKVCache
from test_cache_support import generate, prefilled, same_logprobs, store

STEPS = 12


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return load(str(tiny_model_dir))


def _prompts(tokenizer):
    first = tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    return first, first + tokenizer.encode(" France. Berlin is the capital of")


def _trimmed(cache, n: int):
    for c in cache:
        c.trim(c.offset - n)
    return cache


def test_restored_prefix_matches_cold(llama, tmp_path):
    model, tokenizer = llama
    first, prompt = _prompts(tokenizer)
    assert len(first) % 4  # the offer ends inside a block: both tiers serve its tail
    cold = generate(model, prompt, STEPS)
    s = store(tmp_path, block_size=4, min_restore_tokens=4)
    s.offer(first, prefilled(model, first), "finished")
    for tier, s in each_tier(s, tmp_path, block_size=4, min_restore_tokens=4):
        hit = s.lookup(prompt)
        assert hit is not None and hit.tier == ("ram" if tier == "ram" else "ssd")
        n = len(first)
        assert hit.num_tokens == n and all(type(c) is KVCache and c.offset == n for c in hit.cache)
        warm = generate(model, prompt[n:], STEPS, cache=hit.cache)
        twin = generate(model, prompt[n:], STEPS, cache=_trimmed(prefilled(model, first), n))
        assert warm[0] == cold[0], tier
        assert same_logprobs(warm[1], twin[1]), tier
        assert max(np.abs(a - b).max() for a, b in zip(warm[1], cold[1])) < 1e-3, tier
    s.close()


def test_exact_hit_feeds_last_token(llama):
    model, tokenizer = llama
    prompt = tokenizer.encode("Hello world! How are you today? I am fine, thank you.")[:15]
    s = store(block_size=4, min_restore_tokens=4)  # 3 blocks and a 3-token tail
    s.offer(prompt, prefilled(model, prompt), "finished")
    hit = s.lookup(prompt)
    assert hit.num_tokens == len(prompt) - 1
    warm = generate(model, prompt[hit.num_tokens:], 8, cache=hit.cache)
    assert warm[0] == generate(model, prompt, 8)[0]
    twin = generate(model, prompt[hit.num_tokens:], 8, cache=_trimmed(prefilled(model, prompt), hit.num_tokens))
    assert same_logprobs(warm[1], twin[1])


def each_tier(s, tmp_path, **cfg):
    """(tier, store) three times: as offered (RAM), the SSD alone (RAM cleared), after a restart."""
    yield "ram", s
    s.tick(drain=True)
    s.flush()
    s.clear("ram")
    yield "ssd", s
    s.close()
    yield "restart", store(tmp_path, **cfg)


def _rotating(model, size: int = 8) -> list[RotatingKVCache]:
    # the tiny llama has its own make_cache, so make_prompt_cache(max_kv_size=...) would not rotate
    return [RotatingKVCache(max_size=size, keep=4) for _ in model.layers]


def test_rotating_cache_restored_matches_the_offered_cache(llama, tmp_path):
    """RotatingKVCache layers are exact layers: kept whole at a block boundary (a checkpoint) and
    in RAM tails, and served only at those lengths."""
    model, tokenizer = llama
    first, prompt = _prompts(tokenizer)
    aligned = first[: len(first) // 4 * 4]
    s = store(tmp_path, block_size=4, min_restore_tokens=4)
    s.offer(aligned, prefilled(model, aligned, _rotating(model)), "checkpoint")
    s.offer(first, prefilled(model, first, _rotating(model)), "finished")
    assert prefilled(model, first, _rotating(model))[0].offset > 8  # rotated past its window
    for tier, s in each_tier(s, tmp_path, block_size=4, min_restore_tokens=4):
        hit = s.lookup(prompt)
        assert hit is not None and hit.tier == ("ram" if tier == "ram" else "ssd")
        offered = first if tier == "ram" else aligned  # a tail (RAM) or the boundary's exact state
        n = len(offered)
        assert hit.num_tokens == n and all(type(c) is RotatingKVCache and c.offset == n for c in hit.cache)
        warm = generate(model, prompt[n:], STEPS, cache=hit.cache)
        twin = generate(model, prompt[n:], STEPS, cache=prefilled(model, offered, _rotating(model)))
        assert warm[0] == twin[0] and same_logprobs(warm[1], twin[1]), tier
        assert s.lookup(first[:10] + [1] * 8) is None  # never at a length without an exact state
    s.close()
