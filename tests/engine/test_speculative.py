"""Speculative decoding in the own step (engine/step/speculative.py, engine/step/step_runner.py): the same
greedy tokens, log-probabilities and endings as without it, whatever the proposals; the sampled
acceptance rule keeps the target distribution; the policy pieces on their own."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.config import EngineConfig
from engine.batch_generator import BatchGeneratorRunner as Runner  # mlx-lm's: the reference
from engine.sampling import make_decoding
from engine.step import speculative
from engine.step.speculative import (Adaptive, PendingLookup, PromptLookup, SpecConfig, SpecGate, accepted, new_state,
                                     parse_speculative)
from engine.step.step_runner import StepRunner
from engine.types import SamplingParams
from modelio.cpu_llama import accelerate
from test_step_runner import Job, assert_same, drive

SPEC = SpecConfig(max_tokens=6)


@pytest.fixture(scope="module", params=["mlx_lm", "cpu_fast"])
def model(request, tiny_model_dir):
    """mlx-lm's llama (verification in a padded forward of every decoding row) and the CPU
    fast-path blocks (each verifying row a part of the flat forward)."""
    loaded = mlx_lm.load(str(tiny_model_dir))[0]
    if request.param == "cpu_fast":
        assert accelerate(loaded) > 0
    return loaded


def spec_runner(spec=SPEC, seen: dict | None = None, on_cpu: bool | None = None):
    seen = {} if seen is None else seen

    def make(model, config):
        runner = StepRunner(model, EngineConfig(**{**config.__dict__, "speculative": spec}), on_cpu=on_cpu)
        seen["runner"] = runner
        return runner
    return make


def plain(model, config):
    return StepRunner(model, EngineConfig(**{**config.__dict__, "speculative": "off"}))


_echoes: dict = {}


def echo_jobs(model, seed: int, n: int = 6, spread: int = 20) -> list[Job]:
    """Prompts that hold their own greedy continuation: a random start, what the model says after
    it, and the start again, so prompt lookup proposes long runs that are mostly accepted (and
    rejected where the context makes the model say something else)."""
    rng = random.Random(seed)
    vocab = model.args.vocab_size
    starts = [[rng.randrange(1, vocab) for _ in range(rng.randrange(3, 40))] for _ in range(n)]
    key = (id(model), seed, n)
    if key not in _echoes:
        _echoes[key] = drive(model, plain, [Job(s, 30) for s in starts])
    said = _echoes[key]
    return [Job(s + j.tokens + s, rng.randrange(5, 60), rng.randrange(0, spread)) for s, j in zip(starts, said)]


def counts(runner) -> tuple[int, int]:
    c = runner.counters()
    return c["spec_proposed_tokens"], c["spec_accepted_tokens"]


def test_echo_prompts_match_without_speculation_and_accept_most(model):
    jobs = echo_jobs(model, seed=0)
    seen: dict = {}
    ours = drive(model, spec_runner(SPEC, seen), jobs)
    assert_same(ours, drive(model, Runner, jobs))
    proposed, taken = counts(seen["runner"])
    assert proposed > 0 and taken > proposed * 0.3, (proposed, taken)


def test_long_prompts_are_indexed_off_the_step_and_still_match(model, monkeypatch):
    """A prompt from BACKGROUND_INDEX_TOKENS up gets its lookup index from a worker thread
    (`PendingLookup`): the row proposes once it is there, and greedy output is the same."""
    monkeypatch.setattr(speculative, "BACKGROUND_INDEX_TOKENS", 8)
    built: list[int] = []
    index = speculative._index
    monkeypatch.setattr(speculative, "_index", lambda lo, hi, tokens: built.append(len(tokens)) or index(lo, hi, tokens))
    jobs = echo_jobs(model, seed=1)
    seen: dict = {}
    ours = drive(model, spec_runner(SPEC, seen), jobs)
    assert_same(ours, drive(model, Runner, jobs))
    assert sorted(built) == sorted(len(j.prompt) for j in jobs if len(j.prompt) >= 8)
    proposed, taken = counts(seen["runner"])
    assert proposed > 0 and taken > 0, (proposed, taken)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), spread=st.integers(1, 30), rows=st.sampled_from([2, 3, 8]),
       k=st.sampled_from([1, 3, 8]))
@pytest.mark.parametrize("on_cpu", [True, False], ids=["cpu-step", "gpu-step"])
def test_random_schedules_with_aborts_stops_and_prefixes_match(model, on_cpu, seed, spread, rows, k):
    """Echo prompts and random ones arriving at random steps; one aborted, one stopping on a token
    it generates (inside an accepted run, mostly), some starting from a cached prefix. Also the
    GPU's step (run here): every decoding row padded to the widest a row may feed, in one forward,
    so on the H200 a batched output that differs from its run alone can only be the backend's
    arithmetic for another shape, not the step's bookkeeping."""
    rng = random.Random(seed)
    jobs = echo_jobs(model, seed % 3, n=4, spread=spread)
    vocab = model.args.vocab_size
    jobs += [Job([rng.randrange(1, vocab) for _ in range(rng.randrange(2, 120))], rng.randrange(1, 40),
                 rng.randrange(0, spread)) for _ in range(2)]
    rng.shuffle(jobs)
    reference = drive(model, Runner, jobs, max_running=rows)
    jobs[0].abort = jobs[0].arrive + rng.randrange(1, 8)
    said = reference[1].tokens
    jobs[1].stop = (said[len(said) * 2 // 3],)
    jobs[2].prefix = rng.randrange(1, len(jobs[2].prompt))
    seen: dict = {}
    ours = drive(model, spec_runner(SpecConfig(max_tokens=k), seen, on_cpu=on_cpu), jobs, max_running=rows)
    assert_same(ours[1:], drive(model, Runner, jobs, max_running=rows)[1:])
    # The abort lands at a step; with several tokens a step the job may have ended before it.
    assert ours[0].tokens == reference[0].tokens[:len(ours[0].tokens)]
    assert ours[0].ending == "abort" or ours[0].ending == reference[0].ending and ours[0].tokens == reference[0].tokens
    assert ours[1].ending in ("stop", "length") and (ours[1].ending == "length" or ours[1].tokens[-1] in jobs[1].stop)
    assert counts(seen["runner"])[0] > 0


@pytest.mark.parametrize("k", [2, 8])
def test_the_gpus_step_verifies_in_one_padded_forward_and_matches(model, k):
    """The GPU's step run on the CPU: power-of-two rows, 256-position key buckets, and every
    decoding row in one forward as wide as the most proposals a row may make."""
    jobs = echo_jobs(model, seed=6, n=5, spread=10)
    seen: dict = {}
    ours = drive(model, spec_runner(SpecConfig(max_tokens=k), seen, on_cpu=False), jobs, max_running=8)
    assert_same(ours, drive(model, Runner, jobs, max_running=8))
    proposed, taken = counts(seen["runner"])
    assert proposed > taken > 0


@pytest.mark.parametrize("k", [3, 8])
def test_the_gpus_verifying_steps_chain_on_the_step_in_flight_and_match(model, k):
    """A GPU's verifying step is built before the step in flight is read back (`_chains`): each row
    feeds its last token from the device and proposes what follows the proposals in flight, taken
    as accepted; a row that did not accept them all has its part of the chained step dropped.
    Greedy output is mlx-lm's, and both happen: chained steps, and dropped parts."""
    jobs = echo_jobs(model, seed=6, n=5, spread=10)
    for rows in (1, 8):
        seen: dict = {}
        ours = drive(model, gated_runner(SpecConfig(max_tokens=k, chain=True), seen, FixedGate(1.0)), jobs[:rows],
                     max_running=rows)
        assert_same(ours, drive(model, Runner, jobs[:rows], max_running=rows))
        c = seen["runner"].counters()
        assert c["spec_chained_steps"] > 0 and c["spec_void_rows"] > 0, c
        assert c["spec_accepted_tokens"] > 0


def test_chained_steps_keep_a_seeded_rows_draws(model):
    """Sampled with a seed, a row draws the same tokens with speculation (chained, dropped parts
    and all) as without it: a dropped part's draws are taken back with the rejected positions'."""
    jobs = echo_jobs(model, seed=4, n=4, spread=6)
    sampling = dict(temperature=0.3, top_k=20)
    seen: dict = {}
    off = drive(model, lambda m, config: StepRunner(m, replace(config, speculative="off"), on_cpu=False), jobs,
                max_running=4, sampling=sampling)
    ours = drive(model, gated_runner(SpecConfig(max_tokens=6, chain=True), seen, FixedGate(1.0)), jobs, max_running=4,
                 sampling=sampling)
    assert_same(ours, off)
    c = seen["runner"].counters()
    assert c["spec_chained_steps"] > 0 and c["spec_void_rows"] > 0, c


def test_chain_false_reads_the_step_in_flight_before_verifying(model):
    jobs = echo_jobs(model, seed=6, n=3, spread=4)
    seen: dict = {}
    ours = drive(model, gated_runner(SpecConfig(max_tokens=6, chain=False), seen, FixedGate(1.0)), jobs)
    assert_same(ours, drive(model, Runner, jobs))
    c = seen["runner"].counters()
    assert c["spec_steps"] > 0 and c["spec_chained_steps"] == 0 and c["spec_void_rows"] == 0


class FixedGate(SpecGate):
    """A gate whose verifying step always costs `cost` plain ones (nothing measured changes it)."""

    def __init__(self, cost: float) -> None:
        super().__init__(explore_every=10**9)
        self.cost = cost

    def record(self, verifying: bool, rows: int, seconds: float) -> None:
        pass

    def period(self, verifying: bool, rows: int) -> float | None:
        return self.cost if verifying else 1.0


def gated_runner(spec, seen: dict, gate: SpecGate | None):
    """The GPU's step (run on the CPU) with `gate` in place of the one it measures (None: its own)."""
    make = spec_runner(spec, seen, on_cpu=False)

    def made(model, config):
        runner = make(model, config)
        if gate is not None:
            runner._gate = gate  # noqa: SLF001 - our own class: a gate that measures nothing
        return runner
    return made


@pytest.mark.parametrize("cost", [1.0, 100.0])
def test_a_gpu_verifies_at_any_rows_only_where_the_gate_says_it_pays(model, cost):
    """H200: one decoding row gained on every workload, several rows lost where few proposals were
    accepted; so `auto` on a GPU has no row limit but a gate. A verifying step as cheap as a plain
    one is taken whenever a row expects something at 8 rows; one costing 100 plain steps never is
    (no row can add 99 tokens a row). Either way greedy output is the reference's."""
    jobs = echo_jobs(model, seed=7, n=6, spread=4)
    seen: dict = {}
    ours = drive(model, gated_runner("auto", seen, FixedGate(cost)), jobs, max_running=8)
    assert_same(ours, drive(model, Runner, jobs, max_running=8))
    runner = seen["runner"]
    assert not runner._crowded(32)  # noqa: SLF001 - no row limit on a GPU
    proposed, taken = counts(runner)
    if cost == 1.0:
        assert proposed > taken > 0 and runner.counters()["spec_declined_steps"] == 0
    else:
        assert proposed == 0 and runner.counters()["spec_declined_steps"] > 0


def test_a_gpus_flat_step_verifies_beside_prompt_chunks_in_one_forward_and_matches(tiny_model_dir):
    """`flat_step: true` on a GPU: a step that verifies proposals while prompts feed chunks is one
    forward too (the verifying rows one part at the fixed width, the plain rows one, each chunk
    one): every step one forward, output mlx-lm's."""
    from modelio.flat_llama import flatten

    model = mlx_lm.load(str(tiny_model_dir))[0]
    assert flatten(model) > 0
    jobs = echo_jobs(model, seed=11, n=8, spread=30)
    seen: dict = {}
    calls = [0]
    make = gated_runner("auto", seen, FixedGate(1.0))

    def counted(m, config):
        runner = make(m, replace(config, flat_step=True))
        step = runner.step
        runner.step = lambda: (calls.__setitem__(0, calls[0] + 1), step())[1]  # our own class: count calls
        return runner
    ours = drive(model, counted, jobs, max_running=8, max_batch_tokens=64)
    assert_same(ours, drive(model, Runner, jobs, max_running=8))
    runner = seen["runner"]
    proposed, taken = counts(runner)
    assert proposed > taken > 0
    assert runner.counters()["forwards"] <= calls[0]


class OnceGate(FixedGate):
    """Says yes once (the first time a row expects something), then no."""

    def pays(self, rows: int, expected: float) -> bool:
        if expected <= 0 or getattr(self, "said", False):
            return False
        self.said = True
        return True


def test_after_a_verifying_step_the_gate_decides_the_next_one_too(model):
    """A step after a verifying one must read first (its rows' lengths), but whether it verifies
    again is still the gate's: a gate that said yes once gets one verifying step."""
    jobs = echo_jobs(model, seed=9, n=3, spread=1)
    seen: dict = {}
    ours = drive(model, gated_runner("auto", seen, OnceGate(1.0)), jobs, max_running=8)
    assert_same(ours, drive(model, Runner, jobs, max_running=8))
    assert seen["runner"].counters()["spec_steps"] == 1


def test_the_gpus_step_times_both_kinds_of_step_for_its_gate(model):
    jobs = echo_jobs(model, seed=8, n=4, spread=2)
    seen: dict = {}
    drive(model, gated_runner("auto", seen, None), jobs, max_running=8)
    gate = seen["runner"]._gate  # noqa: SLF001 - our own class
    for verifying in (False, True):
        assert any(gate.period(verifying, rows) for rows in (1, 2, 4, 8)), verifying
    spec_runner("auto", seen, on_cpu=True)(model, EngineConfig())
    assert seen["runner"]._gate is None  # noqa: SLF001 - a CPU's step overlaps little: its row limit instead


def test_the_gate_verifies_while_the_expected_tokens_pay_for_the_slower_step():
    gate = SpecGate(explore_every=4, window=5, min_samples=2)
    gate.record(False, 8, 0.010)
    assert not gate.pays(8, 3.0)  # plain steps of 8 rows timed once: not yet measured, time more
    gate.record(False, 8, 0.010)
    assert gate.pays(8, 0.5)  # a verifying one not timed yet: try it
    gate.record(True, 8, 0.020)
    assert gate.pays(8, 0.5)  # once is not yet measured
    gate.record(True, 8, 0.020)  # twice a plain step
    assert not gate.pays(8, 4.0)  # 12 tokens in 20 ms < 8 in 10
    assert gate.pays(8, 8.0)  # 16 in 20 ms = 8 in 10
    assert not gate.pays(8, 0.0)  # nothing expected: never
    assert [gate.pays(7, 1.0) for _ in range(4)] == [False, False, False, True]  # 7 rows: bucket 8; explores
    assert not gate.pays(16, 100.0)  # another bucket: its own periods
    gate.record(True, 8, 0.010)
    assert gate.period(True, 5) == pytest.approx(0.020)  # the median of 20, 20, 10
    assert gate.declined_steps == 4
    assert gate.report() == {"plain/8": 10.0, "verify/8": 20.0}


def test_a_slow_first_verifying_step_does_not_hold_the_gate_shut():
    """A GPU builds kernels for a shape the first time it meets it: the first verifying steps can
    take many times a steady one. The gate's period is a median, so one such step is forgotten
    after two steady ones, where a moving average would decline for hundreds of steps."""
    gate = SpecGate(explore_every=64)
    for _ in range(3):
        gate.record(False, 1, 0.010)
    gate.record(True, 1, 0.400)  # the first: kernels built for the shape
    gate.record(True, 1, 0.016)
    gate.record(True, 1, 0.016)
    assert gate.period(True, 1) == pytest.approx(0.016)
    assert gate.pays(1, 1.0)  # 2 tokens in 16 ms > 1 in 10
    assert gate.declined_steps == 0


def test_expected_tokens_follow_the_budget_without_counting_a_step():
    a = Adaptive(8)
    for _ in range(6):
        a.record(4, 2)  # q = 2/3
    q = a.q
    assert a.expected(0.4) == pytest.approx(q + q * q)  # k = 2 at that floor
    assert a.expected(0.4) == pytest.approx(q + q * q)  # nothing counted
    assert a.budget(0.4) == 2
    for _ in range(6):
        a.record_lookup(False)  # its context stopped matching: it expects little
    assert a.expected(0.4) < 0.2 * (q + q * q)
    low = Adaptive(8)
    for _ in range(6):
        low.record(1, 0)
    low.budget(0.1)
    assert low.waiting and low.expected(0.1) == 0.0


def test_a_finished_requests_cache_holds_no_rejected_position(model):
    """The cache handed back at the end covers exactly its tokens, with the keys a fresh prefill of
    them gives (a rejected proposal's keys would differ where it was written)."""
    from mlx_lm.models.cache import make_prompt_cache

    jobs = echo_jobs(model, seed=4, n=3)
    seen: dict = {}
    runner = spec_runner(SPEC, seen)(model, EngineConfig(model="tiny", max_running=4, prefill_batch=4))
    finals = {}
    for i, j in enumerate(jobs):
        params = SamplingParams(max_tokens=j.max_tokens, temperature=0.0, ignore_eos=True)
        runner.insert(str(i), j.prompt, [], None, make_decoding(params, len(j.prompt), []), j.max_tokens)
    while len(runner):
        for g in runner.step()[1]:
            if g.finish_reason:
                finals[g.request_id] = g
    proposed, taken = counts(runner)
    assert proposed > taken > 0  # some rejected, some accepted
    for g in finals.values():
        fresh = make_prompt_cache(model)
        model(mx.array([g.tokens]), cache=fresh)
        for ours, ref in zip(g.cache, fresh):
            assert ours.offset == ref.offset == len(g.tokens)
            assert mx.abs(ours.state[0] - ref.state[0][..., :ours.offset, :]).max().item() < 1e-4


def test_rings_do_not_speculate_and_still_match(model):
    """A ring table (max_kv_size) turns speculation off: a rejected position's write would land on
    a ring slot that later tokens still attend to."""
    from test_step_runner import RotatingRunner

    config = EngineConfig(model="tiny", max_kv_size=32, speculative=SPEC)
    assert StepRunner(model, config).speculative is None
    assert StepRunner(model, EngineConfig(model="tiny", speculative=SPEC)).speculative == SPEC
    jobs = echo_jobs(model, seed=5, n=3)
    seen: dict = {}
    assert_same(drive(model, spec_runner(SPEC, seen), jobs, max_kv_size=32),
                drive(model, RotatingRunner, jobs, max_kv_size=32))
    assert counts(seen["runner"]) == (0, 0)


# -- the acceptance rule keeps the target distribution -------------------------------------------

def chi_squared(observed: list[int], expected: list[float]) -> float:
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)


def test_sampled_acceptance_reproduces_the_target_distribution():
    """A fixed target p over 6 tokens, a proposal x = 2 (p(x) = 0.3), temperature 0.7 and top_k 5
    applied by the request's own sampler: the emitted first token is distributed as the target
    (accepted with probability p'(x), else drawn from the rest renormalised), and the token after
    an accepted proposal is distributed as its own position's target."""
    from engine.sampling import make_request_sampler
    from engine.step.records import Slot
    from engine.step.sampling import sample_positions
    from engine.step.speculative import new_state

    p0 = [0.05, 0.25, 0.30, 0.10, 0.20, 0.10]
    p1 = [0.40, 0.04, 0.06, 0.30, 0.09, 0.11]
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=8)
    decoding = make_decoding(params, 1, [])
    trials = 4000
    slot = Slot("r", 0, decoding, None, 8, [1], [1], 1, spec=new_state(SPEC))
    logits = mx.log(mx.array([p0, p1]))
    rows = [(slot, [1, 2], logits)] * trials  # last token 1, proposal 2
    tokens, _ = sample_positions(rows)
    drawn = tokens.tolist()
    firsts, seconds = [0] * 6, [0] * 6
    for t in range(trials):
        y0, y1 = drawn[2 * t], drawn[2 * t + 1]
        taken = accepted([2], [y0, y1])
        emitted = [y0, y1][:taken + 1]
        firsts[emitted[0]] += 1
        if taken:
            seconds[emitted[1]] += 1

    def target(p):  # what sampling without speculation draws from: top_k 5, temperature 0.7
        kept = sorted(p, reverse=True)[:5]
        w = [x ** (1 / 0.7) if x >= kept[-1] else 0.0 for x in p]
        return [x / sum(w) for x in w]

    q0, q1 = target(p0), target(p1)
    # 5 degrees of freedom (one cell is 0 under top_k): the 0.999 quantile is 20.5
    assert chi_squared(firsts, [q * trials for q in q0]) < 20.5, firsts
    assert firsts[0] == 0  # cut by top_k, never emitted
    assert abs(firsts[2] / trials - q0[2]) < 0.03  # the acceptance rate is p'(x)
    assert chi_squared(seconds, [q * firsts[2] for q in q1]) < 20.5, seconds


