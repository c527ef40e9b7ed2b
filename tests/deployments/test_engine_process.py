"""The engine in its own process (deployments/engine_process.py + engine_worker.py) on the tiny model.

What the replica relied on in process must hold across the socket: the same events (tokens, text,
logprobs, endings, usage) as `AsyncEngine` in process, the same refusal exceptions before the first
event, aborts, administration, a drain on shutdown, and no orphan: a worker whose replica dies
exits, and a worker that dies ends every open request with an error event and fails the health check.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from api.core.wire import sampling_to_wire
from cache_tiers.config import CacheConfig
from deployments.engine_host import EngineHost
from deployments.engine_ipc import pack, receive, refusal_from_wire, refusal_to_wire
from deployments.engine_process import EngineProcess
from deployments.engine_worker import Worker
from engine.config import EngineConfig
from engine.loop import AsyncEngine
from engine.types import (ContextLengthError, EngineClosedError, FinishReason, InvalidRequestError,
                          OverloadedError, Request, SamplingParams)

ROOT = Path(__file__).resolve().parents[2]


def config(model: Path, **overrides) -> EngineConfig:
    overrides.setdefault("cache", CacheConfig(enabled=False))
    return EngineConfig(model=str(model), **overrides)


@contextlib.asynccontextmanager
async def running(cfg: EngineConfig):
    """An EngineProcess, ready, shut down at the end whatever happened."""
    engine = EngineProcess(cfg)
    await engine.wait_ready(120)
    try:
        yield engine
    finally:
        await engine.shutdown()


def req(rid: str, n: int, **params) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 12)
    return Request(tuple(range(7, 7 + n)), SamplingParams(**params), request_id=rid)


async def events_of(engine, request: Request) -> list:
    return [e async for batch in engine.stream(request) for e in batch]


def summary(events) -> list:
    out = []
    for e in events:
        lp = None if e.logprob is None else (e.logprob.token_id, round(e.logprob.logprob, 4),
                                              [(t, round(v, 4)) for t, v in e.logprob.top])
        out.append((e.token_id, e.text, lp, e.finish_reason, e.usage, e.stop_string, e.error))
    return out


def test_the_same_events_as_the_engine_in_process(tiny_model_dir):
    requests = [req("a", 5, logprobs=2), req("b", 40, stop=("e",), max_tokens=24), req("c", 17, ignore_eos=True),
                req("d", 9, logit_bias=((11, 5.0),), logprobs=0), req("e", 3, temperature=0.8, seed=3)]

    async def run(engine) -> list:
        await engine.wait_ready(120)
        try:
            return await asyncio.gather(*(events_of(engine, r) for r in requests))
        finally:
            await engine.shutdown()

    cfg = config(tiny_model_dir)
    here = asyncio.run(run(AsyncEngine(cfg)))
    there = asyncio.run(run(EngineProcess(cfg)))
    assert [summary(e) for e in there] == [summary(e) for e in here]
    assert all(e[-1].finished for e in there) and there[0][0].logprob is not None


@pytest.mark.parametrize("ms", [None, 0.5])
def test_the_engine_process_takes_its_switch_interval(tiny_model_dir, ms):
    """`engine.switch_interval_ms` sets the engine process's interpreter switch interval (its event
    loop against the MLX thread); unset, Python's own 5 ms stays."""
    async def go() -> dict:
        engine = EngineProcess(config(tiny_model_dir, switch_interval_ms=ms))
        await engine.wait_ready(120)
        try:
            await events_of(engine, req("x", 3, max_tokens=2))
            return engine.stats()
        finally:
            await engine.shutdown()

    assert asyncio.run(go())["engine_switch_interval_ms"] == pytest.approx(5.0 if ms is None else ms)
    with pytest.raises(ValueError):
        EngineConfig(switch_interval_ms=0)


