"""Calls onto the MLX thread whose caller gave up, and the per-request status of constrained requests."""

from __future__ import annotations

import asyncio
import time

from engine.types import Request, SamplingParams
from engine_helpers import make_engine, run


def test_a_call_cancelled_by_its_caller_does_not_kill_the_mlx_thread(tiny_model_dir):
    engine = make_engine(tiny_model_dir)

    async def main():
        try:
            slow = asyncio.ensure_future(engine.call(lambda e: time.sleep(0.5)))  # the thread is busy
            try:  # as the health probe does behind a long step: give up before the thread gets to it
                await asyncio.wait_for(engine.call(lambda e: "late"), 0.05)
            except asyncio.TimeoutError:
                pass
            await slow
            return await asyncio.wait_for(engine.call(lambda e: "alive"), 10), engine.alive
        finally:
            await engine.shutdown()
    assert run(main()) == ("alive", True)


def test_requests_status_marks_constrained_requests(tiny_model_dir):
    from api.output.grammars import answer_grammar
    from api.core.conversation import OutputFormat

    engine = make_engine(tiny_model_dir)

    async def main():
        try:
            grammar = answer_grammar(OutputFormat("json_object"))
            streams = [engine.stream(Request((5, 6, 7), SamplingParams(max_tokens=400, grammar=g, ignore_eos=True),
                                             request_id=rid)) for rid, g in (("free", None), ("json", grammar))]
            firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
            await asyncio.gather(*firsts)
            status = {r["id"]: r["constrained"] for r in await engine.requests_status()}
            for s in streams:
                await s.aclose()
            return status
        finally:
            await engine.shutdown()
    assert run(main()) == {"free": False, "json": True}