# -- the policy on its own ------------------------------------------------------------------------

def test_prompt_lookup_proposes_what_followed_the_longest_latest_match():
    lookup = PromptLookup(1, 3)
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 3, 6, 7]
    # suffix (6, 7): latest earlier occurrence at 6..7, followed by 8, 2, 3
    assert lookup.propose(tokens, 3) == [8, 2, 3]
    assert lookup.propose(tokens + [8], 2) == [2, 3]  # (6, 7, 8) latest at 6..8
    assert lookup.propose([1, 2, 3], 4) == []  # nothing seen before
    assert lookup.propose(tokens, 0) == []
    assert PromptLookup(1, 3).propose([4, 4], 5) == [4]  # only what is known


def _reference_proposal(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Prompt lookup by scanning: the longest suffix n-gram's latest earlier occurrence."""
    end = len(tokens)
    for n in range(min(ngram_max, end), ngram_min - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # occurrences that end before the last token
            if tokens[start:start + n] == suffix:
                return tokens[start + n:min(start + n + k, end)]
    return []


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), vocab=st.sampled_from([3, 7, 50, 1 << 22]), ngram_max=st.integers(1, 7),
       steps=st.lists(st.integers(1, 150), min_size=1, max_size=8), big_at=st.integers(0, 400))
def test_prompt_lookup_index_equals_a_scan_whatever_it_grows_by(seed, vocab, ngram_max, steps, big_at):
    """The index (packed keys: one integer to 3 ids, a pair to 6; NumPy for long runs; tuple keys past
    6 ids and past 21-bit ids) proposes what a scan
    of the tokens finds, as the tokens grow by whole prompts and by a few tokens a step; an id too
    large to pack may arrive at any point (vocab 1 << 22, or one such id at `big_at`)."""
    rng = random.Random(seed)
    lookup = PromptLookup(1, ngram_max)
    tokens: list[int] = []
    for grow in steps:
        tokens += [rng.randrange(vocab) for _ in range(grow)]
        if len(tokens) > big_at >= len(tokens) - grow:
            tokens[big_at] = (1 << 21) + 5
        for k in (1, 4):
            assert lookup.propose(tokens, k) == _reference_proposal(tokens, k, 1, ngram_max)