class FrameSink:
    """The replica's end of the socket, for a `Worker` run in this process."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.transport = self

    def write(self, data: bytes) -> None:
        self.data += data

    def get_write_buffer_size(self) -> int:
        return 0


def test_the_engine_process_sends_tokens_and_the_replica_makes_their_text(tiny_model_dir):
    """Detokenizing stays out of the engine's process, whose event loop shares the interpreter with
    the MLX thread: a request without stop strings leaves the worker as token ids with no text (the
    replica makes it: `test_the_same_events_as_the_engine_in_process` checks that text); one with
    stop strings has its text made by the engine, which must see it to end the request."""
    plain = req("plain", 5, max_tokens=10, ignore_eos=True)
    stops = req("stops", 5, max_tokens=10, ignore_eos=True, stop=("never said",))

    async def main() -> dict[str, list[dict]]:
        engine = AsyncEngine(config(tiny_model_dir))
        await engine.wait_ready(120)
        sink = FrameSink()
        worker = Worker(engine, sink)  # type: ignore[arg-type]
        try:
            for r in (plain, stops):
                worker.handle(["add", r.request_id, list(r.prompt_tokens), sampling_to_wire(r.params), 0, ""])
            await asyncio.gather(*worker.tasks.values())
        finally:
            await engine.shutdown()
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(sink.data))
        reader.feed_eof()
        events: dict[str, list[dict]] = {}
        while (frame := await receive(reader)) is not None:
            if frame[0] == "events":
                for rid, wire in frame[1].items():
                    events.setdefault(rid, []).extend(wire)
        return events

    events = asyncio.run(main())
    assert [e["token"] is not None for e in events["plain"]].count(True) == 10
    assert all(e["text"] == "" for e in events["plain"]), events["plain"]
    assert "".join(e["text"] for e in events["stops"]), "the engine made no text for a request with stop strings"


def test_refusals_raise_the_engines_own_exceptions(tiny_model_dir):
    async def main() -> None:
        # Speculation off: the running request must still run when the third arrives (several tokens
        # a step can finish its 400 within the wait below).
        cfg = config(tiny_model_dir, max_running=1, max_waiting=1, prefill_batch=1, max_tokens_limit=1000,
                     speculative="off")
        async with running(cfg) as engine:
            with pytest.raises(ContextLengthError, match="maximum context length"):
                await events_of(engine, req("long", 10, max_tokens=engine.context_length))
            with pytest.raises(InvalidRequestError, match="max_tokens must be at most"):
                await events_of(engine, req("limit", 10, max_tokens=engine.config.max_tokens_limit + 1))
            with pytest.raises(InvalidRequestError):
                await events_of(engine, req("grammar", 10, grammar="this is not a grammar"))
            # One running, one waiting: the third is refused as overloaded, with the engine's retry hint.
            first = engine.stream(req("run", 10, max_tokens=400, ignore_eos=True))
            await first.__anext__()
            second = asyncio.ensure_future(events_of(engine, req("wait", 10, max_tokens=2)))
            await asyncio.sleep(0.3)
            with pytest.raises(OverloadedError) as refused:
                await events_of(engine, req("third", 10))
            assert refused.value.retry_after_s > 0
            await first.aclose()  # leaves early: aborted there
            assert (await second)[-1].finish_reason == FinishReason.LENGTH

    asyncio.run(main())


def test_a_consumer_that_leaves_aborts_the_request_there(tiny_model_dir):
    async def main() -> None:
        async with running(config(tiny_model_dir)) as engine:
            stream = engine.stream(req("leave", 10, max_tokens=1000, ignore_eos=True))
            await stream.__anext__()
            await stream.aclose()
            for _ in range(100):
                if not await engine.requests_status():
                    break
                await asyncio.sleep(0.05)
            assert await engine.requests_status() == []
            await asyncio.sleep(0.3)  # stats arrive every 0.1 s
            assert engine.stats()["requests_finished"] == {"abort": 1}

    asyncio.run(main())


def test_administration_crosses_the_socket(tiny_model_dir, tmp_path):
    async def main() -> None:
        cfg = config(tiny_model_dir, cache=CacheConfig(ssd_dir=str(tmp_path / "ssd")))
        async with running(cfg) as engine:
            await engine.ping()
            await events_of(engine, req("x", 140, max_tokens=2))  # past one 64-token block
            held = await engine.held_prefixes(8)
            assert held and isinstance(held[0], np.ndarray)
            assert list(held[0][:40]) == list(range(7, 47))
            assert (await engine.flush_cache())["ssd"]["enabled"] is True
            assert (await engine.clear_cache("ram"))["ram"]["entries"] == 0
            with pytest.raises(ValueError):
                await engine.clear_cache("everything")
            assert await engine.deep_reset() == 0
            assert engine.stats()["engine_pid"] == engine.process.pid != os.getpid()

    asyncio.run(main())


def test_shutdown_drains_then_the_worker_exits(tiny_model_dir):
    async def main() -> None:
        engine = EngineProcess(config(tiny_model_dir))
        await engine.wait_ready(120)
        stream = engine.stream(req("long", 10, max_tokens=2000, ignore_eos=True))
        await stream.__anext__()
        shutdown = asyncio.ensure_future(engine.shutdown(drain_s=0.2))
        rest = [e async for batch in stream for e in batch]
        await shutdown
        assert rest[-1].finish_reason == FinishReason.ABORT and rest[-1].error_code == "shutdown"
        assert engine.process.returncode == 0
        assert not Path(engine._dir).exists()  # noqa: SLF001 (our own class)
        with pytest.raises(EngineClosedError):
            await events_of(engine, req("late", 5))

    asyncio.run(main())


def test_a_dead_worker_ends_open_requests_with_an_error_and_fails_health(tiny_model_dir):
    async def main() -> None:
        host = EngineHost(config(tiny_model_dir), process=True)
        await host.start()
        engine = host.engine
        stream = engine.stream(req("victim", 10, max_tokens=2000, ignore_eos=True))
        await stream.__anext__()
        os.kill(engine.process.pid, signal.SIGKILL)

        async def rest_of_stream() -> list:
            return [e async for batch in stream for e in batch]
        rest = await asyncio.wait_for(rest_of_stream(), 60)  # it ends; it does not hang
        last = rest[-1]
        assert last.finish_reason == FinishReason.ERROR and last.error_code == "internal_error"
        assert "engine process exited" in last.error and "retry" in last.error
        assert not engine.ready
        with pytest.raises(RuntimeError, match="not ready"):
            await host.check_health()  # Serve replaces the replica
        with pytest.raises(EngineClosedError):
            await engine.ping()
        items = [item async for item in host.stream([5, 6, 7], {"max_tokens": 2}, "after")]
        assert items == [{"rejected": {"kind": "closed", "message": items[0]["rejected"]["message"],
                                       "retry_after_s": 1.0}}]
        await host.shutdown(0)

    asyncio.run(main())


def test_a_frame_the_replica_cannot_read_stops_the_worker_and_fails_open_requests(tiny_model_dir):
    async def main() -> None:
        engine = EngineProcess(config(tiny_model_dir))
        await engine.wait_ready(120)
        stream = engine.stream(req("open", 10, max_tokens=2000, ignore_eos=True))
        await stream.__anext__()
        garbled = asyncio.StreamReader()
        garbled.feed_data(pack(["no-such-frame", 1]))
        await asyncio.wait_for(engine._read(garbled), 60)  # noqa: SLF001 (our own class)
        assert engine.process.returncode is not None and not engine.ready

        async def rest_of_stream() -> list:
            return [e async for batch in stream for e in batch]
        last = (await asyncio.wait_for(rest_of_stream(), 60))[-1]
        assert last.finish_reason == FinishReason.ERROR and last.error_code == "internal_error"
        await engine.shutdown()

    asyncio.run(main())


def test_the_worker_exits_when_its_replica_dies(tiny_model_dir):
    script = textwrap.dedent(f"""
        import asyncio, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from cache_tiers.config import CacheConfig
        from deployments.engine_process import EngineProcess
        from engine.config import EngineConfig
        async def main():
            engine = EngineProcess(EngineConfig(model={str(tiny_model_dir)!r}, cache=CacheConfig(enabled=False)))
            await engine.wait_ready(120)
            print(engine.process.pid, flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _running(child):
            time.sleep(0.1)
        assert not _running(child), "the engine process outlived its replica"
    finally:
        parent.kill()
        parent.wait()


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its (dead) parent would reap it


def test_a_model_that_fails_to_load_is_reported(tmp_path):
    async def main() -> None:
        engine = EngineProcess(config(tmp_path / "no-such-model"))
        with pytest.raises(RuntimeError, match="the engine failed to start"):
            await engine.wait_ready(120)
        assert not engine.ready
        await engine.shutdown()
        assert engine.process.returncode == 0

    asyncio.run(main())


def test_frames_carry_arrays_as_bytes_and_refusals_by_kind():
    async def roundtrip(message: list) -> list:
        reader = asyncio.StreamReader()
        reader.feed_data(pack(message))
        reader.feed_eof()
        got = await receive(reader)
        assert await receive(reader) is None  # end of stream
        return got

    tokens = np.arange(5, dtype=np.int32)
    got = asyncio.run(roundtrip(["reply", 1, True, [tokens, FinishReason.STOP, {"k": (1, 2)}]]))
    assert got[:3] == ["reply", 1, True] and got[3][1:] == ["stop", {"k": [1, 2]}]
    assert got[3][0].dtype == np.int32 and list(got[3][0]) == [0, 1, 2, 3, 4]
    with pytest.raises(TypeError, match="cannot send"):
        pack(["stats", object()])
    again = refusal_from_wire(*refusal_to_wire(OverloadedError("busy", 2.5)))
    assert type(again) is OverloadedError and again.retry_after_s == 2.5 and str(again) == "busy"
    fault = refusal_from_wire(*refusal_to_wire(KeyError("x")))
    assert type(fault) is RuntimeError  # our own fault stays a 5xx, never a client's 4xx
