"""Seed-parity features of the engine: checkpoints, warm-up, bounded KV, deep reset."""

from __future__ import annotations

import pytest

from cache_tiers.config import CacheConfig

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import default_store
from engine.types import FinishReason, Request, RequestStatus, SamplingParams
from engine_helpers import FaultyModel, collect, make_engine, request, run, tiny_loader

TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 40


def store_config(tmp_path) -> CacheConfig:
    return CacheConfig(ram_bytes=256 * 2**20, ssd_dir=str(tmp_path / "ssd"), block_size=16, min_restore_tokens=8)


def test_failed_long_prefill_resumes_from_last_checkpoint(tiny_model_dir, tmp_path):
    holder = {}

    def wrap(model):
        holder["m"] = FaultyModel(model)
        return holder["m"]

    eng = make_engine(tiny_model_dir, wrap=wrap, store_factory=default_store, cache=store_config(tmp_path),
                      prefill_chunk=64, checkpoint_every=128)
    try:
        tokens = tuple(eng.tokenizer.encode(TEXT))[:600]
        assert len(tokens) == 600
        holder["m"].fail_after = 6  # the 6th prefill chunk fails: 320 tokens were done
        events = run(collect(eng, Request(tokens, SamplingParams(max_tokens=4, temperature=0.0))))[1]
        assert events[-1].finish_reason is FinishReason.ERROR
        events = run(collect(eng, Request(tokens, SamplingParams(max_tokens=4, temperature=0.0))))[1]
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert events[-1].usage.cached_tokens == 256  # the last checkpoint before the fault
    finally:
        run(eng.shutdown())


def test_warmup_prompt_is_cached_before_first_request(tiny_model_dir, tmp_path):
    system = "You are a helpful assistant. " * 10
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=store_config(tmp_path),
                      warmup_prompts=(system,))
    try:
        events = run(collect(eng, request(eng, system + "What is the capital of France?")))[1]
        assert events[-1].usage.cached_tokens >= len(eng.tokenizer.encode(system)) - 2
        assert events[-1].usage.cache_tier == "ram"
    finally:
        run(eng.shutdown())


def test_bounded_kv_keeps_streaming_past_its_size(tiny_model_dir):
    from engine.memory import kv_bytes_per_token

    eng = make_engine(tiny_model_dir, max_kv_size=64)
    try:
        text, events = run(collect(eng, request(eng, TEXT[:200], max_tokens=300)))
        assert events[-1].finish_reason is FinishReason.LENGTH and len(events) == 300
        # The own step's table stays allocated between requests (BatchGenerator frees its cache):
        # one row of a 64-slot ring and its scratch slot, rounded to the CPU's 64-position block,
        # not the ~350 positions the request went through.
        bpt = kv_bytes_per_token(tiny_loader(tiny_model_dir)(None).model)
        assert eng.stats()["runner"]["kind"] == "pomona" and 0 < eng.stats()["kv_bytes"] <= 128 * bpt
    finally:
        run(eng.shutdown())


def test_deep_reset_fails_running_and_empties_cache(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=store_config(tmp_path))
    try:
        run(collect(eng, request(eng, TEXT[:300])))

        async def scenario():
            gen = eng.generate(request(eng, "hello world", max_tokens=1900))
            await gen.__anext__()
            failed = await eng.deep_reset()
            return failed, [e async for e in gen]

        failed, rest = run(scenario())
        assert failed == 1
        assert rest[-1].finish_reason is FinishReason.ERROR
        events = run(collect(eng, request(eng, TEXT[:300])))[1]
        assert events[-1].usage.cached_tokens == 0
    finally:
        run(eng.shutdown())


def test_request_status_lists_phases(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_running=1, prefill_batch=1)
    try:
        async def scenario():
            gen = eng.generate(request(eng, "hello world", max_tokens=1900, request_id="decoding-one"))
            await gen.__anext__()
            waiting = eng.generate(request(eng, "Madrid", request_id="queued-one"))
            import asyncio

            task = asyncio.ensure_future(waiting.__anext__())
            await asyncio.sleep(0.3)
            status = {s["id"]: s for s in await eng.requests_status()}
            eng.abort("decoding-one")
            eng.abort("queued-one")
            async for _ in gen:
                pass
            await task
            return status

        status = run(scenario())
        assert status["decoding-one"]["phase"] == "decode"
        assert status["decoding-one"]["output_tokens"] >= 1 and status["decoding-one"]["ttft_s"] is not None
        assert status["queued-one"]["phase"] == "queued"
    finally:
        run(eng.shutdown())


def test_clear_cache_tiers(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=store_config(tmp_path))
    try:
        run(collect(eng, request(eng, TEXT[:300])))
        run(eng.call(lambda engine: engine.store.flush()))  # SSD writes happen behind the request
        stats = run(eng.clear_cache("ram"))
        assert stats["ram"]["entries"] == 0
        events = run(collect(eng, request(eng, TEXT[:300])))[1]
        assert events[-1].usage.cache_tier == "ssd"
        run(eng.clear_cache("all"))
        events = run(collect(eng, request(eng, TEXT[:300] + " more")))[1]
        assert events[-1].usage.cached_tokens == 0
    finally:
        run(eng.shutdown())