@given(seed=st.integers(0, 10_000), vocab=st.sampled_from([3, 8, 300]), ahead=st.integers(0, 6), k=st.integers(1, 8))
@settings(max_examples=60, deadline=None)
def test_proposing_ahead_matches_through_expected_tokens_and_never_indexes_them(seed, vocab, ahead, k):
    """`propose_ahead(tokens, ahead, k)`: what a scan of tokens + ahead proposes where the match
    lies in `tokens` (the index holds `tokens` only), and the index afterwards as if `ahead` had
    never been seen: a guess that fails leaves no trace."""
    rng = random.Random(seed)
    tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
    guess = [rng.randrange(vocab) for _ in range(ahead)]
    lookup, fresh = PromptLookup(1, 4), PromptLookup(1, 4)
    got = lookup.propose_ahead(tokens, guess, k)
    full = tokens + guess
    want = []
    for n in range(min(4, len(full)), 0, -1):  # the latest earlier occurrence that starts in `tokens`
        suffix = full[len(full) - n:]
        hits = [i for i in range(n, len(tokens)) if full[i - n:i] == suffix]
        if hits:
            want = full[hits[-1]:hits[-1] + k]
            break
    assert got == want
    more = [rng.randrange(vocab) for _ in range(5)]
    assert lookup.propose(tokens + more, k) == fresh.propose(tokens + more, k)


