"""The own step's plan (engine/step/step_runner.py): which rows ("slots") are in use, and each step's
token budget: who decodes and which prompt chunks are fed.

Imports no MLX, so the policy is tested with no model at all.

The batch's KV cache is a table of rows ("slots"), one per running sequence, preallocated and
reused: a sequence that leaves frees its row and the next admission takes the lowest free one, so
nothing is copied when the batch changes (mlx-lm's `BatchGenerator` rebuilds every layer's cache
on each join and each leave). Shapes are bucketed so the number of distinct shapes the backend
compiles kernels for stays small: the rows a step computes round up to a power of two on a GPU
(an idle row costs a GPU almost nothing, a new shape a compile), and the key length a step
attends over rounds up to a block.

Each step has a token budget (`max_batch_tokens`, as vLLM's scheduler uses it): every decoding
sequence takes one token of it, and prompts being prefilled share the rest in chunks, first come
first served, so a long prompt never stalls the running decodes for its whole prefill. A second
bound keeps a step with prefill within `max_decode_stall` times a plain decode step, from the
step times measured so far (`StallBudget`).
"""

from __future__ import annotations

from dataclasses import dataclass

# A prefill always advances by at least this much per step. Small, so that a tight stall bound can be
# kept where a token costs a lot: on the 2-core box each prompt token in a decoding step's forward
# adds ~4 ms to a ~100 ms step (8 tokens: 1.3x, 16: 1.6x).
MIN_PREFILL_TOKENS = 8


def round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def row_bucket(span: int, limit: int, on_cpu: bool) -> int:
    """How many rows a step computes when rows [0, span) are in use: exactly `span` on a CPU (an
    idle row costs a CPU a whole row's compute), the next power of two (at most `limit`) on a GPU."""
    if on_cpu or span <= 1:
        return max(span, 1)
    return min(1 << (span - 1).bit_length(), max(limit, span))


class SlotTable:
    """Which rows are in use; the lowest free row goes to the next admission."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._free = list(range(rows))  # kept sorted: lowest first keeps the used span short
        self._used: set[int] = set()

    def acquire(self, row: int | None = None) -> int:
        """The lowest free row, or `row` when it is free (a row that still holds a prefix)."""
        if not self._free:
            raise RuntimeError(f"all {self.rows} batch rows are in use")
        if row is None or row not in self._free:
            row = self._free[0]
        self._free.remove(row)
        self._used.add(row)
        return row

    def release(self, row: int) -> None:
        if row not in self._used:
            raise ValueError(f"row {row} is not in use")
        self._used.remove(row)
        self._free.append(row)
        self._free.sort()

    @property
    def span(self) -> int:
        """One past the highest row in use (0 when none is)."""
        return max(self._used) + 1 if self._used else 0

    def __len__(self) -> int:
        return len(self._used)


@dataclass(frozen=True)
class Chunk:
    key: str  # the sequence's request id
    tokens: int  # prompt tokens it feeds this step


def plan_prefill(decoding: int, waiting: list[tuple[str, int]], budget: int, stall_tokens: int | None,
                 chunk_limit: int | None = None) -> list[Chunk]:
    """The prefill chunks of one step.

    `decoding`: sequences decoding this step (a token of the budget each); `waiting`: (key, prompt
    tokens left) of the sequences in prefill, in admission order; `budget`: the step's token
    budget (`max_batch_tokens`); `stall_tokens`: how many prefill tokens keep the step within the
    stall bound (None: no bound, e.g. nothing decodes); `chunk_limit`: most tokens one sequence
    feeds in a step (None: no limit). Whatever the budgets, a step with prefill waiting advances it
    by at least MIN_PREFILL_TOKENS, so a prompt always progresses.
    """
    room = budget - decoding
    if stall_tokens is not None:
        room = min(room, stall_tokens)
    room = max(room, MIN_PREFILL_TOKENS)
    chunks = []
    for key, left in waiting:
        if room <= 0:
            break
        n = min(left, room, chunk_limit or left)
        if n > 0:
            chunks.append(Chunk(key, n))
            room -= n
    return chunks


class StallBudget:
    """How many prefill tokens a step may carry beside the decodes, from measured step times.

    Tracks (moving averages) the time of a step that only decodes and the extra time per prefill
    token of a step that also prefills; the answer keeps a mixed step within `ratio` times a
    decode step. Before any measurement, and when nothing decodes, there is no bound.
    """

    def __init__(self, ratio: float | None, weight: float = 0.2) -> None:
        self.ratio = ratio
        self.weight = weight
        self.decode_s: float | None = None
        self.per_token_s: float | None = None

    def record(self, seconds: float, prefill_tokens: int, decoding: int) -> None:
        if decoding and not prefill_tokens:
            self.decode_s = self._mix(self.decode_s, seconds)
        elif prefill_tokens and self.decode_s is not None:
            extra = max(seconds - (self.decode_s if decoding else 0.0), 0.0) / prefill_tokens
            self.per_token_s = self._mix(self.per_token_s, extra)

    def tokens(self, decoding: int) -> int | None:
        if self.ratio is None or not decoding or self.decode_s is None or not self.per_token_s:
            return None
        return int((self.ratio - 1.0) * self.decode_s / self.per_token_s)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)
