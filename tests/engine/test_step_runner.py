"""Pomona's own step (engine/step/step_runner.py) against mlx-lm's BatchGenerator (engine/batch_generator.py), the
reference: the same greedy tokens, log-probabilities and endings for prompts of mixed lengths that
arrive at any step, leave early, stop on a token, or start from a cached prefix."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx_lm
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from engine.config import EngineConfig
from engine import runner_choice as step_runner  # where make_runner's `_told` lives
from engine.batch_generator import BatchGeneratorRunner as Runner  # mlx-lm's: the reference
from engine.runner_choice import make_runner
from engine.sampling import make_decoding
from engine.step.kv_table import FlatView
from engine.step.step_runner import StepRunner
from engine.types import SamplingParams
from modelio.cpu_llama import accelerate
from modelio.flat_llama import flatten
from engine_helpers import collect, make_engine, request, run
from hybrid_models import hybrid_model_dir  # noqa: F401  (a fixture)


@pytest.fixture(scope="module", params=["mlx_lm", "cpu_fast"])
def model(request, tiny_model_dir):
    """mlx-lm's llama as loaded, and with the CPU fast-path blocks (modelio/cpu_llama.py), whose
    attention takes the own step's flat forward (decode rows and prompt chunks in one)."""
    loaded = mlx_lm.load(str(tiny_model_dir))[0]
    if request.param == "cpu_fast":
        assert accelerate(loaded) > 0
    return loaded


@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    arrive: int = 0  # the step it is inserted before
    abort: int | None = None  # the step it is removed before (None: runs to its end)
    stop: tuple[int, ...] = ()
    prefix: int = 0  # tokens of the prompt given as a ready cache
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ending: str | None = None


def fresh_cache(model, max_kv_size=None):
    """mlx-lm's caches; with a bound, the `RotatingKVCache`s `make_prompt_cache` builds for a model
    without its own `make_cache` (mlx-lm's llama has one, and keeps plain KVCaches whatever the bound)."""
    if max_kv_size is None:
        return make_prompt_cache(model)
    return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in model.layers]


class RotatingRunner(Runner):
    """The reference for a bounded cache: mlx-lm's BatchGenerator handed rotating caches (which it
    merges into a BatchRotatingKVCache) for every prompt."""

    def __init__(self, model, config):
        super().__init__(model, config)
        self.bound = config.max_kv_size

    def insert(self, request_id, tokens, cached, cache, decoding, max_tokens):
        cache = fresh_cache(self._model, self.bound) if cache is None else cache
        super().insert(request_id, tokens, cached, cache, decoding, max_tokens)


def prefix_cache(model, tokens, max_kv_size=None):
    cache = fresh_cache(model, max_kv_size)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def drive(model, make, jobs: list[Job], max_running: int = 8, sampling: dict | None = None, **config) -> list[Job]:
    """Run `jobs` through the runner `make` builds, greedy (or `sampling`'s settings, job i seeded i
    more than its seed)."""
    runner = make(model, EngineConfig(model="tiny", max_running=max_running, prefill_batch=min(4, max_running),
                                      **config))
    jobs = [Job(j.prompt, j.max_tokens, j.arrive, j.abort, j.stop, j.prefix) for j in jobs]
    step, started = 0, set()
    while any(j.ending is None for j in jobs):
        for i, j in enumerate(jobs):
            # the engine's scheduler admits no more than max_running; later arrivals wait for a row
            if i not in started and j.arrive <= step and len(runner) < max_running:
                started.add(i)
                extra = {} if sampling is None else {**sampling, "seed": sampling.get("seed", 0) + i}
                params = SamplingParams(**{"max_tokens": j.max_tokens, "temperature": 0.0, "ignore_eos": True,
                                           "stop_token_ids": j.stop, **extra})
                cache = prefix_cache(model, j.prompt[:j.prefix], config.get("max_kv_size")) if j.prefix else None
                runner.insert(str(i), j.prompt[j.prefix:], j.prompt[:j.prefix], cache,
                              make_decoding(params, len(j.prompt), []), j.max_tokens)
            if j.abort is not None and i in started and step >= j.abort and j.ending is None:
                runner.remove(str(i))
                j.ending = "abort"
        _, generated = runner.step()
        for g in generated:
            j = jobs[int(g.request_id)]
            j.tokens.append(g.token)
            j.logprobs.append(g.logprobs[g.token].item())
            if g.finish_reason:
                j.ending = g.finish_reason
                assert len(g.tokens) == g.cache[0].offset  # the cache covers exactly the tokens it names
                assert g.tokens[:len(j.prompt)] == j.prompt
        step += 1
        assert step < 3000, "the runner stopped making progress"
    return jobs


