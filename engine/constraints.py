"""Constrained decoding with llguidance: a per-request logits processor that masks what a grammar forbids.

Compilation happens off the MLX thread (`AsyncEngine.stream` calls `build_constraint` through
`asyncio.to_thread`): llguidance's tokenizer is built once per tokenizer, each grammar is compiled once
into a pristine matcher kept in an LRU, and every request gets a `deep_copy` of it (microseconds, against
~1 ms for a fresh `LLMatcher`). On the MLX thread the processor only advances its matcher by the token
sampled last, fills the next token bitmask and applies it.

Reasoning models: the grammar applies to the answer. When the tokenizer has single-token think markers,
tokens pass unconstrained while a think section is open (the prompt ended inside one, or the model opened
one at its first step); the grammar starts after `think_end`.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref
from collections import OrderedDict
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

log = logging.getLogger("pomona.engine")

GRAMMAR_CACHE_SIZE = 256
# Bytes of grammar text the compiled-matcher cache may hold. A compiled matcher's memory grows with
# its grammar, and a grammar may be megabytes (a client's schema): a bound by count alone let 256 of
# them hold gigabytes of the engine's process. A grammar over the whole budget is compiled, not kept.
GRAMMAR_CACHE_BYTES = 64 * 2**20


def llg_tokenizer(tokenizer: Any) -> LLTokenizer:
    """llguidance's view of an mlx-lm `TokenizerWrapper` (~0.5 s for a 50k vocabulary: build once).

    `llguidance.hf.from_tokenizer` wants the HF `PreTrainedTokenizerFast` itself, which the wrapper does
    not expose publicly; it forwards attribute access to it, so its public `backend_tokenizer` is read
    and converted the way `from_tokenizer` does. EOS is every id the engine stops on, so a finished
    grammar lets the model end with any of them.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError("constrained decoding needs a fast (Rust) Hugging Face tokenizer; this model has none")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return LLTokenizer(backend.to_str(), eos_token=sorted(tokenizer.eos_token_ids))


