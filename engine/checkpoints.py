"""Where a prompt's prefill leaves checkpoints in the prefix cache: a pure policy.

A model whose cache can be trimmed (plain attention: KV rows per token) can serve any prefix of a
stored entry, so a checkpoint anywhere is as good as anywhere else: one every `checkpoint_every`
prefilled tokens, counted from where the prefill started (the SSD tier cuts each to a block).

A hybrid model's state-space layers (mlx-lm's `ArraysCache`) hold one running summary of all
tokens so far, which cannot be cut back: an entry serves exactly its own length. Its checkpoints
therefore sit where other prompts can use them, at absolute block boundaries (multiples of the
cache's `block_size`, the SSD tier's unit, so they are written there too):

- every `checkpoint_every` tokens (rounded up to whole blocks) from the start of the prompt, so
  two conversations with the same system prompt and tools leave checkpoints at the same positions
  and the second one starts from the first one's, whatever the first had restored;
- at the last block boundary before the prompt's end, so the same prompt again (a retry) or a
  later turn that extends it resumes from the SSD too (an entry must leave one token to feed).

The runner feeds such a prompt to mlx-lm in segments ending at those positions
(`BatchGenerator.insert_segments` stops a prefill step at each segment's end), so the engine sees
the prefill reach each of them and extracts the cache there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from engine.config import EngineConfig


AUTO_EVERY = 1024


@dataclass(frozen=True)
class CheckpointPolicy:
    every: int | None  # prefilled tokens between checkpoints; None: no checkpoints
    block: int | None = None  # exact-only caches: checkpoints at multiples of this only

    @classmethod
    def for_model(cls, model: Any, config: EngineConfig, on_cpu: bool | None = None) -> "CheckpointPolicy":
        """`checkpoint_every` "auto": every 1,024 tokens on the CPU backend and for models whose state
        cannot be trimmed; none on a GPU for plain attention (see EngineConfig.checkpoint_every)."""
        every = config.checkpoint_every if config.cache.enabled else None
        trimmable = can_trim_prompt_cache(make_prompt_cache(model, config.max_kv_size))
        if every == "auto":
            on_cpu = mx.default_device() == mx.cpu if on_cpu is None else on_cpu
            every = AUTO_EVERY if on_cpu or not trimmable else None
        if every is None or trimmable:
            return cls(every)
        block = config.cache.block_size
        return cls(-(-every // block) * block, block)

    def due(self, position: int, last: int, prompt_len: int) -> bool:
        """Whether to offer a checkpoint now that the prefill has reached prompt token `position`;
        `last` is where the previous checkpoint (or the restored prefix) ended."""
        if self.every is None or not last < position < prompt_len:
            return False
        if self.block is None:
            return position - last >= self.every
        return position % self.every == 0 or position == self.last_boundary(prompt_len)

    def last_boundary(self, prompt_len: int) -> int:
        """The last block boundary that leaves at least one prompt token to feed."""
        block = self.block or 1
        return (prompt_len - 1) // block * block

    def segments(self, tokens: Sequence[int], start: int) -> list[list[int]]:
        """`tokens` (the prompt from position `start` on) split at the checkpoint positions inside
        them; one segment when checkpoints need no particular position."""
        if self.block is None or self.every is None:
            return [list(tokens)]
        end = start + len(tokens)
        cuts = set(range(start - start % self.every + self.every, end, self.every))
        cuts.add(self.last_boundary(end))
        bounds = [start, *sorted(c for c in cuts if start < c < end), end]
        return [list(tokens[a - start:b - start]) for a, b in zip(bounds, bounds[1:])]