def assert_same(ours: list[Job], reference: list[Job]) -> None:
    for a, b in zip(ours, reference):
        assert a.ending == b.ending
        if b.ending == "abort":  # where an abort lands depends on each step's latency: a prefix of it
            n = min(len(a.tokens), len(b.tokens))
            assert a.tokens[:n] == b.tokens[:n]
            continue
        assert a.tokens == b.tokens
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def random_jobs(vocab: int, seed: int, n: int = 10, spread: int = 30) -> list[Job]:
    rng = random.Random(seed)
    return [Job([rng.randrange(1, vocab) for _ in range(rng.randrange(1, 300))], rng.randrange(1, 40),
                rng.randrange(0, spread)) for _ in range(n)]


def test_mixed_lengths_arriving_at_random_steps_match_batch_generator(model):
    jobs = random_jobs(model.args.vocab_size, seed=0)
    assert_same(drive(model, StepRunner, jobs), drive(model, Runner, jobs))


def test_more_prompts_than_rows_wait_and_reuse_freed_rows(model):
    jobs = random_jobs(model.args.vocab_size, seed=1, n=12, spread=3)
    runner = StepRunner(model, EngineConfig(model="tiny", max_running=4, prefill_batch=4))
    ours = drive(model, lambda m, c: runner, jobs[:4])
    size = runner.cache_nbytes()
    ours += drive(model, lambda m, c: runner, jobs[4:8])  # a second wave into the freed rows
    assert runner.cache_nbytes() == size and len(runner) == 0  # nothing grown, nothing left behind
    assert_same(ours, drive(model, Runner, jobs[:4], max_running=4) + drive(model, Runner, jobs[4:8], max_running=4))


def test_aborts_stop_tokens_and_cached_prefixes_match(model):
    vocab = model.args.vocab_size
    jobs = random_jobs(vocab, seed=2, n=8)
    reference = drive(model, Runner, jobs)
    jobs[1].abort = jobs[1].arrive + 4
    jobs[2].stop = (reference[2].tokens[len(reference[2].tokens) // 2],)  # a token it will generate
    jobs[3].prefix = len(jobs[3].prompt) - 1
    jobs[4].prefix = len(jobs[4].prompt) // 2
    assert_same(drive(model, StepRunner, jobs), drive(model, Runner, jobs))
    ours = drive(model, StepRunner, jobs)
    assert ours[2].ending == "stop" and ours[2].tokens[-1] in jobs[2].stop
    assert ours[3].tokens == reference[3].tokens and ours[4].tokens == reference[4].tokens  # hit == cold


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), spread=st.integers(1, 40), rows=st.sampled_from([2, 3, 8]))
def test_random_arrival_schedules_match(model, seed, spread, rows):
    jobs = random_jobs(model.args.vocab_size, seed, n=6, spread=spread)
    assert_same(drive(model, StepRunner, jobs, max_running=rows), drive(model, Runner, jobs, max_running=rows))


def test_a_small_step_budget_feeds_long_prompts_in_chunks_beside_the_decodes(model):
    jobs = [Job(list(range(1, 20)), 60), Job(list(range(5, 700)), 5, arrive=3)]
    runner = StepRunner(model, EngineConfig(model="tiny", max_running=4, prefill_batch=4, max_batch_tokens=64,
                                            prefill_chunk=512, max_decode_stall=None))
    progress, decoded_while_prefilling = [], 0
    step = 0
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    runner.insert("0", jobs[0].prompt, [], None, make_decoding(params, 19, []), 60)
    while len(runner):
        if step == 3:
            runner.insert("1", jobs[1].prompt, [], None, make_decoding(params, 695, []), 5)
        prompts, generated = runner.step()
        progress += [p.done for p in prompts if p.request_id == "1"]
        if any(p.request_id == "1" and not p.end_of_prompt for p in prompts):
            decoded_while_prefilling += any(g.request_id == "0" for g in generated)
        step += 1
    # 64 tokens a step, one of them the running decode's: the 695-token prompt takes 11 chunks of 63
    assert progress[:3] == [63, 126, 189] and progress[-1] == 695
    assert decoded_while_prefilling >= 9  # the running request got a token in (nearly) every one of them


