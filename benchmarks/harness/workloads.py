"""Benchmark workloads: random prompts, prefix repetition, multi-turn chat. Seeded and reproducible.

Lengths are in tokens of the model's tokenizer when a `tokenizer.json` is available (text is built
from random words and cut at the token count), otherwise one word stands in for one token.
Outputs are fixed-length by asking servers not to stop at EOS (see `EndpointConfig.extra_body`);
the client reports the output tokens actually produced.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from benchmarks.harness.client import Conversation

# Plain words that every BPE vocabulary splits into few tokens, so a word count is a fair estimate.
_WORDS = tuple("""
time person year way day thing man world life hand part child eye woman place work week case point
government company number group problem fact be have do say get make go know take see come think look
want give use find tell ask seem feel try leave call good new first last long great little own other
old right big high different small large next early young important few public bad same able to of in
for on with at by from up about into over after beneath under above the and a that I it not he as you
this but his they her she or an will my one all would there their river mountain garden window music
paper story table market bridge cloud forest engine letter morning evening silver orange purple yellow
number signal village harbor station planet rocket winter summer autumn spring ocean desert valley
""".split())


class TextMaker:
    """Random text of a requested token length."""

    def __init__(self, tokenizer_path: str | Path | None = None) -> None:
        self._encode: Callable[[str], list[int]] | None = None
        self._decode: Callable[[list[int]], str] | None = None
        if tokenizer_path is not None:
            path = Path(tokenizer_path)
            path = path / "tokenizer.json" if path.is_dir() else path
            if path.exists():
                from tokenizers import Tokenizer

                tok = Tokenizer.from_file(str(path))
                self._encode = lambda text: tok.encode(text, add_special_tokens=False).ids
                self._decode = tok.decode

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> "TextMaker":
        """From a loaded Hugging Face / mlx-lm tokenizer (what the engine itself uses)."""
        maker = cls(None)
        maker._encode = lambda text: list(tokenizer.encode(text, add_special_tokens=False))
        maker._decode = tokenizer.decode
        return maker

    def count(self, text: str) -> int:
        if self._encode is None:
            return len(text.split())
        return len(self._encode(text))

    def text(self, n_tokens: int, rng: random.Random) -> str:
        words = [rng.choice(_WORDS) for _ in range(n_tokens)]
        if self._encode is None or self._decode is None:
            return " ".join(words)
        # Each word is at least one token, so n words are enough; cut at n tokens exactly.
        return self._decode(self._encode(" ".join(words))[:n_tokens])


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload. `kind` picks the generator; unused fields are ignored by the other kinds."""

    name: str
    kind: str  # "random" | "prefix" | "multiturn"
    num_requests: int = 32  # random: requests; prefix: prefixes x suffixes; multiturn: conversations
    input_len: int = 128  # random: prompt; prefix: suffix; multiturn: each new user message
    output_len: int = 32
    prefix_len: int = 0  # prefix: shared system prompt length
    num_prefixes: int = 1
    turns: int = 1
    seed: int = 0


def random_workload(spec: WorkloadSpec, maker: TextMaker) -> list[Conversation]:
    rng = random.Random(spec.seed)
    return [Conversation(turns=(maker.text(spec.input_len, rng),), max_tokens=spec.output_len, conv_id=i)
            for i in range(spec.num_requests)]


def prefix_workload(spec: WorkloadSpec, maker: TextMaker) -> list[Conversation]:
    """`num_prefixes` shared system prompts, each followed by distinct user messages, shuffled
    (seeded) the way vLLM's prefix-repetition dataset does, so requests of a group interleave."""
    rng = random.Random(spec.seed)
    prefixes = [maker.text(spec.prefix_len, rng) for _ in range(spec.num_prefixes)]
    convs = []
    for i in range(spec.num_requests):
        group = i % spec.num_prefixes
        convs.append(Conversation(turns=(maker.text(spec.input_len, rng),), max_tokens=spec.output_len,
                                  system=prefixes[group], conv_id=i, group=group))
    rng.shuffle(convs)
    return convs


def multiturn_workload(spec: WorkloadSpec, maker: TextMaker) -> list[Conversation]:
    """Conversations of `turns` user messages; each turn resends the history plus the reply."""
    rng = random.Random(spec.seed)
    return [Conversation(turns=tuple(maker.text(spec.input_len, rng) for _ in range(spec.turns)),
                         max_tokens=spec.output_len, conv_id=i)
            for i in range(spec.num_requests)]


_BUILDERS = {"random": random_workload, "prefix": prefix_workload, "multiturn": multiturn_workload}


def build(spec: WorkloadSpec, maker: TextMaker) -> list[Conversation]:
    if spec.kind not in _BUILDERS:
        raise ValueError(f"unknown workload kind {spec.kind!r}; known: {sorted(_BUILDERS)}")
    return _BUILDERS[spec.kind](spec, maker)


def first_turn_messages(conv: Conversation) -> list[dict[str, str]]:
    """Chat messages of a conversation's first turn (what the bare loop can reproduce offline)."""
    msgs = [{"role": "system", "content": conv.system}] if conv.system else []
    return msgs + [{"role": "user", "content": conv.turns[0]}]


@dataclass(frozen=True)
class Suite:
    """Workload sizes for one side-by-side run."""

    concurrencies: tuple[int, ...]
    random: WorkloadSpec
    prefix: WorkloadSpec
    multiturn: WorkloadSpec
    multiturn_concurrency: int
    prefix_concurrency: int
    request_rates: tuple[float, ...] = ()
    # Concurrency level c runs max(sweep_min_requests, sweep_waves * c) random requests, so every
    # level sees a refill of the batch (continuous batching) and not only one synchronized wave.
    sweep_min_requests: int = 8
    sweep_waves: int = 2

    def sweep_spec(self, concurrency: int) -> WorkloadSpec:
        n = max(self.sweep_min_requests, self.sweep_waves * concurrency)
        # A seed per level: reusing one would make each level's prompts a prefix-cache hit of the
        # previous level's on any server with a prefix cache, and the sweep would measure the cache.
        return replace(self.random, name=f"random-c{concurrency}", num_requests=n,
                       seed=self.random.seed + 1000 + concurrency)


def quick_suite() -> Suite:
    """Sized for a 2-core box: every server through every workload in a few minutes each."""
    return Suite(
        concurrencies=(1, 8, 16, 32),
        random=WorkloadSpec("random", "random", input_len=64, output_len=64),
        prefix=WorkloadSpec("prefix", "prefix", num_requests=16, input_len=32, output_len=16,
                            prefix_len=512, num_prefixes=2, seed=1),
        multiturn=WorkloadSpec("multiturn", "multiturn", num_requests=2, input_len=64, output_len=32,
                               turns=8, seed=2),
        multiturn_concurrency=2,
        prefix_concurrency=4,
    )


def full_suite() -> Suite:
    return Suite(
        concurrencies=(1, 4, 8, 16, 32),
        random=WorkloadSpec("random", "random", input_len=256, output_len=128),
        prefix=WorkloadSpec("prefix", "prefix", num_requests=32, input_len=64, output_len=32,
                            prefix_len=2000, num_prefixes=4, seed=1),
        multiturn=WorkloadSpec("multiturn", "multiturn", num_requests=4, input_len=128, output_len=64,
                               turns=8, seed=2),
        multiturn_concurrency=4,
        prefix_concurrency=4,
        request_rates=(2.0, 8.0),
        sweep_min_requests=16,
        sweep_waves=3,
    )
