"""EngineProcess writes the frames of one event-loop pass together (deployments/engine_process.py `_send`).

Requests set free by the same step's endings must reach the worker in one read, so that its event
loop hands them to the MLX thread together and they join the running batch as one group (session 14
on the H200: sent frame by frame, they arrived split and the step took 1.7x as long). No worker here:
a writer that records what it is given.
"""

from __future__ import annotations

import asyncio

from deployments.engine_ipc import pack
from deployments.engine_process import EngineProcess


class RecordingWriter:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing


def process_with(writer: RecordingWriter) -> EngineProcess:
    engine = EngineProcess.__new__(EngineProcess)  # no worker: only the sending half
    engine._writer = writer  # type: ignore[assignment]
    engine._outbox = []
    return engine


def test_frames_of_one_pass_leave_in_one_write_after_it():
    async def main() -> RecordingWriter:
        writer = RecordingWriter()
        engine = process_with(writer)
        frames = [["add", f"r{i}", [1, 2, 3], {"max_tokens": 4}, 0, ""] for i in range(5)] + [["abort", "r0"]]
        for frame in frames:
            engine._send(frame)
        assert writer.writes == []  # nothing leaves during the pass
        await asyncio.sleep(0)
        assert writer.writes == [b"".join(pack(f) for f in frames)]
        engine._send(["abort", "r1"])  # a later pass: a write of its own
        await asyncio.sleep(0)
        assert writer.writes[1:] == [pack(["abort", "r1"])]
        return writer

    asyncio.run(main())


def test_outside_an_event_loop_a_frame_leaves_at_once_and_a_closed_socket_takes_none():
    writer = RecordingWriter()
    engine = process_with(writer)
    engine._send(["abort", "r0"])
    assert writer.writes == [pack(["abort", "r0"])]
    writer.closing = True
    engine._send(["abort", "r1"])
    assert writer.writes == [pack(["abort", "r0"])] and engine._outbox == []


class LateStreams:
    """A real AsyncEngine whose streams hand over their last batch a little late: the scheduling
    that let a reply overtake the final events (CI, session 15) made reproducible."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def stream(self, request, text: bool = True):
        async for batch in self.engine.stream(request, text):
            if batch and batch[-1].finished:
                await asyncio.sleep(0.05)
            yield batch

    async def shutdown(self, drain_s: float = 0.0) -> None:
        await self.engine.shutdown(drain_s)


def test_the_shutdown_reply_follows_the_last_events(tiny_model_dir):
    from cache_tiers.config import CacheConfig
    from deployments.engine_ipc import receive
    from deployments.engine_worker import Worker
    from engine.config import EngineConfig
    from engine.loop import AsyncEngine

    async def frames_read_back(writes: list[bytes]) -> list[list]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(writes))
        reader.feed_eof()
        out = []
        while (frame := await receive(reader)) is not None:
            out.append(frame)
        return out

    async def main() -> None:
        engine = AsyncEngine(EngineConfig(model=str(tiny_model_dir), cache=CacheConfig(enabled=False)))
        await engine.wait_ready()
        writer = RecordingWriter()
        worker = Worker(LateStreams(engine), writer)  # type: ignore[arg-type]
        worker.handle(["add", "long", list(range(7, 17)), {"max_tokens": 2000, "ignore_eos": True}, 0, ""])
        while not writer.writes:
            await asyncio.sleep(0.01)
        await worker.call(1, "shutdown", [0.0])
        frames = await frames_read_back(writer.writes)
        kinds = [f[0] for f in frames]
        assert kinds[-1] == "reply" and frames[-1][2] is True
        last = [w for f in frames if f[0] == "events" for w in f[1].get("long", [])][-1]
        assert (last["finish"], last["code"]) == ("abort", "shutdown")

    asyncio.run(main())
