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
    """A grammar whose compile takes ~0.5 s on the tiny model (8,000 patterned properties): the window
    in which the client leaves. Free text after it, so a request that does run, runs long."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}x{i}$"}
                                               for i in range(8000)}}
    return LLMatcher.grammar_from_json_schema(schema)


def long_request(rid: str, grammar: str = FREE_TEXT) -> Request:
    return Request(tuple(range(7, 17)), SamplingParams(max_tokens=400, ignore_eos=True, temperature=0.0,
                                                       grammar=grammar), request_id=rid)


async def never_ran(engine, seconds: float = 1.5) -> None:
    """Nothing runs or waits for `seconds`, and no request finished (not even by an abort)."""
    for _ in range(int(seconds / 0.05)):
        assert await engine.requests_status() == []
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the engine process publishes stats every 0.1 s
    stats = engine.stats()
    assert stats["requests_finished"] == {} and stats["prompt_tokens_total"] == 0, stats


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
            await never_ran(engine)
            # The engine still serves, the same grammar included.
            batches = await _all(engine.stream(Request((7, 8, 9), SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                 grammar=grammar), request_id="next")))
            assert batches[-1][-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        finally:
            await engine.shutdown()

    asyncio.run(main())


async def _all(stream) -> list:
    return [batch async for batch in stream]
