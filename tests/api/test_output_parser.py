"""OutputParser on model-style text for each mlx-lm tool parser Pomona can wire, streamed in pieces
split at every position: the events, the calls and the content must not depend on the split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load

from api.core.conversation import (ReasoningDelta, TextDelta, ToolArgsDelta, ToolCallEnd, ToolCallStart)
from api.output.parser import OutputParser
from api.output.tool_syntax import available_parsers, syntax_for
from tiny_model import build_tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}},
]
WEATHER = ("get_weather", {"city": "Paris", "days": 2})
TIME = ("get_time", {"tz": "Europe/Paris"})

# (parser module, model-style answer, the calls it holds). Formats from each module's code and docstring.
CASES = [
    ("json_tools", 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
                   '\n</tool_call>\n<tool_call>\n{"arguments": {"tz": "Europe/Paris"}, "name": "get_time"}\n</tool_call>\n',
     [WEATHER, TIME]),
    ("qwen3_coder", "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>", [WEATHER, TIME]),
    ("pythonic", 'I will check.<|tool_call_start|>[get_weather(city="Paris", days=2), get_time(tz="Europe/Paris")]'
                 "<|tool_call_end|>", [WEATHER, TIME]),
    ("mistral", 'I will check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]'
                '{"tz": "Europe/Paris"}', [WEATHER, TIME]),
    ("glm47", "I will check.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", [WEATHER]),
    ("laguna", "I will check.<tool_call>get_time\n<arg_key>tz</arg_key>\n<arg_value>Europe/Paris</arg_value>\n"
               "</tool_call>", [TIME]),
    ("kimi_k2", 'I will check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
                '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
                'functions.get_time:1<|tool_call_argument_begin|>{"tz": "Europe/Paris"}<|tool_call_end|>'
                "<|tool_calls_section_end|>", [WEATHER, TIME]),
    ("kimi_k3", 'I will check.<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|><|open|>argument '
                'key="city" type="string"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key="days" '
                'type="integer"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>', [WEATHER]),
    ("minimax_m2", 'I will check.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
                   '</parameter>\n<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n'
                   '<parameter name="tz">Europe/Paris</parameter>\n</invoke>\n</minimax:tool_call>', [WEATHER, TIME]),
    ("gemma4", 'I will check.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>', [WEATHER]),
    ("function_gemma", "I will check.<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:2}"
                       "<end_function_call>", [WEATHER]),
    ("longcat", "I will check.<longcat_tool_call>get_weather\n<longcat_arg_key>city</longcat_arg_key>\n"
                "<longcat_arg_value>Paris</longcat_arg_value>\n<longcat_arg_key>days</longcat_arg_key>\n"
                "<longcat_arg_value>2</longcat_arg_value>\n</longcat_tool_call>", [WEATHER]),
    ("minicpm5", 'I will check.<function name="get_weather"><param name="city">Paris</param><param name="days">2'
                 '</param></function>\n<function name="get_time"><param name="tz">Europe/Paris</param></function>',
     [WEATHER, TIME]),
    ("muse_spark", 'I will check.<atem:function_calls><atem:invoke name="get_weather"><atem:parameter name="city">'
                   'Paris</atem:parameter><atem:parameter name="days">2</atem:parameter></atem:invoke>'
                   "</atem:function_calls>", [WEATHER]),
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    out = Path(tmp_path_factory.mktemp("tok"))
    build_tokenizer(out)
    return load(out)


def run(parser: OutputParser, pieces: list[str], reason: str = "stop") -> list:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish(reason)


def merged(events: list) -> list:
    """Consecutive deltas of one kind (and call) joined; call ids replaced by their order."""
    ids: dict[str, str] = {}
    out: list = []
    for e in events:
        if isinstance(e, (ToolCallStart, ToolCallEnd)):
            call_id = e.id if isinstance(e, ToolCallStart) else e.call.id
            ids.setdefault(call_id, f"id{len(ids)}")
        if out and type(e) is type(out[-1]) and isinstance(e, (TextDelta, ReasoningDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        elif out and isinstance(e, ToolArgsDelta) and isinstance(out[-1], ToolArgsDelta) and e.index == out[-1].index:
            out[-1] = ToolArgsDelta(e.index, out[-1].text + e.text)
        elif isinstance(e, ToolCallStart):
            out.append(("start", e.index, ids[e.id], e.name))
        elif isinstance(e, ToolCallEnd):
            out.append(("end", e.index, ids[e.call.id], e.call.name, e.call.arguments))
        else:
            out.append(e)
    return out


def check_calls(events: list, expected: list) -> None:
    """Calls in order, indices 0.., deltas concatenating to the final arguments."""
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.call.name, json.loads(e.call.arguments)) for e in ends] == [(n, a) for n, a in expected]
    assert [e.index for e in ends] == list(range(len(expected)))
    for end in ends:
        start = next(e for e in events if isinstance(e, ToolCallStart) and e.index == end.index)
        assert (start.id, start.name) == (end.call.id, end.call.name)
        assert "".join(e.text for e in events if isinstance(e, ToolArgsDelta) and e.index == end.index) \
            == end.call.arguments
        assert end.call.id.startswith("call_") or end.call.id.startswith("functions.")


@pytest.mark.parametrize("name,text,expected", CASES, ids=[c[0] for c in CASES])
def test_every_split_gives_the_same_events(tokenizer, name, text, expected):
    syntax = syntax_for(tokenizer, forced=name)
    whole_parser = OutputParser(syntax, TOOLS)
    whole = run(whole_parser, [text])
    check_calls(whole, expected)
    content = "".join(e.text for e in whole if isinstance(e, TextDelta))
    assert content == whole_parser.text == text[:text.index(syntax.start)].rstrip()  # no markup, no "\n"s
    assert whole_parser.finish_reason("stop") == "tool_calls"
    assert [c.name for c in whole_parser.tool_calls] == [n for n, _ in expected]
    reference = merged(whole)
    for k in range(len(text) + 1):
        assert merged(run(OutputParser(syntax, TOOLS), [text[:k], text[k:]])) == reference, k
    assert merged(run(OutputParser(syntax, TOOLS), list(text))) == reference


TWO_CALLS = [c for c in CASES if len(c[2]) > 1]


@pytest.mark.parametrize("name,text,expected", TWO_CALLS, ids=[c[0] for c in TWO_CALLS])
def test_max_calls_keeps_only_the_first_call(tokenizer, name, text, expected):
    """parallel_tool_calls false: one call in the answer, whether the second has its own section
    (json_tools, qwen3_coder, mistral) or shares the first's (pythonic's list, kimi's section)."""
    syntax = syntax_for(tokenizer, forced=name)

    def make():
        return OutputParser(syntax, TOOLS, max_calls=1)
    events = split_everywhere(make, text + " More text.")
    check_calls([e for e in run(make(), [text])], expected[:1])
    parser = make()
    run(parser, [text])
    assert [c.name for c in parser.tool_calls] == [expected[0][0]] and parser.dropped_calls == 0
    assert parser.text == text[:text.index(syntax.start)].rstrip() and parser.finish_reason("stop") == "tool_calls"
    assert sum(1 for e in events if isinstance(e, tuple) and e[0] == "start") == 1


