"""The engine step, one direction: schedule -> start what the plan admits -> run the batch once ->
update the sequences from the runner's output, returning the step's events to the loop.

Runs only on the MLX thread (see `engine.loop`). Nothing here blocks on I/O: the prefix store takes
copies and writes to disk behind the request path.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from cache_tiers.store import Match, NullStore, PrefixStore
from engine import mlx_settings
from engine.config import EngineConfig
from engine.memory import MemoryAccount, kv_bytes_per_token
from engine.restore_choice import RestoreChoice
from engine.runner import Extracted, Generated, PromptProgress, Runner
from engine.runner_choice import make_runner
from engine.sampling import make_decoding, top_logprobs
from engine.scheduler import LOADING, Admission, BatchView, Scheduler, SchedulerOutput, kv_footprint
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.text import TextStream, TokensOnly, text_in_engine
from engine.types import FinishReason, Request, RequestStatus, TokenEvent, TokenLogprob

log = logging.getLogger("pomona.engine")

EXPIRY_CHECK_S = 0.1  # request deadlines are checked this often, not every step


class _Load:
    """A waiting request's prefix being read from the SSD (`Engine._find`), or, with no `prefetch`,
    one the engine chose to compute again (engine/restore_choice.py); keyed by its prompt's
    identity, which its Request (frozen) keeps for the request's life."""

    def __init__(self, tokens: tuple[int, ...], prefetch: Any | None, read_tokens: int = 0,
                 started: float = 0.0) -> None:
        self.tokens = tokens
        self.prefetch = prefetch
        self.read_tokens = read_tokens  # what the read brings past RAM's part
        self.started = started
        self.taken = False  # the store has taken what was read (then `find` answers from RAM)


