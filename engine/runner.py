"""The sole owner of mlx-lm's `BatchGenerator`, through its public API only.

The runner executes; it decides nothing. It maps between Pomona's request ids and the generator's
integer uids, and can throw the whole batch state away and start clean after a fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from mlx_lm.generate import BatchGenerator

from engine.config import EngineConfig
from engine.sampling import Decoding

log = logging.getLogger("pomona.engine")


@dataclass(frozen=True)
class PromptProgress:
    request_id: str
    done: int
    total: int
    end_of_prompt: bool


class Generated(NamedTuple):  # a tuple, not a frozen dataclass: one per token, built every step
    request_id: str
    token: int
    logprobs: Any  # mx.array over the vocabulary
    finish_reason: str | None  # "stop" or "length" from mlx-lm
    cache: list[Any] | None  # prompt + output cache, on the final response only
    tokens: list[int] | None  # the tokens `cache` covers


class Runner:
    def __init__(self, model: Any, config: EngineConfig) -> None:
        self._model = model
        self._config = config
        self._generator = self._new_generator()
        self._uid_to_id: dict[int, str] = {}
        self._id_to_uid: dict[str, int] = {}

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._model,
            completion_batch_size=self._config.max_running,
            prefill_batch_size=self._config.prefill_batch,
            prefill_step_size=self._config.prefill_chunk,
            max_kv_size=self._config.max_kv_size,
        )

    def __len__(self) -> int:
        return len(self._uid_to_id)

    def insert(self, request_id: str, tokens: Sequence[int], cached: Sequence[int], cache: list[Any] | None,
               decoding: Decoding, max_tokens: int) -> None:
        """Start `tokens` (the uncached rest of the prompt) on top of `cache`, which covers `cached`."""
        [uid] = self._generator.insert(
            [list(tokens)],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[list(cached)] if cached else None,
            samplers=[decoding.sampler],
            logits_processors=[list(decoding.logits_processors)],
            stop_sequences=[decoding.stop_sequences],
        )
        self._uid_to_id[uid] = request_id
        self._id_to_uid[request_id] = uid

    def step(self) -> tuple[list[PromptProgress], list[Generated]]:
        prompt_responses, generation_responses = self._generator.next()
        prompts = [
            PromptProgress(self._uid_to_id[r.uid], r.progress[0], r.progress[1], r.end_of_prompt)
            for r in prompt_responses if r.uid in self._uid_to_id
        ]
        generated = []
        for r in generation_responses:
            request_id = self._uid_to_id.get(r.uid)
            if request_id is None:
                continue
            if r.finish_reason is not None:
                self._forget(r.uid)
            generated.append(Generated(request_id, r.token, r.logprobs, r.finish_reason, r.prompt_cache,
                                       r.all_tokens))
        return prompts, generated

    def extract(self, request_id: str) -> tuple[list[Any], list[int]] | None:
        """A copy of a running request's cache and the tokens it covers (for the prefix store)."""
        uid = self._id_to_uid.get(request_id)
        if uid is None:
            return None
        return self._generator.extract_cache([uid]).get(uid)

    def remove(self, request_id: str, return_cache: bool = False) -> tuple[list[Any], list[int]] | None:
        uid = self._id_to_uid.get(request_id)
        if uid is None:
            return None
        caches = self._generator.remove([uid], return_prompt_caches=return_cache)
        self._forget(uid)
        return caches.get(uid)

    def reset(self) -> list[str]:
        """Drop every sequence and start a clean generator; returns the ids that were dropped."""
        dropped = list(self._id_to_uid)
        self._generator.close()
        self._generator = self._new_generator()
        self._uid_to_id.clear()
        self._id_to_uid.clear()
        return dropped

    def cache_nbytes(self) -> int:
        return self._generator.prompt_cache_nbytes

    def close(self) -> None:
        self._generator.close()

    def _forget(self, uid: int) -> None:
        request_id = self._uid_to_id.pop(uid, None)
        if request_id is not None:
            self._id_to_uid.pop(request_id, None)