def test_every_wireable_parser_is_covered():
    assert {c[0] for c in CASES} == set(available_parsers())


def test_json_arguments_stream_before_the_end_marker(tokenizer):
    syntax = syntax_for(tokenizer)  # the tiny tokenizer has no tools: the generic fallback
    text = CASES[0][1]
    parser, seen = OutputParser(syntax, TOOLS), []
    for i, ch in enumerate(text):
        seen += [(i, e) for e in parser.feed(ch)]
    first_end = text.index("</tool_call>")
    deltas = [i for i, e in seen if isinstance(e, ToolArgsDelta) and e.index == 0]
    start = next(i for i, e in seen if isinstance(e, ToolCallStart))
    assert start < text.index('"arguments"')  # the name is out before its arguments begin
    assert len(deltas) > 10 and max(deltas) < first_end
    # "arguments" before "name": held, then sent as soon as the name is known, still before the end
    second = [i for i, e in seen if isinstance(e, ToolArgsDelta) and e.index == 1]
    assert second and min(second) == text.index('"get_time"') + len('"get_time"') - 1
    assert parser.finish("stop") == []
    # the wrapper's closing brace and whitespace never go out
    assert [c.arguments for c in parser.tool_calls] == ['{"city": "Paris", "days": 2}', '{"tz": "Europe/Paris"}']


