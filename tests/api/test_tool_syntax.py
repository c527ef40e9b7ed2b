"""syntax_for and render_prompt on real tokenizers: the tiny one (no tools in its template, so the
generic fallback) and copies of it with test-made chat templates that know tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load
from mlx_lm.tool_parsers import json_tools, pythonic, qwen3_coder

from api.core.conversation import Message, Tool, ToolCall
from api.output.parser import OutputParser
from api.output.tool_syntax import (FALLBACK_END, FALLBACK_START, TemplateError, available_parsers,
                                     fallback_system_text, render_prompt, syntax_for)
from tiny_model import build_tokenizer

# Hermes / Qwen2.5 style: tools as JSON in the system turn, calls as <tool_call> JSON (mlx-lm infers
# json_tools from "<tool_call>" and "tool_call.name"), results as user <tool_response> turns.
JSON_TOOLS_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not loop.first %}{{ raise_exception('System message must be first') }}{% endif %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls %}{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if house_style %}({{ house_style }}){% endif %}{% endif %}"""

# Qwen3-Coder style markers: the same <tool_call> markers, an XML body (mlx-lm infers qwen3_coder).
QWEN3_CODER_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}"
    "Call with <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>\n{% endif %}"
    "{% for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}"
)

TOOLS = (Tool("get_weather", "Current weather", {"type": "object", "properties": {"city": {"type": "string"}},
                                                 "required": ["city"]}),)
