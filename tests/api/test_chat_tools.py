"""Tool calling, structured output, n and logit_bias on /v1/chat/completions: the official openai SDK
against the real app and engine in process (tests/agent_helpers.py), tiny random models.

Two templates: the tiny model's own (no tools: Pomona's generic fallback renders them) and a
test-made one that knows tools (mlx-lm's json_tools parser, the native path).
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from agent_helpers import SCHEMAS, TOOLS, in_process, tools_model_dir

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
SEEDS = range(8)


@pytest.fixture(scope="module", params=["fallback", "native"])
def model_dir(request, tiny_model_dir, tmp_path_factory):
    if request.param == "fallback":
        return tiny_model_dir
    return tools_model_dir(tiny_model_dir, tmp_path_factory.mktemp("tools") / "model")


def run(model_dir, body):
    """Run `body(client)` against a fresh in-process app."""
    async def main():
        async with in_process(model_dir) as http:
            client = openai.AsyncOpenAI(base_url="http://pomona.test/v1", api_key="x", http_client=http,
                                        max_retries=0)
            return await body(client)
    return asyncio.run(main())


def valid_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_and_named_calls_always_valid(model_dir):
    async def body(client):
        outs = []
        for seed in SEEDS:
            for choice in ("required", {"type": "function", "function": {"name": "search_docs"}}):
                outs.append((choice, await client.chat.completions.create(
                    model="tiny", messages=MSG, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=seed,
                    parallel_tool_calls=False, max_tokens=120)))
        return outs
    for choice, out in run(model_dir, body):
        c = out.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.tool_calls and "<tool_call>" not in (c.message.content or "")
        assert len(c.message.tool_calls) == 1  # parallel_tool_calls false: exactly one
        valid_call(c.message.tool_calls[0])
        if isinstance(choice, dict):
            assert c.message.tool_calls[0].function.name == "search_docs"


def test_full_tool_loop(model_dir):
    async def body(client):
        first = await client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, temperature=0,
                                                     tool_choice="required", parallel_tool_calls=False,
                                                     max_tokens=120)
        call = first.choices[0].message.tool_calls[0]
        history = MSG + [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "clear"}'}]
        final = await client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                                     tool_choice="none", temperature=0, max_tokens=16)
        return first, final
    first, final = run(model_dir, body)
    valid_call(first.choices[0].message.tool_calls[0])
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert isinstance(answer.message.content, str) and "<tool_call>" not in answer.message.content
    assert final.usage.prompt_tokens > first.usage.prompt_tokens
    # the tools stay in the prompt under "none": the second turn starts with the first's prompt (cached)
    assert final.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2


def reassemble(chunks) -> tuple[str, list[dict], str, int]:
    text, calls, finish, pieces = "", {}, None, 0
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            text += delta.content or ""
            for tc in delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert slot["id"] is None, "the id comes once, in the call's first delta"
                    slot["id"], slot["name"] = tc.id, tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
                    pieces += 1
            finish = choice.finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish, pieces


def test_streamed_calls_match_whole_and_arrive_in_pieces(model_dir):
    async def body(client):
        pairs = []
        for seed in range(3):
            kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", temperature=1.0,
                      seed=seed, max_tokens=120, parallel_tool_calls=False)
            whole = await client.chat.completions.create(**kw)
            stream = [c async for c in await client.chat.completions.create(stream=True, **kw)]
            pairs.append((whole, stream))
        return pairs
    for whole, stream in run(model_dir, body):
        text, calls, finish, pieces = reassemble(stream)
        expected = whole.choices[0].message.tool_calls
        assert finish == "tool_calls" and "<tool_call>" not in text
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in expected]
        assert all(c["id"].startswith("call_") for c in calls)
        assert pieces > len(calls), "arguments must stream in pieces, not one blob per call"


@pytest.fixture(scope="module")
def special_dir(tmp_path_factory):
    from agent_helpers import special_tools_model_dir

    return special_tools_model_dir(tmp_path_factory.mktemp("special") / "model")


def test_special_token_markers_forced_and_forbidden(special_dir):
    """Markers that are one special token each: "required" writes them as those tokens, and "none"
    keeps the model from them even when the logits push hard toward the start marker."""
    from modelio.models import tokenizer_for as load_tokenizer

    start = load_tokenizer(str(special_dir)).convert_tokens_to_ids("<tool_call>")

    async def body(client):
        forced = [await client.chat.completions.create(
            model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            temperature=1.0, seed=s, max_tokens=120) for s in range(4)]
        pushed = dict(model="tiny", messages=MSG, tools=TOOLS, temperature=1.0, max_tokens=24,
                      logit_bias={str(start): 100})
        free = await client.chat.completions.create(**pushed)  # auto: the push makes it call
        none = [await client.chat.completions.create(tool_choice="none", seed=s, **pushed) for s in range(4)]
        return forced, free, none
    forced, free, none = run(special_dir, body)
    for out in forced:
        assert out.choices[0].finish_reason == "tool_calls"
        valid_call(out.choices[0].message.tool_calls[0])
    assert "tool_call" not in (free.choices[0].message.content or "")
    for out in none:
        message = out.choices[0].message
        assert not message.tool_calls and "tool_call" not in (message.content or "")
        assert out.choices[0].finish_reason in ("stop", "length")


PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def test_json_schema_and_json_object_always_hold(tiny_model_dir):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    async def body(client):
        outs = [await client.chat.completions.create(model="tiny", messages=MSG, response_format=schema_format,
                                                     temperature=1.0, seed=s, max_tokens=200) for s in SEEDS]
        objs = [await client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, seed=s,
                                                     response_format={"type": "json_object"}, max_tokens=1500)
                for s in range(4)]
        return outs, objs
    outs, objs = run(tiny_model_dir, body)
    for out in outs:
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    for out in objs:
        assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize("fmt", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/definitions/missing"}}},
])
def test_bad_schema_is_a_400_naming_the_field(tiny_model_dir, fmt):
    async def body(client):
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt, max_tokens=5)
        return err.value
    err = run(tiny_model_dir, body)
    assert err.body["param"] == "response_format" and "schema" in err.body["message"]


def test_free_requests_keep_their_greedy_text_beside_constrained_ones(tiny_model_dir):
    async def free(client):
        out = await client.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=24,
                                                   extra_body={"ignore_eos": True})
        return out.choices[0].message.content

    async def body(client):
        alone = await free(client)
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        mixed = await asyncio.gather(
            free(client), *(client.chat.completions.create(model="tiny", messages=MSG, response_format=fmt,
                                                           temperature=1.0, seed=s, max_tokens=120) for s in range(3)),
            client.chat.completions.create(model="tiny", messages=MSG, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=9, max_tokens=120),
            free(client))
        return alone, mixed
    alone, mixed = run(tiny_model_dir, body)
    assert mixed[0] == alone and mixed[-1] == alone
    for out in mixed[1:4]:
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    valid_call(mixed[4].choices[0].message.tool_calls[0])


def test_n_choices_whole_and_streamed(tiny_model_dir):
    async def body(client):
        whole = await client.chat.completions.create(model="tiny", messages=MSG, n=3, temperature=1.0, seed=5,
                                                     max_tokens=8, extra_body={"ignore_eos": True})
        stream = [c async for c in await client.chat.completions.create(
            model="tiny", messages=MSG, n=2, temperature=1.0, seed=5, max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
        return whole, stream
    whole, stream = run(tiny_model_dir, body)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens > 0
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert sorted(texts) == [0, 1]
    assert texts[0] == whole.choices[0].message.content and texts[1] == whole.choices[1].message.content
    assert stream[-1].usage.completion_tokens == 16


def test_logit_bias_steers_and_is_checked(tiny_model_dir):
    async def body(client):
        out = await client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, max_tokens=6,
                                                   logit_bias={"65": 100}, logprobs=True,
                                                   extra_body={"ignore_eos": True})
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2,
                                                 logit_bias={"999999": 5})
        return out, err.value
    out, err = run(tiny_model_dir, body)
    tokens = [lp.token for lp in out.choices[0].logprobs.content]
    assert len(tokens) == 6 and len(set(tokens)) == 1
    assert err.body["param"] == "logit_bias"


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory):
    from agent_helpers import think_model_dir

    return think_model_dir(tmp_path_factory.mktemp("think") / "model")


def test_reasoning_content_split_inline_and_off_and_schema_after_it(think_dir):
    from modelio.models import tokenizer_for as load_tokenizer

    end = load_tokenizer(str(think_dir)).convert_tokens_to_ids("</think>")
    kw = dict(model="tiny", messages=MSG, temperature=0, max_tokens=16,
              logit_bias={str(end): 1}, extra_body={"ignore_eos": True})  # the random model closes it soon

    async def body(client):
        split = await client.chat.completions.create(**kw)
        stream = [c async for c in await client.chat.completions.create(stream=True, **kw)]
        inline = await client.chat.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                                             "separate_reasoning": False}})
        off = await client.chat.completions.create(**{**kw, "extra_body": {
            "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}})
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        shaped = [await client.chat.completions.create(model="tiny", messages=MSG, temperature=1.0, seed=s,
                                                       max_tokens=300, response_format=fmt,
                                                       logit_bias={str(end): 2}) for s in range(3)]
        return split, stream, inline, off, shaped
    split, stream, inline, off, shaped = run(think_dir, body)
    message = split.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "think>" not in reasoning and not (message.content or "").startswith("</think>")
    assert split.choices[0].message.content is not None
    streamed = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in stream
                       if c.choices)
    assert streamed == reasoning
    assert "</think>" in inline.choices[0].message.content
    assert not (inline.choices[0].message.model_extra or {}).get("reasoning_content")
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content")
    for out in shaped:  # the schema holds for the answer; the reasoning before it is free
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    assert any(out.choices[0].message.model_extra.get("reasoning_content") for out in shaped)
