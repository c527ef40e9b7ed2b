"""`AsyncEngine.shutdown(drain_s)` on the tiny model: drain, refuse, abort past the drain, flush the SSD.

The model is paced (a short sleep in each forward pass, on the MLX thread) so that a request of
N tokens surely outlasts N sleeps: whether it ran to its end or was stopped then depends on the
drain rules, not on how fast this machine is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import diskcache
import pytest

from cache_tiers.config import CacheConfig
from cache_tiers.factory import build_store
from cache_tiers.storage import DiskcacheStorage
from engine.loop import default_store
from engine.types import EngineClosedError, FinishReason, TokenEvent
from engine_helpers import collect, make_engine, request, run

PACE_S = 0.01
PROMPT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France. " * 2


class Paced:
    """A real model whose every forward pass also sleeps PACE_S."""

    def __init__(self, model: Any) -> None:
        self.inner = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(PACE_S)
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def paced_engine(path, **overrides: Any):
    return make_engine(path, wrap=Paced, **overrides)


async def first_then_rest(engine, req) -> tuple[asyncio.Future, list[TokenEvent]]:
    """Start streaming `req`; return once its first token arrived, with a task for the rest."""
    events: list[TokenEvent] = []
    first = asyncio.get_running_loop().create_future()

    async def consume() -> list[TokenEvent]:
        async for event in engine.generate(req):
            events.append(event)
            if not first.done():
                first.set_result(None)
        return events

    task = asyncio.ensure_future(consume())
    await asyncio.wait_for(first, 60)
    return task, events


def test_running_requests_finish_within_the_drain_and_new_ones_are_refused(tiny_model_dir, tmp_path):
    cache = CacheConfig(ssd_dir=str(tmp_path / "ssd"), ram_bytes=64 * 2**20, block_size=16, min_restore_tokens=8)
    eng = paced_engine(tiny_model_dir, store_factory=default_store, cache=cache)
    req = request(eng, PROMPT, max_tokens=60, ignore_eos=True)

    async def main() -> list[TokenEvent]:
        task, _ = await first_then_rest(eng, req)
        stopping = asyncio.ensure_future(eng.shutdown(drain_s=120))
        await asyncio.sleep(0)  # shutdown has begun: the engine refuses from now on
        with pytest.raises(EngineClosedError, match="retry on another replica"):
            await collect(eng, request(eng, "a late one", max_tokens=4))
        events = await asyncio.wait_for(task, 60)
        await asyncio.wait_for(stopping, 60)
        return events

    events = run(main())
    assert events[-1].finish_reason is FinishReason.LENGTH, events[-1]
    assert sum(1 for e in events if e.token_id is not None) == 60
    # What finished during the drain was offered to the store and written before the engine stopped.
    again = make_engine(tiny_model_dir, store_factory=default_store, cache=cache)
    try:
        follow_up = request(again, PROMPT, max_tokens=2)
        _, hit = run(collect(again, follow_up))
        assert hit[-1].usage.cache_tier == "ssd"
        assert hit[-1].usage.cached_tokens >= len(follow_up.prompt_tokens) - 16
    finally:
        run(again.shutdown())


def test_past_the_drain_running_and_queued_requests_end_with_a_shutdown_error(tiny_model_dir):
    eng = paced_engine(tiny_model_dir, max_running=1, prefill_batch=1)
    running = request(eng, PROMPT, max_tokens=1000, ignore_eos=True)  # >= 10 s paced: outlasts the drain
    queued = request(eng, "waiting for a slot", max_tokens=8)

    async def main() -> tuple[list[TokenEvent], list[TokenEvent]]:
        task, _ = await first_then_rest(eng, running)
        waiting = asyncio.ensure_future(collect(eng, queued))
        await asyncio.sleep(0.05)  # queued behind the running one (max_running=1)
        await asyncio.wait_for(eng.shutdown(drain_s=0.2), 60)  # never a hang
        return await asyncio.wait_for(task, 10), (await asyncio.wait_for(waiting, 10))[1]

    events, queued_events = run(main())
    for evs in (events, queued_events):
        last = evs[-1]
        assert last.finish_reason is FinishReason.ABORT and last.error_code == "shutdown", last
        assert "retry" in last.error
    assert sum(1 for e in events if e.token_id is not None) < 1000
    assert not any(e.token_id is not None for e in queued_events)


def test_after_shutdown_calls_and_requests_are_refused_not_left_waiting(tiny_model_dir):
    eng = make_engine(tiny_model_dir)

    async def main() -> None:
        await eng.shutdown()
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(eng.call(lambda engine: None), 10)
        with pytest.raises(EngineClosedError):
            await asyncio.wait_for(collect(eng, request(eng, "hello", max_tokens=2)), 10)

    run(main())


def test_commands_left_when_the_thread_stops_are_answered(tiny_model_dir):
    """A call that races the stop (a health probe, an admin call) is answered, or fails, but
    never waits forever for a thread that has gone."""
    eng = paced_engine(tiny_model_dir)
    req = request(eng, PROMPT, max_tokens=1000, ignore_eos=True)

    async def main() -> None:
        task, _ = await first_then_rest(eng, req)
        stopping = asyncio.ensure_future(eng.shutdown(drain_s=0))
        await asyncio.sleep(0)  # the stop command is queued; this call lands behind it
        late = asyncio.ensure_future(eng.call(lambda engine: "ran"))
        await asyncio.wait_for(stopping, 60)
        try:
            assert await asyncio.wait_for(late, 10) == "ran"  # it got in before the stop after all
        except EngineClosedError:
            pass
        assert (await asyncio.wait_for(task, 10))[-1].error_code == "shutdown"

    run(main())


class SlowDisk:
    """The real diskcache storage, with each entry's write taking WRITE_S (markers are fast)."""

    WRITE_S = 0.4

    def __init__(self, inner: DiskcacheStorage) -> None:
        self.inner = inner

    def set(self, key: str, value: bytes) -> None:
        if key.startswith("e/"):
            time.sleep(self.WRITE_S)
        self.inner.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_shutdown_returns_once_the_queued_ssd_writes_are_on_disk(tiny_model_dir, tmp_path):
    """Finished requests' entries are queued for the SSD behind the request path; a slow disk keeps
    them queued when the engine is told to stop. `shutdown` returns only once they are on disk: a
    process that exits right after (a replica told to stop) keeps them for the next start."""
    cache = CacheConfig(ssd_dir=str(tmp_path / "ssd"), ram_bytes=64 * 2**20, block_size=16, min_restore_tokens=8)

    def slow_store(config, loaded):
        disk = SlowDisk(DiskcacheStorage(config.cache.ssd_dir, config.cache.ssd_bytes))
        return build_store(config.cache, loaded.fingerprint, storage=disk)

    eng = make_engine(tiny_model_dir, store_factory=slow_store, cache=cache)
    for i in range(3):
        run(collect(eng, request(eng, PROMPT + f" Question {i}?", max_tokens=3)))
    run(eng.shutdown())
    on_disk = diskcache.Cache(cache.ssd_dir)
    try:
        entries = [key for key in on_disk.iterkeys() if key.startswith("b/")]
    finally:
        on_disk.close()
    assert len(entries) >= 3, entries
