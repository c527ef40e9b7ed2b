"""Prompt text -> token ids, reusing the tokens of the longest prefix this tokenizer has already seen.

Why: an agent resends its whole conversation every turn (15-20k tokens), and encoding it again
took 30-65 ms of every turn's first token on the H200 host (benchmarks/agent/agent_breakdown.py), about
as long as the engine's work on the turn. A rendered chat prompt is a run of segments that each
begin with a special token (`<|im_start|>`...), and a tokenizer splits its added tokens out of the
text before anything else runs, so the ids of the text are the ids of the text before a segment
start followed by the ids of the text from there: no merge crosses that boundary. The tokens up to
the start of a prompt's last segment (where the next turn's text goes on differently: the
generation prompt) are remembered, keyed by a hash chain over the segments; a later prompt that
begins with the same text encodes only what follows.

Only special tokens that strip no whitespace around them and are matched in the raw text are
boundaries (an `lstrip` token would take the spaces before it, which the split encoding would
keep; a `normalized` one is matched after normalization). The first encoding of each tokenizer is
checked against a whole encoding; a mismatch turns reuse off for that tokenizer and
is logged, so a tokenizer this reasoning does not hold for costs only time, never a wrong prompt.
The cache is keyed by a salt (the caller's tenant) too: one tenant's prompts never shorten the
encoding time of another's.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections import OrderedDict
from typing import Any

log = logging.getLogger(__name__)

CHECKS = 1  # encodings checked against a whole encoding, per tokenizer (each costs a whole encoding)
MAX_ENTRIES = 512  # remembered prefixes (an agent session holds one at a time)
MAX_TOKENS = 8_000_000  # token ids held in all (about 64 MB of Python ints at worst)


class IncrementalEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, list[int]] = OrderedDict()
        self._held = 0
        self._checks = CHECKS
        self.reused_tokens = 0  # ids taken from the cache instead of encoded again
        specials = _boundaries(tokenizer)
        self._pattern = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
            if specials else None

    def encode(self, text: str, salt: str = "") -> list[int]:
        if self._pattern is None:
            return self._encode(text)
        cuts = [m.start() for m in self._pattern.finditer(text) if m.start() > 0]
        if not cuts:
            return self._encode(text)
        digests = _chain(text, cuts, salt)
        start, ids = 0, []
        with self._lock:
            for cut, digest in zip(reversed(cuts), reversed(digests)):
                found = self._cache.get(digest)
                if found is not None:
                    self._cache.move_to_end(digest)
                    start, ids = cut, found
                    break
        last = cuts[-1]
        head = ids + (self._encode(text[start:last]) if last > start else [])
        out = head + self._encode(text[last:])
        if self._checks > 0:
            self._check(text, out)
        with self._lock:
            if digests[-1] not in self._cache:
                self._cache[digests[-1]] = head
                self._held += len(head)
                while self._cache and (len(self._cache) > MAX_ENTRIES or self._held > MAX_TOKENS):
                    self._held -= len(self._cache.popitem(last=False)[1])
            self.reused_tokens += len(ids)
        return out

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _check(self, text: str, out: list[int]) -> None:
        self._checks -= 1
        whole = self._encode(text)
        if whole != out:
            log.warning("prompt tokens: encoding a prompt in parts at special tokens differs from encoding "
                        "it whole with this tokenizer; prompts are encoded whole from now on")
            self._pattern = None
            with self._lock:
                self._cache.clear()
                self._held = 0


def _boundaries(tokenizer: Any) -> list[str]:
    """Added special tokens that strip nothing around them: safe places to split a prompt."""
    try:
        added = dict(tokenizer.added_tokens_decoder)
    except Exception:  # a tokenizer without added tokens: nothing to split at
        return []
    return [t.content for t in added.values() if getattr(t, "special", False) and t.content
            and not getattr(t, "lstrip", False) and not getattr(t, "rstrip", False)
            and not getattr(t, "normalized", False)]  # matched in the raw text, as the split is


def _chain(text: str, cuts: list[int], salt: str) -> list[bytes]:
    """Digest of text[:cut] for every cut, chained segment by segment (one pass over the text)."""
    h = hashlib.blake2b(salt.encode(), digest_size=16)
    out, prev = [], 0
    for cut in cuts:
        h.update(text[prev:cut].encode())
        out.append(h.copy().digest())
        prev = cut
    return out
