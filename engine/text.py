"""Per-request streaming text: detokenize token by token and hold back what a stop string may claim.

mlx-lm's streaming detokenizers already wait for complete UTF-8 characters. On top of that,
text that could be the beginning of a stop string is held back until it is clear either way, so
a client never receives text that is later "taken back", and the stop string itself is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from engine.types import FinishReason, TokenEvent


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string was found; `text` is everything before it
    stop: str | None = None  # which one


def _prefix_function(s: str) -> list[int]:
    """Knuth-Morris-Pratt: for each i, the length of the longest proper prefix of s[:i+1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """One stop string's matcher over text that grows: after each `feed`, `state` is the length of
    the longest tail of the text that is a prefix of the stop (what must be held back).

    Knuth-Morris-Pratt, so the work is amortised O(1) per new character whatever the stop's length.
    The check it replaces compared every prefix of every stop against the text's tail on every
    token: work quadratic in the stop's length, on the MLX thread, for each request of the batch.
    """

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop, self.fail, self.state = stop, _prefix_function(stop), 0

    def feed(self, text: str, start: int) -> int | None:
        """Advance over text[start:]; the index where the stop first occurs in full, or None."""
        stop, fail, k, n = self.stop, self.fail, self.state, len(self.stop)
        for i in range(start, len(text)):
            c = text[i]
            while k and stop[k] != c:
                k = fail[k - 1]
            if stop[k] == c:
                k += 1
                if k == n:
                    self.state = k
                    return i - n + 1
        self.state = k
        return None


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the table mlx-lm's BPE detokenizer uses;
    rebuilt here from the published algorithm because mlx-lm keeps its copy private)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for c, b in zip(chars, printable)}


_BYTE_TABLES: dict[int, tuple[list[str], list[bytes], frozenset[int]]] = {}


def _byte_table(tokenmap: list[str]) -> tuple[list[bytes], frozenset[int]]:
    """Each vocabulary entry's bytes, and the ids of single-space tokens: once per tokenizer."""
    hit = _BYTE_TABLES.get(id(tokenmap))
    if hit is not None and hit[0] is tokenmap:
        return hit[1], hit[2]
    decoder = byte_decoder()
    table = []
    for piece in tokenmap:  # exactly as BPEStreamingDetokenizer._decode_bytes maps each character
        raw = bytearray()
        for c in piece:
            b = decoder.get(c, False)
            if b:
                raw.append(b)
            else:
                raw.extend(bytes(c, "utf-8"))
        table.append(bytes(raw))
    spaces = frozenset(i for i, piece in enumerate(tokenmap) if len(piece) == 1 and decoder.get(piece[0]) == 32)
    _BYTE_TABLES[id(tokenmap)] = (tokenmap, table, spaces)
    return table, spaces


class FastBPEStreamingDetokenizer:
    """The text of mlx-lm's `BPEStreamingDetokenizer` after every token, at a fraction of the cost.

    mlx-lm's version maps every pending character back to a byte through a dict, token by token;
    here each vocabulary entry's bytes are computed once per tokenizer and shared by all requests
    (on a GPU the per-token Python cost of the engine decides throughput at high concurrency).
    Its own class, not a subclass: it keeps its pending bytes itself instead of writing mlx-lm's
    private state. tests/engine/test_text.py compares the two on every token.
    """

    def __init__(self, slow: BPEStreamingDetokenizer) -> None:
        self.tokenmap = slow.tokenmap
        self._table, self._spaces = _byte_table(slow.tokenmap)
        self.reset()

    def reset(self) -> None:
        self.text = ""
        self.tokens: list[int] = []
        self._pending = b""

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        if token < len(self._table):
            raw = self._pending + self._table[token]
        else:  # mlx-lm's fallback for a padded model vocabulary
            raw = self._pending + b"!"
        text = raw.decode("utf-8", "replace")
        if not text.endswith("\ufffd") and token not in self._spaces:
            if text and text[0] == " " and not self.text:
                text = text[1:]
            self.text += text
            self._pending = b""
        else:
            self._pending = raw

    def finalize(self) -> None:
        text = self._pending.decode("utf-8", "replace")
        if text and text[0] == " " and not self.text:
            text = text[1:]
        self.text += text
        self._pending = b""


