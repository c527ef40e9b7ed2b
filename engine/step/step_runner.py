"""Pomona's own batched step: the `Runner` protocol (engine/runner.py) on mlx-lm's public model API.

What it does differently from mlx-lm's `BatchGenerator` (the reference, `engine_step: mlx_lm`):
- a newcomer's prompt is fed in chunks inside the running batch's steps, within the step's token
  budget (engine/step/plan.py), instead of steps of its own that stall every running sequence;
- its first token is sampled from its last prompt chunk, and it decodes with the batch from the
  next step on: no batch-of-one decode and merge;
- the KV cache is a table of reusable rows (engine/step/kv_table.py): nothing is rebuilt when a
  sequence joins or leaves.

A step is: plan (who decodes, which prompt chunks), build the forwards and the sampling lazily,
start them (`mx.async_eval`), then read back the *previous* step's tokens while this one runs, as
`BatchGenerator` does; a sequence's input is the token sampled for it the step before, still on
the device. Everything runs on the engine's MLX thread. Where a CPU's step and a GPU's differ,
the step reads one record chosen at start-up (engine/step/backend.py), never the device itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.checkpoints import CheckpointPolicy
from engine.config import EngineConfig
from engine.forward import logits_at
from engine.runner import DIRECT_PREFILL_CHUNK, Checkpoint, Extracted, Generated, PromptProgress, StoredPrefix
from engine.sampling import Decoding
from engine.step.backend import StepBackend, prefill_shape, step_backend
from engine.step.draft import DraftProposer, check_vocab, load_draft
from engine.step.kv_table import Batch, SlotKV, flat_views, layer_shapes, supports_flat
from engine.step.plan import MIN_PREFILL_TOKENS, SlotTable, StallBudget, plan_prefill, round_up, row_bucket
from engine.step.records import Slot, Work, merge
from engine.step.sampling import first_token, process_logits, sample, sample_positions
from engine.step.speculative import SpecConfig, SpecGate, accepted, new_state, resolve

log = logging.getLogger("pomona.engine")

FLAT_EXTRA_POSITIONS = 4  # what a CPU flat forward's parts cost beyond a plain forward, in positions
SPEC_PARTS = 3  # most parts a CPU flat step puts its verifying rows in (`width_groups`)
SPEC_MIN_FLOOR = 0.1


def width_groups(slots: list[Slot], widths: list[int]) -> list[list[Slot]]:
    """Rows sorted by width, cut where a row is more than twice as wide as its group's first (so
    padding at most doubles a group) into at most SPEC_PARTS groups."""
    groups: list[list[Slot]] = []
    first = 0
    for s, w in zip(slots, widths):
        if not groups or (w > 2 * first and len(groups) < SPEC_PARTS):
            groups.append([])
            first = w
        groups[-1].append(s)
    return groups


def unsupported(model: Any, config: EngineConfig) -> str | None:
    """Why this step cannot run `model` (None: it can): its table holds plain attention KV only."""
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {"KVCache"}:  # with max_kv_size, these become rings (engine/step/rings.py)
        return f"its layers need {', '.join(sorted(kinds))} caches, not only KVCache"
    return None


class StepRunner:
    """`engine_step: pomona`: a `Runner` (engine/runner.py) on the own batched step."""

    def __init__(self, model: Any, config: EngineConfig, on_cpu: bool | None = None) -> None:
        """`on_cpu`: which backend's step to build (None: the default device's); False on a CPU runs
        the GPU's step there (padded, bucketed shapes), which tests use to check it."""
        self._model = model
        on_cpu = mx.default_device() == mx.cpu if on_cpu is None else on_cpu
        self._backend: StepBackend = step_backend(on_cpu, flat_supported=supports_flat(model))
        self._config = config = config.for_backend(self._backend.on_cpu)
        self._stream = mx.new_stream(mx.default_device())
        self.checkpoints = CheckpointPolicy.for_model(model, config)
        self.kv_window = config.max_kv_size  # every row is a ring of this many positions when set
        self.stored_prefix: StoredPrefix = lambda request_id, tokens: 0  # the engine tells what its store holds
        self._shapes = layer_shapes(model)
        self._stall = StallBudget(config.max_decode_stall)
        self._block = self._backend.position_block
        # Decode rows and prompt chunks in one forward (`flat_step`): the CPU's flat step (its fast-path
        # blocks, evaluated as built and timed for the stall budget), or a GPU's (any llama model,
        # `modelio.flat_llama`; chunks padded to the prefill buckets, left in flight like any step).
        flat = config.flat_steps() and supports_flat(model)
        if config.flat_step is True and not flat:
            log.info("engine.flat_step: this model's attention takes no flat forward (llama blocks do); "
                     "a step with prompt chunks runs two forwards")
        self._flat = self._backend.flat and flat
        self._flat_mixed = not self._backend.on_cpu and flat and config.max_kv_size is None
        # For the step report: prompt tokens fed, host time building steps, time waiting for a
        # step's tokens, and the distinct forward shapes (each a kernel compile on a JIT backend).
        self._counts = {"prefill_tokens": 0, "forwards": 0, "build_s": 0.0, "wait_s": 0.0, "rows_reused": 0}
        self._shapes_seen: set[tuple[int, ...]] = set()
        # Speculation (engine/step/speculative.py). Not on ring tables (max_kv_size): a rejected
        # position's write lands in a ring slot that still holds a position the row's later
        # tokens attend to, and the table keeps no copy to roll back to.
        self.speculative: SpecConfig | None = None if config.max_kv_size is not None \
            else resolve(config.speculative, self._backend.on_cpu)
        # Most decoding rows with which a step still proposes (a CPU's floor), and where a verifying
        # step gives up the overlap, whether it pays for that, as measured (`SpecGate`).
        self._spec_rows = self._backend.spec_max_rows
        self._gate = SpecGate() if self._backend.spec_gate else None
        self._first_token_read = config.first_token_reads(self._backend.on_cpu)
        self._last_end: float | None = None  # when the previous step call ended (the gate's periods)
        self._counts.update({"spec_steps": 0, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0,
                             "spec_chained_steps": 0, "spec_void_rows": 0})
        self._draft: DraftProposer | None = None
        if self.speculative is not None and self.speculative.method == "draft":
            draft = load_draft(self.speculative.draft_model, config.dtype, config.cpu_fast_paths)
            check_vocab(draft, model)
            self._draft = DraftProposer(draft, self.speculative.max_tokens)
        self._new_table()

    def _new_table(self) -> None:
        self._table = SlotTable(self._config.max_running)
        self._kv = SlotKV(self._shapes, self._block, self._config.max_kv_size)
        self._next_input = mx.zeros((0,), mx.int32)  # per row: the token it feeds next, on the device
        self._slots: dict[str, Slot] = {}  # in admission order
        # Free rows and the tokens whose KV they still hold (positions [0, len)): a request whose
        # restored prefix one of them holds takes that row and skips copying the prefix in. An
        # agent's next turn usually finds its previous turn's row untouched.
        self._left: dict[int, list[int]] = {}
        self._inflight: Work | None = None
        self._last_read: float | None = None

    def __len__(self) -> int:
        return len(self._slots)

    def self_check(self) -> None:
        """A short prompt through the table must give mlx-lm's own logits (row 1, so rows and
        positions are both exercised), through the flat forward too where steps use it; raises
        otherwise."""
        prompt = [1, 2, 3, 4, 5]
        reference = self._model(mx.array([prompt]), cache=make_prompt_cache(self._model))[0, -1]
        self._grow(2, len(prompt) + 1)
        batch = Batch(self._kv, [0], len(prompt), [1], round_up(len(prompt), self._block))
        views = [batch.views()] + ([flat_views([batch])] if self._flat or self._flat_mixed else [])
        scale = float(mx.abs(reference).max().item()) or 1.0
        for cache in views:
            ours = logits_at(self._model, mx.array([prompt]), cache, [(0, len(prompt) - 1)])[0]
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
        held = self._holding(cached) if cache is not None and cached else None
        row = self._table.acquire(held)
        self._left.pop(row, None)
        try:
            # The whole prompt's positions now: growing the table copies every row, and a copy per
            # chunk as a long prompt is fed would stall the running decodes again and again.
            self._grow(row + 1, len(cached) + len(tokens) + 2)
            if row == held:  # the row holds the prefix already: the restored copy is never computed
                self._counts["rows_reused"] += 1
            elif cache is not None and cached:
                self._kv.write_prefix(row, cache, len(cached))
        except Exception:
            self._table.release(row)
            raise
        spec = None if self.speculative is None else \
            new_state(self.speculative, cached, tokens, padded=self._backend.fixed_verify_width)
        self._slots[request_id] = Slot(request_id, row, decoding, decoding.stop_sequences.matcher(), max_tokens,
                                        list(tokens), list(cached), len(cached), spec=spec, cached=len(cached))

    def insert_after_first_token(self, request_id: str, tokens: Sequence[int], cached: Sequence[int],
                                 cache: list[Any] | None, decoding: Decoding, max_tokens: int,
                                 on_checkpoint: Checkpoint | None = None) -> Generated:
        """Feed the whole rest now (the batch waits) and return the first token; the request decodes
        with the batch from the next step. `on_checkpoint` is for hybrid models, which this step
        does not run (engine/runner_choice.py's `make_runner` keeps them on `BatchGenerator`)."""
        self.insert(request_id, tokens, cached, cache, decoding, max_tokens)
        slot = self._slots[request_id]
        with mx.stream(self._stream):
            while slot.prefilling:
                n = min(len(slot.rest) - slot.fed, DIRECT_PREFILL_CHUNK)
                work = self._prefill([(slot, n)])
            mx.eval(work.tokens, work.logprobs, self._kv.arrays())
        token, logprobs = int(work.tokens[0].item()), work.logprobs[0]
        return self._read_one(slot, token, logprobs)

    def extract(self, request_id: str) -> Extracted | None:
        """A copy of a running request's cache past what the prefix store holds, and the tokens it
        covers. Why only past it: a long conversation's turn would otherwise copy its whole history
        on the device twice (prompt end, finish) for the store to keep its new blocks. A ring holds
        only its window: copied whole."""
        slot = self._slots.get(request_id)
        if slot is None:
            return None
        n = min(slot.length, len(slot.known))
        tokens = slot.known[:n]
        start = self.stored_prefix(request_id, tokens) if self.kv_window is None else 0
        if start >= n:
            return None
        return Extracted(self._kv.extract(slot.row, n, start), tokens, start)

    def remove(self, request_id: str, return_cache: bool = False) -> Extracted | None:
        kept = self.extract(request_id) if return_cache else None
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._table.release(slot.row)
            if self.kv_window is None:  # a ring holds only its window: nothing to find again
                self._left[slot.row] = slot.known[:min(slot.length, len(slot.known))]
        return kept

    def _holding(self, cached: Sequence[int]) -> int | None:
        """A free row whose KV starts with `cached` (the longest such, so shorter ones stay for others)."""
        n, best, best_len = len(cached), None, -1
        want = list(cached)
        for row, held in self._left.items():
            if len(held) >= n and len(held) > best_len and held[:n] == want:
                best, best_len = row, len(held)
        return best

    def reset(self) -> list[str]:
        """Drop every sequence and start a clean table; returns the ids that were dropped."""
        dropped = list(self._slots)
        self._new_table()
        return dropped

    def cache_nbytes(self) -> int:
        return self._kv.nbytes()

    def speculation(self, request_id: str) -> dict[str, int]:
        """A running request's proposed and accepted tokens ({} when it does not speculate)."""
        slot = self._slots.get(request_id)
        return slot.spec.stats() if slot is not None and slot.spec is not None else {}

    def counters(self) -> dict[str, Any]:
        decode_s = self._stall.decode_s  # moving average of steps that only decode: the steady decode rate
        return {"kind": "pomona", **self._counts, "shapes": len(self._shapes_seen),
                "decode_step_ms": round(1000 * decode_s, 3) if decode_s else 0.0,
                "spec_declined_steps": self._gate.declined_steps if self._gate is not None else 0,
                "spec_gate_ms": self._gate.report() if self._gate is not None else {}}

    def close(self) -> None:
        self._slots.clear()

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> tuple[list[PromptProgress], list[Generated]]:
        """Start this step, then read back the previous one (its tokens were computed meanwhile);
        a step that samples a prompt's first token is read back at once where `first_token_read` says."""
        started = time.perf_counter()
        read = self._inflight
        read_first, gate_after = (False, False) if (chained := self._chains()) else self._reads_first()
        if chained:
            # Built before the step in flight is read back, on the guess that its verifying rows
            # accept all their proposals; reading it then drops the parts of rows where they did not.
            work = self._start(speculate=True, gate=True, chained=True, pending=read)
            built = time.perf_counter()
            generated = self._read(read, after=work)
            ended = time.perf_counter()
            self._counts["build_s"] += built - started
            self._counts["wait_s"] += ended - built
        elif read_first:
            # Proposals follow a row's last token, which the host must know: read back first (the
            # step no longer overlaps building the next one; on a CPU it never did much).
            self._inflight = None
            generated = self._read(read)
            built = time.perf_counter()
            work = self._start(speculate=True, gate=gate_after)
            ended = time.perf_counter()
            self._counts["wait_s"] += built - started
            self._counts["build_s"] += ended - built
        else:
            work = self._start()
            built = time.perf_counter()
            generated = self._read(read)
            ended = time.perf_counter()
            self._counts["build_s"] += built - started
            self._counts["wait_s"] += ended - built
        if work is not None and self._reads_now(work):
            # A first token leaves in this call rather than the next (`first_token_read`).
            generated += self._read(work)
            ended = time.perf_counter()
            self._time(work, read, ended - started, ended)
            self._last_read, self._inflight = ended, None
        else:
            self._time(work, read, ended - started, ended)
            self._inflight = work
        self._time_kind(self._kind(chained, read_first, work, read), work, read, ended)
        return (work.progress if work else []), generated

    def _chains(self) -> bool:
        """Whether this step is built before the one in flight is read back (a GPU, whose step's
        building otherwise stops overlapping the device's work for every verifying step: 1.3x a
        plain step's period at one row on the H100, 2x at 8-32 rows, session 28). Each row whose
        last token is still on the device feeds it from there, and proposes what prompt lookup
        expects after the proposals it verifies in flight, all taken as accepted. Not for a draft
        model (it feeds on the tokens), rows with logits processors (they see each input on the
        host), or while prompt chunks wait (their steps read first, as they always did)."""
        if not self._backend.chain_verify or self.speculative is None or not self.speculative.chain \
                or self._draft is not None:
            return False
        return not any(s.prefilling or s.decoding.logits_processors for s in self._slots.values())

    @staticmethod
    def _kind(chained: bool, read_first: bool, built: Work | None, read: Work | None) -> bool | None:
        """The kind of step a call's period times for the gate: verifying, plain, or neither (None).
        Unchained, a call that read first built a verifying step without overlap; chained, a call
        between two verifying steps times a verifying one, between two plain ones a plain one."""
        if not chained:
            return read_first
        verifying = [bool(w.verified) for w in (built, read) if w is not None]
        return verifying[0] if verifying and len(set(verifying)) == 1 else None

    def _reads_now(self, work: Work) -> bool:
        """Whether `work` is read back in the call that started it: it samples a prompt's first
        token, and `first_token_read` says so for that prompt ("now": any; "hits": one whose
        restored prefix is at least as long as the rest it fed)."""
        if self._first_token_read == "next_step" or not work.prefill_tokens:
            return False
        ending = [p.request_id for p in work.progress if p.end_of_prompt]
        if not ending or self._first_token_read == "now":
            return bool(ending)
        return any((s := self._slots.get(rid)) is not None and s.cached >= len(s.rest) for rid in ending)

    def _reads_first(self) -> tuple[bool, bool]:
        """(Whether this step reads the one in flight first, so that it may verify proposals;
        whether the gate is still to decide, once read, if it does.) It reads first when the step
        in flight verified some (its rows' lengths are known only once read), or when a decoding
        row would propose and, where a verifying step gives up the overlap, that was measured to
        pay at the tokens the rows are expected to add (`SpecGate`)."""
        if self.speculative is None:
            return False, False
        if self._inflight is not None and self._inflight.verified:
            return True, self._gate is not None
        decoding = [s for s in self._slots.values() if not s.prefilling]
        if self._crowded(len(decoding)):  # none may propose: keep the overlap
            return False, False
        if self._gate is None:
            return any(not s.spec.adaptive.waiting for s in decoding), False
        floor = self._floor(len(decoding))
        return self._gate.pays(len(decoding), sum(s.spec.adaptive.expected(floor) for s in decoding)), False

    def _floor(self, rows: int) -> float:
        """The acceptance chance a proposed position must have to pay for itself: it costs about
        1 / (rows + fixed) of the step (`fixed`: the step's cost not per position, in positions),
        and the step emits about `rows` tokens."""
        return max(SPEC_MIN_FLOOR, rows / (rows + self._backend.spec_fixed_positions))

    def _time_kind(self, verifying: bool | None, built: Work | None, read: Work | None, ended: float) -> None:
        """Give the gate this step's period (since the previous call ended), as a verifying one or
        a plain one (`_kind`), by its decoding rows; steps with prompt chunks are left out (their
        period is the chunk's)."""
        last, self._last_end = self._last_end, ended
        if self._gate is None or verifying is None or last is None or built is None or not built.decoding \
                or read is None:
            return  # (a step that read nothing overlapped nothing: it follows an idle engine or a read-back at once)
        if built.prefill_tokens or (read is not None and read.prefill_tokens):
            return
        self._gate.record(verifying, built.decoding, ended - last)

    def _proposals(self, decode: list[Slot], speculate: bool, gate: bool = False, chained: bool = False,
                   pending: dict[Slot, list[int]] | None = None) -> dict[Slot, list[int]]:
        """Each decoding row's proposals for this step (rows with none are left out). Every row's
        controller counts the step, also when this step cannot speculate. `gate`: whether to verify
        is still the gate's (`SpecGate`). `pending`: rows whose next token the step in flight
        samples, unread, with the proposals it verifies for them: taken as accepted, and the token
        after them guessed by the lookup, these rows propose what follows that guess. `chained`:
        steps are built so (`_chains`), which the gate weighs (`Adaptive.expected_chained`)."""
        out: dict[Slot, list[int]] = {}
        if self.speculative is None:
            return out
        floor = self._floor(len(decode))
        if speculate and gate and self._gate is not None:
            speculate = self._gate.pays(len(decode), sum(s.spec.adaptive.expected_chained(floor) if chained
                                                         else s.spec.adaptive.expected(floor) for s in decode))
        # On a CPU a verifying step also costs its forward's extra parts, and with more rows
        # decoding the proposals measured a net loss (docs/measurements.md): none past a few rows.
        crowded = self._crowded(len(decode))
        for s in decode:
            k = min(s.spec.adaptive.budget(floor), s.max_tokens - s.sampled - 1)
            if not speculate or crowded or k <= 0:
                continue
            if pending is not None and s in pending:
                proposals = s.spec.lookup.propose_ahead(s.known, pending[s], k + 1)[1:]
            elif self._draft is not None:
                proposals = self._draft.propose(s.spec, s.known, k)
            else:
                proposals = s.spec.lookup.propose(s.known, k)
            s.spec.adaptive.record_lookup(bool(proposals))
            for process in s.decoding.logits_processors:
                if proposals and hasattr(process, "admissible"):  # a grammar: cut at its first refusal
                    proposals = proposals[:process.admissible(s.known[-1], proposals)]
            if proposals:
                out[s] = proposals
        return out

    def _crowded(self, decoding: int) -> bool:
        """Whether so many rows decode that none may propose (`StepBackend.spec_max_rows`)."""
        limit = self._spec_rows
        return limit is not None and decoding > limit

    def _start(self, speculate: bool = False, gate: bool = False, chained: bool = False,
               pending: Work | None = None) -> Work | None:
        """Plan and start a step. `chained`: built before `pending`, the step in flight, is read
        back (`_chains`)."""
        decode = [s for s in self._slots.values() if not s.prefilling and s.sampled < s.max_tokens]
        unread = {} if pending is None else \
            {s: pending.verified.get(s, []) for s, _ in pending.outputs if s not in pending.void}
        verify = self._proposals(decode, speculate, gate, chained, unread)
        waiting = [(s.request_id, len(s.rest) - s.fed) for s in self._slots.values() if s.prefilling]
        stall = self._stall.tokens(len(decode))
        if stall is None and decode and self._stall.ratio is not None:
            stall = MIN_PREFILL_TOKENS  # not measured yet: the smallest chunk
        chunks = plan_prefill(len(decode), waiting, self._config.max_batch_tokens, stall,
                              self._config.prefill_chunk) if waiting else []
        if not decode and not chunks:
            return None
        with mx.stream(self._stream):
            if verify and not chunks and self._flat and not self._pad_all(decode, verify):
                # Not waited for here: a verifying step's attention stays lazy (CpuAttention takes
                # MLX's for a few queries), so the step overlaps what the engine does meanwhile.
                work = self._flat_step([s for s in decode if s not in verify], [], verify)
            elif chunks and self._flat:
                work = self._timed_flat_step(decode, [(self._slots[c.key], c.tokens) for c in chunks], verify)
            elif chunks and decode and self._flat_mixed:
                work = self._flat_step([s for s in decode if s not in verify],
                                       [(self._slots[c.key], c.tokens) for c in chunks], verify)
            else:
                if verify:  # every decoding row in one forward, padded to the most proposals
                    work = self._verify_group(decode, verify, unread)
                    if any(unread.get(s) for s in decode):
                        self._counts["spec_chained_steps"] += 1
                else:
                    work = self._decode(decode) if decode else None
                if work is not None and chunks:
                    # Started before the prefill forward is built: that forward writes the same layer
                    # arrays, in place only once nothing still reads the decode's views of them.
                    mx.async_eval(work.tokens, work.logprobs, self._next_input, self._kv.arrays())
                if chunks:
                    pre = self._prefill([(self._slots[c.key], c.tokens) for c in chunks])
                    work = pre if work is None else merge(work, pre)
            mx.async_eval(work.tokens, work.logprobs, self._next_input, self._kv.arrays())
        return work

    def _decode(self, decode: list[Slot]) -> Work:
        batch, inputs = self._decode_batch(decode)
        logits = self._model(inputs[:, None], cache=batch.views())[:, -1, :]
        self._counts["forwards"] += 1
        return self._decoded(decode, logits, inputs)

    def _decode_batch(self, decode: list[Slot]) -> tuple[Batch, mx.array]:
        """The decode forward's rows (every row of the table in use, one token each) and inputs."""
        self._grow(self._table.span, max(s.length for s in self._slots.values()) + 2)
        count = row_bucket(self._table.span, self._kv.rows, on_cpu=self._backend.exact_rows)
        # Rows that do not decode (free, prefilling, done) write their step's garbage at the table's
        # last position, which no sequence reaches (`_grow` keeps one spare), and are left out of
        # the key length, so a long prompt being fed does not lengthen every decode's attention.
        scratch = self._kv.scratch
        starts = [scratch] * count
        for s in decode:
            starts[s.row] = s.length
        batch = Batch(self._kv, starts, 1, None, self._keys_len(max(s.length for s in decode) + 1))
        self._shapes_seen.add((count, 1, batch.keys_len, self._kv.capacity))
        return batch, self._next_input[:count]

    def _decoded(self, decode: list[Slot], logits: mx.array, inputs: mx.array) -> Work:
        """Process and sample the decode rows' logits (one row per table row of the forward)."""
        rows = [s.row for s in decode]
        logits = process_logits(decode, rows, logits, inputs)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = sample(decode, rows, logprobs)
        self._next_input[:logits.shape[0]] = tokens
        for s in decode:
            s.length += 1
            s.sampled += 1
        return Work([(s, s.row) for s in decode], tokens, logprobs, len(decode), 0, widths={s: 1 for s in decode})

    def _timed_flat_step(self, decode: list[Slot], chunks: list[tuple[Slot, int]],
                         verify: dict[Slot, list[int]]) -> Work:
        """`_flat_step`, run to its end here and timed for the stall budget. On a CPU a step's
        forward mostly runs while it is built (the fast paths evaluate each layer's attention), so
        it cannot overlap the previous one anyway; waiting for that one first makes the time this
        step's own."""
        if self._inflight is not None:
            mx.eval(self._inflight.tokens)
        started = time.perf_counter()
        work = self._flat_step([s for s in decode if s not in verify], chunks, verify)
        mx.eval(work.tokens, work.logprobs, self._next_input, self._kv.arrays())
        if not verify:  # a verifying step is neither a plain decode nor priced as prompt tokens
            self._stall.record(time.perf_counter() - started, work.prefill_tokens, work.decoding)
        return work

    def _flat_step(self, decode: list[Slot], chunks: list[tuple[Slot, int]],
                   verify: dict[Slot, list[int]] | None = None) -> Work:
        """The decode rows, the verifying rows and every prompt chunk as one flat forward
        (`flat_attention`: modelio/flat_llama.py, the CPU's fast-path blocks extend it): the weights
        are read and every projection runs once for all of them. On the 2-core box a forward costs
        ~one pass over the weights whatever its rows, so a chunk in a forward of its own nearly
        doubled a decoding step; a GPU's host builds one forward instead of two (-15 %,
        benchmarks/engine/step_build.py)."""
        verify = verify or {}
        # On a GPU each chunk is padded to its prefill bucket (`prefill_shape`: few shapes to compile).
        shapes = [prefill_shape(n, s.length, self._block) if self._backend.bucketed_prefill
                  else (n, self._keys_len(s.length + n)) for s, n in chunks]
        ends = [max(s.length + width, keys_len) + 1 for (s, _), (width, keys_len) in zip(chunks, shapes)]
        self._grow(self._table.span, max(ends + [s.length + len(p) + 2 for s, p in verify.items()]))
        batches, inputs, at = [], [], []
        if decode:
            batch, decode_inputs = self._decode_batch(decode)
            batches.append(batch)
            inputs.append(decode_inputs)
            at += [(0, i) for i in range(batch.count)]
        start = sum(b.count for b in batches)
        # The verifying rows go in a few parts, each its rows' last tokens and proposals padded to
        # its longest (written past each row's length, overwritten later): rows of like widths
        # together (`width_groups`), since on a CPU a padded position costs a real one and each
        # part's rope, writes and attention cost a few ms a step whatever its tokens.
        verify = dict(sorted(verify.items(), key=lambda item: len(item[1])))
        # A GPU verifies at one fixed width (`_verify_batch`): one part, as its own verifying forward does.
        groups = [list(verify)] if verify and self._backend.fixed_verify_width \
            else width_groups(list(verify), [len(p) + 1 for p in verify.values()])
        for group_slots in groups:
            group = self._verify_batch(group_slots, [len(verify[s]) + 1 for s in group_slots])
            batches.append(group)
            inputs.append(mx.array([x for s in group_slots for x in self._padded(s, verify[s], group.tokens)],
                                   dtype=mx.int32))
            at += [(0, start + b * group.tokens + j) for b, s in enumerate(group_slots) for j in range(len(verify[s]) + 1)]
            start += group.count * group.tokens
        ending = []
        for (s, n), (width, keys_len) in zip(chunks, shapes):
            batches.append(Batch(self._kv, [s.length], width, [s.row], keys_len, None if width == n else [n]))
            inputs.append(mx.array(s.rest[s.fed:s.fed + n] + [0] * (width - n), dtype=mx.int32))
            if s.fed + n == len(s.rest):
                ending.append(s)
                at.append((0, start + n - 1))
            start += width
        self._shapes_seen.add((sum(b.count * b.tokens for b in batches), batches[-1].keys_len, self._kv.capacity))
        self._counts["prefill_tokens"] += sum(n for _, n in chunks)
        self._counts["forwards"] += 1
        logits = logits_at(self._model, mx.concatenate(inputs)[None], flat_views(batches), at)
        count = batches[0].count if decode else 0
        work = self._decoded(decode, logits[:count], inputs[0]) if decode else None
        if verify:
            width = sum(len(p) + 1 for p in verify.values())
            checked = self._verified(verify, [s.known[-1:] + p for s, p in verify.items()], logits[count:count + width])
            work = checked if work is None else merge(work, checked)
        self._advance(chunks)
        firsts = [(s, first_token(s, logits[len(at) - len(ending) + j][None])) for j, s in enumerate(ending)]
        pre = self._prefilled(chunks, firsts)
        return pre if work is None else merge(work, pre)

    def _pad_all(self, decode: list[Slot], verify: dict[Slot, list[int]]) -> bool:
        """On a CPU, whether every decoding row padded to the widest in one plain forward costs less
        than the flat forward's parts: measured on the 2-core box (SmolLM2-135M, 8 rows), a flat
        forward costs ~4 positions more than a plain one of the same positions (153 against
        126 ms), and a position ~6 ms."""
        width = 1 + max(len(p) for p in verify.values())
        return len(decode) * width <= len(decode) + sum(len(p) for p in verify.values()) + FLAT_EXTRA_POSITIONS

    def _verify_group(self, decode: list[Slot], verify: dict[Slot, list[int]],
                      unread: dict[Slot, list[int]] | None = None) -> Work:
        """Every decoding row in one forward of its last token and its proposals (none for some),
        padded to the longest: the padding writes past each row's length, where the row's next
        tokens overwrite it. On a GPU the width is always the most proposals a row may make, so
        the widths do not multiply the shapes compiled. `unread`: rows whose last token is still
        on the device (`_proposals`); then every row's first input is taken from there."""
        ins = [s.known[-1:] + verify.get(s, []) for s in decode]
        batch = self._verify_batch(decode, [len(x) for x in ins])
        self._shapes_seen.add((len(decode), batch.tokens, batch.keys_len, self._kv.capacity))
        self._counts["forwards"] += 1
        inputs = mx.array([self._padded(s, verify.get(s, []), batch.tokens) for s in decode], dtype=mx.int32)
        if unread and any(s in unread for s in decode):
            last = self._next_input[mx.array([s.row for s in decode], dtype=mx.int32)]
            inputs = mx.concatenate([last[:, None], inputs[:, 1:]], axis=1)
        logits = logits_at(self._model, inputs, batch.views(), [(b, j) for b, x in enumerate(ins) for j in range(len(x))])
        return self._verified({s: verify.get(s, []) for s in decode}, ins, logits)

    def _verify_batch(self, slots: list[Slot], counts: list[int]) -> Batch:
        """Rows feeding their last token and proposals (`counts` tokens each) at their lengths,
        padded to the longest; on a GPU to the most a row may feed (one shape whatever the
        proposals), with the key length bucketed as a decode's."""
        width = self.speculative.max_tokens + 1 if self._backend.fixed_verify_width else max(counts)
        self._grow(self._table.span, max(s.length + width + 1 for s in slots))
        keys_len = self._keys_len(max(s.length + width for s in slots))
        return Batch(self._kv, [s.length for s in slots], width, [s.row for s in slots], keys_len, counts)

    @staticmethod
    def _padded(s: Slot, proposals: list[int], width: int) -> list[int]:
        return s.known[-1:] + proposals + [0] * (width - 1 - len(proposals))

    def _verified(self, verify: dict[Slot, list[int]], ins: list[list[int]], logits: mx.array) -> Work:
        """Sample every position of the verifying rows (`ins`: each row's inputs, in `verify`'s
        order; `logits` one row per input); acceptance is decided when the step is read back."""
        rows, at, outputs = [], 0, []
        for (s, proposals), inputs in zip(verify.items(), ins):
            rows.append((s, inputs, logits[at:at + len(inputs)]))
            outputs.append((s, at))
            at += len(inputs)
            s.length += len(inputs)  # rolled back at the read for the rejected ones
            s.sampled += len(inputs)
        tokens, logprobs = sample_positions(rows)
        self._counts["spec_steps"] += 1
        # Each row's last position samples the token it feeds next if all its proposals stand; left
        # on the device, where a step built before this one is read takes it (a read feeds the
        # right one where they did not).
        last = [at + len(inputs) - 1 for (_, at), (_, inputs, _) in zip(outputs, rows)]
        self._next_input[mx.array([s.row for s in verify], dtype=mx.int32)] = tokens[mx.array(last, dtype=mx.int32)]
        return Work(outputs, tokens, logprobs, len(verify), 0, verified=dict(verify),
                    widths={s: len(inputs) for s, inputs, _ in rows}, undo={s: s.spec.undo for s in verify})

    def _keys_len(self, end: int) -> int:
        """A forward's key length: on a GPU bucketed (each new shape is a compile), on a CPU exact,
        so no padded key costs compute and a one-row chunk's mask is plain causal
        (`RowsView.make_mask`)."""
        return end if self._backend.exact_keys else round_up(end, self._block)

    @staticmethod
    def _advance(chunks: list[tuple[Slot, int]]) -> None:
        """Account the prompt chunks a step has fed."""
        for s, n in chunks:
            s.known.extend(s.rest[s.fed:s.fed + n])
            s.fed += n
            s.length += n

    def _prefill(self, chunks: list[tuple[Slot, int]]) -> Work:
        """Feed prompt chunks; a chunk that ends its prompt samples the first token. On a GPU the
        chunks go in one forward (padded to the longest), on a CPU one forward each (padding
        would cost a CPU real compute)."""
        groups = [chunks] if self._backend.prefill_together else [chunks[i:i + 1] for i in range(len(chunks))]
        return self._prefilled(chunks, [first for group in groups for first in self._prefill_group(group)])

    def _prefilled(self, chunks: list[tuple[Slot, int]],
                   ending: list[tuple[Slot, tuple[mx.array, mx.array]]]) -> Work:
        """A step's prefill outputs: the first tokens of the prompts that ended (their rows feed
        them next step) and every chunk's progress."""
        progress = [PromptProgress(s.request_id, s.fed, len(s.rest), not s.prefilling) for s, _ in chunks]
        outputs = [(slot, i) for i, (slot, _) in enumerate(ending)]
        firsts = [token for _, (token, _) in ending]
        logprobs = [lp for _, (_, lp) in ending]
        tokens = mx.concatenate(firsts) if firsts else mx.zeros((0,), mx.int32)
        logprobs = mx.concatenate(logprobs, axis=0) if logprobs else mx.zeros((0, 1))
        if firsts:
            self._next_input[mx.array([s.row for s, _ in outputs], dtype=mx.int32)] = tokens
        return Work(outputs, tokens, logprobs, 0, sum(n for _, n in chunks), progress)

    def _prefill_group(self, group: list[tuple[Slot, int]]) -> list[tuple[Slot, tuple[mx.array, mx.array]]]:
        width = max(n for _, n in group)
        starts = [s.length for s, _ in group]
        if not self._backend.bucketed_prefill or self.kv_window is not None:
            keys_len = self._keys_len(max(a + width for a in starts)) if len(group) == 1 \
                else round_up(max(a + width for a in starts), self._block)
        else:  # a GPU: shapes from a few buckets (see prefill_shape)
            width, keys_len = prefill_shape(width, max(starts), self._block)
        self._grow(self._table.span, max(max(starts) + width, keys_len) + 1)
        inputs = mx.array([s.rest[s.fed:s.fed + n] + [0] * (width - n) for s, n in group], dtype=mx.int32)
        batch = Batch(self._kv, starts, width, [s.row for s, _ in group], keys_len, [n for _, n in group])
        self._shapes_seen.add((len(group), width, keys_len, self._kv.capacity))
        self._counts["prefill_tokens"] += sum(n for _, n in group)
        self._counts["forwards"] += 1
        ending = [(i, s, n) for i, (s, n) in enumerate(group) if s.fed + n == len(s.rest)]
        logits = logits_at(self._model, inputs, batch.views(), [(i, n - 1) for i, _, n in ending])
        self._advance(group)
        return [(s, first_token(s, logits[j:j + 1])) for j, (_, s, _) in enumerate(ending)]

    def _time(self, built: Work | None, read: Work | None, call_s: float, ended: float) -> None:
        """Feed the stall budget a step's time (flat steps time themselves). A decode-only step runs
        between two read-backs, unless a flat step ran synchronously in between. Without flat steps
        on a CPU the forward runs while it is built (the fast paths evaluate as they go), so a
        call's time is the step it built; on a GPU the time between two read-backs is the step read."""
        if self._flat:
            if read is not None and not read.prefill_tokens and self._last_read is not None \
                    and not (built is not None and built.prefill_tokens):
                self._stall.record(ended - self._last_read, 0, read.decoding)
        elif self._backend.runs_while_built:
            if built is not None:
                self._stall.record(call_s, built.prefill_tokens, built.decoding)
        elif read is not None and self._last_read is not None:
            self._stall.record(ended - self._last_read, read.prefill_tokens, read.decoding)
        self._last_read = ended if read is not None else None

    # -- reading back -------------------------------------------------------------------------
    def _read(self, work: Work | None, after: Work | None = None) -> list[Generated]:
        """Read back `work`; `after`: the step already built on it (`_chains`), whose part for a row
        that did not accept all its proposals is dropped here."""
        if work is None:
            return []
        tokens = work.tokens.tolist()
        out: list[Generated] = []
        feed: list[tuple[int, int]] = []  # (row, token) a verifying row feeds next
        for slot, i in work.outputs:
            if self._slots.get(slot.request_id) is not slot or slot in work.void:  # finished, removed, dropped
                continue
            proposals = work.verified.get(slot)
            if proposals is None:
                out.append(self._read_one(slot, tokens[i], work.logprobs[i]))
                continue
            sampled = tokens[i:i + len(proposals) + 1]
            taken = accepted(proposals, sampled)
            self._settle(slot, proposals, taken, work.undo.get(slot))
            if taken < len(proposals):
                self._void(after, slot)
            for j in range(taken + 1):  # a run ends where the request does: later tokens are dropped
                g = self._read_one(slot, sampled[j], work.logprobs[i + j])
                out.append(g)
                if g.finish_reason is not None:
                    break
            else:
                if taken < len(proposals):  # else the device holds it already (`_verified`)
                    feed.append((slot.row, sampled[taken]))
        if feed:
            self._next_input[mx.array([r for r, _ in feed], dtype=mx.int32)] = mx.array([t for _, t in feed],
                                                                                         dtype=mx.int32)
        return out

    def _void(self, after: Work | None, slot: Slot) -> None:
        """Drop `slot`'s part of `after`, built on the guess that the step read before it accepted
        all of the row's proposals: its length and sampled count go back (its KV past the length is
        overwritten later), and its outputs are not read. Its sampler key went back with the
        rejected positions (`_settle`: the key from before them, which came before `after`'s)."""
        if after is None or slot not in after.widths or slot in after.void:
            return
        slot.length -= after.widths[slot]
        slot.sampled -= after.widths[slot]
        after.void.add(slot)
        self._counts["spec_void_rows"] += 1

    def _settle(self, slot: Slot, proposals: list[int], taken: int, undo: list[Any] | None) -> None:
        """A verified row's outcome: the rejected positions' KV is dropped (the row's length rolls
        back; later tokens overwrite it), and its processors, sampler key and context go back to
        where the accepted positions left them (`undo`: the step's states before each position)."""
        rejected = len(proposals) - taken
        spec = slot.spec
        if rejected:
            slot.length -= rejected
            slot.sampled -= rejected
            if slot.decoding.logits_processors and slot.context is not None:
                slot.context = slot.context[:slot.context.shape[0] - rejected]
            states, key = undo[taken + 1]
            for process, state in zip(slot.decoding.logits_processors, states or ()):
                if state is not None:
                    process.restore(state)
            if key is not None:
                slot.decoding.sampler.key = key
        if proposals:
            spec.proposed += len(proposals)
            spec.accepted += taken
            spec.adaptive.record(len(proposals), taken)
            self._counts["spec_proposed_tokens"] += len(proposals)
            self._counts["spec_accepted_tokens"] += taken

    def _read_one(self, slot: Slot, token: int, logprobs: mx.array) -> Generated:
        slot.generated += 1
        slot.known.append(token)
        reason = "length" if slot.generated >= slot.max_tokens else None
        if slot.matcher.advance(token):
            reason = "stop"
        if reason is None:
            return Generated(slot.request_id, token, logprobs, None, None, None)
        kept = self.remove(slot.request_id, return_cache=True)
        if kept is None:  # the store holds all of it
            return Generated(slot.request_id, token, logprobs, reason, None, None)
        return Generated(slot.request_id, token, logprobs, reason, kept.cache, kept.tokens, kept.start)

    def _grow(self, rows: int, positions: int) -> None:
        old = self._kv.rows
        self._kv.ensure(rows, positions)
        if self._kv.rows > old:
            self._next_input = mx.concatenate([self._next_input, mx.zeros((self._kv.rows - old,), mx.int32)])
