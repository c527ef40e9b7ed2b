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


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


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
    private state. tests/test_text.py compares the two on every token.
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
        self._sent = 0  # characters of detokenizer text already released
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
        # A new match can only start where fresh text could complete it.
        start = max(0, self._sent - self._max_stop + 1)
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self._stops) if i >= 0]
        if hits:
            cut, stop = min(hits, key=lambda hit: hit[0])  # the earliest match ends the text
            delta = text[self._sent:cut] if cut > self._sent else ""
            self._sent = max(self._sent, cut)
            self.done = True
            return TextDelta(delta, True, stop)
        end = len(text) if final else len(text) - _held_suffix(text, self._stops)
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
