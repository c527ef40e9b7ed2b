"""Step channels (deployments/channels.py, EngineHost.channel): one item per engine step per ingress.

The real EngineHost over the tiny model's engine and the real HandleBackend, in this process; the
Ray Serve handle between them is a small fake that does what Serve does for a streaming call: runs
the replica's generator in its own task, hands its items to the caller, cancels it on `cancel()`,
and raises Ray's actor error once the "replica" is killed. The routers' pinning is tested on its own.
"""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
from ray.exceptions import RayActorError

from api.core.errors import ApiError
from api.core.wire import sampling_to_wire
from deployments import engine_host
from deployments.engine_host import EngineHost, StreamPacing
from deployments.ingress import HandleBackend
from engine.types import SamplingParams
from engine_helpers import make_engine
from fleet.router import pinned

TOKENS = 24
UNPACED = StreamPacing(items_per_s=0)


class FakeResponse:
    """A streaming call as Serve's DeploymentResponseGenerator behaves: iterate, `cancel()`."""

    def __init__(self, gen: AsyncIterator[Any], replica: "FakeReplica") -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._replica = replica
        self._task = asyncio.ensure_future(self._run(gen))
        replica.calls.append(self)

    async def _run(self, gen: AsyncIterator[Any]) -> None:
        try:
            async for item in gen:
                self._queue.put_nowait(("item", item))
            self._queue.put_nowait(("end", None))
        except BaseException as exc:  # noqa: BLE001 - a cancelled replica generator ends the stream too
            self._queue.put_nowait(("error", exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            await gen.aclose()

    def die(self) -> None:
        self._task.cancel()
        self._queue.put_nowait(("error", RayActorError()))

    def cancel(self) -> None:
        self._task.cancel()

    def __aiter__(self) -> "FakeResponse":
        return self

    async def __anext__(self) -> Any:
        kind, value = await self._queue.get()
        if kind == "item":
            return value
        self._queue.put_nowait((kind, value))  # stays ended
        if kind == "end" or isinstance(value, asyncio.CancelledError):
            raise StopAsyncIteration
        raise value


class FakeReplica:
    """`handle.options(stream=True).generate/.channel.remote(...)` onto one EngineHost."""

    def __init__(self, host: EngineHost) -> None:
        self.host = host
        self.calls: list[FakeResponse] = []
        self.generate = SimpleNamespace(remote=lambda *a: FakeResponse(host.stream(*a), self))
        self.channel = SimpleNamespace(remote=lambda *a, **kw: FakeResponse(host.channel(*a, **kw), self))

    def options(self, **_: Any) -> "FakeReplica":
        return self

    def kill(self) -> None:
        for call in self.calls:
            call.die()


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Any):
    engine = make_engine(tiny_model_dir)
    yield engine
    asyncio.run(engine.shutdown(drain_s=0))


def _host(engine: Any) -> EngineHost:
    return EngineHost(engine.config, engine_factory=lambda _: engine, pacing=UNPACED, replica_key="r1")


def _params(max_tokens: int = TOKENS) -> dict[str, Any]:
    return sampling_to_wire(SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def _tokens(backend: HandleBackend, prompt: list[int], rid: str) -> list[int]:
    return [e["token"] async for item in backend.stream(prompt, _params(), rid) for e in item
            if e["token"] is not None]


async def _all(stream: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in stream]


async def _drain(stream: AsyncIterator[Any]) -> None:
    async for _ in stream:
        pass


async def _idle(engine: Any) -> None:
    for _ in range(200):
        if not await engine.requests_status():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the engine still runs requests")


def test_every_request_gets_its_tokens_and_each_step_travels_once(engine: Any) -> None:
    prompts = [[1 + i, 2, 3 + i, 4] for i in range(8)]

    async def run() -> tuple[list[list[int]], list[list[int]], EngineHost]:
        direct = HandleBackend(FakeReplica(_host(engine)))  # one item per request per step
        expected = [await _tokens(direct, p, f"d{i}") for i, p in enumerate(prompts)]
        host = _host(engine)
        backend = HandleBackend(FakeReplica(host), step_channels=True, pacing=UNPACED)
        got = await asyncio.gather(*(_tokens(backend, p, f"c{i}") for i, p in enumerate(prompts)))
        return expected, list(got), host

    expected, got, host = asyncio.run(run())
    assert got == expected and all(len(t) == TOKENS for t in got)
    # 8 requests x 24 tokens: one first item each on their own streams, the rest by the step.
    assert host.items["request"] == len(prompts)
    assert host.items["channel"] <= TOKENS + 4, host.items
    assert not host._outboxes  # noqa: SLF001 - our own class: nothing left behind


def test_a_paced_stream_ends_as_soon_as_its_last_event_arrives(engine: Any) -> None:
    """Pacing lets tokens wait for company, never a stream's end: a closed-loop client (an agent)
    sends its next request as soon as the last one ends."""
    async def run() -> list[list[dict[str, Any]]]:
        slow = StreamPacing(items_per_s=1 / 60, max_interval_s=60.0)  # one SSE write a minute
        backend = HandleBackend(FakeReplica(_host(engine)), step_channels=True, pacing=slow)
        stream = backend.stream([2, 4, 6], _params(max_tokens=6), "quick")
        return await asyncio.wait_for(_all(stream), 20)  # without the early end: 60 s, a TimeoutError

    items = asyncio.run(run())
    assert len(items) == 2 and items[-1][-1]["finish"] == "length"
    assert sum(e["token"] is not None for i in items for e in i) == 6


def test_a_client_leaving_aborts_its_request_and_leaves_nothing_behind(engine: Any) -> None:
    host = _host(engine)

    async def run() -> None:
        backend = HandleBackend(FakeReplica(host), step_channels=True, pacing=UNPACED)
        stream = backend.stream([9, 8, 7], _params(max_tokens=1500), "leaver")
        assert (await stream.__anext__())[0]["token"] is not None
        await stream.__anext__()  # a batch from the channel
        await stream.aclose()
        await _idle(engine)
        # The channel stays subscribed (until idle) but holds nothing of the request that left.
        boxes = list(host._outboxes.values())  # noqa: SLF001 - our own class
        assert [(b.open, b.pending) for b in boxes] == [(0, {})]

    asyncio.run(run())


def test_a_request_whose_ingress_never_reads_its_channel_leaves_nothing_behind(engine: Any) -> None:
    host = _host(engine)

    async def run() -> None:
        stream = host.stream([7, 7, 7], _params(max_tokens=1500), "unread", "gone-ingress")
        first = await stream.__anext__()
        assert first["replica"] == "r1" and first["events"]
        reading = asyncio.ensure_future(stream.__anext__())  # the pump: events into the outbox
        await asyncio.sleep(0.3)
        assert host._outboxes["gone-ingress"].pending["unread"]  # noqa: SLF001 - our own class
        reading.cancel()  # Serve cancels the call: the ingress went away
        await asyncio.gather(reading, return_exceptions=True)
        await _idle(engine)
        assert not host._outboxes  # noqa: SLF001

    asyncio.run(run())


def test_a_channel_that_ends_with_requests_running_is_read_again(engine: Any) -> None:
    host = _host(engine)
    replica = FakeReplica(host)
    cut = [True]

    async def cut_once(gen: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for item in gen:
            yield item
            if cut:  # the first subscription ends after one item, as an idle one would
                cut.clear()
                return

    replica.channel = SimpleNamespace(remote=lambda *a, **kw: FakeResponse(cut_once(host.channel(*a, **kw)), replica))

    async def run() -> list[int]:
        backend = HandleBackend(replica, step_channels=True, pacing=UNPACED)
        return await asyncio.wait_for(_tokens(backend, [6, 5, 4], "resubscribed"), 30)

    assert len(asyncio.run(run())) == TOKENS
    assert len(replica.calls) == 3  # the request's own stream and two subscriptions


@pytest.mark.parametrize("what_fails", ["replica", "channel"])
def test_a_failure_after_the_first_event_ends_the_stream_with_a_503(engine: Any, what_fails: str) -> None:
    """The replica dies (every call of it fails), or only the step channel its request is bound to."""
    async def run() -> ApiError:
        replica = FakeReplica(_host(engine))
        backend = HandleBackend(replica, step_channels=True, pacing=UNPACED)
        stream = backend.stream([3, 3, 3], _params(max_tokens=1500), f"fails-{what_fails}")
        await stream.__anext__()
        await stream.__anext__()
        if what_fails == "replica":
            replica.kill()
        else:
            replica.calls[1].die()  # calls[0] is the request's own stream, calls[1] its channel
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(_drain(stream), 10)  # a lost failure would hang here
        await stream.aclose()
        await _idle(engine)
        return err.value

    assert asyncio.run(run()).status == 503


def test_an_idle_channel_ends_and_the_next_request_opens_another(engine: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(engine_host, "CHANNEL_IDLE_S", 0.1)
    host = _host(engine)

    async def run() -> list[int]:
        replica = FakeReplica(host)
        backend = HandleBackend(replica, step_channels=True, pacing=UNPACED)
        first = await _tokens(backend, [5, 6], "one")
        channels = replica.calls[1]
        await asyncio.sleep(0.4)
        assert channels._task.done()  # noqa: SLF001 - the fake's own task: the channel ended idle
        second = await _tokens(backend, [5, 6], "two")
        assert len(replica.calls) == 4  # two requests, two channels
        return [len(first), len(second)]

    assert asyncio.run(run()) == [TOKENS, TOKENS]


REQUEST_CONTEXT: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="")


def test_the_channel_is_not_a_child_of_the_request_that_opened_it(engine: Any) -> None:
    """Serve cancels the handle calls made in a request's context when that request is cancelled;
    the channel carries other requests' events, so it is opened outside any request's context."""
    host = _host(engine)
    replica = FakeReplica(host)
    seen: list[str] = []

    def channel(*a: Any, **kw: Any) -> FakeResponse:
        seen.append(REQUEST_CONTEXT.get())
        return FakeResponse(host.channel(*a, **kw), replica)

    replica.channel = SimpleNamespace(remote=channel)

    async def run() -> int:
        REQUEST_CONTEXT.set("request-that-opened-it")  # what Serve's request context is to its calls
        backend = HandleBackend(replica, step_channels=True, pacing=UNPACED)
        return len(await _tokens(backend, [1, 1, 2], "opener"))

    assert asyncio.run(run()) == TOKENS
    assert seen == [""]


def test_a_channel_for_another_replica_says_so() -> None:
    host = EngineHost(SimpleNamespace(), engine_factory=lambda _: SimpleNamespace(), replica_key="r1")

    async def run() -> list[Any]:
        return [item async for item in host.channel("ingress", "r0")]

    assert asyncio.run(run()) == [{"wrong_replica": "r1"}]


def test_channels_end_when_the_host_shuts_down(engine: Any) -> None:
    class Closing:
        async def shutdown(self, drain_s: float) -> None:
            pass

    host = EngineHost(SimpleNamespace(), engine_factory=lambda _: Closing(), replica_key="r1")

    async def run() -> list[Any]:
        channel = host.channel("ingress", "r1")
        reading = asyncio.ensure_future(channel.__anext__())
        await asyncio.sleep(0.05)
        assert not reading.done()
        await host.shutdown(drain_s=0)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(reading, 1.0)
        return []

    asyncio.run(run())


def _replica(unique_id: str) -> Any:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id))


def _pending(method: str, **kwargs: Any) -> Any:
    return SimpleNamespace(metadata=SimpleNamespace(call_method=method), kwargs=kwargs)


def test_routers_pin_channel_calls_to_the_replica_they_name() -> None:
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    assert pinned([a, b, c], _pending("channel", replica="b")) == [[b]]
    assert pinned([a, c], _pending("channel", replica="b")) == [[a]]  # gone: one that will say so
    assert pinned([a, b, c], _pending("generate")) is None
    assert pinned([a, b, c], None) is None
    assert pinned([], _pending("channel", replica="b")) == [] and pinned([], None) == []


def test_the_ingress_paces_by_the_steps_its_channel_delivers(engine: Any) -> None:
    """Time pacing: the ingress measures the replica's step from its channel's items and sends each
    stream an item every `steps` of them, however few streams run (no item budget involved)."""
    async def items(pacing: StreamPacing, rid: str) -> tuple[list[list[dict[str, Any]]], float | None]:
        backend = HandleBackend(FakeReplica(_host(engine)), step_channels=True, pacing=pacing)
        got = await asyncio.wait_for(_all(backend.stream([3, 1, 4], _params(max_tokens=64), rid)), 60)
        return got, backend._channels.step_s("r1")  # noqa: SLF001 - our own class

    every_step, step_s = asyncio.run(items(UNPACED, "every-step"))
    paced, _ = asyncio.run(items(StreamPacing(items_per_s=0, steps=4.0, max_interval_s=5.0), "by-time"))
    assert step_s is not None and step_s > 0
    assert sum(e["token"] is not None for i in paced for e in i) == 64
    # About one item a step unpaced (fewer where a step speculates several tokens), about one every
    # 4 steps paced.
    assert len(paced) <= 64 / 2 and len(every_step) >= 1.5 * len(paced), (len(every_step), len(paced))
