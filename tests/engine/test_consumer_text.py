"""Detokenization on the consumer's side (`Engine(consumer_text=True)` + `ConsumerText`).

Requests without stop strings leave the engine as token ids; `AsyncEngine.stream` makes their
text. Whatever path makes it, the client must see the same text, token by token: the engine's
own `TextStream` run on the same requests is the reference.
"""

from __future__ import annotations

from typing import Any

import pytest

from cache_tiers.config import CacheConfig

from engine.config import EngineConfig
from engine.engine import Engine
from engine.text import ConsumerText
from engine.types import FinishReason, Request, SamplingParams, TokenEvent
from engine_helpers import collect, make_engine, run, tiny_loader

PROMPTS = ["héllo wörld, ünïcode ✓ 日本語 ", "The quick brown fox jumps over the lazy dog.", "a"]


def make(tiny_model_dir, consumer_text: bool) -> Engine:
    config = EngineConfig(model=str(tiny_model_dir), cache=CacheConfig(enabled=False))
    loaded = tiny_loader(tiny_model_dir)(config)
    return Engine(loaded.model, loaded.tokenizer, config, consumer_text=consumer_text)


def requests(eng: Engine, **params: Any) -> list[Request]:
    return [Request(tuple(eng.tokenizer.encode(p)), SamplingParams(**params), request_id=f"r{i}")
            for i, p in enumerate(PROMPTS)]


def drive(eng: Engine, reqs: list[Request], abort_after: int | None = None) -> dict[str, list[list[TokenEvent]]]:
    """Every step's events, by request id (one list per step, as the loop delivers them)."""
    out: dict[str, list[list[TokenEvent]]] = {r.request_id: [] for r in reqs}
    for r in reqs:
        eng.add_request(r)
    steps = 0
    while eng.has_work():
        events = eng.step()
        steps += 1
        if abort_after is not None and steps == abort_after:
            events += eng.abort_request(reqs[0].request_id)
        for rid in out:
            mine = [e for e in events if e.request_id == rid]
            if mine:
                out[rid].append(mine)
    return out


def texts_by_event(batches: list[list[TokenEvent]], consumer: ConsumerText | None) -> list[tuple]:
    rows = []
    for batch in batches:
        for e in (consumer.fill(batch) if consumer is not None else batch):
            rows.append((e.token_id, e.text, e.finish_reason))
    return rows


def assert_same_text(eng: Engine, got: dict[str, list[list[TokenEvent]]],
                     ref: dict[str, list[list[TokenEvent]]]) -> None:
    """`got` (token ids only, text made by a `ConsumerText` per request) reads as `ref` does."""
    for rid in ref:
        assert all(e.text == "" for batch in got[rid] for e in batch)  # the engine made no text
        consumer = ConsumerText(lambda: eng.tokenizer.detokenizer)
        assert texts_by_event(got[rid], consumer) == texts_by_event(ref[rid], None)


@pytest.mark.parametrize("params", [
    dict(max_tokens=40, temperature=1.0, seed=3),          # random tokens: partial UTF-8 pieces
    dict(max_tokens=12, temperature=0.0),
    dict(max_tokens=1, temperature=0.0),
], ids=["sampled-bytes", "greedy", "one-token"])
def test_consumer_text_equals_engine_text(tiny_model_dir, params):
    ref_eng, eng = make(tiny_model_dir, False), make(tiny_model_dir, True)
    try:
        assert_same_text(eng, drive(eng, requests(eng, **params)), drive(ref_eng, requests(ref_eng, **params)))
    finally:
        ref_eng.close()
        eng.close()


def test_stop_token_and_abort_endings_match(tiny_model_dir):
    ref_eng, eng = make(tiny_model_dir, False), make(tiny_model_dir, True)
    try:
        probe = drive(ref_eng, requests(ref_eng, max_tokens=6, temperature=0.0))
        stop_id = [e.token_id for batch in probe["r1"] for e in batch][3]  # r1's fourth token ends it
        params = dict(max_tokens=30, temperature=0.0, stop_token_ids=(stop_id,))
        ref = drive(ref_eng, requests(ref_eng, **params), abort_after=3)
        got = drive(eng, requests(eng, **params), abort_after=3)
        assert ref["r0"][-1][-1].finish_reason is FinishReason.ABORT
        assert ref["r1"][-1][-1].finish_reason is FinishReason.STOP
        assert_same_text(eng, got, ref)
    finally:
        ref_eng.close()
        eng.close()


def test_stop_strings_keep_the_text_in_the_engine(tiny_model_dir):
    eng = make(tiny_model_dir, True)
    try:
        [req] = requests(eng, max_tokens=8, temperature=0.0, stop=("zzzz-never",))[:1]
        events = [e for batch in drive(eng, [req])[req.request_id] for e in batch]
        assert "".join(e.text for e in events)  # made in the engine: stop strings are matched there
    finally:
        eng.close()


def test_async_engine_streams_the_same_text(tiny_model_dir):
    ref_eng = make(tiny_model_dir, False)
    engine = make_engine(tiny_model_dir)
    try:
        for params in (dict(max_tokens=24, temperature=1.0, seed=5), dict(max_tokens=10, temperature=0.0)):
            ref = drive(ref_eng, requests(ref_eng, **params))
            for req in requests(ref_eng, **params):
                text, events = run(collect(engine, Request(req.prompt_tokens, req.params)))
                expected = [e for batch in ref[req.request_id] for e in batch]
                assert text == "".join(e.text for e in expected)
                assert [e.token_id for e in events] == [e.token_id for e in expected]
    finally:
        ref_eng.close()
        run(engine.shutdown())