class Engine:
    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, store: PrefixStore | None = None,
                 clock: Callable[[], float] = time.monotonic, consumer_text: bool = False,
                 rates_path: Path | None = None) -> None:
        """With `consumer_text`, events of requests without stop strings carry token ids and no text:
        the consumer makes it (`engine.text.ConsumerText`, as `AsyncEngine.stream` does). `rates_path`:
        where the SSD read-or-compute rates are kept between runs (engine/restore_choice.py)."""
        config = config.for_backend(mx.default_device() == mx.cpu)  # "auto" settings made concrete
        self.config = config
        self._consumer_text = consumer_text
        self.tokenizer = tokenizer
        self.store: PrefixStore = store or NullStore()
        self.scheduler = Scheduler(config, on_cpu=mx.default_device() == mx.cpu)
        mlx_settings.apply(config)  # before the first forward: MLX reads these once
        self.runner: Runner = make_runner(model, config)
        self.runner.stored_prefix = self._stored_prefix
        self.stats = EngineStats()
        self.seqs: dict[str, Sequence] = {}  # waiting and admitted, until their final event
        self._prefilling: dict[str, Sequence] = {}  # admitted, prompt not yet fully processed
        self._next_expiry = 0.0
        self._eos = sorted(tokenizer.eos_token_ids)
        self._clock = clock
        self._min_store = max(1, config.cache.min_restore_tokens)
        self._direct_run = 0  # direct first-token admissions since the batch last ran
        self._loads: dict[int, _Load] = {}  # waiting requests whose prefix the SSD's reader is reading
        self.restores = RestoreChoice(enabled=config.cache.ssd_reads == "auto")  # read an SSD hit, or compute it
        self._rates_path = rates_path
        if rates_path is not None:
            self.restores.load(rates_path)
        # Called (from the store's reader thread) when a read ends: the engine's loop wakes to take it.
        self.wake: Callable[[], None] = lambda: None
        # A waiting prompt sharing this many leading tokens with one being prefilled waits for that
        # prefill to be cached rather than computing the same tokens alongside it.
        self._share_tokens = None if isinstance(self.store, NullStore) else max(64, self._min_store)
        self.memory: MemoryAccount | None = None
        if config.memory_budget_bytes is not None:
            self.memory = MemoryAccount(config.memory_budget_bytes, kv_bytes_per_token(model), self.store)

    # -- requests in and out ------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request (raises `OverloadedError` when the waiting queue is full)."""
        if request.request_id in self.seqs:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.params.grammar is not None and request.constraint is None:
            # Compiling here would stall the batch; AsyncEngine.stream compiles before queueing.
            raise RuntimeError("a request with a grammar needs its constraint built first "
                               "(engine.constraints.build_constraint)")
        try:
            self.scheduler.add_request(request)
        except Exception:
            self.stats.requests_rejected += 1
            raise
        timeout = self.config.request_timeout_s
        self.seqs[request.request_id] = Sequence(
            request=request,
            text=self._text_stream(request.params.stop),
            deadline=None if timeout is None else request.arrival_time + timeout,
        )

    def _text_stream(self, stops: tuple[str, ...]) -> TextStream | TokensOnly:
        if self._consumer_text and not text_in_engine(stops):
            return TokensOnly()
        return TextStream(self.tokenizer.detokenizer, stops)

    def abort_request(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
                      error: str | None = None, code: str | None = None) -> list[TokenEvent]:
        seq = self.seqs.get(request_id)
        if seq is None:
            return []
        if seq.status is RequestStatus.WAITING:
            self.scheduler.finish_requests({request_id})
            self._loads.pop(id(seq.request.prompt_tokens), None)
        else:
            self._remove_running(seq, store=True)
        return [self._final(seq, reason, "", error=error, code=code)]

    def has_work(self) -> bool:
        return bool(self.seqs)

    def waiting_on_loads(self) -> bool:
        """Every request here waits for its prefix to be read from the SSD: a step would do
        nothing, so the loop may sleep until `wake` (a read finished) or a command."""
        pending = sum(1 for load in self._loads.values() if load.prefetch is not None and not load.prefetch.done())
        return bool(self.seqs) and pending >= len(self.seqs)

    def idle(self) -> None:
        """Nothing to run: finish every offer's hand-over to the SSD now (no step waits for it)."""
        self.store.tick(drain=True)

    def view(self) -> BatchView:
        prefilling = [s for s in self._prefilling.values() if s.status is RequestStatus.PREFILLING]
        lefts = [s.prefill_left for s in prefilling]
        kv_free = None if self.memory is None else self.memory.free_tokens(self._reserved_tokens())
        return BatchView(
            running=len(self.runner),
            prefilling=len(prefilling),
            prefill_tokens_left=sum(lefts),
            prefill_min_left=min(lefts, default=0),
            prefill_max_left=max(lefts, default=0),
            kv_tokens_free=kv_free,
            prefilling_prompts=tuple(s.request.prompt_tokens for s in prefilling),
            share_tokens=self._share_tokens,
            first_token_pending=sum(1 for s in self.seqs.values() if s.status is not RequestStatus.WAITING
                                    and s.first_token_at is None and s.prefill_left <= 1),
            kv_window=self.runner.kv_window,
        )

    def _reserved_tokens(self) -> int:
        window = self.runner.kv_window
        return sum(kv_footprint(s.prompt_len + s.request.params.max_tokens, window) for s in self.seqs.values()
                   if s.status is not RequestStatus.WAITING)

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Schedule, run the batch once (unless the plan says it waits), update from its output."""
        started = time.perf_counter()  # a direct first-token prefill stalls the batch too: count it
        plan = self.schedule()
        decoding = len(self.runner) > len(self._prefilling)
        events = list(plan.expired) + self._start(plan)
        if plan.batch_waits:
            return events
        try:
            prompts, generated = self.run()
        except Exception as exc:  # contain the fault: fail this batch, keep serving
            return events + self._recover(exc)
        self.stats.record_step(time.perf_counter() - started, len(generated), decoding)
        return events + self.update_from_output(prompts, generated)

    def schedule(self) -> SchedulerOutput:
        """The step's plan: the scheduler's admissions, with the requests that ran out of time
        (aborted first) and whether the batch waits this step.

        After a direct first-token admission the batch waits (up to `prefill_batch` such admissions
        in a row): those first tokens go out at once, and prefix hits that arrived during that
        prefill (they tend to come in groups: clients whose requests ended in the same step) are
        admitted in the next step, before the batch runs, so all of them join one decode step.
        """
        # Per-step Python runs between forward passes; on a GPU it adds to every step, so work
        # that scales with the batch is skipped when it cannot matter (nobody waits, no deadline due).
        expired = self._expire() if self._clock() >= self._next_expiry else []
        self.store.tick()  # hands the SSD what earlier steps offered: computed by now, nothing waits
        plan = self.scheduler.schedule(self.view(), self._find) if len(self.scheduler) else SchedulerOutput()
        direct = sum(1 for a in plan.admit if a.direct)
        if not expired and not direct:
            return plan  # the common step: no copy of the plan
        # This plan's direct admissions count as planned: one whose cached prefix reads short when
        # it starts (`_admit`) joins the batched prefill but still counts towards the run's limit.
        return replace(plan, expired=tuple(expired),
                       batch_waits=direct > 0 and self._direct_run + direct < self.config.prefill_batch)

    def run(self) -> tuple[list[PromptProgress], list[Generated]]:
        """The batch's step; the direct first-token run it ends starts again."""
        self._direct_run = 0
        return self.runner.step()

    def _start(self, plan: SchedulerOutput) -> list[TokenEvent]:
        """Start what the plan admits (the runner's inserts; a direct admission's prefill runs here)."""
        events: list[TokenEvent] = []
        for admission in plan.admit:
            events += self._admit(admission)
        if plan.admit and self.memory is not None:
            self.memory.rebalance(self._reserved_tokens())
        return events

    def update_from_output(self, prompts: list[PromptProgress], generated: list[Generated]) -> list[TokenEvent]:
        """Prefill progress (prompt offers, checkpoints), then one event per generated token."""
        self._on_prompts(prompts)
        return self._on_generated(generated)

    def _find(self, tokens: tuple[int, ...], salt: str) -> Match | None:
        """`store.find`, except that a prefix the SSD must supply is read off the MLX thread first.

        Why: a restore used to read and parse the SSD's rows here, on the MLX thread, while every
        running request waited (hundreds of MB for a long agent prompt of a large model). Now the
        request answers LOADING (the scheduler admits others meanwhile) while the store's reader
        thread reads; the step that sees the read done has the store take it into RAM (wrapping
        arrays: no disk, no parsing) and the request is admitted from there, its hit still
        reported as the SSD's. Unless reading was measured to be slower than computing the same
        tokens (engine/restore_choice.py): then the request takes what RAM holds, decided once."""
        load = self._loads.get(id(tokens))
        if load is not None and load.tokens is tokens:
            if load.prefetch is None:
                return self.store.find(tokens, salt, read_ssd=False)
            if not load.taken:
                if not load.prefetch.done():
                    return LOADING
                # Others running: the hand-over is spread over steps (`cache.ssd_handover_ms` each).
                handover = self.config.cache.ssd_handover_ms
                budget = handover / 1e3 if handover is not None and self._others_run() else None
                if not self.store.complete(load.prefetch, budget):
                    return LOADING
                load.taken = True
                self.restores.record_read(load.read_tokens, self._clock() - load.started)
            return self.store.find(tokens, salt)
        match = self.store.find(tokens, salt)
        if match is None or match.tier != "ssd" or match.too_short:
            return match
        if not self.restores.should_read():
            self._loads[id(tokens)] = _Load(tokens, None)
            return self.store.find(tokens, salt, read_ssd=False)
        prefetch = self.store.prefetch(match, tokens)
        if prefetch is None:
            return match
        self._loads[id(tokens)] = _Load(tokens, prefetch, match.num_tokens - match.ram_tokens, self._clock())
        prefetch.on_done(lambda: self.wake())
        return LOADING

    def _others_run(self) -> bool:
        """Whether any request is admitted (prefilling or decoding): it waits for every step here.
        (The loading request itself is still waiting.)"""
        return any(s.status in (RequestStatus.PREFILLING, RequestStatus.DECODING) for s in self.seqs.values())

    def _admit(self, admission: Admission) -> list[TokenEvent]:
        seq = self.seqs[admission.request.request_id]
        tokens = seq.request.prompt_tokens
        self._loads.pop(id(tokens), None)
        hit = self.store.restore(tokens, admission.match, seq.request.cache_salt)
        seq.admitted_at = self._clock()  # before the insert: a direct admission prefills inside it
        cached = hit.num_tokens if hit is not None else 0
        params = seq.request.params
        decoding = make_decoding(params, len(tokens), self._eos, seq.request.constraint)
        # The SSD entry the plan counted on may read shorter (or not at all): then the batch path.
        direct = admission.direct and hit is not None and admission.match is not None \
            and cached >= admission.match.num_tokens
        first: Generated | None = None
        try:
            if direct:
                first = self.runner.insert_after_first_token(
                    seq.request_id, tokens[cached:], tokens[:cached], hit.cache, decoding, params.max_tokens,
                    on_checkpoint=lambda n, cache: self._offer(seq, Extracted(cache, list(tokens[:n])), "checkpoint"))
            else:
                self.runner.insert(seq.request_id, tokens[cached:], tokens[:cached], hit.cache if hit else None,
                                   decoding, params.max_tokens)
        except Exception as exc:
            log.exception("could not start request %s", seq.request_id)
            self.runner.remove(seq.request_id)
            return [self._final(seq, FinishReason.ERROR, "", error=f"could not start the request: {exc}",
                                code="internal_error")]
        seq.cached_tokens, seq.cache_tier = cached, (hit.tier if hit else None)
        self.stats.prompt_tokens_total += len(tokens)
        self.stats.cached_tokens_total += cached
        if first is None:
            seq.advance(RequestStatus.PREFILLING)
            self._prefilling[seq.request_id] = seq
            return []
        # No "prompt" offer: this prompt is a cached prefix plus a short rest, and the request's
        # finished offer (prompt + output) covers it; a copy now would only delay the first token.
        seq.prefill_done = len(tokens) - cached
        self.stats.direct_first_tokens += 1
        self._direct_run += 1
        return self._on_generated([first])

    def _on_prompts(self, prompts: list[PromptProgress]) -> None:
        for p in prompts:
            seq = self.seqs.get(p.request_id)
            if seq is None:
                continue
            seq.prefill_done = p.done
            if p.end_of_prompt:  # in the decode batch now: its prefill slot is free for the next prompt
                seq.advance(RequestStatus.DECODING)
                self._prefilling.pop(seq.request_id, None)
            if p.end_of_prompt and seq.prompt_len >= self._min_store:
                self._offer(seq, self.runner.extract(seq.request_id), "prompt")
            elif not p.end_of_prompt and self._checkpoint_due(seq):
                # A long prefill leaves a resumable trail: an abort, a fault or a second request
                # with the same start continues from here instead of from zero.
                seq.checkpointed = seq.prefill_done
                self._offer(seq, self.runner.extract(seq.request_id), "checkpoint")

    def _checkpoint_due(self, seq: Sequence) -> bool:
        # engine/checkpoints.py: every N tokens, or at absolute block boundaries for hybrid models
        return self.runner.checkpoints.due(seq.cached_tokens + seq.prefill_done,
                                           seq.cached_tokens + seq.checkpointed, seq.prompt_len)

    def _on_generated(self, generated: list[Generated]) -> list[TokenEvent]:
        events = []
        now = self._clock()
        for g in generated:
            seq = self.seqs.get(g.request_id)
            if seq is None:
                continue
            if seq.first_token_at is None:
                seq.first_token_at = now
                seq.advance(RequestStatus.DECODING)
                arrived = seq.request.arrival_time
                self.stats.record_first_token(now - arrived, (seq.admitted_at or now) - arrived)
                self.restores.record_prefill(seq.prompt_len - seq.cached_tokens, now - (seq.admitted_at or now))
            seq.output_tokens += 1
            seq.last_token_at = now
            events.append(self._token_event(seq, g))
        return events

    def _token_event(self, seq: Sequence, g: Generated) -> TokenEvent:
        logprob = self._logprob(seq, g)
        if g.finish_reason == "stop":  # EOS or a stop token id: its text is not part of the output
            delta = seq.text.finish()
            self._offer(seq, Extracted(g.cache, g.tokens, g.start) if g.cache else None, "finished")
            return self._final(seq, FinishReason.STOP, delta.text, token=g.token, logprob=logprob)
        delta = seq.text.add(g.token)
        if delta.stopped:
            self._remove_running(seq, store=True)
            return self._final(seq, FinishReason.STOP, delta.text, token=g.token, logprob=logprob,
                               stop=delta.stop)
        if g.finish_reason == "length":
            tail = seq.text.finish()
            self._offer(seq, Extracted(g.cache, g.tokens, g.start) if g.cache else None, "finished")
            reason = FinishReason.STOP if tail.stopped else FinishReason.LENGTH
            return self._final(seq, reason, delta.text + tail.text, token=g.token, logprob=logprob,
                               stop=tail.stop)
        return TokenEvent(seq.request_id, g.token, delta.text, logprob)

    def _logprob(self, seq: Sequence, g: Generated) -> TokenLogprob | None:
        n = seq.request.params.logprobs
        if n is None:
            return None
        chosen, top = top_logprobs(g.logprobs, g.token, n)
        return TokenLogprob(g.token, chosen, top)

    # -- endings ------------------------------------------------------------------------------
    def _final(self, seq: Sequence, reason: FinishReason, text: str, token: int | None = None,
               logprob: TokenLogprob | None = None, error: str | None = None,
               code: str | None = None, stop: str | None = None) -> TokenEvent:
        seq.finish(reason)
        self.seqs.pop(seq.request_id, None)
        self._prefilling.pop(seq.request_id, None)
        if self.memory is not None:
            self.memory.rebalance(self._reserved_tokens())  # finished requests give memory back
        self.stats.requests_finished[reason.value] += 1
        return TokenEvent(seq.request_id, token, text, logprob, reason, seq.usage(), error, code, stop)

    def _remove_running(self, seq: Sequence, store: bool) -> None:
        keep = store and seq.status is RequestStatus.DECODING
        removed = self.runner.remove(seq.request_id, return_cache=keep)
        if keep:
            self._offer(seq, removed, "finished")

    def _offer(self, seq: Sequence, extracted: Extracted | None, kind: str) -> None:
        if extracted is None or isinstance(self.store, NullStore):
            return
        cache, tokens, start = extracted
        if len(tokens) < self._min_store:
            return
        try:
            self.store.offer(list(tokens), cache, kind, seq.request.cache_salt, start)  # type: ignore[arg-type]
        except Exception:  # the cache is an optimisation: never fail a request over it
            log.exception("prefix store refused an offer for %s", seq.request_id)

    def _stored_prefix(self, request_id: str, tokens: list[int]) -> int:
        """The runner's `stored_prefix`: leading tokens of a request's cache the store holds now
        (the offer that follows on this thread copies only past them)."""
        seq = self.seqs.get(request_id)
        if seq is None or isinstance(self.store, NullStore) or len(tokens) < self._min_store:
            return 0
        return self.store.held(tokens, seq.request.cache_salt)

    def _expire(self) -> list[TokenEvent]:
        now = self._clock()
        self._next_expiry = now + EXPIRY_CHECK_S
        late = [s for s in self.seqs.values() if s.deadline is not None and now > s.deadline]
        events = []
        for seq in late:
            limit = self.config.request_timeout_s
            events += self.abort_request(
                seq.request_id, FinishReason.ERROR,
                error=f"The request exceeded the server's {limit:.0f} s time limit; "
                      "ask for fewer tokens or retry when the server is less busy.", code="timeout")
        return events

    def _recover(self, exc: Exception) -> list[TokenEvent]:
        """A step failed: fail the requests in the batch, rebuild the batch, keep the queue."""
        failed = self.runner.reset()
        # The ids are the ones the ingress puts in its 5xx answers: a user's report finds this line.
        log.exception("engine step failed; failing the running batch (requests %s) and rebuilding it",
                      ", ".join(failed) or "none")
        self.stats.faults += 1
        # An exception inside an mx.compile'd function (mlx-lm's samplers are compiled with the
        # global random state as an input) can leave a tracer in that state, which breaks every
        # later compiled sample; reseeding restores a real one.
        mx.random.seed(time.time_ns() % 2**32)
        events = []
        for request_id in failed:
            seq = self.seqs.get(request_id)
            if seq is not None:
                events.append(self._final(seq, FinishReason.ERROR, "", error=(
                    f"The server hit an internal error while generating ({type(exc).__name__}: {exc}). "
                    "The request was stopped; retrying it is safe."), code="internal_error"))
        return events

    def deep_reset(self) -> list[TokenEvent]:
        """Fail what is running, drop every cached prefix and release MLX's buffer cache."""
        events = []
        for request_id in self.runner.reset():
            seq = self.seqs.get(request_id)
            if seq is not None:
                events.append(self._final(seq, FinishReason.ERROR, "", error=(
                    "The server's cache was reset by an administrator; retry the request."), code="reset"))
        self.store.clear("all")
        mx.clear_cache()
        return events

    def running_status(self) -> list[dict]:
        now = self._clock()
        return [{**s.describe(now), **self._loading_phase(s), **self.runner.speculation(s.request_id)}
                for s in self.seqs.values()]

    def _loading_phase(self, seq: Sequence) -> dict[str, str]:
        """A waiting request whose cached prefix the SSD's reader is reading says so."""
        load = self._loads.get(id(seq.request.prompt_tokens))
        loading = load is not None and load.tokens is seq.request.prompt_tokens and load.prefetch is not None \
            and not load.taken
        return {"phase": "loading"} if loading and seq.status is RequestStatus.WAITING else {}

    def status(self) -> dict[str, Any]:
        """Counters and gauges for the loop to publish (read on the MLX thread, between steps)."""
        view = self.view()
        return {**self.stats.as_dict(), "waiting": len(self.scheduler), "running": view.running,
                "prefilling": view.prefilling, "kv_bytes": self.runner.cache_nbytes(), "runner": self.runner.counters(),
                "cache": self.store.stats(), "ssd_reads": self.restores.as_dict()}

    def close(self) -> None:
        self.runner.close()
        self.store.close()
        if self._rates_path is not None:
            self.restores.save(self._rates_path)
