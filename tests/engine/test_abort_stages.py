"""An abort is honoured at every stage, the grammar compile included (a request then never runs).

The grammar compiles before the request is queued on the MLX thread. With the engine in its own
process (engine_process: true, the default), an abort that arrived then was forwarded to an engine
that did not know the id yet: a no-op, and the request ran to max_tokens with nobody listening.
"""

from __future__ import annotations

import asyncio
import threading

from llguidance import LLMatcher

from cache_tiers.config import CacheConfig
from engine import loop as engine_loop
from engine.config import EngineConfig
from engine.types import FinishReason, Request, SamplingParams

FREE_TEXT = LLMatcher.grammar_from_lark("start: TEXT\nTEXT: /(.|\\n)*/")


def slow_grammar() -> str:
    """A valid grammar whose compile takes ~0.2 s (a 60,000-word alternation, then free text): the
    window in which the client leaves. A request that does run, runs long."""
    words = "|".join(f"w{i}z" for i in range(60_000))
    return LLMatcher.grammar_from_lark(f"start: WORD TEXT\nWORD: /({words})/\nTEXT: /(.|\\n)*/")


def long_request(rid: str, grammar: str = FREE_TEXT) -> Request:
    return Request(tuple(range(7, 17)), SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0,
                                                       grammar=grammar), request_id=rid)


async def never_ran(engine, seconds: float = 1.0, others: dict | None = None) -> None:
    """Nothing runs or waits for `seconds`, and no request finished (not even by an abort) but
    `others` (finish reason -> count of other requests, run before)."""
    for _ in range(int(seconds / 0.05)):
        assert await engine.requests_status() == []
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the engine process publishes stats every 0.1 s
    stats = engine.stats()
    assert stats["requests_finished"] == (others or {}), stats


def test_an_abort_while_the_grammar_compiles_in_process(tiny_model_dir, monkeypatch):
    """AsyncEngine.abort from elsewhere (another task, another thread) while the grammar compiles."""
    compiling, release = threading.Event(), threading.Event()
    real = engine_loop.build_constraint

    def slow_compile(*args):
        compiling.set()
        release.wait(10)
        return real(*args)
    monkeypatch.setattr(engine_loop, "build_constraint", slow_compile)

    async def main() -> None:
        engine = engine_loop.AsyncEngine(EngineConfig(model=str(tiny_model_dir), cache=CacheConfig(enabled=False)))
        await engine.wait_ready(120)
        try:
            events = asyncio.ensure_future(_all(engine.stream(long_request("gone"))))
            await asyncio.to_thread(compiling.wait, 10)
            engine.abort("gone")
            release.set()
            batches = await asyncio.wait_for(events, 10)
            assert [[(e.finish_reason, e.token_id) for e in b] for b in batches] == [[(FinishReason.ABORT, None)]]
            await never_ran(engine, 0.5)
            assert engine.stats()["prompt_tokens_total"] == 0
        finally:
            release.set()
            await engine.shutdown()

    asyncio.run(main())


def test_an_abort_while_the_grammar_compiles_in_the_engine_process(tiny_model_dir):
    """The default deployment: the client leaves 50 ms after sending, while the engine process compiles."""
    from deployments.engine_process import EngineProcess

    async def main() -> None:
        engine = EngineProcess(EngineConfig(model=str(tiny_model_dir), cache=CacheConfig(enabled=False)))
        await engine.wait_ready(120)
        try:
            grammar = slow_grammar()
            stream = engine.stream(long_request("gone", grammar))
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0.05)
            assert not first.done()  # no event yet: the engine process is still compiling
            first.cancel()  # the consumer leaves: the stream sends the abort
            await asyncio.gather(first, return_exceptions=True)
            # A request of the same grammar, sent after: once it is done, the first one's compile is
            # over too, and that one would have been queued before it.
            nxt = Request((7, 8, 9), SamplingParams(max_tokens=3, ignore_eos=True, grammar=grammar), request_id="next")
            batches = await _all(engine.stream(nxt))
            finish = batches[-1][-1].finish_reason
            assert finish in (FinishReason.LENGTH, FinishReason.STOP)
            await never_ran(engine, others={finish.value: 1})
            assert engine.stats()["prompt_tokens_total"] == 3  # only "next" was ever admitted
        finally:
            await engine.shutdown()

    asyncio.run(main())


async def _all(stream) -> list:
    return [batch async for batch in stream]
