"""`parallel_tool_calls: false` (OpenAI chat, Responses) and Anthropic's
`tool_choice.disable_parallel_tool_use` under tool_choice "auto": at most one call in the answer.

The model: tiny, random, with single-token call markers and a tools-aware template
(agent_helpers.special_tools_model_dir). A strict tool puts the call body under the grammar, and a
+100 logit_bias on the start marker makes the model open a call whenever free text is allowed, so
left alone it writes call after call until max_tokens; the baseline below checks that it does.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx2
import openai
import pytest

from agent_helpers import SCHEMAS, TOOLS, in_process, special_tools_model_dir
from modelio.models import tokenizer_for as load_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
STRICT = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return special_tools_model_dir(tmp_path_factory.mktemp("special") / "model")


@pytest.fixture(scope="module")
def push(model_dir) -> dict[str, int]:
    return {str(load_tokenizer(str(model_dir)).convert_tokens_to_ids("<tool_call>")): 100}


def run(model_dir, body, http_lib=httpx2):
    async def main():
        async with in_process(model_dir, http_lib) as http:
            return await body(http)
    return asyncio.run(main())


def test_chat_completions(model_dir, push):
    async def body(http):
        client = openai.AsyncOpenAI(base_url="http://pomona.test/v1", api_key="x", http_client=http, max_retries=0)
        kw = dict(model="tiny", messages=ASK, tools=STRICT, temperature=1.0, max_tokens=MAX_TOKENS, logit_bias=push)
        free = await client.chat.completions.create(seed=0, **kw)
        one = [await client.chat.completions.create(seed=s, parallel_tool_calls=False, **kw) for s in range(3)]
        streamed = [c async for c in await client.chat.completions.create(
            seed=1, parallel_tool_calls=False, stream=True, **kw)]
        return free, one, streamed
    free, one, streamed = run(model_dir, body, http_lib=__import__("httpx"))
    assert len(free.choices[0].message.tool_calls) > 1  # the push works: left alone, several calls
    for out in one:
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
        assert json.loads(calls[0].function.arguments).keys() <= SCHEMAS[calls[0].function.name]["properties"].keys()
        assert out.usage.completion_tokens < MAX_TOKENS  # generation ended at the call, not at max_tokens
    indices = {tc.index for c in streamed for ch in c.choices for tc in ch.delta.tool_calls or ()}
    assert indices == {0} and streamed[-1].choices[0].finish_reason == "tool_calls"


def test_responses(model_dir, push):
    tools = [{"type": "function", **t["function"]} for t in STRICT]

    async def body(http):
        client = openai.AsyncOpenAI(base_url="http://pomona.test/v1", api_key="x", http_client=http, max_retries=0)
        kw = dict(model="tiny", input="Weather in Paris?", tools=tools, temperature=1.0,
                  max_output_tokens=MAX_TOKENS, store=False, extra_body={"logit_bias": push, "seed": 2})
        return (await client.responses.create(**kw),
                await client.responses.create(parallel_tool_calls=False, **kw))
    free, one = run(model_dir, body, http_lib=__import__("httpx"))
    assert sum(i.type == "function_call" for i in free.output) > 1
    assert [i.type for i in one.output] == ["function_call"] and one.status == "completed"
    assert one.usage.output_tokens < MAX_TOKENS


def test_anthropic_disable_parallel_tool_use(model_dir, push):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"], "strict": True} for t in TOOLS]

    async def body(http):
        client = anthropic.AsyncAnthropic(base_url="http://pomona.test", api_key="x", http_client=http,
                                          max_retries=0)
        kw = dict(model="tiny", max_tokens=MAX_TOKENS, messages=ASK, tools=tools,
                  extra_body={"logit_bias": push, "temperature": 1.0, "seed": 3})
        free = await client.messages.create(**kw)
        one = await client.messages.create(tool_choice={"type": "auto", "disable_parallel_tool_use": True}, **kw)
        async with client.messages.stream(tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                                          **kw) as stream:
            final = await stream.get_final_message()
        return free, one, final
    free, one, final = run(model_dir, body)
    assert sum(b.type == "tool_use" for b in free.content) > 1
    for message in (one, final):
        assert [b.type for b in message.content] == ["tool_use"]
        # the end marker Pomona stopped at is not the client's stop sequence
        assert message.stop_reason == "tool_use" and message.stop_sequence is None
        assert message.usage.output_tokens < MAX_TOKENS


def test_text_end_marker_becomes_a_stop_string_that_is_not_reported(tiny_model_dir, model_dir):
    """Markers written as text (the fallback's "</tool_call>"): a stop string, added once, within the
    engine's bound, and hidden from the client's stop_sequence; a special-token marker: a stop token."""
    from engine.types import MAX_STOP_STRINGS, SamplingParams

    from api.core.conversation import Conversation, Message, Tool, ToolChoice
    from api.core.generation import _end_at_first_call
    from api.output.tool_syntax import syntax_for

    def conv(parallel=False, mode="auto", stop=()):
        return Conversation("tiny", (Message("user", "hi"),), SamplingParams(stop=stop), tools=(Tool("f"),),
                            tool_choice=ToolChoice(mode, "f" if mode == "named" else None),
                            parallel_tool_calls=parallel)
    tok = load_tokenizer(str(tiny_model_dir))
    syntax = syntax_for(tok)
    for c in (conv(), conv(stop=("END",))):
        sampling, added = _end_at_first_call(c, c.sampling, syntax, tok)
        assert added == "</tool_call>" and sampling.stop == c.sampling.stop + ("</tool_call>",)
    for c in (conv(parallel=True), conv(mode="named"), conv(mode="none"), conv(stop=("</tool_call>",)),
              conv(stop=tuple(f"s{i}" for i in range(MAX_STOP_STRINGS)))):
        assert _end_at_first_call(c, c.sampling, syntax, tok) == (c.sampling, None)
    special = load_tokenizer(str(model_dir))
    sampling, added = _end_at_first_call(conv(), conv().sampling, syntax_for(special), special)
    assert added is None and sampling.stop_token_ids == (special.convert_tokens_to_ids("</tool_call>"),)