def test_memory_account_cache_gives_way_before_requests_wait(tiny_model_dir, tmp_path):
    from engine.memory import kv_bytes_per_token
    from engine_helpers import tiny_loader

    bpt = kv_bytes_per_token(tiny_loader(tiny_model_dir)(None).model)
    budget_tokens = 4000
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=store_config(tmp_path),
                      memory_budget_bytes=budget_tokens * bpt)
    try:
        run(collect(eng, request(eng, TEXT[:1200], max_tokens=2)))  # ~280 tokens cached in RAM
        run(eng.call(lambda engine: engine.store.flush()))
        assert eng.stats()["cache"]["ram"]["bytes"] > 0

        async def scenario():
            import asyncio

            # two requests reserving ~1,910 tokens each fit beside each other only if the cache
            # gives up its RAM; a third must wait.
            gens = [eng.generate(request(eng, "hello world", max_tokens=1900, request_id=f"m{i}"))
                    for i in range(3)]
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.wait(firsts[:2])
            await asyncio.sleep(0.3)
            status = {s["id"]: s["phase"] for s in await eng.requests_status()}
            stats = eng.stats()
            for i in range(3):
                eng.abort(f"m{i}")
            for g, f in zip(gens, firsts):
                await f
                async for _ in g:
                    pass
            return status, stats

        status, stats = run(scenario())
        assert status["m0"] == "decode" and status["m1"] == "decode" and status["m2"] == "queued"
        ram = stats["cache"]["ram"]
        assert ram["budget_bytes"] <= (budget_tokens - 2 * 1900) * bpt
        assert ram["bytes"] <= ram["budget_bytes"]
        assert stats["cache"]["ssd"]["demotions"] >= 1 or ram["evictions"] >= 1
    finally:
        run(eng.shutdown())


def test_quantized_prefix_entries_are_smaller_and_reused(tmp_path):
    from tiny_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "wide", hidden=128)  # head dim 32: mx.quantize's smallest group

    def ram_bytes_after_one(bits):
        cache = CacheConfig(ram_bytes=256 * 2**20, block_size=16, min_restore_tokens=8, quantize_bits=bits,
                            quantize_group_size=32, quantize_min_tokens=32)
        eng = make_engine(model_dir, store_factory=default_store, cache=cache)
        try:
            run(collect(eng, request(eng, TEXT[:600], max_tokens=4)))
            held = eng.stats()["cache"]["ram"]["bytes"]
            text, events = run(collect(eng, request(eng, TEXT[:600] + " again", max_tokens=8)))
            return held, events[-1].usage
        finally:
            run(eng.shutdown())

    full, _ = ram_bytes_after_one(None)
    small, usage = ram_bytes_after_one(8)
    assert small < 0.5 * full
    assert usage.cache_tier == "ram" and usage.cached_tokens >= 100


def test_bounded_kv_cache_is_stored_and_reused_only_at_exact_boundaries(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=store_config(tmp_path), max_kv_size=64)
    try:
        first_text, first = run(collect(eng, request(eng, TEXT[:300], max_tokens=80, logprobs=0)))
        output = tuple(e.token_id for e in first)
        prompt = tuple(eng.tokenizer.encode(TEXT[:300]))
        # the next turn starts with everything the rotated cache covered: an exact-boundary hit
        # (the own step's cache ends before the last output token, which it never fed)
        follow = prompt + output + tuple(eng.tokenizer.encode(" next"))
        events = run(collect(eng, Request(follow, SamplingParams(max_tokens=4, temperature=0.0))))[1]
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert events[-1].usage.cached_tokens == len(prompt) + len(output) - 1
        # a prompt that diverges inside the rotated window cannot use it (no trimming a ring buffer)
        other = prompt + output[:40] + tuple(eng.tokenizer.encode(" elsewhere"))
        events = run(collect(eng, Request(other, SamplingParams(max_tokens=4, temperature=0.0))))[1]
        assert events[-1].finish_reason is FinishReason.LENGTH
        assert events[-1].usage.cached_tokens < len(prompt) + 40
    finally:
        run(eng.shutdown())


@pytest.mark.parametrize("hold", [True, False])
def test_newcomer_waits_for_an_earlier_prompts_first_token(tiny_model_dir, hold):
    """The engine counts a prompt that is fed but has no token yet, and the scheduler holds others back.
    On mlx-lm's step, whose first token comes steps after the prompt is fed (the engine's own step
    reads it back the step after)."""
    config = EngineConfig(model=str(tiny_model_dir), first_token_first=hold, prefill_group_ratio=None,
                          engine_step="mlx_lm")
    loaded = tiny_loader(tiny_model_dir)(config)
    eng = Engine(loaded.model, loaded.tokenizer, config)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    eng.add_request(Request(tuple(range(20, 60)), params, request_id="a"))
    eng.step()  # admits "a" and feeds its prompt
    eng.add_request(Request(tuple(range(70, 90)), params, request_id="b"))
    admitted_before_first_token = False
    while eng.seqs["a"].first_token_at is None:
        eng.step()
        admitted_before_first_token |= eng.seqs["b"].status is not RequestStatus.WAITING and \
            eng.seqs["a"].first_token_at is None
    assert admitted_before_first_token is not hold
    while eng.has_work():
        eng.step()
    assert "b" not in eng.seqs  # it ran to the end either way
    eng.close()