def test_the_memory_account_sees_the_own_steps_rings_and_not_mlx_lms_dropped_bound(model):
    """The own step keeps `max_kv_size` as a ring per row; mlx-lm gives llama (its own
    `make_cache`) unbounded caches whatever `max_kv_size` says, so that step is accounted in full."""
    config = EngineConfig(model="tiny", max_kv_size=32)
    assert StepRunner(model, config).kv_window == 32
    assert Runner(model, config).kv_window is None
    assert StepRunner(model, EngineConfig(model="tiny")).kv_window is None


def test_a_flat_forward_that_fails_the_start_up_check_falls_back(model, monkeypatch):
    def refuse(self, n, **_):
        raise NotImplementedError("no flat forward here")

    monkeypatch.setattr(step_runner, "_told", set())
    monkeypatch.setattr(FlatView, "make_mask", refuse)
    flat = hasattr(model.model.layers[0].self_attn, "flat_attention")
    runner = make_runner(model, EngineConfig(model="tiny"))
    assert type(runner) is (Runner if flat else StepRunner)


def test_decodes_and_a_prompt_chunk_share_one_forward_on_the_cpu_fast_path(model):
    """With the CPU fast-path llama blocks a step's decode rows and prompt chunks run as one flat
    forward (a CPU forward costs about one pass over the weights, whatever its rows); with mlx-lm's
    own blocks they are two forwards."""
    runner = StepRunner(model, EngineConfig(model="tiny", max_running=4, prefill_batch=4, max_batch_tokens=64))
    flat = hasattr(model.model.layers[0].self_attn, "flat_attention")
    assert forwards_of_a_step_with_a_chunk(runner) == (1 if flat else 2)


def forwards_of_a_step_with_a_chunk(runner) -> int:
    """The forwards of a step in which one request decodes and another's prompt feeds a chunk."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    runner.insert("0", list(range(1, 20)), [], None, make_decoding(params, 19, []), 60)
    for _ in range(3):
        runner.step()
    runner.insert("1", list(range(5, 300)), [], None, make_decoding(params, 295, []), 5)
    before = runner.counters()["forwards"]
    prompts, _ = runner.step()
    assert [p.request_id for p in prompts] == ["1"] and not prompts[0].end_of_prompt
    return runner.counters()["forwards"] - before


def test_models_the_step_cannot_run_fall_back_once_with_a_log(model, hybrid_model_dir, caplog, monkeypatch):
    monkeypatch.setattr(step_runner, "_told", set())  # other tests' engines may have logged these reasons
    caplog.set_level(logging.WARNING, logger="pomona.engine")
    hybrid = mlx_lm.load(str(hybrid_model_dir("mamba2")))[0]
    assert type(make_runner(hybrid, EngineConfig(model="h"))) is Runner
    assert type(make_runner(hybrid, EngineConfig(model="h", max_kv_size=64))) is Runner
    assert sum("ArraysCache" in r.message for r in caplog.records) == 1  # logged once
    assert type(make_runner(model, EngineConfig(model="tiny"))) is StepRunner
    assert type(make_runner(model, EngineConfig(model="tiny", engine_step="mlx_lm"))) is Runner


@pytest.mark.parametrize("params", [
    dict(repetition_penalty=1.3), dict(frequency_penalty=0.8, presence_penalty=0.5),
    dict(logit_bias=((5, 4.0), (7, -100.0))), dict(stop=("e",)), dict(logprobs=3),
    dict(temperature=0.8, seed=11),
], ids=["repetition", "penalties", "bias", "stop-string", "logprobs", "seeded"])
def test_engine_features_give_the_same_text_on_both_steps(tiny_model_dir, params):
    texts = {}
    for step in ("pomona", "mlx_lm"):
        engine = make_engine(tiny_model_dir, engine_step=step)
        try:
            async def batch():
                reqs = [request(engine, p, max_tokens=24, **params) for p in ("hello world", "Paris is", "x y z")]
                return [await collect(engine, r) for r in reqs]
            results = run(batch())
            texts[step] = [(text, [e.finish_reason for e in events][-1],
                            [round(e.logprob.logprob, 4) if e.logprob else None for e in events])
                           for text, events in results]
        finally:
            run(engine.shutdown())
    assert texts["pomona"] == texts["mlx_lm"]


# -- bounded KV (max_kv_size): each row a ring, mlx-lm's BatchRotatingKVCache the reference -----

def test_a_bounded_kv_cache_runs_on_the_own_step(model, caplog, monkeypatch):
    monkeypatch.setattr(step_runner, "_told", set())
    caplog.set_level(logging.WARNING, logger="pomona.engine")
    assert type(make_runner(model, EngineConfig(model="tiny", max_kv_size=64))) is StepRunner
    assert "BatchGenerator" not in caplog.text


def test_bounded_kv_decode_wraps_the_ring_as_batch_generator_does(model):
    """Prompts shorter than the 32-token window, generation far past it (the decode ring wraps
    several times), mixed lengths arriving at different steps, one leaving early."""
    rng = random.Random(7)
    vocab = model.args.vocab_size
    jobs = [Job([rng.randrange(1, vocab) for _ in range(n)], m, arrive)
            for n, m, arrive in [(5, 120, 0), (20, 90, 0), (31, 100, 3), (1, 70, 9), (12, 110, 20)]]
    jobs[3].abort = 40
    assert_same(drive(model, StepRunner, jobs, max_kv_size=32), drive(model, RotatingRunner, jobs, max_kv_size=32))


def test_bounded_kv_prompts_longer_than_the_window_match(model):
    """Prompts longer than the window, fed in chunks (a small step budget: chunks of several
    lengths, some longer than the window) beside running decodes: a chunk's queries see the ring as
    it was plus the chunk, as mlx-lm's concatenate-then-trim update does."""
    rng = random.Random(8)
    vocab = model.args.vocab_size
    jobs = [Job([rng.randrange(1, vocab) for _ in range(n)], m, arrive)
            for n, m, arrive in [(10, 80, 0), (150, 40, 2), (64, 50, 5), (33, 60, 6), (200, 30, 12)]]
    for config in (dict(max_kv_size=32, prefill_chunk=48, max_batch_tokens=96), dict(max_kv_size=64)):
        assert_same(drive(model, StepRunner, jobs, **config), drive(model, RotatingRunner, jobs, **config))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([32, 48, 64]), rows=st.sampled_from([2, 8]))