def fast_detokenizer(detokenizer: Any) -> Any:
    if type(detokenizer) is BPEStreamingDetokenizer:
        return FastBPEStreamingDetokenizer(detokenizer)
    return detokenizer


class TextStream:
    """Turns one request's tokens into releasable text deltas."""

    def __init__(self, detokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._detok = fast_detokenizer(detokenizer)
        self._stops = tuple(stops)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._matchers = [StopMatcher(s) for s in self._stops]
        self._sent = 0  # characters of detokenizer text already released
        self._fed = 0  # characters of detokenizer text the matchers have read
        self._tail = ""  # the last max_stop - 1 of them: to notice a detokenizer that rewrote them
        self.done = False

    def add(self, token: int) -> TextDelta:
        self._detok.add_token(token)
        return self._release(final=False)

    def finish(self) -> TextDelta:
        """Flush at the end of generation: nothing can complete a stop string any more."""
        self._detok.finalize()
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._detok.text

    def _release(self, final: bool) -> TextDelta:
        if self.done:
            return TextDelta("", True)
        text = self._detok.text
        if not self._stops:  # nothing to hold back (detokenizer text only grows): release all that is new
            delta = text[self._sent:]
            self._sent = len(text)
            return TextDelta(delta, False)
        window = self._max_stop - 1
        if len(text) < self._fed or text[max(0, self._fed - window):self._fed] != self._tail:
            # The detokenizer rewrote its unreleased tail (mlx-lm's naive one re-decodes the current
            # line): read again from where a match could still start, as new text.
            for m in self._matchers:
                m.state = 0
            self._fed = max(0, self._sent - self._max_stop + 1)
        hits = [(i, m.stop) for i, m in ((m.feed(text, self._fed), m) for m in self._matchers) if i is not None]
        self._fed, self._tail = len(text), text[max(0, len(text) - window):]
        if hits:
            cut, stop = min(hits, key=lambda hit: hit[0])  # the earliest match ends the text
            delta = text[self._sent:cut] if cut > self._sent else ""
            self._sent = max(self._sent, cut)
            self.done = True
            return TextDelta(delta, True, stop)
        end = len(text) if final else len(text) - max(m.state for m in self._matchers)
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return TextDelta(delta, False)


_NOTHING = TextDelta("", False)


class TokensOnly:
    """Stands in for `TextStream` in the engine when the consumer detokenizes (see `ConsumerText`).

    Only requests without stop strings qualify: nothing then depends on the text inside the engine,
    and detokenizing on the consumer's thread takes that per-token Python off the MLX thread (on a
    GPU it otherwise adds to every step at high concurrency; run D/E in benchmarks/results/accelerators-engine-runs.md).
    """

    def add(self, token: int) -> TextDelta:
        return _NOTHING

    def finish(self) -> TextDelta:
        return _NOTHING


def text_in_engine(stops: Sequence[str]) -> bool:
    """Whether a request's text must be made in the engine: stop strings end generation there."""
    return bool(stops)


class ConsumerText:
    """The text of a `TokensOnly` request, made from its events on the consumer's side.

    The same deltas the engine's `TextStream` would have put in the events: a token ending the
    request with `STOP` is an EOS or stop token and not part of the text; the held-back tail is
    flushed on a normal ending (stop, length) and dropped on an abort or error, as the engine does.
    """

    def __init__(self, detokenizer: Callable[[], Any]) -> None:
        self._detokenizer = detokenizer  # called at the first event: the tokenizer loads with the model
        self._stream: TextStream | None = None

    def fill(self, events: list[TokenEvent]) -> list[TokenEvent]:
        if self._stream is None:
            self._stream = TextStream(self._detokenizer())
        out = []
        for e in events:
            text = e.text
            if e.token_id is not None and e.finish_reason in (None, FinishReason.LENGTH):
                text += self._stream.add(e.token_id).text
            if e.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                text += self._stream.finish().text
            out.append(e if text == e.text else TokenEvent(e.request_id, e.token_id, text, e.logprob,
                                                           e.finish_reason, e.usage, e.error, e.error_code))
        return out
