"""The engine on a tiny random llama: sampling, stops, aborts, joining, faults, batch invariance."""

from __future__ import annotations

import asyncio

import pytest

from engine.types import ContextLengthError, FinishReason, OverloadedError
from engine_helpers import FaultyModel, collect, make_engine, request, run


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    yield eng
    run(eng.shutdown())


PROMPTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. Berlin is",
    "x",
    "Numbers: 1 2 3 4 5",
    "def main():\n    print('hello')",
    "Unicode: café, naïve",
    "How are you today? I am fine, thank you. The quick brown fox jumps over the lazy dog again and again",
    "Madrid",
]


def test_batch_invariance_greedy_mixed_lengths(engine):
    alone = [run(collect(engine, request(engine, p, max_tokens=24)))[0] for p in PROMPTS]

    async def together():
        return await asyncio.gather(*[collect(engine, request(engine, p, max_tokens=24)) for p in PROMPTS])

    batched = [text for text, _ in run(together())]
    assert batched == alone
    assert len(set(alone)) > 4  # the outputs are varied, so equality means something


def test_max_tokens_gives_length_and_usage(engine):
    text, events = run(collect(engine, request(engine, "hello world", max_tokens=7)))
    last = events[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert last.usage.completion_tokens == 7 and len(events) == 7
    assert last.usage.prompt_tokens == len(engine.tokenizer.encode("hello world"))
    assert all(e.finish_reason is None for e in events[:-1])


def test_seed_reproduces_and_differs(engine):
    def sample(seed):
        return run(collect(engine, request(engine, "hello", temperature=1.0, seed=seed, max_tokens=24)))[0]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_seeded_request_unaffected_by_batch_neighbours(engine):
    alone = run(collect(engine, request(engine, "Paris", temperature=0.9, seed=3, max_tokens=20)))[0]

    async def crowded():
        others = [collect(engine, request(engine, p, temperature=1.0, max_tokens=20)) for p in PROMPTS[:4]]
        mine = collect(engine, request(engine, "Paris", temperature=0.9, seed=3, max_tokens=20))
        return (await asyncio.gather(mine, *others))[0][0]

    assert run(crowded()) == alone


def test_truncation_samplers_reduce_to_greedy(engine):
    greedy = run(collect(engine, request(engine, "Berlin is", max_tokens=16)))[0]
    for params in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        text = run(collect(engine, request(engine, "Berlin is", temperature=1.0, seed=1, max_tokens=16,
                                           **params)))[0]
        assert text == greedy, params


def test_penalties_change_greedy_output(engine):
    prompt = "x"  # greedy output of this prompt repeats tokens
    base = run(collect(engine, request(engine, prompt, max_tokens=24, logprobs=0)))[1]
    base_tokens = [e.token_id for e in base]
    assert len(set(base_tokens)) < len(base_tokens)
    for params in ({"repetition_penalty": 2.0}, {"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        events = run(collect(engine, request(engine, prompt, max_tokens=24, **params)))[1]
        tokens = [e.token_id for e in events]
        assert tokens != base_tokens, params
        assert len(set(tokens)) >= len(set(base_tokens)), params


def test_logprobs_top_n(engine):
    events = run(collect(engine, request(engine, "hello world", max_tokens=5, logprobs=3)))[1]
    for e in events:
        assert e.logprob.token_id == e.token_id
        assert len(e.logprob.top) == 3
        values = [v for _, v in e.logprob.top]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one
        assert e.logprob.top[0][0] == e.token_id
        assert abs(e.logprob.top[0][1] - e.logprob.logprob) < 1e-5


def test_stop_string_across_token_boundaries(engine):
    full = run(collect(engine, request(engine, "hello world", max_tokens=24)))[0]
    # a stop string that spans the text of several tokens, taken from the middle of the output
    stop = full[5:9]
    assert len(stop) == 4
    text, events = run(collect(engine, request(engine, "hello world", max_tokens=24, stop=(stop,))))
    assert events[-1].finish_reason is FinishReason.STOP
    assert text == full[: full.find(stop)]
    assert stop not in text


def test_stop_token_ids(engine):
    events = run(collect(engine, request(engine, "hello world", max_tokens=24)))[1]
    target = events[3].token_id
    text, stopped = run(collect(engine, request(engine, "hello world", max_tokens=24, stop_token_ids=(target,))))
    assert stopped[-1].finish_reason is FinishReason.STOP
    assert stopped[-1].token_id == target
    assert len(stopped) == [e.token_id for e in events].index(target) + 1


def test_abort_while_running_frees_the_slot(engine):
    async def scenario():
        req = request(engine, "hello world", max_tokens=500, request_id="to-abort")
        gen = engine.generate(req)
        first = await gen.__anext__()
        engine.abort("to-abort")
        rest = [e async for e in gen]
        return first, rest

    first, rest = run(scenario())
    assert rest[-1].finish_reason is FinishReason.ABORT
    assert len(rest) < 100
    run(asyncio.sleep(0.3))
    assert engine.stats()["running"] == 0


def test_client_leaving_early_aborts(engine):
    async def scenario():
        gen = engine.generate(request(engine, "hello world", max_tokens=500))
        await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.5)

    run(scenario())
    assert engine.stats()["running"] == 0


def test_join_running_batch(engine):
    async def scenario():
        gen = engine.generate(request(engine, "hello world", max_tokens=40, request_id="long-runner"))
        firsts = [await gen.__anext__() for _ in range(3)]
        joined = await collect(engine, request(engine, "Madrid", max_tokens=8))
        rest = [e async for e in gen]
        return firsts + rest, joined

    long_events, (joined_text, joined_events) = run(scenario())
    assert long_events[-1].finish_reason is FinishReason.LENGTH and len(long_events) == 40
    assert joined_text == run(collect(engine, request(engine, "Madrid", max_tokens=8)))[0]


def test_context_length_refused_before_queueing(engine):
    req = request(engine, "hello", max_tokens=2048)
    with pytest.raises(ContextLengthError) as err:
        run(collect(engine, req))
    assert "maximum context length" in str(err.value)


def test_abort_while_waiting(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_running=1, prefill_batch=1)
    try:
        async def scenario():
            holder = eng.generate(request(eng, "hello world", max_tokens=1900, request_id="holder"))
            await holder.__anext__()
            waiting = asyncio.ensure_future(collect(eng, request(eng, "Madrid", request_id="queued")))
            await asyncio.sleep(0.6)
            assert eng.stats()["waiting"] == 1
            eng.abort("queued")
            _, events = await waiting
            eng.abort("holder")
            async for _ in holder:
                pass
            return events

        events = run(scenario())
        assert [e.finish_reason for e in events] == [FinishReason.ABORT]
        assert events[0].usage.completion_tokens == 0
    finally:
        run(eng.shutdown())


def test_full_queue_rejects(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_running=1, prefill_batch=1, max_waiting=1)
    try:
        async def scenario():
            holder = eng.generate(request(eng, "hello world", max_tokens=1900, request_id="h"))
            await holder.__anext__()
            queued = asyncio.ensure_future(collect(eng, request(eng, "a", max_tokens=2)))
            await asyncio.sleep(0.2)
            with pytest.raises(OverloadedError):
                await collect(eng, request(eng, "b", max_tokens=2))
            eng.abort("h")
            async for _ in holder:
                pass
            return await queued

        text, events = run(scenario())
        assert events[-1].finish_reason is FinishReason.LENGTH
    finally:
        run(eng.shutdown())


def test_fault_in_step_fails_batch_and_engine_keeps_serving(tiny_model_dir):
    holder = {}

    def wrap(model):
        holder["model"] = FaultyModel(model)
        return holder["model"]

    eng = make_engine(tiny_model_dir, wrap=wrap)
    try:
        async def scenario():
            gen = eng.generate(request(eng, "hello world", max_tokens=200))
            await gen.__anext__()
            holder["model"].armed = True
            rest = [e async for e in gen]
            return rest

        rest = run(scenario())
        assert rest[-1].finish_reason is FinishReason.ERROR
        assert "injected fault" in rest[-1].error and "retry" in rest[-1].error
        assert eng.stats()["faults"] == 1
        text, events = run(collect(eng, request(eng, "hello world", max_tokens=5)))
        assert events[-1].finish_reason is FinishReason.LENGTH and len(events) == 5
    finally:
        run(eng.shutdown())


def test_request_timeout_ends_with_error(tiny_model_dir):
    eng = make_engine(tiny_model_dir, request_timeout_s=0.3)
    try:
        events = run(collect(eng, request(eng, "hello world", max_tokens=2000 - 10)))[1]
        assert events[-1].finish_reason is FinishReason.ERROR
        assert "time limit" in events[-1].error
    finally:
        run(eng.shutdown())


def test_top_k_beyond_vocabulary_keeps_every_token(engine):
    text, events = run(collect(engine, request(engine, "hello", temperature=1.0, top_k=10**6, seed=5)))
    assert events[-1].finish_reason is FinishReason.LENGTH
    assert text == run(collect(engine, request(engine, "hello", temperature=1.0, seed=5)))[0]


def test_tiny_temperature_is_greedy(engine):
    greedy = run(collect(engine, request(engine, "Berlin is")))[0]
    assert run(collect(engine, request(engine, "Berlin is", temperature=1e-30)))[0] == greedy


def test_engine_recovers_from_a_poisoned_random_state(engine):
    """An exception inside a compiled mlx-lm sampler leaves a tracer in MLX's global random state;
    the engine's fault recovery must restore it so later sampled requests work."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_top_k

    def poison(_engine):
        try:
            apply_top_k(mx.zeros((1, 8)), 100)
        except ValueError:
            return True
        return False

    assert run(engine.call(poison))
    outcomes = [run(collect(engine, request(engine, "hello", temperature=1.0)))[1][-1].finish_reason
                for _ in range(3)]
    assert outcomes[-1] is FinishReason.LENGTH and outcomes.count(FinishReason.ERROR) <= 1