def test_bounded_kv_random_schedules_match(model, seed, window, rows):
    jobs = random_jobs(model.args.vocab_size, seed, n=5, spread=20)
    assert_same(drive(model, StepRunner, jobs, max_running=rows, max_kv_size=window),
                drive(model, RotatingRunner, jobs, max_running=rows, max_kv_size=window))


def test_bounded_kv_restored_prefixes_and_finished_caches_round_trip(model):
    """A rotating prefix cache (mlx-lm's, rotated or not) written into a row gives what
    BatchGenerator gives on it; a finished request's cache is a `RotatingKVCache` in token order
    that, restored on either step, continues as the request itself would have."""
    rng = random.Random(9)
    vocab = model.args.vocab_size
    jobs = [Job([rng.randrange(1, vocab) for _ in range(n)], 40, arrive, prefix=p)
            for n, arrive, p in [(100, 0, 70), (50, 1, 20), (40, 2, 39), (90, 3, 0)]]
    assert_same(drive(model, StepRunner, jobs, max_kv_size=32), drive(model, RotatingRunner, jobs, max_kv_size=32))
    prompt = jobs[0].prompt
    first = drive(model, StepRunner, [Job(prompt, 60)], max_kv_size=32)[0]
    long = drive(model, RotatingRunner, [Job(prompt, 80)], max_kv_size=32)[0]
    assert first.tokens == long.tokens[:60]
    cache, covered = run_to_end(StepRunner(model, EngineConfig(model="tiny", max_kv_size=32)), "a", prompt, [],
                                None, 60)[1:]
    assert type(cache[0]).__name__ == "RotatingKVCache" and cache[0].offset == len(covered) == 159
    assert cache[0].keep == 0 and cache[0].state[0].shape[2] == 32
    # the last 32 tokens in order: the keys a pass with mlx-lm's own cache leaves there
    reference = prefix_cache(model, covered, 32)
    assert mx.abs(cache[0].state[0] - reference[0].state[0][..., -32:, :]).max().item() < 1e-4
    for make in (StepRunner, RotatingRunner):  # restored (its last token fed anew): as the long run went on
        more = run_to_end(make(model, EngineConfig(model="tiny", max_kv_size=32)), "b", first.tokens[-1:],
                          covered, cache, 20)[0]
        assert more == long.tokens[60:], make