def test_a_chained_steps_expected_tokens_weigh_the_chance_that_all_proposals_stand():
    """Chained, a row's step yields (1 + expected) / (2 - f) tokens (f: how often all its proposals
    stood, as recorded): a row whose proposals always all stand adds what it expects; one whose
    runs always break early adds less than a plain step's token would (negative)."""
    always, broken = Adaptive(4, padded=True), Adaptive(4, padded=True)
    for _ in range(30):
        always.record(4, 4)
        broken.record(4, 1)
    assert always.expected_chained() == pytest.approx(always.expected(), rel=1e-3)
    assert broken.expected_chained() < 0 < broken.expected()


def test_a_pending_index_proposes_nothing_until_built_then_what_the_index_does():
    from concurrent.futures import Future

    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 8, 2, 3, 6, 7]
    future: Future = Future()
    pending = PendingLookup(future, 1, 3)
    assert pending.propose(tokens, 3) == []  # not built yet: the row decodes without proposals
    built = PromptLookup(1, 3)
    built.sync(tokens[:9])
    future.set_result(built)
    assert pending.propose(tokens, 3) == PromptLookup(1, 3).propose(tokens, 3) == [8, 2, 3]
    failed: Future = Future()
    failed.set_exception(RuntimeError("boom"))
    assert PendingLookup(failed, 1, 3).propose(tokens, 3) == [8, 2, 3]  # indexed on the step instead
    long = new_state(SpecConfig(), list(range(speculative.BACKGROUND_INDEX_TOKENS)), [1])
    assert isinstance(long.lookup, PendingLookup)
    assert isinstance(new_state(SpecConfig(), [1, 2], [3]).lookup, PromptLookup)


