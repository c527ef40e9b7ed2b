"""Pomona's own batched step: the `Runner` interface (engine/runner.py) on mlx-lm's public model API.

What it does differently from mlx-lm's `BatchGenerator` (the reference, `engine_step: mlx_lm`):
- a newcomer's prompt is fed in chunks inside the running batch's steps, within the step's token
  budget (engine/slots.py), instead of steps of its own that stall every running sequence;
- its first token is sampled from its last prompt chunk, and it decodes with the batch from the
  next step on: no batch-of-one decode and merge;
- the KV cache is a table of reusable rows (engine/slot_cache.py): nothing is rebuilt when a
  sequence joins or leaves.

A step is: plan (who decodes, which prompt chunks), build the forwards and the sampling lazily,
start them (`mx.async_eval`), then read back the *previous* step's tokens while this one runs, as
`BatchGenerator` does; a sequence's input is the token sampled for it the step before, still on
the device. Everything runs on the engine's MLX thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler

from engine.checkpoints import CheckpointPolicy
from engine.config import EngineConfig
from engine.runner import DIRECT_PREFILL_CHUNK, Checkpoint, Generated, PromptProgress, Runner, logits_at
from engine.sampling import Decoding, Sampler
from engine.slot_cache import Batch, SlotKV, layer_shapes
from engine.slots import (POSITION_BLOCK_CPU, POSITION_BLOCK_GPU, Chunk, SlotTable, StallBudget, plan_prefill,
                          round_up, row_bucket)

log = logging.getLogger("pomona.engine")
_told: set[str] = set()  # fallback reasons already logged


def make_runner(model: Any, config: EngineConfig) -> "StepRunner | Runner":
    """The step `config.engine_step` names; "pomona" falls back to mlx-lm's for models it cannot run."""
    if config.engine_step == "mlx_lm":
        return Runner(model, config)
    reason = unsupported(model, config)
    if reason is None:
        try:
            runner = StepRunner(model, config)
            runner.self_check()
            return runner
        except Exception as exc:  # an architecture whose attention does not take the table's views
            reason = f"its forward failed on the batch table ({type(exc).__name__}: {exc})"
    if reason not in _told:
        _told.add(reason)
        log.warning("engine_step pomona cannot run this model: %s; using mlx-lm's BatchGenerator", reason)
    return Runner(model, config)


def unsupported(model: Any, config: EngineConfig) -> str | None:
    if config.max_kv_size is not None:
        return "a rotating KV cache (max_kv_size) is set"
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {"KVCache"}:
        return f"its layers need {', '.join(sorted(kinds))} caches, not only KVCache"
    return None


@dataclass(eq=False)
class _Slot:
    request_id: str
    row: int
    decoding: Decoding
    matcher: Any
    max_tokens: int
    rest: list[int]  # the prompt tokens to feed (the uncached rest)
    known: list[int]  # token values known here: cached prefix, prompt fed, outputs read back
    length: int  # KV positions written, in-flight steps included
    fed: int = 0  # of `rest`
    sampled: int = 0  # output tokens sampled, in-flight ones included
    generated: int = 0  # output tokens read back
    context: mx.array | None = None  # prompt + outputs, for logits processors

    @property
    def prefilling(self) -> bool:
        return self.fed < len(self.rest)


@dataclass
class _Work:
    """One started step: what to read back from it next step."""

    outputs: list[tuple[_Slot, int]]  # (slot, index into tokens/logprobs)
    tokens: mx.array
    logprobs: mx.array  # (len(tokens), vocab)
    decoding: int
    prefill_tokens: int
    progress: list[PromptProgress] = field(default_factory=list)


