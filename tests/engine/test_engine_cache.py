"""The engine with the real tiered prefix store: hits are exact, reported, and survive restarts."""

from __future__ import annotations

import pytest

from cache_tiers.config import CacheConfig
from engine.loop import default_store
from engine_helpers import collect, make_engine, request, run

LONG = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
        "Berlin is the capital of Germany. Madrid is the capital of Spain. ") * 4


def cache_config(tmp_path, **kw) -> CacheConfig:
    kw.setdefault("ram_bytes", 256 * 2**20)
    return CacheConfig(ssd_dir=str(tmp_path / "ssd"), block_size=16, min_restore_tokens=8, **kw)


@pytest.fixture()
def cold_texts(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    try:
        yield {q: run(collect(eng, request(eng, LONG + q, max_tokens=20)))[0] for q in ("Who?", "Where?")}
    finally:
        run(eng.shutdown())


def test_hit_gives_same_greedy_output_and_reports_cached_tokens(tiny_model_dir, tmp_path, cold_texts):
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=cache_config(tmp_path))
    try:
        first_text, first = run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
        assert first_text == cold_texts["Who?"]
        assert first[-1].usage.cached_tokens == 0
        second_text, second = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))
        assert second_text == cold_texts["Where?"]
        usage = second[-1].usage
        prefix_len = len(eng.tokenizer.encode(LONG))
        assert usage.cache_tier == "ram"
        assert prefix_len - 4 <= usage.cached_tokens < usage.prompt_tokens
        stats = eng.stats()
        assert stats["cached_tokens_total"] == usage.cached_tokens
        assert stats["direct_first_tokens"] == 1  # the hit's first token came from the direct path
    finally:
        run(eng.shutdown())


def test_exact_repeat_reuses_all_but_one_token(tiny_model_dir, tmp_path, cold_texts):
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=cache_config(tmp_path))
    try:
        run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
        text, events = run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
        assert text == cold_texts["Who?"]
        assert events[-1].usage.cached_tokens == events[-1].usage.prompt_tokens - 1
    finally:
        run(eng.shutdown())


def test_next_chat_turn_reuses_prompt_and_output(tiny_model_dir, tmp_path):
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=cache_config(tmp_path))
    try:
        prompt = eng.tokenizer.encode(LONG)
        first = run(collect(eng, request(eng, LONG, max_tokens=12, logprobs=0)))[1]
        output = [e.token_id for e in first]
        follow_up = tuple(prompt + output + eng.tokenizer.encode(" And then?"))
        from engine.types import Request, SamplingParams

        events = run(collect(eng, Request(follow_up, SamplingParams(max_tokens=4, temperature=0.0))))[1]
        # everything up to the end of the first answer came from the cache
        assert events[-1].usage.cached_tokens >= len(prompt) + len(output) - 1
    finally:
        run(eng.shutdown())


@pytest.mark.parametrize("host_copies", ["auto", True])  # True: what MLX's CUDA backend runs (the writer reads copies)
def test_ssd_tier_serves_after_restart(tiny_model_dir, tmp_path, cold_texts, host_copies):
    config = cache_config(tmp_path, host_copies=host_copies)
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
    run(eng.shutdown())  # flushes the SSD write-behind queue

    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    try:
        text, events = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))
        assert text == cold_texts["Where?"]
        assert events[-1].usage.cache_tier == "ssd"
        assert events[-1].usage.cached_tokens >= 16
    finally:
        run(eng.shutdown())


def test_concurrent_requests_sharing_a_prefix_compute_it_once(tiny_model_dir, tmp_path, cold_texts):
    import asyncio

    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=cache_config(tmp_path))
    try:
        async def both():
            return await asyncio.gather(collect(eng, request(eng, LONG + "Who?", max_tokens=20)),
                                        collect(eng, request(eng, LONG + "Where?", max_tokens=20)))

        (who, who_events), (where, where_events) = run(both())
        assert who == cold_texts["Who?"] and where == cold_texts["Where?"]
        cached = sorted([who_events[-1].usage.cached_tokens, where_events[-1].usage.cached_tokens])
        assert cached[0] == 0 and cached[1] >= len(eng.tokenizer.encode(LONG)) - 4
    finally:
        run(eng.shutdown())


def test_a_tenant_never_hits_another_tenants_prefix(tiny_model_dir, tmp_path):
    """Requests share cached prefixes only under the same cache salt (the tenant): another salt gets
    no hit, so neither its cached-token count nor its timing reveals another tenant's prompt."""
    from engine.types import Request, SamplingParams

    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=cache_config(tmp_path))
    try:
        tokens = tuple(eng.tokenizer.encode(LONG + "Who?"))

        def ask(salt):
            events = run(collect(eng, Request(tokens, SamplingParams(max_tokens=4, temperature=0.0),
                                              cache_salt=salt)))[1]
            return events[-1].usage.cached_tokens

        assert ask("tenant-a") == 0
        assert ask("tenant-b") == 0  # a's prefix is not served to b, from RAM or the SSD
        assert ask("tenant-a") == len(tokens) - 1
        assert ask("tenant-b") == len(tokens) - 1  # b's own history is
    finally:
        run(eng.shutdown())