def test_adaptive_k_follows_acceptance_and_the_floor_and_backs_off_when_it_does_not_pay():
    a = Adaptive(8)
    assert a.budget(0.1) >= 2  # a prior of 0.6: 0.6**4 = 0.13
    for _ in range(6):
        a.record(8, 8)
    assert a.budget(0.1) == 8 and a.budget(0.5) == 8  # all accepted: q near 1
    high = Adaptive(8)
    for _ in range(6):
        high.record(4, 2)  # q = 2/3
    assert high.budget(0.1) == 5 and high.budget(0.4) == 2  # the largest j with q**j >= floor
    low = Adaptive(8)
    for _ in range(6):
        low.record(1, 0)
    assert low.budget(0.1) == 0 and low.waiting
    while low.waiting:
        assert low.budget(0.1) == 0
    assert low.budget(0.1) == 1  # a probe
    low.record(1, 0)
    waited = 0
    while low.budget(0.1) == 0:
        waited += 1
    assert waited > 8  # backed off longer the second time


def test_a_padded_row_proposes_its_most_at_every_step_and_still_weighs_them_by_q():
    """A GPU verifies every row at one fixed width: a row proposing fewer saves nothing, so it never
    backs off; what it is expected to add (for the gate) still falls with its acceptance."""
    a = Adaptive(8, padded=True)
    for _ in range(8):
        a.record(8, 0)  # every proposal rejected: a CPU's row would back off
        assert a.budget(0.5) == 8 and not a.waiting
    q = a.q
    assert q < 0.2
    assert a.expected(0.5) == pytest.approx(sum(q ** j for j in range(1, 9)))
    assert a.expected(0.5) < 0.25
    cpu = Adaptive(8)
    for _ in range(8):
        cpu.record(8, 0)
    assert cpu.budget(0.5) == 0 and cpu.waiting
    long_prompt = list(range(speculative.BACKGROUND_INDEX_TOKENS))
    assert new_state(SpecConfig(), [1, 2], [3], padded=True).adaptive.padded
    assert new_state(SpecConfig(), long_prompt, [1], padded=True).adaptive.padded
    assert not new_state(SpecConfig(), [1, 2], [3]).adaptive.padded
    draft = SpecConfig(method="draft", draft_model="/m")  # a draft's proposals cost a forward each
    assert not new_state(draft, [1, 2], [3], padded=True).adaptive.padded