def think_markers(tokenizer: Any) -> tuple[int, int] | None:
    """(think_start_id, think_end_id) when both markers are single tokens, else None."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    try:
        start, end = tokenizer.think_start_id, tokenizer.think_end_id
    except ValueError:  # a multi-token marker: mlx-lm has no id for it; the grammar starts at once
        return None
    return None if start is None or end is None else (start, end)


def _last_index(tokens: Sequence[int], token: int) -> int:
    for i in range(len(tokens) - 1, -1, -1):
        if tokens[i] == token:
            return i
    return -1


def prompt_in_think(prompt: Sequence[int], markers: tuple[int, int] | None) -> bool:
    """Whether the prompt ends inside an open think section (templates that open it for the model)."""
    return markers is not None and _last_index(prompt, markers[0]) > _last_index(prompt, markers[1])


class GrammarConstraint:
    """The logits processor of one request: `proc(tokens, logits)`, logits of shape [1, vocab].

    Called once per generated token on the MLX thread, first with the prompt as `tokens`, then with
    the token sampled last appended. Stateful: one per request, never shared.
    """

    def __init__(self, matcher: LLMatcher, vocab_size: int, eos: Sequence[int],
                 markers: tuple[int, int] | None, in_think: bool) -> None:
        self._matcher = matcher
        self._eos = tuple(eos)
        self._bitmask = allocate_token_bitmask(1, vocab_size)
        self._markers = markers
        self._thinking = in_think  # tokens pass unconstrained until think_end
        self._may_think = markers is not None and not in_think  # first step: think_start also allowed
        self._started = False
        self._allowed: np.ndarray | None = None  # per model vocabulary, made at the first call
        self._metal: bool | None = None
        self._consumed = 0  # tokens the matcher has consumed (what `restore` rolls back by)

    @property
    def matcher(self) -> LLMatcher:
        return self._matcher

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._started:
            self._advance(int(tokens[-1].item()))
        self._started = True
        if self._thinking:
            return logits
        return self._apply(logits)

    def _advance(self, token: int) -> None:
        if self._thinking:
            self._thinking = token != self._markers[1]
            return
        if self._may_think:
            self._may_think = False
            if token == self._markers[0]:  # the model chose to reason first
                self._thinking = True
                return
        if self._matcher.consume_token(token):
            self._consumed += 1
        else:
            log.warning("grammar matcher refused token %d: %s", token, self._matcher.get_error())

    # -- speculative steps (engine/step/step_runner.py): positions that may be rejected ---------------
    def snapshot(self) -> tuple[bool, bool, bool, int]:
        """The state before a call, for `restore` when the call's position is rejected."""
        return self._started, self._thinking, self._may_think, self._consumed

    def restore(self, state: tuple[bool, bool, bool, int]) -> None:
        """Back to `snapshot`'s state: the matcher rolls back the tokens consumed since."""
        self._started, self._thinking, self._may_think, consumed = state
        if self._consumed > consumed:
            self._matcher.rollback(self._consumed - consumed)
        self._consumed = consumed

    def admissible(self, last: int, proposals: list[int]) -> int:
        """How many of `proposals` (to follow `last`, the token the next call consumes) the grammar
        allows in a row: a step verifies only those, since the calls for the positions after a
        forbidden token would feed the matcher a token it refuses."""
        state = self.snapshot()
        n = 0
        try:
            if self._started:
                self._advance(last)
            for token in proposals:
                free = self._thinking or (self._may_think and token == self._markers[0])
                if not free and (self._matcher.is_error() or self._matcher.validate_tokens([token]) != 1):
                    break
                self._advance(token)
                n += 1
        finally:
            self.restore(state)
        return n

    def _apply(self, logits: mx.array) -> mx.array:
        fill_next_token_bitmask(self._matcher, self._bitmask)
        if self._matcher.is_error():  # cannot happen for sampled-from-mask tokens; end the request cleanly
            self._bitmask[:] = 0
            for eos in self._eos:
                self._set_bit(eos)
        if self._may_think:
            self._set_bit(self._markers[0])
        if self._metal is None:
            self._metal = mx.metal.is_available() and mx.default_device() == mx.gpu
        if self._metal:  # Metal kernel; words past the mask (a padded model vocabulary) are masked
            from llguidance.mlx import apply_token_bitmask

            return apply_token_bitmask(logits, self._bitmask)
        vocab = logits.shape[-1]
        if self._allowed is None:
            self._allowed = np.zeros(vocab, dtype=np.bool_)  # ids past the tokenizer's stay forbidden
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")  # bit i of word w = id 32w+i
        n = min(vocab, bits.size)
        self._allowed[:n] = bits[:n]
        return mx.where(mx.array(self._allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _set_bit(self, token: int) -> None:
        words = self._bitmask.view(np.uint32)
        words[0, token // 32] |= np.uint32(1 << (token % 32))


class ConstraintFactory:
    """Compiles grammars for one tokenizer; thread-safe, meant to be called off the MLX thread."""

    def __init__(self, tokenizer: Any, cache_size: int = GRAMMAR_CACHE_SIZE,
                 cache_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self._tokenizer = tokenizer
        self._llg: LLTokenizer | None = None
        self._pristine: OrderedDict[str, LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self.cached_bytes = 0  # grammar text held by `_pristine`
        self._lock = threading.Lock()
        self.markers = think_markers(tokenizer)
        self._eos = sorted(tokenizer.eos_token_ids)

    @property
    def llg(self) -> LLTokenizer:
        with self._lock:
            if self._llg is None:
                self._llg = llg_tokenizer(self._tokenizer)
            return self._llg

    def matcher(self, grammar: str) -> LLMatcher:
        """A fresh matcher for `grammar`; raises ValueError with llguidance's message if it is invalid."""
        with self._lock:
            pristine = self._pristine.get(grammar)
            if pristine is not None:
                self._pristine.move_to_end(grammar)
                return pristine.deep_copy()
        llg = self.llg
        pristine = LLMatcher(llg, grammar, log_level=0)  # drops the GIL while it compiles
        if pristine.is_error():
            raise ValueError(f"invalid grammar: {pristine.get_error()}")
        if len(grammar) <= self._cache_bytes:
            with self._lock:
                if grammar not in self._pristine:
                    self._pristine[grammar] = pristine
                    self.cached_bytes += len(grammar)
                while len(self._pristine) > self._cache_size or self.cached_bytes > self._cache_bytes:
                    dropped, _ = self._pristine.popitem(last=False)
                    self.cached_bytes -= len(dropped)
        return pristine.deep_copy()

    @property
    def cached(self) -> int:
        """Compiled grammars held."""
        return len(self._pristine)

    def build(self, grammar: str, prompt: Sequence[int]) -> GrammarConstraint:
        matcher = self.matcher(grammar)
        return GrammarConstraint(matcher, self.llg.vocab_size, self._eos, self.markers,
                                 prompt_in_think(prompt, self.markers))


_factories: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_factories_lock = threading.Lock()


def constraint_factory(tokenizer: Any) -> ConstraintFactory:
    """The one factory of a tokenizer object (so llguidance's tokenizer is built once per tokenizer)."""
    with _factories_lock:
        factory = _factories.get(tokenizer)
        if factory is None:
            factory = _factories[tokenizer] = ConstraintFactory(tokenizer)
        return factory


def build_constraint(tokenizer: Any, grammar: str, prompt: Sequence[int]) -> GrammarConstraint:
    """The logits processor for one request; blocking (run it off the MLX thread). ValueError if invalid."""
    return constraint_factory(tokenizer).build(grammar, prompt)
