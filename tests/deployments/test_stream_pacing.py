"""EngineHost's stream pacing (deployments/engine_host.py): fewer, fuller stream items, same tokens.

Real engine on the tiny model, in this process; no Ray (the paced generator is what the LLM server
deployment yields through Ray Serve, unchanged).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from api.core.wire import sampling_to_wire
from deployments.engine_host import EngineHost, StreamPacing
from engine.types import SamplingParams
from engine_helpers import make_engine

TOKENS = 24


def test_interval_is_each_streams_share_of_the_budget() -> None:
    pacing = StreamPacing(items_per_s=1000.0, max_interval_s=0.2)
    assert pacing.interval(1) == pytest.approx(0.001)
    assert pacing.interval(0) == pytest.approx(0.001)  # a stream counts itself
    assert pacing.interval(64) == pytest.approx(0.064)
    assert pacing.interval(500) == pytest.approx(0.2)  # capped: no token waits longer
    assert StreamPacing(items_per_s=0).interval(128) == 0.0  # off


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any):
    engine = make_engine(tiny_model_dir)
    yield engine
    asyncio.run(engine.shutdown(drain_s=0))


def _host(engine: Any, pacing: StreamPacing) -> EngineHost:
    return EngineHost(engine.config, engine_factory=lambda _: engine, pacing=pacing)


def _params(max_tokens: int = TOKENS) -> dict[str, Any]:
    return sampling_to_wire(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _items(host: EngineHost, rid: str) -> list[list[dict[str, Any]]]:
    return [item async for item in host.stream([1, 2, 3, 4], _params(), rid)]


def test_paced_stream_sends_every_token_in_fewer_items(engine: Any) -> None:
    unpaced = asyncio.run(_items(_host(engine, StreamPacing(items_per_s=0)), "unpaced"))
    # One stream, 1 item/s: the first token goes at once, the rest wait out the interval together.
    paced = asyncio.run(_items(_host(engine, StreamPacing(items_per_s=1.0, max_interval_s=1.0)), "paced"))

    def tokens(items: list[list[dict[str, Any]]]) -> list[int]:
        return [e["token"] for item in items for e in item if e["token"] is not None]

    assert tokens(paced) == tokens(unpaced) and len(tokens(paced)) == TOKENS
    assert "".join(e["text"] for i in paced for e in i) == "".join(e["text"] for i in unpaced for e in i)
    assert len(paced[0]) >= 1 and paced[-1][-1]["finish"] == "length"
    assert len(paced) < TOKENS // 2, [len(i) for i in paced]


def test_the_per_request_path_paces_by_the_engines_own_step_time(engine: Any) -> None:
    """Without step channels the replica paces each stream itself, in units of the engine's step
    time (its stats' moving average): 100 steps a stream makes one item per 24-token request."""
    by_time = asyncio.run(_items(_host(engine, StreamPacing(items_per_s=0, steps=100.0, max_interval_s=5.0)), "t"))
    assert sum(e["token"] is not None for i in by_time for e in i) == TOKENS
    assert len(by_time) <= 3, [len(i) for i in by_time]  # the first token, then (almost) all the rest


def test_client_leaving_while_paced_aborts_the_request(engine: Any) -> None:
    host = _host(engine, StreamPacing(items_per_s=0.5, max_interval_s=2.0))

    async def leave_early() -> int:
        stream = host.stream([5, 6, 7], _params(max_tokens=1500), "leaver")
        first = await stream.__anext__()
        assert first and first[0]["token"] is not None
        assert host.active_streams == 1
        await stream.aclose()  # what Ray Serve does when the caller goes away: the host is asleep now
        for _ in range(200):  # the abort lands at the engine's next step
            if not await engine.requests_status():
                break
            await asyncio.sleep(0.05)
        return len(await engine.requests_status())

    assert asyncio.run(leave_early()) == 0
    assert host.active_streams == 0


def test_time_pacing_waits_a_number_of_steps_whatever_the_streams() -> None:
    pacing = StreamPacing(items_per_s=0, steps=2.0, max_interval_s=0.2)
    assert pacing.interval(1, 0.025) == pytest.approx(0.05)
    assert pacing.interval(128, 0.025) == pytest.approx(0.05)  # not a share of a budget: 128 streams wait as one
    assert pacing.interval(128, None) == 0.0  # step unknown yet: no wait
    assert pacing.interval(128, 0.5) == pytest.approx(0.2)  # capped
    # With a budget too, the longer of the two waits.
    assert StreamPacing(items_per_s=1000.0, steps=2.0).interval(128, 0.025) == pytest.approx(0.128)
    assert StreamPacing(items_per_s=1000.0, steps=2.0).interval(8, 0.025) == pytest.approx(0.05)


def test_the_step_clock_averages_arrival_gaps_and_skips_idle_ones() -> None:
    from deployments.engine_host import StepClock

    clock = StepClock(idle_s=0.5)
    assert clock.step_s is None
    for t in (0.0, 0.02, 0.04, 0.06):
        clock.tick(t)
    assert clock.step_s == pytest.approx(0.02)
    clock.tick(5.0)  # idle: not a step
    assert clock.step_s == pytest.approx(0.02)
    clock.tick(5.1)
    assert clock.step_s == pytest.approx(0.8 * 0.02 + 0.2 * 0.1)


def test_the_default_settings_pace_by_time() -> None:
    from api.service.settings import AppSettings

    settings = AppSettings()
    assert settings.stream_pacing_steps == 2.0 and settings.stream_items_per_s == 0.0
