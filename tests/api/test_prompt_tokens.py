"""api/core/prompt_tokens.py: a resent conversation is encoded only past what was seen, with the ids a
whole encoding gives."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from api.core.prompt_tokens import IncrementalEncoder
from modelio.models import load_tokenizer, resolve_model


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("default", weights=False))


WORDS = ["def", " x", "(", "):", "\n", "  return", " 42", "é", "😀", " the", "  ", "<", "|", "im", ">", "\t"]


def turn_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(WORDS) for _ in range(n))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), turns=st.integers(1, 6))
def test_a_growing_conversation_encodes_as_a_whole_encoding_does(tok, seed, turns):
    rng = random.Random(seed)
    enc = IncrementalEncoder(tok)
    enc._checks = 0  # compare every time here, not only the first few
    messages = [{"role": "system", "content": turn_text(rng, 50)}]
    for _ in range(turns):
        messages.append({"role": "user", "content": turn_text(rng, rng.randrange(1, 80))})
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert enc.encode(text) == list(tok.encode(text, add_special_tokens=False))
        messages.append({"role": "assistant", "content": turn_text(rng, rng.randrange(0, 30))})


def test_the_next_turn_reuses_the_previous_turns_ids_within_a_salt_only(tok):
    messages = [{"role": "system", "content": "You are a careful agent. " * 100},
                {"role": "user", "content": "Read the file."}]
    first = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    messages += [{"role": "assistant", "content": "Reading it."}, {"role": "user", "content": "Now fix it."}]
    second = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    enc = IncrementalEncoder(tok)
    enc.encode(first, salt="a")
    assert enc.reused_tokens == 0
    assert enc.encode(second, salt="b") == list(tok.encode(second, add_special_tokens=False))
    assert enc.reused_tokens == 0  # another tenant's prefix is not reused
    ids = enc.encode(second, salt="a")
    assert ids == list(tok.encode(second, add_special_tokens=False))
    assert enc.reused_tokens > 500  # the system prompt and the first turn were not encoded again


class SplitDiffers:
    """A tokenizer for which encoding in parts at a special token differs from a whole encoding."""

    class _Special:
        content, special, lstrip, rstrip = "<s>", True, False, False

    added_tokens_decoder = {0: _Special()}

    def encode(self, text, add_special_tokens=False):
        return [len(text)] if text.startswith("<s>") or "<s>" not in text else [1, len(text)]


def test_a_tokenizer_that_splits_differently_is_encoded_whole_from_then_on():
    enc = IncrementalEncoder(SplitDiffers())
    text = "abc<s>def<s>gh"
    enc.encode(text)  # the check finds the parts differ
    assert enc._pattern is None
    assert enc.encode(text) == SplitDiffers().encode(text)


def test_special_tokens_that_strip_whitespace_are_not_boundaries():
    class Strip(SplitDiffers):
        class _Special:
            content, special, lstrip, rstrip = "<s>", True, True, False

        added_tokens_decoder = {0: _Special()}

    assert IncrementalEncoder(Strip())._pattern is None