class HeldReads:
    """A restarted engine whose prefix store's SSD reads wait for `go` (their threads in `readers`,
    `started` set by the first): the LONG prefix is on its SSD only."""

    def __init__(self, tiny_model_dir, tmp_path) -> None:
        import threading

        config = cache_config(tmp_path)
        eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
        run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
        run(eng.shutdown())
        stores: list = []
        self.engine = make_engine(tiny_model_dir, cache=config,
                                  store_factory=lambda c, l: stores.append(default_store(c, l)) or stores[0])
        self.started, self.go, self.readers = threading.Event(), threading.Event(), []
        read = stores[0].ssd.read_blocks

        def held_read(*args):
            self.readers.append(threading.current_thread().name)
            self.started.set()
            self.go.wait(20)
            return read(*args)

        stores[0].ssd.read_blocks = held_read

    async def read_started(self) -> bool:
        import asyncio

        return await asyncio.to_thread(self.started.wait, 60)

    def close(self) -> None:
        self.go.set()
        run(self.engine.shutdown())


def test_an_ssd_read_never_holds_up_the_running_requests(tiny_model_dir, tmp_path, cold_texts):
    """After a restart a prompt's prefix is on the SSD only: the store's reader thread reads it while
    the engine keeps stepping, so another request runs to its end while that read is held, and the
    SSD hit is then admitted with the same output as a cold start and reported as the SSD's."""
    import asyncio

    held = HeldReads(tiny_model_dir, tmp_path)
    eng = held.engine

    async def scenario():
        hit = asyncio.create_task(collect(eng, request(eng, LONG + "Where?", request_id="hit", max_tokens=20)))
        assert await held.read_started()
        other, events = await collect(eng, request(eng, "Hello there, how are you today?", max_tokens=24))
        assert events[-1].finished and not hit.done()  # ran to its end while the read was held
        phases = {r["id"]: r["phase"] for r in await eng.requests_status()}
        assert phases == {"hit": "loading"}
        held.go.set()
        return await hit

    try:
        text, events = run(scenario())
        assert text == cold_texts["Where?"]
        assert events[-1].usage.cache_tier == "ssd" and events[-1].usage.cached_tokens >= 16
        assert held.readers and all(name.startswith("pomona-ssd-reader") for name in held.readers)
    finally:
        held.close()


def test_a_request_aborted_while_its_prefix_loads_ends_and_the_engine_goes_on(tiny_model_dir, tmp_path, cold_texts):
    import asyncio

    held = HeldReads(tiny_model_dir, tmp_path)
    eng = held.engine

    async def scenario():
        hit = asyncio.create_task(collect(eng, request(eng, LONG + "Where?", request_id="left", max_tokens=20)))
        assert await held.read_started()
        eng.abort("left")
        text, events = await hit
        held.go.set()
        assert events[-1].finish_reason.value == "abort" and text == ""
        assert await eng.requests_status() == []
        # The same prompt again: served (from what the read brought, or the SSD), as a cold start would.
        return await collect(eng, request(eng, LONG + "Where?", max_tokens=20))

    try:
        text, events = run(scenario())
        assert text == cold_texts["Where?"] and events[-1].usage.cached_tokens >= 16
        assert run(eng.call(lambda e: len(e._loads))) == 0
    finally:
        held.close()


def _recorded_restart(tiny_model_dir, tmp_path, **cache_kw):
    """An engine restarted on an SSD holding LONG's prefix, whose store records each `complete`
    call: (time, what it returned, blocks held so far)."""
    import time

    config = cache_config(tmp_path, **cache_kw)
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    run(collect(eng, request(eng, LONG + "Who?", max_tokens=20)))
    run(eng.shutdown())
    stores: list = []
    eng = make_engine(tiny_model_dir, cache=config,
                      store_factory=lambda c, l: stores.append(default_store(c, l)) or stores[0])
    calls: list = []
    complete = stores[0].complete

    def recorded(prefetch, budget_s=None):
        done = complete(prefetch, budget_s)
        calls.append((time.perf_counter(), done, prefetch.blocks_taken))
        return done

    stores[0].complete = recorded
    return eng, calls


