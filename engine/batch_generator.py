"""The `Runner` (engine/runner.py) on mlx-lm's `BatchGenerator`: its sole owner, through its public
API only. The reference the own step (engine/step/) is tested against, and the fallback for models
that step cannot run (engine/runner_choice.py).

The runner executes; it decides nothing. It maps between Pomona's request ids and the generator's
integer uids, and can throw the whole batch state away and start clean after a fault.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from engine.checkpoints import CheckpointPolicy
from engine.config import EngineConfig
from engine.forward import last_logits
from engine.runner import DIRECT_PREFILL_CHUNK, Checkpoint, Extracted, Generated, PromptProgress, StoredPrefix
from engine.sampling import Decoding

log = logging.getLogger("pomona.engine")


def bounded_window(model: Any, max_kv_size: int | None) -> int | None:
    """`max_kv_size` where mlx-lm's caches for `model` honour it (rotating caches), else None: a
    model with its own `make_cache` (llama among them) gets unbounded caches from mlx-lm whatever
    `max_kv_size` says, and must be accounted for in full."""
    if max_kv_size is None:
        return None
    caches = make_prompt_cache(model, max_kv_size)
    return max_kv_size if caches and all(isinstance(c, RotatingKVCache) for c in caches) else None


class BatchGeneratorRunner:
    """`engine_step: mlx_lm`: the batch is mlx-lm's `BatchGenerator`."""

    def __init__(self, model: Any, config: EngineConfig) -> None:
        config = config.for_backend(mx.default_device() == mx.cpu)
        self._model = model
        self._config = config
        self._generator = self._new_generator()
        # Where prefills stop for checkpoints (the engine asks `checkpoints.due`); a hybrid
        # model's prompts are fed in segments that end there.
        self.checkpoints = CheckpointPolicy.for_model(model, config)
        self.kv_window = bounded_window(model, config.max_kv_size)
        self.stored_prefix: StoredPrefix = lambda request_id, tokens: 0  # unused: caches are copied whole
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
        [uid] = self._generator.insert_segments(
            [self.checkpoints.segments(tokens, len(cached))],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[list(cached)] if cached else None,
            samplers=[decoding.sampler],
            logits_processors=[list(decoding.logits_processors)],
            stop_sequences=[decoding.stop_sequences],
        )
        self._uid_to_id[uid] = request_id
        self._id_to_uid[request_id] = uid

    def insert_after_first_token(self, request_id: str, tokens: Sequence[int], cached: Sequence[int],
                                 cache: list[Any] | None, decoding: Decoding, max_tokens: int,
                                 on_checkpoint: Checkpoint | None = None) -> Generated:
        """Prefill `tokens` on top of `cache` (covering `cached`) outside the batch, sample the first
        output token now, and continue the request in the batch unless that token ends it.

        mlx-lm returns a new prompt's first token three `next()` calls after its insertion, each
        carrying the running batch's decode step; this returns it after one forward pass over
        `tokens`. The request then joins the batch as a one-token prompt (its first token) on the
        prefilled cache, so the rest of its output comes from `BatchGenerator` as usual. The first
        token goes through the same logits processors and sampler, with the same context (the
        whole prompt), as mlx-lm would give it. A hybrid model's prefill stops at its checkpoint
        positions (`checkpoints.segments`) and hands `on_checkpoint(tokens covered, cache)` the cache
        there, as the batch path's prompt progress does.
        """
        prompt = list(cached) + list(tokens)
        cache = cache if cache is not None else make_prompt_cache(self._model, self._config.max_kv_size)
        token, logprobs = self._prefill_and_sample(tokens, prompt, cache, decoding, on_checkpoint)
        # Pomona's stop sequences are single tokens (stop strings are matched on text), so a fresh
        # matcher decides whether the first token is one.
        reason = "stop" if decoding.stop_sequences.matcher().advance(token) else None
        if reason is None and max_tokens <= 1:
            reason = "length"
        if reason is not None:  # finished at its first token: the cache covers the prompt
            return Generated(request_id, token, logprobs, reason, cache, prompt)
        self.insert(request_id, [token], prompt, cache, decoding, max_tokens - 1)
        return Generated(request_id, token, logprobs, None, None, None)

    def _prefill_and_sample(self, tokens: Sequence[int], prompt: list[int], cache: list[Any],
                            decoding: Decoding, on_checkpoint: Checkpoint | None) -> tuple[int, mx.array]:
        with mx.stream(self._generator.stream):  # ordered after the batch's work in flight
            last = self._prefill_all_but_last(tokens, len(prompt) - len(tokens), cache, on_checkpoint)
            logits = last_logits(self._model, mx.array(last)[None], cache)
            if decoding.logits_processors:
                context = mx.array(prompt)
                for process in decoding.logits_processors:
                    logits = process(context, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = decoding.sampler(logprobs)
            mx.eval(sampled, logprobs)
        return int(sampled.item()), logprobs[0]

    def _prefill_all_but_last(self, tokens: Sequence[int], start: int, cache: list[Any],
                              on_checkpoint: Checkpoint | None) -> list[int]:
        """Run `tokens` (prompt positions from `start`) into `cache` but for the last piece, which
        is returned: in pieces that bound one pass's memory and end at checkpoint positions."""
        chunk = max(self._config.prefill_chunk, DIRECT_PREFILL_CHUNK)
        segments = self.checkpoints.segments(tokens, start)
        pieces = [segment[i:i + chunk] for segment in segments for i in range(0, len(segment), chunk)]
        stops = set(itertools.accumulate((len(s) for s in segments[:-1]), initial=start))
        position = start
        for piece in pieces[:-1]:
            self._model(mx.array(piece)[None], cache=cache)
            mx.eval([c.state for c in cache])
            position += len(piece)
            if on_checkpoint is not None and position in stops:
                on_checkpoint(position, cache)
        return pieces[-1]

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

    def extract(self, request_id: str) -> Extracted | None:
        """A copy of a running request's whole cache and the tokens it covers (for the prefix
        store): mlx-lm's generator copies a sequence's cache only whole (`stored_prefix` unused)."""
        uid = self._id_to_uid.get(request_id)
        if uid is None:
            return None
        got = self._generator.extract_cache([uid]).get(uid)
        return None if got is None else Extracted(*got)

    def remove(self, request_id: str, return_cache: bool = False) -> Extracted | None:
        uid = self._id_to_uid.get(request_id)
        if uid is None:
            return None
        caches = self._generator.remove([uid], return_prompt_caches=return_cache)
        self._forget(uid)
        got = caches.get(uid)
        return None if got is None else Extracted(*got)

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

    def counters(self) -> dict[str, Any]:
        return {"kind": "mlx_lm"}

    def speculation(self, request_id: str) -> dict[str, int]:
        """No speculation on mlx-lm's BatchGenerator (the own step has it: engine/step/speculative.py)."""
        return {}

    def close(self) -> None:
        self._generator.close()

    def _forget(self, uid: int) -> None:
        request_id = self._uid_to_id.pop(uid, None)
        if request_id is not None:
            self._id_to_uid.pop(request_id, None)
