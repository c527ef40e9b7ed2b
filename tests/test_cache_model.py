"""With a tiny real model: continuing from a cached prefix generates what a cold start does."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from test_cache_support import store


def _greedy(model, prompt: list[int], n: int, cache=None) -> list[int]:
    out = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=cache,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        out.append(int(tok))
    return out


def test_restored_prefix_matches_cold_greedy(tiny_model_dir, tmp_path):
    model, tokenizer = load(str(tiny_model_dir))
    first = tokenizer.encode("The quick brown fox jumps over the lazy dog. Paris is the capital of")
    prompt = first + tokenizer.encode(" France. Berlin is the capital of")
    cold = _greedy(model, prompt, 12)

    cache = make_prompt_cache(model)
    model(mx.array([first]), cache=cache)
    s = store(tmp_path, block_size=4, min_restore_tokens=4)
    s.offer(first, cache, "finished")

    for tier in ("ram", "ssd"):
        if tier == "ssd":
            s.flush()
            s.clear("ram")
        hit = s.lookup(prompt)
        assert hit is not None and hit.tier == tier
        assert hit.num_tokens == (len(first) if tier == "ram" else len(first) // 4 * 4)
        warm = _greedy(model, prompt[hit.num_tokens:], 12, cache=hit.cache)
        assert warm == cold
    s.close()


def test_exact_hit_feeds_last_token(tiny_model_dir):
    model, tokenizer = load(str(tiny_model_dir))
    prompt = tokenizer.encode("Hello world! How are you today? I am fine, thank you.")
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    s = store(min_restore_tokens=4)
    s.offer(prompt, cache, "finished")
    hit = s.lookup(prompt)
    assert hit.num_tokens == len(prompt) - 1
    assert _greedy(model, prompt[hit.num_tokens:], 8, cache=hit.cache) == _greedy(model, prompt, 8)