def split_everywhere(make, text: str, reason: str = "stop") -> list:
    """The merged events, checked to be the same for every two-piece split and char by char."""
    reference = merged(run(make(), [text], reason))
    for k in range(len(text) + 1):
        assert merged(run(make(), [text[:k], text[k:]], reason)) == reference, k
    assert merged(run(make(), list(text), reason)) == reference
    return reference


def test_reasoning_is_split_from_content_and_calls(tokenizer):
    syntax = syntax_for(tokenizer)
    text = ('<think>The user wants weather; "<tool" is not a call.</think>\n\nChecking.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')

    def make():
        return OutputParser(syntax, TOOLS, think_start="<think>", think_end="</think>")
    events = split_everywhere(make, text)
    assert events[0] == ReasoningDelta('The user wants weather; "<tool" is not a call.')
    assert events[1] == TextDelta("\n\nChecking.")
    assert events[2][:2] == ("start", 0) and events[-1][3:] == ("get_weather", '{"city": "Paris", "days": 2}')
    # a prompt that ends inside an open think section (enable_thinking templates)
    parser = OutputParser(syntax, TOOLS, think_start="<think>", think_end="</think>", starts_in_reasoning=True)
    run(parser, ["Hmm, 2+2", "=4.</th", "ink>The answer is 4."])
    assert (parser.reasoning, parser.text, parser.finish_reason("stop")) == ("Hmm, 2+2=4.", "The answer is 4.", "stop")


def test_reasoning_inline_stays_in_content_with_its_markers(tokenizer):
    text = "<think>Let me see.</think>It is 4."
    parser = OutputParser(syntax_for(tokenizer), TOOLS, think_start="<think>", think_end="</think>",
                          reasoning_inline=True)
    events = run(parser, list(text))
    assert (parser.text, parser.reasoning) == (text, "")
    assert not any(isinstance(e, ReasoningDelta) for e in events)


def test_tools_disabled_markers_are_content(tokenizer):
    text = 'Here:\n<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\n'
    parser = OutputParser(syntax_for(tokenizer), TOOLS, tools_enabled=False)
    events = run(parser, list(text))
    assert parser.text == text and parser.tool_calls == ()
    assert all(isinstance(e, TextDelta) for e in events) and parser.finish_reason("stop") == "stop"


def test_malformed_call_is_dropped_not_content_and_later_calls_still_parse(tokenizer):
    syntax = syntax_for(tokenizer)
    bad = '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call>'
    good = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    text = f"First.\n{bad}\n{good}"
    events = split_everywhere(lambda: OutputParser(syntax, TOOLS), text)
    assert events[0] == TextDelta("First.")  # the markup never reaches content
    assert events[1][:2] == ("start", 0) and events[-1][3:] == ("get_time", '{"tz": "UTC"}')
    parser = OutputParser(syntax, TOOLS)
    run(parser, [text])
    assert parser.finish_reason("stop") == "tool_calls" and parser.invalid_calls == ()
    assert parser.text == "First." and parser.dropped_calls == 1
    # a non-JSON syntax: qwen3_coder text without a function block
    qwen = syntax_for(tokenizer, forced="qwen3_coder")
    parser = OutputParser(qwen, TOOLS)
    run(parser, list("Ok.<tool_call>\nnot a call\n</tool_call>"))
    assert parser.text == "Ok." and parser.tool_calls == () and parser.dropped_calls == 1
    assert parser.finish_reason("stop") == "stop"


