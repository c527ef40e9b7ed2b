"""Constrained decoding (engine/constraints.py), logit_bias and stop-string reporting, on real tiny models.

The tiny models are random: whatever a grammar allows, they pick from it at random, which is what
makes them a fair test that the mask (not the model) produces the structure.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher

from cache_tiers.factory import build_store
from api.core.conversation import OutputFormat
from api.core.wire import event_to_wire, sampling_from_wire, sampling_to_wire
from api.output.grammars import answer_grammar
from cache_tiers.config import CacheConfig
from engine.config import EngineConfig
from engine.constraints import build_constraint
from engine.engine import Engine
from engine.types import FinishReason, Request, SamplingParams
from engine_helpers import collect, make_engine, request, tiny_loader

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "box": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["tags"], "additionalProperties": False},
    },
    "required": ["color", "count", "box"],
    "additionalProperties": False,
}
GRAMMAR = answer_grammar(OutputFormat("json_schema", SCHEMA), max_string_length=8)
SEEDS = range(20)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    yield eng
    asyncio.run(eng.shutdown())


@pytest.fixture(scope="module")
def think_engine(tmp_path_factory):
    from tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("tiny-think"), extra_special=("<think>", "</think>"))
    eng = make_engine(path)
    assert eng.tokenizer.has_thinking
    yield eng
    asyncio.run(eng.shutdown())


def run_all(engine, requests):
    async def go():
        return await asyncio.gather(*(collect(engine, r) for r in requests))
    return asyncio.run(go())


def test_schema_outputs_validate_at_temperature_one(engine):
    # ignore_eos on some: a finished grammar still ends the request at EOS
    requests = [request(engine, "Hello world", temperature=1.0, seed=s, max_tokens=200, grammar=GRAMMAR,
                        ignore_eos=s % 2 == 1) for s in SEEDS]
    for text, events in run_all(engine, requests):
        assert events[-1].finish_reason is FinishReason.STOP, text  # the grammar ended it at EOS
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_always_parses(engine):
    grammar = answer_grammar(OutputFormat("json_object"), max_string_length=8)
    requests = [request(engine, "Paris is", temperature=1.0, seed=s, max_tokens=300, grammar=grammar)
                for s in SEEDS]
    for text, events in run_all(engine, requests):
        assert events[-1].finish_reason is FinishReason.STOP, text
        assert isinstance(json.loads(text), dict)


def test_free_requests_unchanged_beside_constrained_ones(engine):
    prompts = ["The quick brown fox", "Berlin is the capital", "Numbers: 1 2 3"]
    alone = [t for t, _ in run_all(engine, [request(engine, p, max_tokens=32) for p in prompts])]
    constrained = []
    for s in range(4):  # compiled beforehand, so that they join the batch together with the free ones
        r = request(engine, "Hello", temperature=1.0, seed=s, max_tokens=60, grammar=GRAMMAR)
        constrained.append(replace(r, constraint=build_constraint(engine.tokenizer, GRAMMAR, r.prompt_tokens)))
    results = run_all(engine, constrained + [request(engine, p, max_tokens=32) for p in prompts])
    assert [t for t, _ in results[4:]] == alone
    for text, _ in results[:4]:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_mask_covers_a_padded_model_vocabulary(engine):
    """A model's vocabulary may be larger than its tokenizer's: the ids past the tokenizer stay forbidden."""
    import mlx.core as mx

    tok = engine.tokenizer
    vocab = len(tok.get_vocab())
    prompt = tuple(tok.encode("Hello"))
    logits = mx.zeros((1, vocab + 40))
    out = build_constraint(tok, GRAMMAR, prompt)(mx.array(prompt), logits)[0].tolist()
    allowed = [i for i, v in enumerate(out) if v == 0.0]
    assert allowed and all(tok.decode([i]).startswith("{") for i in allowed)  # a JSON object starts
    assert all(v == float("-inf") for v in out[vocab:])


def test_logit_bias(engine):
    free = run_all(engine, [request(engine, "Hello world", max_tokens=8)])[0][1]
    first = free[0].token_id
    forced = 200 if first != 200 else 201
    _, events = run_all(engine, [request(engine, "Hello world", max_tokens=8, logit_bias=((forced, 100.0),))])[0]
    assert [e.token_id for e in events] == [forced] * 8
    _, events = run_all(engine, [request(engine, "Hello world", max_tokens=8, logit_bias=((first, -100.0),))])[0]
    assert first not in [e.token_id for e in events]
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((5, 101.0),))
    params = SamplingParams(logit_bias=((5, -3.0), (7, 2.0)), grammar=GRAMMAR)
    assert sampling_from_wire(json.loads(json.dumps(sampling_to_wire(params)))) == params


def test_invalid_grammar_refused_before_generation(engine):
    bad = LLMatcher.grammar_from_json_schema({"type": "nope"})
    with pytest.raises(ValueError, match="nope"):
        run_all(engine, [request(engine, "Hello", grammar=bad)])
    with pytest.raises(ValueError, match="unknown special token"):
        run_all(engine, [request(engine, "Hello", grammar=LLMatcher.grammar_from_lark('start: <nope> "x"'))])


def test_stop_string_reported(engine):
    text, _ = run_all(engine, [request(engine, "The quick brown fox", max_tokens=24)])[0]
    later, earlier = text[10:13], text[4:7]
    out, events = run_all(engine, [request(engine, "The quick brown fox", max_tokens=24, stop=(later, earlier))])[0]
    assert out == text[:text.index(earlier)]
    assert events[-1].stop_string == earlier and event_to_wire(events[-1])["stop_str"] == earlier
    _, events = run_all(engine, [request(engine, "The quick brown fox", max_tokens=24)])[0]
    assert events[-1].stop_string is None


def _answer(engine, tokens) -> tuple[list[int], str]:
    """The tokens before `</think>`, and the text after it (without the final EOS)."""
    tokens = [t for t in tokens if t not in engine.tokenizer.eos_token_ids]
    end = engine.tokenizer.think_end_id
    assert end in tokens, engine.tokenizer.decode(tokens)
    cut = tokens.index(end)
    return tokens[:cut], engine.tokenizer.decode(tokens[cut + 1:])


def test_reasoning_is_free_then_the_answer_follows_the_schema(think_engine):
    tok = think_engine.tokenizer
    prompt = tuple(tok.encode("Hello world")) + (tok.think_start_id,)  # the template opened the think section
    bias = ((tok.think_end_id, 10.0),)  # so that the random model closes it within max_tokens
    reasoned = 0
    for seed in range(6):
        params = dict(temperature=1.0, seed=seed, max_tokens=200, logit_bias=bias)
        free = run_all(think_engine, [Request(prompt, SamplingParams(**params))])[0][1]
        constrained = run_all(think_engine, [Request(prompt, SamplingParams(grammar=GRAMMAR, **params))])[0][1]
        free_tokens = [e.token_id for e in free]
        reasoning, answer = _answer(think_engine, [e.token_id for e in constrained])
        assert reasoning == free_tokens[:len(reasoning)]  # unconstrained while thinking
        jsonschema.validate(json.loads(answer), SCHEMA)
        reasoned += len(reasoning) > 0
    assert reasoned > 0  # some runs did reason before answering


def test_model_may_open_a_think_section_first(think_engine):
    tok = think_engine.tokenizer
    prompt = tuple(tok.encode("Hello world"))
    bias = ((tok.think_start_id, 8.0), (tok.think_end_id, 12.0))  # open it often, close it soon
    thought = 0
    for seed in range(6):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=200, logit_bias=bias, grammar=GRAMMAR)
        events = run_all(think_engine, [Request(prompt, params)])[0][1]
        tokens = [e.token_id for e in events]
        if tokens[0] == tok.think_start_id:
            thought += 1
            _, answer = _answer(think_engine, tokens)
        else:
            answer = tok.decode([t for t in tokens if t not in tok.eos_token_ids])
        jsonschema.validate(json.loads(answer), SCHEMA)
    assert thought > 0  # the test exercised the think path


def test_direct_first_token_path_is_constrained(tiny_model_dir):
    """A prefix hit's first token is sampled outside the batch (runner._prefill_and_sample): the same
    processor must constrain it, and the request's output must equal the batched path's."""
    outputs = []
    for direct in (64, None):
        cache = CacheConfig(ram_bytes=64 * 2**20, min_restore_tokens=8)
        config = EngineConfig(model=str(tiny_model_dir), direct_first_token=direct, cache=cache)
        loaded = tiny_loader(Path(tiny_model_dir))(config)
        eng = Engine(loaded.model, loaded.tokenizer, config, store=build_store(cache, "tiny"))
        prefix = tuple(eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4))
        runs = [Request(prefix + (40, 41), SamplingParams(max_tokens=2, temperature=0.0), request_id="warm")]
        for i in range(3):
            tokens = prefix + tuple(range(50 + i, 55 + i))
            runs.append(Request(tokens, SamplingParams(max_tokens=120, temperature=0.0, grammar=GRAMMAR),
                                request_id=f"c{i}", constraint=build_constraint(eng.tokenizer, GRAMMAR, tokens)))
        texts = {}
        for r in runs:
            eng.add_request(r)
            while eng.has_work():
                for e in eng.step():
                    texts[e.request_id] = texts.get(e.request_id, "") + e.text
        assert eng.stats.direct_first_tokens == (3 if direct else 0)
        eng.close()
        outputs.append([texts[f"c{i}"] for i in range(3)])
    assert outputs[0] == outputs[1]
    for text in outputs[0]:
        jsonschema.validate(json.loads(text), SCHEMA)
