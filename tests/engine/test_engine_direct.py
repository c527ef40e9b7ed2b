"""A prefix hit's first token comes from a prefill outside the batch (`engine.direct_first_token`).

The same requests run with the direct path on and off must give the same tokens, log-probabilities
and endings; with it on, the first token is out in the step that admits the request.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from cache_tiers.factory import build_store
from cache_tiers.config import CacheConfig
from engine.config import EngineConfig
from engine.engine import Engine
from engine.forward import last_logits
from engine.types import FinishReason, Request, SamplingParams, TokenEvent
from engine_helpers import tiny_loader

PREFIX = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 6


def make(tiny_model_dir, direct: int | None, **overrides: Any) -> Engine:
    cache = CacheConfig(ram_bytes=64 * 2**20, min_restore_tokens=8)
    config = EngineConfig(model=str(tiny_model_dir), direct_first_token=direct, cache=cache, **overrides)
    loaded = tiny_loader(tiny_model_dir)(config)
    return Engine(loaded.model, loaded.tokenizer, config, store=build_store(cache, "tiny"))


def drive(eng: Engine, requests: list[Request]) -> dict[str, list[TokenEvent]]:
    """Run `requests` together to the end; every event, by request id."""
    out: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    for r in requests:
        eng.add_request(r)
    while eng.has_work():
        for e in eng.step():
            out[e.request_id].append(e)
    return out


def warm(eng: Engine) -> tuple[int, ...]:
    prefix = tuple(eng.tokenizer.encode(PREFIX))
    drive(eng, [Request(prefix + (5,), SamplingParams(max_tokens=2, temperature=0.0), request_id="warm")])
    return prefix


def questions(prefix: tuple[int, ...], **params: Any) -> list[Request]:
    return [Request(prefix + tuple(range(40 + i, 50 + 2 * i)), SamplingParams(**params), request_id=f"q{i}")
            for i in range(3)]


def summary(events: list[TokenEvent]) -> tuple:
    """Tokens, text, ending and length; log-probabilities apart (`logprobs`), compared with a tolerance
    (rounding them would flip a digit now and then: -0.38805 vs -0.38804)."""
    return (tuple(e.token_id for e in events if e.token_id is not None), "".join(e.text for e in events),
            events[-1].finish_reason, events[-1].usage.completion_tokens)


def logprobs(events: list[TokenEvent]) -> list[float]:
    return [e.logprob.logprob for e in events if e.logprob is not None]


PARAMS = [
    dict(max_tokens=12, temperature=0.0, logprobs=2),
    dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=7, repetition_penalty=1.3, presence_penalty=0.5),
    dict(max_tokens=1, temperature=0.0),
]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy-logprobs", "seeded-penalties", "one-token"])
def test_direct_first_token_changes_no_output(tiny_model_dir, params):
    results, lps = {}, {}
    for direct in (None, 256):
        eng = make(tiny_model_dir, direct)
        try:
            prefix = warm(eng)
            out = drive(eng, questions(prefix, **params))
            results[direct] = {k: summary(v) for k, v in out.items()}
            lps[direct] = {k: logprobs(v) for k, v in out.items()}
            assert eng.stats.direct_first_tokens == (3 if direct else 0)
            assert all(v[-1].usage.cached_tokens >= len(prefix) - 8 for v in out.values())
        finally:
            eng.close()
    assert results[None] == results[256]
    assert lps[None].keys() == lps[256].keys()
    for key, cold in lps[None].items():
        assert lps[256][key] == pytest.approx(cold, abs=1e-3), key


def test_first_token_comes_in_the_admitting_step(tiny_model_dir):
    eng = make(tiny_model_dir, 256)
    try:
        prefix = warm(eng)
        [req] = questions(prefix, max_tokens=6, temperature=0.0)[:1]
        eng.add_request(req)
        first = eng.step()
        assert [e.request_id for e in first if e.token_id is not None] == [req.request_id]
        assert eng.seqs[req.request_id].first_token_at is not None
        events = list(first)
        while eng.has_work():
            events += eng.step()
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert events[-1].usage.completion_tokens == 6
        assert sum(1 for e in events if e.token_id is not None) == 6
    finally:
        eng.close()


def test_longer_rest_than_the_limit_takes_the_batch_path_unless_nobody_runs(tiny_model_dir):
    """Rests of 10-14 tokens against a limit of 4: the first of three admitted together finds the
    batch idle and goes direct (it stalls nobody); the two after it would stall it: batch path."""
    eng = make(tiny_model_dir, 4)
    try:
        prefix = warm(eng)
        out = drive(eng, questions(prefix, max_tokens=4, temperature=0.0))
        assert eng.stats.direct_first_tokens == 1
        assert all(v[-1].finish_reason is FinishReason.LENGTH for v in out.values())
    finally:
        eng.close()


def test_a_short_cached_start_is_restored_in_the_batch_not_directly(tiny_model_dir):
    """A hit covering less than half of its prompt (a shared system prompt, say) is mostly a new
    prompt: it prefills in the batch on top of its cached start, with the tokens a cold run gives."""
    outputs = {}
    for warmed in (False, True):
        eng = make(tiny_model_dir, 256)
        try:
            start = tuple(eng.tokenizer.encode(PREFIX))[:10]
            if warmed:
                drive(eng, [Request(start + (5,), SamplingParams(max_tokens=2, temperature=0.0), request_id="w")])
            requests = [Request(start + tuple(range(40 + i, 62 + i)), SamplingParams(max_tokens=6, temperature=0.0),
                                request_id=f"r{i}") for i in range(3)]  # rests of 22 tokens on 10 cached
            out = drive(eng, requests)
            outputs[warmed] = {k: summary(v) for k, v in out.items()}
            cached = [v[-1].usage.cached_tokens for v in out.values()]
            assert eng.stats.direct_first_tokens == 0
            assert all(8 <= c <= 10 for c in cached) if warmed else cached == [0, 0, 0]
        finally:
            eng.close()
    assert outputs[True] == outputs[False]


def test_first_token_can_end_the_request(tiny_model_dir):
    eng = make(tiny_model_dir, 256)
    try:
        prefix = warm(eng)
        [probe] = questions(prefix, max_tokens=1, temperature=0.0)[:1]
        first = drive(eng, [probe])[probe.request_id][-1]
        stop_id = Request(probe.prompt_tokens, SamplingParams(max_tokens=8, temperature=0.0,
                                                              stop_token_ids=(first.token_id,)), request_id="s")
        stop_text = Request(probe.prompt_tokens, SamplingParams(max_tokens=8, temperature=0.0,
                                                                stop=(first.text[:1],)), request_id="t")
        out = drive(eng, [stop_id, stop_text])
        for rid in ("s", "t"):
            assert out[rid][-1].finish_reason is FinishReason.STOP
            assert "".join(e.text for e in out[rid]) == ""
            assert out[rid][-1].usage.completion_tokens == 1
        assert eng.stats.direct_first_tokens >= 3
        assert len(eng.runner) == 0  # nothing left behind in the batch
    finally:
        eng.close()


def test_config_resolves_auto_per_backend():
    assert EngineConfig(prefill_chunk=128).direct_first_token_limit(on_cpu=True) == 128
    assert EngineConfig().direct_first_token_limit(on_cpu=False) == 0
    assert EngineConfig(direct_first_token=None).direct_first_token_limit(on_cpu=True) == 0
    assert EngineConfig(direct_first_token=32).direct_first_token_limit(on_cpu=False) == 32
    with pytest.raises(ValueError, match="direct_first_token"):
        EngineConfig(direct_first_token=0)


@pytest.mark.parametrize("direct", [None, 256], ids=["batch-path", "direct-path"])
def test_engine_records_time_to_first_token_and_queue_time(tiny_model_dir, direct):
    """The engine's own TTFT and queue-time sums (what /metrics exports next to the ingress's TTFT
    histogram): counted once per request, from arrival, with queue time never above TTFT."""
    eng = make(tiny_model_dir, direct)
    try:
        prefix = warm(eng)
        before = eng.stats.as_dict()
        reqs = questions(prefix, max_tokens=3, temperature=0.0)
        drive(eng, reqs)
        after = eng.stats.as_dict()
        assert after["first_tokens"] - before["first_tokens"] == len(reqs)
        ttft = after["ttft_seconds_sum"] - before["ttft_seconds_sum"]
        queued = after["queue_seconds_sum"] - before["queue_seconds_sum"]
        assert ttft > 0 and 0 <= queued <= ttft
    finally:
        eng.close()


class _Scaled(llama.Model):
    """An architecture whose call does more than body + head: it must get the full call."""

    def __call__(self, inputs, cache=None, input_embeddings=None):
        return super().__call__(inputs, cache, input_embeddings) * 0.5


@pytest.mark.parametrize("cls,tied", [(llama.Model, True), (llama.Model, False), (_Scaled, True)])
def test_last_logits_equal_the_full_calls_last_row(cls, tied):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97,
                           tie_word_embeddings=tied)
    mx.random.seed(3)
    model = cls(args)
    prefix, rest = mx.array([[5, 17, 42, 3, 9]]), mx.array([[11, 7, 60, 2]])
    full_cache, last_cache = make_prompt_cache(model), make_prompt_cache(model)
    model(prefix, cache=full_cache), model(prefix, cache=last_cache)
    want = model(rest, cache=full_cache)[:, -1, :]
    got = last_logits(model, rest, last_cache)
    assert got.shape == (1, 97)
    assert mx.allclose(got, want, atol=1e-5).item()
    # Both leave the same cache behind: the next token continues from the whole rest.
    assert [c.offset for c in last_cache] == [c.offset for c in full_cache] == [9, 9]
    assert mx.allclose(model(mx.array([[4]]), cache=last_cache), model(mx.array([[4]]), cache=full_cache),
                       atol=1e-5).item()


def _admit_one_by_one(eng: Engine, requests: list[Request]) -> list[list[TokenEvent]]:
    """Queue each request after the previous step, as hits arriving during each direct prefill."""
    steps = []
    for request in requests:
        eng.add_request(request)
        steps.append(eng.step())
    return steps


def test_hits_arriving_during_a_direct_prefill_join_before_the_batch_steps(tiny_model_dir):
    # One token per request per step is what this counts: speculation (several a step) off.
    eng = make(tiny_model_dir, 256, speculative="off")
    try:
        requests = questions(warm(eng), max_tokens=5, temperature=0.0)
        batch_steps = eng.stats.steps
        steps = _admit_one_by_one(eng, requests)
        # Each step admitted one newcomer and sent its first token; the batch has not run yet.
        assert [[e.request_id for e in step if e.token_id is not None] for step in steps] == [["q0"], ["q1"], ["q2"]]
        assert eng.stats.steps == batch_steps and len(eng.runner) == 3
        events = [e for step in steps for e in step]
        while eng.has_work():
            events += eng.step()
        # All three joined the batch together: every later step carried a token for each until the end.
        later = [e for e in events[3:] if e.token_id is not None]
        assert [sorted(e.request_id for e in later[i:i + 3]) for i in range(0, 12, 3)] == [["q0", "q1", "q2"]] * 4
        for request_id in ("q0", "q1", "q2"):
            mine = [e for e in events if e.request_id == request_id]
            assert sum(1 for e in mine if e.token_id is not None) == 5
            assert mine[-1].finish_reason is FinishReason.LENGTH
    finally:
        eng.close()


def test_direct_admissions_hold_the_batch_for_at_most_prefill_batch_of_them(tiny_model_dir):
    eng = make(tiny_model_dir, 256, prefill_batch=2)
    try:
        q0, q1, q2 = questions(warm(eng), max_tokens=3, temperature=0.0)
        batch_steps = eng.stats.steps
        [first] = _admit_one_by_one(eng, [q0])
        assert [e.request_id for e in first if e.token_id is not None] == ["q0"]
        assert eng.stats.steps == batch_steps
        [second] = _admit_one_by_one(eng, [q1])
        # The second direct admission reaches the bound: the batch runs in the same step.
        assert [e.request_id for e in second if e.token_id is not None] == ["q1"]
        assert eng.stats.steps == batch_steps + 1
        eng.add_request(q2)
        third = eng.step()  # the count starts again: q2's first token, no batch step
        assert [e.request_id for e in third if e.token_id is not None] == ["q2"]
        assert eng.stats.steps == batch_steps + 1
        cold = Request(tuple(range(60, 90)), SamplingParams(max_tokens=3, temperature=0.0), request_id="cold")
        eng.add_request(cold)
        eng.step()  # no direct admission: the batch runs (and takes the cold prompt in)
        assert eng.stats.steps == batch_steps + 2 and eng.stats.direct_first_tokens == 3
    finally:
        eng.close()