def test_started_call_with_broken_arguments_still_ends(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",, }}\n</tool_call>'
    events = split_everywhere(lambda: OutputParser(syntax_for(tokenizer), TOOLS), text)
    assert events[-1][3:] == ("get_weather", '{"city": "Paris",, }')
    parser = OutputParser(syntax_for(tokenizer), TOOLS)
    run(parser, [text])
    assert parser.invalid_calls == (0,) and parser.finish_reason("stop") == "stop"


def test_missing_wrapper_brace_is_still_a_call(tokenizer):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    parser = OutputParser(syntax_for(tokenizer), TOOLS)
    run(parser, list(text))
    assert [(c.name, c.arguments) for c in parser.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert parser.finish_reason("stop") == "tool_calls" and parser.text == ""


def test_length_truncated_calls(tokenizer):
    syntax = syntax_for(tokenizer)
    # cut inside the arguments: the started call ends with what was sent, finish "length"
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    events = split_everywhere(lambda: OutputParser(syntax, TOOLS), text, "length")
    assert events == [TextDelta("Sure."), ("start", 0, "id0", "get_weather"), ToolArgsDelta(0, '{"city": "Par'),
                      ("end", 0, "id0", "get_weather", '{"city": "Par')]
    parser = OutputParser(syntax, TOOLS)
    run(parser, [text], "length")
    assert parser.invalid_calls == (0,) and parser.finish_reason("length") == "length"
    # cut before the name: no call was announced; dropped, never markup in content
    text = 'Sure.\n<tool_call>\n{"na'
    parser = OutputParser(syntax, TOOLS)
    events = split_everywhere(lambda: OutputParser(syntax, TOOLS), text, "length")
    run(parser, [text], "length")
    assert parser.text == "Sure." and parser.tool_calls == () and parser.finish_reason("length") == "length"
    assert parser.dropped_calls == 1
    # cut inside the end marker after a complete call: still the call
    text = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_'
    parser = OutputParser(syntax, TOOLS)
    run(parser, list(text), "length")
    assert [c.arguments for c in parser.tool_calls] == ['{"tz": "UTC"}'] and parser.text == ""


def test_plain_text_is_unchanged(tokenizer):
    text = "Hello  world\n\n  <tool is not a marker>   \n"
    for enabled in (True, False):
        parser = OutputParser(syntax_for(tokenizer), TOOLS, tools_enabled=enabled)
        run(parser, list(text))
        assert parser.text == text and parser.finish_reason("stop") == "stop"


def test_json_bodies_that_do_not_stream(tokenizer):
    """Arguments as a JSON string, no arguments, or a list of calls: sent whole at the end marker."""
    syntax = syntax_for(tokenizer)
    text = ('<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}\n</tool_call>'
            '<tool_call>{"name": "get_time"}</tool_call>'
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
            '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]</tool_call>')
    events = split_everywhere(lambda: OutputParser(syntax, TOOLS), text)
    check_calls(run(OutputParser(syntax, TOOLS), [text]),
                [("get_time", {"tz": "UTC"}), ("get_time", {}), WEATHER, TIME])
    assert [e[4] for e in events if isinstance(e, tuple) and e[0] == "end"][:2] == ['{"tz": "UTC"}', "{}"]


def test_two_json_calls_in_one_block(tokenizer):
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
            '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>')
    events = split_everywhere(lambda: OutputParser(syntax_for(tokenizer), TOOLS), text)
    check_calls(run(OutputParser(syntax_for(tokenizer), TOOLS), [text]), [WEATHER, TIME])
    assert not any(isinstance(e, TextDelta) for e in events)


def test_unicode_and_escapes_in_streamed_arguments(tokenizer):
    text = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich 🙂 \\"\\u00e9\\\\", "days": 2}}'
            '</tool_call>')
    events = split_everywhere(lambda: OutputParser(syntax_for(tokenizer), TOOLS), text)
    assert events[-1][4] == '{"city": "Zürich 🙂 \\"\\u00e9\\\\", "days": 2}'  # as generated
    assert json.loads(events[-1][4]) == {"city": 'Zürich 🙂 "é\\', "days": 2}


def test_a_call_may_open_inside_the_reasoning(tokenizer):
    """As mlx-lm's state machine: a call marker inside an unclosed think section is a call."""
    text = '<think>I need the weather<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>Done.'
    events = split_everywhere(lambda: OutputParser(syntax_for(tokenizer), TOOLS, think_start="<think>",
                                                   think_end="</think>"), text)
    assert events[0] == ReasoningDelta("I need the weather") and events[-1] == TextDelta("Done.")
    assert events[-2][3:] == ("get_time", '{"tz": "UTC"}')