def run_to_end(runner, request_id, tokens, cached, cache, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runner.insert(request_id, tokens, cached, cache, make_decoding(params, len(cached) + len(tokens), []),
                  max_tokens)
    out, final = [], None
    while len(runner):
        for g in runner.step()[1]:
            out.append(g.token)
            final = g if g.finish_reason else final
    return out, final.cache, final.tokens


def test_bounded_kv_chunks_padded_into_one_forward_match_chunks_fed_alone(model):
    """The GPU's prefill puts several prompt chunks in one forward, padded to the longest (the
    2-core box's CPU path never does). The padding, and a chunk's tokens pushed out of its own
    window, must not land in a ring: logits and rings equal feeding each chunk alone."""
    from engine.forward import logits_at
    from engine.step.kv_table import Batch, SlotKV, layer_shapes

    rng = random.Random(10)
    history = [[rng.randrange(1, 400) for _ in range(n)] for n in (40, 10)]
    chunks = [[rng.randrange(1, 400) for _ in range(n)] for n in (5, 45)]

    def table():
        kv = SlotKV(layer_shapes(model), 64, 32)
        kv.ensure(2, 33)
        for row, tokens in enumerate(history):
            model(mx.array([tokens]), cache=Batch(kv, [0], len(tokens), [row], 64).views())
        return kv

    together = table()
    width = max(len(c) for c in chunks)
    inputs = mx.array([c + [0] * (width - len(c)) for c in chunks])
    batch = Batch(together, [len(h) for h in history], width, [0, 1], 64, [len(c) for c in chunks])
    ours = logits_at(model, inputs, batch.views(), [(r, len(c) - 1) for r, c in enumerate(chunks)])
    alone = table()
    for row, (h, c) in enumerate(zip(history, chunks)):
        reference = logits_at(model, mx.array([c]), Batch(alone, [len(h)], len(c), [row], 64).views(),
                              [(0, len(c) - 1)])
        assert mx.abs(ours[row] - reference[0]).max().item() < 1e-4
        n = len(h) + len(c)
        for a, b in zip(together.extract(row, n), alone.extract(row, n)):
            assert a.offset == b.offset == n and mx.abs(a.state[0] - b.state[0]).max().item() < 1e-5


def test_bounded_kv_direct_first_token_matches_the_batch(model):
    """`insert_after_first_token` (the rest of a prompt fed at once, in chunks of up to 2,048
    tokens, many times the window) gives the first token the batch gives, on a restored rotating
    prefix or none, and the request decodes on from there as in the batch. (Not compared with
    `Runner.insert_after_first_token`: that one prefills on mlx-lm's single-sequence
    `RotatingKVCache`, which keeps 4 leading tokens, unlike the batch's cache.)"""
    rng = random.Random(11)
    prompt = [rng.randrange(1, model.args.vocab_size) for _ in range(150)]
    for prefix in (0, 130):  # 130: the 20 tokens fed attend to the restored ring
        reference = drive(model, RotatingRunner, [Job(prompt, 20, prefix=prefix)], max_kv_size=32)[0]
        runner = StepRunner(model, EngineConfig(model="tiny", max_kv_size=32))
        params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
        cache = prefix_cache(model, prompt[:prefix], 32) if prefix else None
        first = runner.insert_after_first_token("a", prompt[prefix:], prompt[:prefix], cache,
                                                make_decoding(params, len(prompt), []), 20)
        assert first.token == reference.tokens[0]
        assert abs(first.logprobs[first.token].item() - reference.logprobs[0]) < 1e-4
        rest = []
        while len(runner):
            rest += [g.token for g in runner.step()[1]]
        assert rest == reference.tokens[1:]


def gpu_shaped(model, config):
    """The own step as it runs on a GPU (bucketed shapes, padded prefill groups; a flat forward for
    a step with decode rows and chunks where `flat_step` and the model allow), run here on the CPU:
    MLX computes the same ops on either device."""
    return StepRunner(model, config, on_cpu=False)


def test_gpu_prefill_shapes_come_from_a_few_buckets_and_match(model):
    """A GPU prefill pads its query width to a multiple of the position block and its key length
    to an eighth of the next power of two: the padding is never attended, outputs match."""
    from engine.step.backend import prefill_shape

    assert prefill_shape(600, 15000, 256) == (768, 16384)
    assert prefill_shape(2048, 15000, 256) == (2048, 20480)
    assert prefill_shape(40, 20010, 256) == (256, 20480)
    assert prefill_shape(1, 0, 256) == (256, 256)
    jobs = random_jobs(model.args.vocab_size, seed=5, n=8, spread=10)
    jobs[2].prefix = len(jobs[2].prompt) // 2
    made = []
    # Speculation off: its verifying forwards (a row's token and proposals) have shapes of their own.
    ours = drive(model, lambda m, c: made.append(gpu_shaped(m, replace(c, speculative="off"))) or made[-1], jobs)
    assert_same(ours, drive(model, Runner, jobs))
    prefills = {(w, k) for g, w, k, _ in (s for s in made[0]._shapes_seen if len(s) == 4) if w > 1}
    assert prefills and all(w % 256 == 0 and k % 256 == 0 for w, k in prefills)


@pytest.fixture(scope="module")
def flat_model(tiny_model_dir):
    """mlx-lm's llama with `FlatAttention` swapped in, as `modelio.models` loads it on a GPU."""
    loaded = mlx_lm.load(str(tiny_model_dir))[0]
    assert flatten(loaded) > 0
    return loaded


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spec", ["off", "auto"])
def test_a_gpus_flat_step_matches_with_chunks_padded_to_their_buckets(flat_model, seed, spec):
    """`flat_step: true` on a GPU: decode rows and prompt chunks (each padded to its prefill bucket)
    in one forward; tokens and logprobs are mlx-lm's, with cached prefixes, aborts and speculation."""
    jobs = random_jobs(flat_model.args.vocab_size, seed=seed, n=10, spread=30)
    jobs[3].prefix = len(jobs[3].prompt) // 2
    jobs[5].abort = jobs[5].arrive + 4
    made: list = []
    ours = drive(flat_model, lambda m, c: made.append(gpu_shaped(m, replace(c, flat_step=True, speculative=spec)))
                 or made[-1], jobs, max_batch_tokens=96)
    assert_same(ours, drive(flat_model, Runner, jobs))
    assert made[0]._flat_mixed and not made[0]._flat  # noqa: SLF001 - which step ran


@pytest.mark.parametrize("flat", [True, False])
def test_a_gpus_step_with_decodes_and_a_chunk_is_one_forward_with_flat_step(flat_model, flat):
    runner = gpu_shaped(flat_model, EngineConfig(model="tiny", max_running=4, prefill_batch=4, max_batch_tokens=64,
                                                 flat_step=flat, speculative="off"))
    assert forwards_of_a_step_with_a_chunk(runner) == (1 if flat else 2)
    assert EngineConfig(model="tiny").flat_steps() and not EngineConfig(model="tiny", flat_step=False).flat_steps()
    with pytest.raises(ValueError, match="flat_step"):
        EngineConfig(model="tiny", flat_step="sometimes")


def test_flat_step_on_a_model_without_flat_attention_says_so_and_runs_two_forwards(tiny_model_dir, caplog):
    plain_model = mlx_lm.load(str(tiny_model_dir))[0]  # mlx-lm's blocks, as a non-llama model would be
    with caplog.at_level("INFO", logger="pomona.engine"):
        runner = gpu_shaped(plain_model, EngineConfig(model="tiny", max_running=4, prefill_batch=4,
                                                      max_batch_tokens=64, flat_step=True, speculative="off"))
    assert "takes no flat forward" in caplog.text
    assert forwards_of_a_step_with_a_chunk(runner) == 2


def test_a_turn_whose_prefix_a_free_row_still_holds_takes_that_row(model):
    """An agent's next turn: its restored prefix is what the row of its previous turn still holds,
    so the row is taken again and nothing is copied in; the output is the reference's. A prompt
    that shares less than its restored prefix with a free row does not take it."""
    rng = random.Random(7)
    vocab = model.args.vocab_size
    first = Job([rng.randrange(1, vocab) for _ in range(90)], 12)
    runner = StepRunner(model, EngineConfig(model="tiny", max_running=4, prefill_batch=4))
    [done] = drive(model, lambda m, c: runner, [first])
    history = first.prompt + done.tokens[:-1]  # the row holds the prompt and all but the last output
    follow = Job(history + [rng.randrange(1, vocab) for _ in range(20)], 8, prefix=len(history))
    other = Job(first.prompt[:50] + [rng.randrange(1, vocab) for _ in range(60)], 8, prefix=60)
    ours = drive(model, lambda m, c: runner, [follow])
    assert runner.counters()["rows_reused"] == 1
    assert_same(ours, drive(model, Runner, [follow]))
    ours = drive(model, lambda m, c: runner, [other])  # shares 50 tokens, restores 60: no row holds it
    assert runner.counters()["rows_reused"] == 1
    assert_same(ours, drive(model, Runner, [other]))