def test_speculative_settings_parse():
    assert EngineConfig().speculative == "auto"
    assert EngineConfig(speculative="off").speculative == "off"
    assert EngineConfig.from_dict({"speculative": {"max_tokens": 4}}).speculative == SpecConfig(max_tokens=4)
    assert not SpecConfig().chain and EngineConfig.from_dict({"speculative": {"chain": True}}).speculative.chain
    for bad in ({"method": "nope"}, {"max_tokens": 0}, "sometimes", {"method": "draft"}, {"draft_model": "x"},
                {"chain": "yes"}):
        with pytest.raises(ValueError):
            parse_speculative(bad)
    assert StepRunner.__name__ and EngineConfig(speculative=False).speculative == "off"


# -- the whole engine: every sampling setting, stop strings, grammars, logprobs -------------------

ENGINE_CASES = {
    "greedy": dict(),
    "repetition": dict(repetition_penalty=1.3),
    "penalties": dict(frequency_penalty=0.8, presence_penalty=0.5),
    "bias": dict(logit_bias=((5, 4.0), (7, -100.0))),
    "logprobs": dict(logprobs=3),
    "seeded": dict(temperature=0.8, seed=11, top_p=0.9, min_p=0.02, top_k=50),
    "stop-string": dict(stop=("STOP",)),  # the stop text is set per prompt below
    "grammar": dict(grammar="GRAMMAR"),
}


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    from engine_helpers import make_engine, run

    made = {name: make_engine(tiny_model_dir, speculative=spec)
            for name, spec in (("off", "off"), ("on", SpecConfig(max_tokens=6)))}
    yield made
    for engine in made.values():
        run(engine.shutdown())


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_text_logprobs_and_endings_equal_with_speculation_on_and_off(engines, case):
    """Echo prompts (a start, the model's own continuation, the start again) so proposals are long
    and mostly accepted; a stop string from inside the continuation (so it ends an accepted run);
    a JSON-schema grammar whose continuation was itself generated under the grammar."""
    import asyncio
    from dataclasses import replace

    from engine.types import Request
    from engine_helpers import collect, run
    from test_constraints import GRAMMAR

    params = dict(ENGINE_CASES[case])
    if "grammar" in params:
        params["grammar"] = GRAMMAR
    off, on = engines["off"], engines["on"]
    tok = off.tokenizer
    starts = [tok.encode(t) for t in ("def main():\n    print('hello')", "Paris is the capital of", "1 2 3 4 5 6 7")]

    def req(tokens, **extra):
        sampling = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, **extra})
        return Request(tuple(tokens), sampling)

    async def gather(engine, reqs):
        return await asyncio.gather(*(collect(engine, r) for r in reqs))

    base = {k: v for k, v in params.items() if k != "stop"}
    said = run(gather(off, [req(s, **base) for s in starts]))
    prompts = [s + [e.token_id for e in events if e.token_id is not None] + s for s, (_, events) in zip(starts, said)]
    if "stop" in params:  # a few characters from the middle of what it says after an echo prompt
        again = run(gather(off, [req(p, **base) for p in prompts]))
        params["stop"] = tuple(text[len(text) // 2:len(text) // 2 + 3] for text, _ in again if len(text) > 6)[:1]
    counters = run(on.call(lambda e: e.status()))["runner"]
    before = counters["spec_proposed_tokens"], counters["spec_accepted_tokens"]
    results = {}
    for name, engine in engines.items():
        out = run(gather(engine, [req(p, **params) for p in prompts]))
        results[name] = [(text, events[-1].finish_reason, events[-1].stop_string,
                          [(e.token_id, round(e.logprob.logprob, 4), [t for t, _ in e.logprob.top]) if e.logprob else e.token_id
                           for e in events]) for text, events in out]
    assert results["on"] == results["off"]
    runner = run(on.call(lambda e: e.status()))["runner"]
    assert runner["spec_proposed_tokens"] > before[0]
    if case not in ("repetition", "penalties"):  # penalties push the model off repeating its context
        assert runner["spec_accepted_tokens"] > before[1]
    if "stop" in params:
        assert any(r[1].value == "stop" for r in results["on"])


def test_metrics_and_admin_requests_show_proposed_and_accepted_tokens(engines):
    """`/metrics` renders the runner's counters as `pomona_engine_runner{kind=...}`; a running
    request's row in `/admin/requests` (Engine.running_status) carries its own."""
    import asyncio

    from api.core.metrics import IngressMetrics
    from engine.types import Request
    from engine_helpers import collect, run

    on = engines["on"]
    start = on.tokenizer.encode("Hello world! How are you today?")
    said = run(collect(on, Request(tuple(start), SamplingParams(temperature=0.0, max_tokens=30))))[1]
    prompt = start + [e.token_id for e in said if e.token_id is not None] + start
    rows: list = []

    async def go():
        stream = on.stream(Request(tuple(prompt), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                                   request_id="watched"))
        async for batch in stream:
            rows.extend(r for r in await on.call(lambda e: e.running_status()) if r["id"] == "watched")
            if batch[-1].finished:
                break
    run(go())
    assert rows and all("spec_proposed_tokens" in r and "spec_accepted_tokens" in r for r in rows)
    assert max(r["spec_accepted_tokens"] for r in rows) > 0
    text = IngressMetrics().render(run(on.call(lambda e: e.status())))
    assert 'pomona_engine_runner{kind="spec_accepted_tokens"}' in text
    assert 'pomona_engine_runner{kind="spec_proposed_tokens"}' in text


# -- draft-model proposals ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory):
    """A second tiny llama with the same tokenizer and other weights: a draft that is often wrong."""
    from tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1)


@pytest.mark.parametrize("which", ["same", "other"])
def test_draft_model_proposals_match_without_speculation(model, tiny_model_dir, other_model_dir, which):
    """The draft the model itself (its proposals stand, but where the table's and mlx-lm's
    cache's logits tie) and a draft with other weights (mostly rejected): the same tokens as
    BatchGenerator either way, with arrivals, an abort, a stop token and a cached prefix."""
    from test_step_runner import random_jobs

    path = tiny_model_dir if which == "same" else other_model_dir
    spec = SpecConfig(method="draft", draft_model=str(path), max_tokens=4)
    jobs = random_jobs(model.args.vocab_size, seed=21, n=6, spread=15)
    reference = drive(model, Runner, jobs)
    jobs[2].stop = (reference[2].tokens[len(reference[2].tokens) // 2],)
    jobs[3].prefix = len(jobs[3].prompt) // 2
    seen: dict = {}
    ours = drive(model, spec_runner(spec, seen), jobs)
    assert_same(ours, drive(model, Runner, jobs))
    proposed, taken = counts(seen["runner"])
    assert proposed > 0
    if which == "same":
        assert taken > 0.8 * proposed
    else:
        assert taken < proposed


def test_a_draft_proposes_after_a_rejection_what_a_fresh_draft_would(model):
    """The draft's cache drops what it consumed past the accepted tokens: after proposals that were
    partly rejected, its next proposals equal those of a draft fed the known tokens afresh."""
    from engine.step.draft import DraftProposer
    from engine.step.speculative import new_state

    rng = random.Random(3)
    known = [rng.randrange(1, model.args.vocab_size) for _ in range(30)]
    proposer, state = DraftProposer(model, 6), new_state(SPEC)
    first = proposer.propose(state, known, 6)
    assert len(first) == 6
    known += first[:2] + [(first[2] + 1) % model.args.vocab_size]  # two accepted, then another token
    again = proposer.propose(state, known, 6)
    assert again == DraftProposer(model, 6).propose(new_state(SPEC), known, 6)
    known += again  # all accepted (and the last one sampled): nothing to trim, one token to catch up
    assert proposer.propose(state, known, 3) == DraftProposer(model, 6).propose(new_state(SPEC), known, 3)