def test_a_long_ssd_hit_is_handed_over_across_steps_while_others_run(tiny_model_dir, tmp_path, cold_texts):
    """With a request decoding, the hit's rows become MLX arrays a step at a time (`ssd_handover_ms`,
    here small enough for one block a step), the decoding request's tokens arriving in between;
    the hit then gives the cold output. Alone, the hand-over is one call."""
    import asyncio
    import time

    eng, calls = _recorded_restart(tiny_model_dir, tmp_path, ssd_handover_ms=1e-6)
    stamps: list[float] = []

    async def scenario():
        async def other():
            async for batch in eng.stream(request(eng, "Hello there, how are you today?", max_tokens=200,
                                                  ignore_eos=True)):
                stamps.extend(time.perf_counter() for e in batch if e.token_id is not None)

        running = asyncio.create_task(other())
        while not stamps:
            await asyncio.sleep(0.01)
        hit = await collect(eng, request(eng, LONG + "Where?", max_tokens=20))
        eng.abort(next(iter(r["id"] for r in await eng.requests_status())))
        await running
        return hit

    try:
        text, events = run(scenario())
        assert text == cold_texts["Where?"] and events[-1].usage.cache_tier == "ssd"
        assert len(calls) > 2 and not any(done for _, done, _ in calls[:-1]) and calls[-1][1]
        assert [taken for _, _, taken in calls] == list(range(1, len(calls) + 1))  # a block a step
        assert sum(1 for t in stamps if calls[0][0] < t < calls[-1][0]) >= len(calls) - 2  # the other went on
    finally:
        run(eng.shutdown())
    eng, calls = _recorded_restart(tiny_model_dir, tmp_path / "alone", ssd_handover_ms=1e-6)
    try:
        text, events = run(collect(eng, request(eng, LONG + "Where?", max_tokens=20)))
        assert text == cold_texts["Where?"] and events[-1].usage.cache_tier == "ssd"
        assert len(calls) == 1 and calls[0][1] and calls[0][2] > 2  # nobody to wait: all at once
    finally:
        run(eng.shutdown())


def test_an_idle_engine_writes_what_the_ssd_backlog_could_not_take_on_its_own(tiny_model_dir, tmp_path):
    """A prompt of more blocks than the SSD writer's backlog takes: the blocks left over reach the
    disk while the engine idles, with no request and no flush to drive it (the loop comes back
    every `WRITE_WAIT_S` while some are left); `ssd_write: idle` writes all of them only then."""
    import time

    for policy in ("through", "idle"):
        config = cache_config(tmp_path / policy, write_queue=2, ssd_write=policy)
        eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
        try:
            prompt = LONG * 3  # ~40 blocks of 16 tokens
            blocks = len(eng.tokenizer.encode(prompt)) // 16
            run(collect(eng, request(eng, prompt, max_tokens=2)))
            deadline = time.monotonic() + 5  # at the plain idle wait (0.5 s) ~20 rounds take 10 s
            while time.monotonic() < deadline:  # the engine's own idle ticks; stats are read, not driven
                time.sleep(0.25)
                written = eng.stats()["cache"]["ssd"]["writes"]
                if written >= blocks:
                    break
            assert written >= blocks, (policy, written, blocks)
        finally:
            run(eng.shutdown())


def test_a_cache_flush_returns_once_everything_ram_holds_is_on_disk(tiny_model_dir, tmp_path):
    """`/admin/cache/flush` (AsyncEngine.flush_cache) with more blocks than the writer's backlog
    takes: it hands them over as the writer drains and returns once none are left."""
    config = cache_config(tmp_path, write_queue=2, ssd_write="idle")
    eng = make_engine(tiny_model_dir, store_factory=default_store, cache=config)
    try:
        prompt = LONG * 3
        blocks = len(eng.tokenizer.encode(prompt)) // 16
        run(collect(eng, request(eng, prompt, max_tokens=2)))
        stats = run(eng.flush_cache())
        assert stats["ssd"]["writes"] >= blocks and stats["ssd"]["queued"] == 0
        assert run(eng.call(lambda e: e.store.unwritten())) == 0
    finally:
        run(eng.shutdown())


@pytest.mark.parametrize("engine_step", ["pomona", "mlx_lm"])
def test_a_conversations_offers_copy_its_new_tokens_not_its_history(tiny_model_dir, tmp_path, engine_step):
    """Each turn's offers (its prompt's end, its finish) hand the store only the KV past the blocks it
    holds (the own step; mlx-lm's generator copies whole caches), and every turn still answers as cold."""
    from engine.types import Request, SamplingParams

    offers = []

    def recording(config, loaded):
        store = default_store(config, loaded)
        real = store.offer

        def offer(tokens, cache, kind, salt="", start=0):
            offers.append((kind, len(tokens), start, cache[0].state[0].shape[2]))
            return real(tokens, cache, kind, salt, start)

        store.offer = offer
        return store

    def turns(eng):
        conversation, texts = [], []
        for question in (LONG, " Who lives there?", " And in Spain?"):
            conversation = conversation + eng.tokenizer.encode(question)
            text, events = run(collect(eng, Request(tuple(conversation), SamplingParams(max_tokens=12, temperature=0.0))))
            conversation = conversation + [e.token_id for e in events if e.token_id is not None]
            texts.append(text)
        return texts

    cold = make_engine(tiny_model_dir, engine_step=engine_step)
    try:
        want = turns(cold)
    finally:
        run(cold.shutdown())
    eng = make_engine(tiny_model_dir, store_factory=recording, cache=cache_config(tmp_path), engine_step=engine_step)
    try:
        assert turns(eng) == want
    finally:
        run(eng.shutdown())
    later = [o for o in offers if o[1] > offers[0][1] + 16]  # offers of turns 2 and 3
    assert later
    for kind, n, start, copied in later:
        assert copied == n - start
        if engine_step == "pomona":
            assert start > 0 and copied < 40, (kind, n, start)  # a turn's new tokens and at most a block more
        else:
            assert start == 0
