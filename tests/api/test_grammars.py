"""Grammar builders (api/output/grammars.py), driven token by token through llguidance with a real tokenizer."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher
from mlx_lm.utils import load_tokenizer

from api.core.conversation import OutputFormat, Tool, ToolChoice
from api.output.grammars import (GrammarError, answer_grammar, check_grammar, special_marker_id,
                                  tool_grammar)
from engine.constraints import llg_tokenizer

START, END = "<tool_call>", "</tool_call>"
WEATHER = Tool("get_weather", "Current weather", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}, strict=True)
CLOCK = Tool("get_time", "Time in a zone", {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"], "additionalProperties": False})
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer"},
        "owner": {"type": "object", "properties": {"name": {"type": "string"},
                                                   "pets": {"type": "array", "items": {"type": "string"}}},
                  "required": ["name", "pets"], "additionalProperties": False},
    },
    "required": ["kind", "age", "owner"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def special(tmp_path_factory):
    from tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("tiny-tools-tok")
    build_tokenizer(path, extra_special=(START, END))
    return load_tokenizer(path)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes exactly this text (as the model's tokens) and may end after it."""
    matcher = LLMatcher(llg_tokenizer(tokenizer), grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    tokens = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


def call(name: str, arguments: dict) -> str:
    return f"{START}\n{json.dumps({'name': name, 'arguments': arguments})}\n{END}"


def test_answer_grammars(plain):
    assert answer_grammar(OutputFormat()) is None
    schema = answer_grammar(OutputFormat("json_schema", SCHEMA))
    check_grammar(schema)
    good = {"kind": "cat", "age": 3, "owner": {"name": "Ann", "pets": ["Tom", "Rex"]}}
    assert accepts(plain, schema, json.dumps(good))
    for bad in ({**good, "kind": "cow"}, {**good, "age": "3"}, {"kind": "cat", "age": 3},
                {**good, "owner": {"name": "Ann", "pets": "Tom"}}, {**good, "extra": 1}):
        assert not accepts(plain, schema, json.dumps(bad)), bad
    assert answer_grammar(OutputFormat("json_schema", dict(SCHEMA))) is schema  # cached by schema text
    anything = answer_grammar(OutputFormat("json_object"))
    check_grammar(anything)
    assert accepts(plain, anything, json.dumps({"a": [1, -2.5e3, True, None, {"b": "x\\"}], "c": {}}))
    assert accepts(plain, anything, "{}")
    for bad in ('[1, 2]', '"text"', '{"a": 1', '{"a": 01}'):
        assert not accepts(plain, anything, bad), bad


def test_string_and_integer_bounds(plain):
    bounded = answer_grammar(OutputFormat("json_schema", SCHEMA), max_string_length=8)
    text = lambda name, age=3: json.dumps({"kind": "dog", "age": age, "owner": {"name": name, "pets": []}})
    assert accepts(plain, bounded, text("x" * 8)) and not accepts(plain, bounded, text("x" * 9))
    assert not accepts(plain, bounded, text("x", age=10**16))
    exact = answer_grammar(OutputFormat("json_schema", SCHEMA), max_string_length=None)
    assert accepts(plain, exact, text("x" * 300, age=10**16))
    explicit = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 400}}, "required": ["s"]}
    assert accepts(plain, answer_grammar(OutputFormat("json_schema", explicit), 8), json.dumps({"s": "y" * 300}))
    assert not accepts(plain, answer_grammar(OutputFormat("json_object"), 8), json.dumps({"k": "y" * 9}))


@pytest.mark.parametrize("schema", [{"type": "nope"}, {"type": "object", "properties": {"a": {"$ref": "#/missing"}}},
                                    {"not": {"type": "string"}}])
def test_bad_schemas_raise(schema):
    with pytest.raises(GrammarError):
        check_grammar(answer_grammar(OutputFormat("json_schema", schema)))


def test_bad_requests_raise():
    with pytest.raises(GrammarError):
        answer_grammar(OutputFormat("json_schema", {"a": {1, 2}}))  # not JSON
    with pytest.raises(GrammarError, match="not in tools"):
        tool_grammar([WEATHER], ToolChoice("named", "nope"), True, START, END, False)
    with pytest.raises(GrammarError):
        check_grammar('start: "a" undefined_rule')


def test_nothing_enforced():
    assert tool_grammar([WEATHER], ToolChoice("none"), True, START, END, False) is None
    assert tool_grammar([CLOCK], ToolChoice("auto"), True, START, END, True) is None  # no strict tool


def _markers(tokenizer, kind: str) -> dict:
    if kind == "text":
        return {}
    return {"start_token": special_marker_id(tokenizer, START), "end_token": special_marker_id(tokenizer, END)}


@pytest.mark.parametrize("kind", ["text", "special"])
def test_tool_grammars(plain, special, kind):
    tok = plain if kind == "text" else special
    marks = _markers(tok, kind)
    good, other = call("get_weather", {"city": "Paris", "unit": "c"}), call("get_time", {"tz": "UTC"})
    bad_args, bad_name = call("get_weather", {"city": "Paris", "unit": "k"}), call("nope", {})
    missing = call("get_weather", {"city": "Paris"})

    def grammar(mode, parallel=True, allow_text=False):
        g = tool_grammar([WEATHER, CLOCK], ToolChoice(mode, "get_time" if mode == "named" else None),
                         parallel, START, END, allow_text, **marks)
        check_grammar(g)
        return g

    required = grammar("required")
    assert accepts(tok, required, good) and accepts(tok, required, f"{good}\n{other}")
    for bad in (bad_args, bad_name, missing, "Hello", f"Hi {good}", ""):
        assert not accepts(tok, required, bad), bad
    single = grammar("required", parallel=False)
    assert accepts(tok, single, other) and not accepts(tok, single, f"{good}\n{other}")
    named = grammar("named")
    assert accepts(tok, named, other) and not accepts(tok, named, good)
    auto = grammar("auto", allow_text=True)
    for ok in ("Hello there", f"Let me check. {good}", good, f"{good}\n{other}"):
        assert accepts(tok, auto, ok), ok
    for bad in (f"Let me check. {bad_args}", f"x {missing}", f"x {bad_name}"):
        assert not accepts(tok, auto, bad), bad
    preamble = grammar("required", allow_text=True)
    assert accepts(tok, preamble, f"Sure. {good}") and not accepts(tok, preamble, "Sure.")


def test_special_marker_id(plain, special):
    assert special_marker_id(plain, START) is None
    assert special_marker_id(special, START) == special.convert_tokens_to_ids(START)
    # A special marker spelled as text is refused by the vocabulary: the id form is needed.
    text_form = tool_grammar([WEATHER], ToolChoice("required"), False, START, END, False)
    assert not accepts(special, text_form, call("get_weather", {"city": "Oslo", "unit": "f"}))
