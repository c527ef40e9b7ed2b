"""The seam between the engine and whatever runs the batch: the declared `Runner` protocol and the
records that cross it.

Two runners implement it: Pomona's own batched step (engine/step/step_runner.py, `StepRunner`,
`engine_step: pomona`) and mlx-lm's `BatchGenerator` (engine/batch_generator.py,
`BatchGeneratorRunner`, `engine_step: mlx_lm`, the reference and the fallback). The engine
(engine/engine.py) sees only this protocol; engine/runner_choice.py's `make_runner` picks one.
A runner executes and decides nothing: the scheduler has already chosen who runs.

Why a declared protocol rather than a base class: the two share no code (one drives mlx-lm's
generator, the other its own KV table), and a `Protocol` lets tests check that both keep the same
surface (tests/engine/test_runner_protocol.py) without coupling their implementations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

from engine.checkpoints import CheckpointPolicy
from engine.sampling import Decoding

# Called with the prompt tokens a prefill has covered and the cache there (to offer a checkpoint).
Checkpoint = Callable[[int, list[Any]], None]

# A direct prefill runs alone (the batch waits for all of it anyway), so it is cut only to bound
# one pass's memory, at mlx-lm's own prefill step: `prefill_chunk` (256 on the CPU, to interleave
# decode steps with batched prefill) would cost a KV-buffer growth per chunk and leave a short
# last chunk (an agent's 281-token tool result: 256 + 25). Both runners cut their direct prefill here.
DIRECT_PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class PromptProgress:
    request_id: str
    done: int
    total: int
    end_of_prompt: bool


class Extracted(NamedTuple):
    """A copy of a request's cache for the prefix store: `cache` covers `tokens[start:]`."""

    cache: list[Any]
    tokens: list[int]
    start: int = 0  # leading tokens left out: the store held them as whole blocks (`StoredPrefix`)


# (request id, its tokens) -> how many leading tokens the prefix store holds as whole blocks now. A
# runner copies a request's cache for the store only past them (the engine sets it; 0: all of it).
StoredPrefix = Callable[[str, Sequence[int]], int]


class Generated(NamedTuple):  # a tuple, not a frozen dataclass: one per token, built every step
    request_id: str
    token: int
    logprobs: Any  # mx.array over the vocabulary
    finish_reason: str | None  # "stop" or "length" from mlx-lm
    cache: list[Any] | None  # prompt + output cache past `start`, on the final response only
    tokens: list[int] | None  # the tokens the request covers (`cache` covers tokens[start:])
    start: int = 0


@runtime_checkable
class Runner(Protocol):
    """What the engine asks of the batch. Every call runs on the engine's MLX thread."""

    # Where prefills stop for checkpoints (the engine asks `checkpoints.due`).
    checkpoints: CheckpointPolicy
    # The most KV positions one sequence keeps (a bounded, rotating cache); None: all of them.
    kv_window: int | None
    # What the store holds of a request's tokens: `extract`, `remove` and a finished request's
    # `Generated` copy only past it (a runner whose caches cannot be cut copies all: start 0).
    stored_prefix: StoredPrefix

    def __len__(self) -> int:
        """Sequences in the batch (prefilling and decoding)."""

    def insert(self, request_id: str, tokens: Sequence[int], cached: Sequence[int], cache: list[Any] | None,
               decoding: Decoding, max_tokens: int) -> None:
        """Start `tokens` (the uncached rest of the prompt) on top of `cache`, which covers `cached`."""

    def insert_after_first_token(self, request_id: str, tokens: Sequence[int], cached: Sequence[int],
                                 cache: list[Any] | None, decoding: Decoding, max_tokens: int,
                                 on_checkpoint: Checkpoint | None = None) -> Generated:
        """Prefill the whole rest now (the batch waits) and return the first token; unless that
        token ends the request, it decodes with the batch from the next step."""

    def step(self) -> tuple[list[PromptProgress], list[Generated]]:
        """Run the batch once: prompt progress and the tokens generated."""

    def extract(self, request_id: str) -> Extracted | None:
        """A copy of a running request's cache past what the store holds (`stored_prefix`), and the
        tokens it covers (for the prefix store); None when the store holds all of it."""

    def remove(self, request_id: str, return_cache: bool = False) -> Extracted | None:
        """Drop a request from the batch; with `return_cache`, what `extract` returns first."""

    def reset(self) -> list[str]:
        """Drop every sequence and start clean (after a fault); returns the ids that were dropped."""

    def cache_nbytes(self) -> int:
        """Bytes the batch's KV state holds."""

    def counters(self) -> dict[str, Any]:
        """The runner's counters for the step report (`kind` names the runner)."""

    def speculation(self, request_id: str) -> dict[str, int]:
        """A running request's proposed and accepted tokens ({} when it does not speculate)."""

    def close(self) -> None:
        """Release the batch."""