class StepRunner:
    def __init__(self, model: Any, config: EngineConfig) -> None:
        self._model = model
        self._config = config
        self._on_cpu = mx.default_device() == mx.cpu
        self._stream = mx.new_stream(mx.default_device())
        self.checkpoints = CheckpointPolicy.for_model(model, config)
        self._shapes = layer_shapes(model)
        self._stall = StallBudget(config.max_decode_stall)
        self._block = POSITION_BLOCK_CPU if self._on_cpu else POSITION_BLOCK_GPU
        # For the step report: prompt tokens fed, host time building steps, time waiting for a
        # step's tokens, and the distinct forward shapes (each a kernel compile on a JIT backend).
        self._counts = {"prefill_tokens": 0, "build_s": 0.0, "wait_s": 0.0}
        self._shapes_seen: set[tuple[int, ...]] = set()
        self._new_table()

    def _new_table(self) -> None:
        self._table = SlotTable(self._config.max_running)
        self._kv = SlotKV(self._shapes, self._block)
        self._next_input = mx.zeros((0,), mx.int32)  # per row: the token it feeds next, on the device
        self._slots: dict[str, _Slot] = {}  # in admission order
        self._inflight: _Work | None = None
        self._last_read: float | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def self_check(self) -> None:
        """A short prompt through the table must give mlx-lm's own logits (row 1, so rows and
        positions are both exercised); raises otherwise."""
        prompt = [1, 2, 3, 4, 5]
        reference = self._model(mx.array([prompt]), cache=make_prompt_cache(self._model))[0, -1]
        self._grow(2, len(prompt) + 1)
        batch = Batch(self._kv, [0], len(prompt), [1], round_up(len(prompt), self._block))
        ours = logits_at(self._model, mx.array([prompt]), batch.views(), [(0, len(prompt) - 1)])[0]
        scale = float(mx.abs(reference).max().item()) or 1.0
        diff = float(mx.abs(ours.astype(mx.float32) - reference.astype(mx.float32)).max().item())
        if diff > 2e-2 * scale:
            raise RuntimeError(f"logits differ from mlx-lm's cache by {diff:.3g} (scale {scale:.3g})")
        self._new_table()

    # -- requests in and out ------------------------------------------------------------------
    def insert(self, request_id: str, tokens: Sequence[int], cached: Sequence[int], cache: list[Any] | None,
               decoding: Decoding, max_tokens: int) -> None:
        """Start `tokens` (the uncached rest of the prompt, at least one) on top of `cache` (covering `cached`)."""
        if not tokens:
            raise ValueError("a request needs at least one prompt token to feed")
        row = self._table.acquire()
        try:
            self._grow(row + 1, len(cached) + 2)
            if cache is not None and cached:
                self._kv.write_prefix(row, cache, len(cached))
        except Exception:
            self._table.release(row)
            raise
        self._slots[request_id] = _Slot(request_id, row, decoding, decoding.stop_sequences.matcher(), max_tokens,
                                        list(tokens), list(cached), len(cached))

    def insert_after_first_token(self, request_id: str, tokens: Sequence[int], cached: Sequence[int],
                                 cache: list[Any] | None, decoding: Decoding, max_tokens: int,
                                 on_checkpoint: Checkpoint | None = None) -> Generated:
        """Feed the whole rest now (the batch waits) and return the first token; the request decodes
        with the batch from the next step. `on_checkpoint` is for hybrid models, which this step
        does not run (engine/runner.py's `make_runner` keeps them on `BatchGenerator`)."""
        self.insert(request_id, tokens, cached, cache, decoding, max_tokens)
        slot = self._slots[request_id]
        with mx.stream(self._stream):
            while slot.prefilling:
                n = min(len(slot.rest) - slot.fed, DIRECT_PREFILL_CHUNK)
                work = self._prefill([(slot, n)])
            mx.eval(work.tokens, work.logprobs, self._kv.arrays())
        token, logprobs = int(work.tokens[0].item()), work.logprobs[0]
        return self._read_one(slot, token, logprobs)

    def extract(self, request_id: str) -> tuple[list[Any], list[int]] | None:
        """A copy of a running request's cache and the tokens it covers (for the prefix store)."""
        slot = self._slots.get(request_id)
        if slot is None:
            return None
        n = min(slot.length, len(slot.known))
        return self._kv.extract(slot.row, n), slot.known[:n]

    def remove(self, request_id: str, return_cache: bool = False) -> tuple[list[Any], list[int]] | None:
        kept = self.extract(request_id) if return_cache else None
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._table.release(slot.row)
        return kept

    def reset(self) -> list[str]:
        """Drop every sequence and start a clean table; returns the ids that were dropped."""
        dropped = list(self._slots)
        self._new_table()
        return dropped

    def cache_nbytes(self) -> int:
        return self._kv.nbytes()

    def counters(self) -> dict[str, Any]:
        decode_s = self._stall.decode_s  # moving average of steps that only decode: the steady decode rate
        return {"kind": "pomona", **self._counts, "shapes": len(self._shapes_seen),
                "decode_step_ms": round(1000 * decode_s, 3) if decode_s else 0.0}

    def close(self) -> None:
        self._slots.clear()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> tuple[list[PromptProgress], list[Generated]]:
        """Start this step, then read back the previous one (its tokens were computed meanwhile)."""
        started = time.perf_counter()
        work = self._start()
        built = time.perf_counter()
        read = self._inflight
        generated = self._read(read)
        ended = time.perf_counter()
        self._counts["build_s"] += built - started
        self._counts["wait_s"] += ended - built
        self._time(work, read, ended - started, ended)
        self._inflight = work
        return (work.progress if work else []), generated

    def _start(self) -> _Work | None:
        decode = [s for s in self._slots.values() if not s.prefilling and s.sampled < s.max_tokens]
        waiting = [(s.request_id, len(s.rest) - s.fed) for s in self._slots.values() if s.prefilling]
        stall = self._stall.tokens(len(decode))
        if stall is None and decode and self._stall.ratio is not None:
            stall = self._config.prefill_chunk  # not measured yet: a cautious chunk
        chunks = plan_prefill(len(decode), waiting, self._config.max_batch_tokens, stall,
                              self._config.prefill_chunk) if waiting else []
        if not decode and not chunks:
            return None
        with mx.stream(self._stream):
            work = self._decode(decode) if decode else None
            if work is not None and chunks:
                # Started before the prefill forward is built: that forward writes the same layer
                # arrays, in place only once nothing still reads the decode's views of them.
                mx.async_eval(work.tokens, work.logprobs, self._next_input, self._kv.arrays())
            if chunks:
                pre = self._prefill([(self._slots[c.key], c.tokens) for c in chunks])
                work = pre if work is None else _merge(work, pre)
            mx.async_eval(work.tokens, work.logprobs, self._next_input, self._kv.arrays())
        return work

    def _decode(self, decode: list[_Slot]) -> _Work:
        self._grow(self._table.span, max(s.length for s in self._slots.values()) + 2)
        count = row_bucket(self._table.span, self._kv.rows, self._on_cpu)
        # Rows that do not decode (free, prefilling, done) write their step's garbage at the table's
        # last position, which no sequence reaches (`_grow` keeps one spare), and are left out of
        # the key length, so a long prompt being fed does not lengthen every decode's attention.
        scratch = self._kv.capacity - 1
        starts = [scratch] * count
        for s in decode:
            starts[s.row] = s.length
        batch = Batch(self._kv, starts, 1, None, round_up(max(s.length for s in decode) + 1, self._block))
        self._shapes_seen.add((count, 1, batch.keys_len, self._kv.capacity))
        inputs = self._next_input[:count]
        logits = self._model(inputs[:, None], cache=batch.views())[:, -1, :]
        rows = [s.row for s in decode]
        logits = self._process(decode, rows, logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = self._sample(decode, rows, logprobs)
        self._next_input[:count] = tokens
        for s in decode:
            s.length += 1
            s.sampled += 1
        return _Work([(s, s.row) for s in decode], tokens, logprobs, len(decode), 0)

    @staticmethod
    def _advance(chunks: list[tuple[_Slot, int]]) -> None:
        """Account the prompt chunks a step has fed."""
        for s, n in chunks:
            s.known.extend(s.rest[s.fed:s.fed + n])
            s.fed += n
            s.length += n

    def _process(self, decode: list[_Slot], index: list[int], logits: mx.array, inputs: mx.array) -> mx.array:
        """Each sequence's logits processors (its row of `logits` at `index`), with its tokens so far
        (the input of this step last)."""
        if not any(s.decoding.logits_processors for s in decode):
            return logits
        rows = [logits[i:i + 1] for i in range(logits.shape[0])]
        for s, i in zip(decode, index):
            if s.decoding.logits_processors:
                s.context = mx.concatenate([s.context, inputs[i:i + 1]])
                for process in s.decoding.logits_processors:
                    rows[i] = process(s.context, rows[i])
        return mx.concatenate(rows, axis=0)

    def _sample(self, decode: list[_Slot], index: list[int], logprobs: mx.array) -> mx.array:
        """One call per distinct sampler (one for the whole batch in the common case)."""
        groups: dict[int, tuple[Sampler, list[int]]] = {}
        for s, i in zip(decode, index):
            groups.setdefault(id(s.decoding.sampler), (s.decoding.sampler, []))[1].append(i)
        count = logprobs.shape[0]
        if len(groups) == 1:
            sampler, rows = next(iter(groups.values()))
            # Rows that do not decode (free, prefilling) may ride along only where they cannot change
            # what a decoding row draws: a seeded sampler's draw depends on the shape it is given.
            if sampler is greedy_sampler or len(rows) == count:
                return sampler(logprobs).astype(mx.int32)
        tokens = mx.zeros((count,), mx.int32)
        for sampler, rows in groups.values():
            index = mx.array(rows, dtype=mx.int32)
            tokens[index] = sampler(logprobs[index]).astype(mx.int32)
        return tokens

    def _prefill(self, chunks: list[tuple[_Slot, int]]) -> _Work:
        """Feed prompt chunks; a chunk that ends its prompt samples the first token. On a GPU the
        chunks go in one forward (padded to the longest), on a CPU one forward each (padding
        would cost a CPU real compute)."""
        groups = [chunks[i:i + 1] for i in range(len(chunks))] if self._on_cpu else [chunks]
        outputs, firsts, logprobs, progress = [], [], [], []
        for group in groups:
            ending = self._prefill_group(group)
            progress += [PromptProgress(s.request_id, s.fed, len(s.rest), not s.prefilling) for s, _ in group]
            for slot, (token, lp) in ending:
                outputs.append((slot, len(firsts)))
                firsts.append(token)
                logprobs.append(lp)
        tokens = mx.concatenate(firsts) if firsts else mx.zeros((0,), mx.int32)
        logprobs = mx.concatenate(logprobs, axis=0) if logprobs else mx.zeros((0, 1))
        if firsts:
            self._next_input[mx.array([s.row for s, _ in outputs], dtype=mx.int32)] = tokens
        return _Work(outputs, tokens, logprobs, 0, sum(n for _, n in chunks), progress)

    def _prefill_group(self, group: list[tuple[_Slot, int]]) -> list[tuple[_Slot, tuple[mx.array, mx.array]]]:
        width = max(n for _, n in group)
        self._grow(self._table.span, max(s.length for s, _ in group) + width + 1)
        inputs = mx.array([s.rest[s.fed:s.fed + n] + [0] * (width - n) for s, n in group], dtype=mx.int32)
        starts = [s.length for s, _ in group]
        keys_len = round_up(max(a + width for a in starts), self._block)
        batch = Batch(self._kv, starts, width, [s.row for s, _ in group], keys_len)
        self._shapes_seen.add((len(group), width, keys_len, self._kv.capacity))
        self._counts["prefill_tokens"] += sum(n for _, n in group)
        ending = [(i, s, n) for i, (s, n) in enumerate(group) if s.fed + n == len(s.rest)]
        logits = logits_at(self._model, inputs, batch.views(), [(i, n - 1) for i, _, n in ending])
        self._advance(group)
        return [(s, self._first_token(s, logits[j:j + 1])) for j, (_, s, _) in enumerate(ending)]

    def _first_token(self, s: _Slot, row: mx.array) -> tuple[mx.array, mx.array]:
        """Sample a prompt's first output token from its last position's logits (1, vocab), after
        its processors, with the whole prompt as their context."""
        if s.decoding.logits_processors:
            s.context = mx.array(s.known, dtype=mx.int32)
            for process in s.decoding.logits_processors:
                row = process(s.context, row)
        lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
        s.sampled = 1
        return s.decoding.sampler(lp).astype(mx.int32).reshape(1), lp

    def _time(self, built: _Work | None, read: _Work | None, call_s: float, ended: float) -> None:
        """Feed the stall budget a step's time. On a CPU the forward runs while it is built (the CPU
        fast paths evaluate as they go), so a call's time is the step it built; on a GPU the time
        between two read-backs is the step read."""
        if self._on_cpu and built is not None:
            self._stall.record(call_s, built.prefill_tokens, built.decoding)
        elif not self._on_cpu and read is not None and self._last_read is not None:
            self._stall.record(ended - self._last_read, read.prefill_tokens, read.decoding)
        self._last_read = ended if read is not None else None

    # -- reading back -------------------------------------------------------------------------
    def _read(self, work: _Work | None) -> list[Generated]:
        if work is None:
            return []
        tokens = work.tokens.tolist()
        out = []
        for slot, i in work.outputs:
            if self._slots.get(slot.request_id) is slot:  # else finished or removed since
                out.append(self._read_one(slot, tokens[i], work.logprobs[i]))
        return out

    def _read_one(self, slot: _Slot, token: int, logprobs: mx.array) -> Generated:
        slot.generated += 1
        slot.known.append(token)
        reason = "length" if slot.generated >= slot.max_tokens else None
        if slot.matcher.advance(token):
            reason = "stop"
        if reason is None:
            return Generated(slot.request_id, token, logprobs, None, None, None)
        cache, tokens = self.remove(slot.request_id, return_cache=True)
        return Generated(slot.request_id, token, logprobs, reason, cache, tokens)

    def _grow(self, rows: int, positions: int) -> None:
        old = self._kv.rows
        self._kv.ensure(rows, positions)
        if self._kv.rows > old:
            self._next_input = mx.concatenate([self._next_input, mx.zeros((self._kv.rows - old,), mx.int32)])


def _merge(a: _Work, b: _Work) -> _Work:
    """A decode step's work and its prefill chunks' (whose outputs index after the decode rows)."""
    shift = a.tokens.shape[0]
    if not b.outputs:
        return _Work(a.outputs, a.tokens, a.logprobs, a.decoding, b.prefill_tokens, b.progress)
    return _Work(a.outputs + [(s, i + shift) for s, i in b.outputs], mx.concatenate([a.tokens, b.tokens]),
                 mx.concatenate([a.logprobs, b.logprobs], axis=0), a.decoding, b.prefill_tokens, b.progress)
