"""Streaming text: multi-byte characters never split, stop strings held back and cut."""

from __future__ import annotations

import pytest
from mlx_lm import load

from engine.text import TextStream


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load(str(tiny_model_dir))[1]


def stream_text(tokenizer, text: str, stops=()):
    ids = tokenizer.encode(text)
    s = TextStream(tokenizer.detokenizer, stops)
    deltas = []
    for t in ids:
        d = s.add(t)
        deltas.append(d.text)
        if d.stopped:
            return deltas, True
    d = s.finish()
    deltas.append(d.text)
    return deltas, d.stopped


def test_multibyte_characters_never_split(tokenizer):
    text = "Unicode: café, naïve, 日本語, emoji 🙂."
    deltas, stopped = stream_text(tokenizer, text)
    assert "".join(deltas) == text and not stopped
    for d in deltas:
        assert "\ufffd" not in d  # every delta is valid, whole characters


def test_stop_string_spanning_tokens_is_cut_and_never_streamed(tokenizer):
    text = "The quick brown fox jumps over the lazy dog."
    deltas, stopped = stream_text(tokenizer, text, stops=("fox jumps",))
    assert stopped
    assert "".join(deltas) == "The quick brown "
    assert all("fox" not in d for d in deltas)


def test_partial_stop_prefix_is_held_then_released(tokenizer):
    text = "Paris is the capital of France."
    s = TextStream(tokenizer.detokenizer, ("capital of Spain",))
    out = []
    for t in tokenizer.encode(text):
        d = s.add(t)
        assert not d.stopped
        out.append(d.text)
        # nothing that could still become the stop string has been released
        assert not "".join(out).endswith("capital")
    out.append(s.finish().text)
    assert "".join(out) == text


def test_earliest_of_several_stops_wins(tokenizer):
    deltas, stopped = stream_text(tokenizer, "Hello world! How are you today?", stops=("you", "world"))
    assert stopped and "".join(deltas) == "Hello "


def test_stop_at_very_start_gives_empty_text(tokenizer):
    deltas, stopped = stream_text(tokenizer, "Hello world", stops=("Hello",))
    assert stopped and "".join(deltas) == ""


def test_fast_detokenizer_gives_mlx_lms_text_after_every_token(tokenizer):
    """The fast BPE detokenizer is its own class (no private mlx-lm state): the same text as
    mlx-lm's after each token, over text with multi-byte characters, lone spaces and odd ids."""
    import random

    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

    from engine.text import FastBPEStreamingDetokenizer

    slow = tokenizer.detokenizer
    if type(slow) is not BPEStreamingDetokenizer:
        pytest.skip("the tiny tokenizer is not byte-level BPE")
    ids = tokenizer.encode(" héllo  wörld — 日本語 🙂 tabs\tand\nlines  ", add_special_tokens=False)
    rng = random.Random(0)
    ids = ids + [rng.randrange(len(slow.tokenmap)) for _ in range(200)]
    fast = FastBPEStreamingDetokenizer(slow)
    slow.reset()
    for token in ids:
        slow.add_token(token)
        fast.add_token(token)
        assert fast.text == slow.text
    slow.finalize()
    fast.finalize()
    assert fast.text == slow.text
