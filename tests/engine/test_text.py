"""Streaming text: multi-byte characters never split, stop strings held back and cut."""

from __future__ import annotations

import time

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


class GrowingText:
    """A detokenizer whose tokens are characters (to drive TextStream with exact text)."""

    def __init__(self) -> None:
        self.text = ""

    def add_token(self, token: str) -> None:  # type: ignore[override]
        self.text += token

    def finalize(self) -> None:
        pass


def _held_reference(text: str, stops) -> int:
    """The check TextStream used before: the longest tail of `text` that is a proper prefix of a stop."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def test_held_text_matches_the_brute_force_check_on_random_text():
    import random

    rng = random.Random(7)
    for _ in range(2000):
        stops = tuple({"".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))})
        s = TextStream(GrowingText(), stops)
        text, released = "", ""
        for _ in range(25):
            piece = "".join(rng.choice("abc") for _ in range(rng.randint(0, 3)))
            text += piece
            d = s.add(piece)  # type: ignore[arg-type]
            released += d.text
            if d.stopped:
                cut = min(i for i in (text.find(stop) for stop in stops) if i >= 0)
                assert released == text[:cut], (stops, text)
                break
            assert released == text[:len(text) - _held_reference(text, stops)], (stops, text)


def test_a_long_stop_string_costs_linear_work_per_token():
    """Long stops: the old check compared every prefix of every stop with the text's tail at every
    token (work quadratic in a stop's length: ~15 s here for the 8 stops below over 3,000 tokens);
    this one reads each new character once per stop."""
    stops = tuple("b" * 3999 + c for c in "cdefghij")  # 8 stops of 4,000 characters, never matching
    s = TextStream(GrowingText(), stops)
    started = time.perf_counter()
    out = "".join(s.add("a").text for _ in range(3000))  # type: ignore[arg-type]
    assert out == "a" * 3000  # nothing can start a stop: nothing is held
    assert time.perf_counter() - started < 2.0
    s = TextStream(GrowingText(), ("a" * 3999 + "b",))
    for _ in range(3999):
        assert s.add("a").text == ""  # type: ignore[arg-type]  # all of it may still become the stop
    assert s.add("a").text == "a"  # type: ignore[arg-type]  # now the first "a" cannot start it
    end = s.add("b")  # type: ignore[arg-type]
    assert end.stopped and end.text == "" and end.stop == "a" * 3999 + "b"
