"""Per-request streaming text: detokenize token by token and hold back what a stop string may claim.

mlx-lm's streaming detokenizers already wait for complete UTF-8 characters. On top of that,
text that could be the beginning of a stop string is held back until it is clear either way, so
a client never receives text that is later "taken back", and the stop string itself is never sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class TextDelta:
    text: str
    stopped: bool  # a stop string was found; `text` is everything before it


def _held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class TextStream:
    """Turns one request's tokens into releasable text deltas."""

    def __init__(self, detokenizer: Any, stops: Sequence[str] = ()) -> None:
        self._detok = detokenizer
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
        if self._stops:
            # A new match can only start where fresh text could complete it.
            start = max(0, self._sent - self._max_stop + 1)
            hits = [i for i in (text.find(s, start) for s in self._stops) if i >= 0]
            if hits:
                cut = min(hits)
                delta = text[self._sent:cut] if cut > self._sent else ""
                self._sent = max(self._sent, cut)
                self.done = True
                return TextDelta(delta, True)
        end = len(text) if final else len(text) - _held_suffix(text, self._stops)
        delta = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return TextDelta(delta, False)