HISTORY = (
    Message("system", "Answer in French."),
    Message("user", "Weather in Paris?"),
    Message("assistant", "Je regarde.", tool_calls=(ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
    Message("tool", "18 C, sunny", tool_call_id="call_1", name="get_weather"),
)


def tokenizer_with(tmp: Path, template: str | None):
    build_tokenizer(tmp)
    if template is not None:
        config = json.loads((tmp / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return load(tmp)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return tokenizer_with(tmp_path_factory.mktemp("plain"), None)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    return tokenizer_with(tmp_path_factory.mktemp("hermes"), JSON_TOOLS_TEMPLATE)


def test_template_without_tools_gets_the_generic_fallback(plain):
    syntax = syntax_for(plain)
    assert (syntax.name, syntax.start, syntax.end, syntax.json_body, syntax.native) == \
        ("json_tools", FALLBACK_START, FALLBACK_END, True, False)
    assert syntax.parse is json_tools.parse_tool_call


def test_template_with_tools_is_native(hermes, tmp_path):
    syntax = syntax_for(hermes)
    assert (syntax.name, syntax.start, syntax.end, syntax.json_body, syntax.native) == \
        ("json_tools", hermes.tool_call_start, hermes.tool_call_end, True, True)
    # same markers as json_tools, another parser: the module is found by its parse function
    coder = syntax_for(tokenizer_with(tmp_path, QWEN3_CODER_TEMPLATE))
    assert (coder.name, coder.json_body, coder.native, coder.parse) == \
        ("qwen3_coder", False, True, qwen3_coder.parse_tool_call)


def test_forced_parser_by_name(plain, hermes):
    syntax = syntax_for(plain, forced="pythonic")
    assert (syntax.name, syntax.start, syntax.end, syntax.parse, syntax.json_body, syntax.native) == \
        ("pythonic", pythonic.tool_call_start, pythonic.tool_call_end, pythonic.parse_tool_call, False, False)
    forced = syntax_for(hermes, forced="qwen3_coder")
    assert (forced.name, forced.native, forced.json_body) == ("qwen3_coder", True, False)
    with pytest.raises(ValueError) as err:
        syntax_for(plain, forced="harmony")
    assert "harmony" in str(err.value) and all(name in str(err.value) for name in available_parsers())


def test_fallback_prompt_keeps_the_system_text_and_renders_history(plain):
    syntax = syntax_for(plain)
    prompt = render_prompt(plain, HISTORY, TOOLS, syntax, {})
    system = prompt[:prompt.index("<|im_end|>")]
    assert system == "<|im_start|>system\nAnswer in French.\n\n" + fallback_system_text(TOOLS)
    tool_line = json.dumps({"name": "get_weather", "description": "Current weather",
                            "parameters": TOOLS[0].parameters})
    assert tool_line in system.splitlines()
    assert ('<|im_start|>assistant\nJe regarde.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # the history's call text is what the output parser reads back as the same call
    block = prompt[prompt.index("Je regarde.\n") + len("Je regarde.\n"):prompt.index("<|im_end|>\n<|im_start|>user\n<tool_r")]
    parser = OutputParser(syntax, [])
    parser.feed(block)
    parser.finish("stop")
    assert [(c.name, c.arguments_object()) for c in parser.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_fallback_without_a_client_system_message(plain):
    prompt = render_prompt(plain, HISTORY[1:2], TOOLS, syntax_for(plain), {})
    assert prompt.startswith("<|im_start|>system\n" + fallback_system_text(TOOLS) + "<|im_end|>\n<|im_start|>user\n")
    # no tools (tool_choice "none"): no tool list, the history still renders
    prompt = render_prompt(plain, HISTORY[1:], (), syntax_for(plain), {})
    assert "tools (functions)" not in prompt and "<tool_response>\n18 C" in prompt
    results = (Message("tool", "a", tool_call_id="1"), Message("tool", "b", tool_call_id="2"))
    prompt = render_prompt(plain, HISTORY[1:3] + results, (), syntax_for(plain), {})
    assert "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response><|im_end|>" \
        in prompt


def test_native_prompt_through_the_models_template(hermes):
    prompt = render_prompt(hermes, HISTORY, TOOLS, syntax_for(hermes), {"house_style": "brief"})
    assert prompt.startswith("<|im_start|>system\nAnswer in French.\n\n# Tools\n<tools>")
    assert json.dumps({"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                        "parameters": TOOLS[0].parameters}}) in prompt
    assert ('<|im_start|>assistant\nJe regarde.<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n(brief)")
    assert "# Tools" not in render_prompt(hermes, HISTORY, (), syntax_for(hermes), {})


def test_template_refusals_are_template_errors(hermes, plain):
    late_system = HISTORY[1:2] + (Message("system", "late"),)
    with pytest.raises(TemplateError, match="System message must be first"):
        render_prompt(hermes, late_system, TOOLS, syntax_for(hermes), {})
    with pytest.raises(TemplateError, match="tokenize"):
        render_prompt(hermes, HISTORY, TOOLS, syntax_for(hermes), {"tokenize": True})
    bad_args = (Message("assistant", "", tool_calls=(ToolCall("c", "get_weather", "{city"),)),)
    for tok in (hermes, plain):
        with pytest.raises(TemplateError, match="not JSON"):
            render_prompt(tok, HISTORY[1:2] + bad_args, TOOLS, syntax_for(tok), {})


def test_the_documented_fallback_format_is_the_one_rendered():
    import api.output.tool_syntax as ts
    quoted = [line[4:] for line in ts.__doc__.splitlines() if line.startswith("    ")]
    rendered = fallback_system_text(TOOLS).splitlines()
    assert len(quoted) == len(rendered) == 7
    assert [q for i, q in enumerate(quoted) if i != 1] == [r for i, r in enumerate(rendered) if i != 1]
    assert json.loads(rendered[1])["name"] == "get_weather" and quoted[1].startswith('{"name": "get_weather"')


NO_SYSTEM_TEMPLATE = (  # Gemma 2 style: no system role, no tools
    "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_fallback_text_goes_to_the_first_user_turn_without_a_system_role(tmp_path):
    tok = tokenizer_with(tmp_path, NO_SYSTEM_TEMPLATE)
    syntax = syntax_for(tok)
    assert not syntax.native
    prompt = render_prompt(tok, HISTORY[1:], TOOLS, syntax, {})
    assert prompt.startswith(f"<start_of_turn>user\n{fallback_system_text(TOOLS)}\n\nWeather in Paris?<end_of_turn>")
    with pytest.raises(TemplateError, match="System role not supported"):  # the client's own system message
        render_prompt(tok, HISTORY, TOOLS, syntax, {})
