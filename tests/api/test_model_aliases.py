"""`model_aliases`: the model names agent clients send (Claude Code's `claude-sonnet-4-5`, ...) answered
by the served model; any other name stays a 404 `model_not_found`, in each dialect's shape."""

from __future__ import annotations

import asyncio

import anthropic
import httpx
import httpx2
import openai
import pytest

from agent_helpers import in_process
from api.service.settings import AppSettings

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ALIASES = ["claude-*", "gpt-5"]
ASK = [{"role": "user", "content": "hi"}]


def test_aliases_are_validated_and_matched_as_patterns():
    settings = AppSettings.from_args({"model": "m", "model_aliases": ALIASES})
    assert settings.model_aliases == ("claude-*", "gpt-5")
    assert settings.is_alias("claude-sonnet-4-5") and settings.is_alias("claude-3-5-haiku-latest")
    assert settings.is_alias("gpt-5")
    assert not any(settings.is_alias(n) for n in ("claude", "Claude-sonnet", "gpt-5-mini", "m"))
    assert not AppSettings.from_args({"model": "m"}).is_alias("claude-sonnet-4-5")
    for bad in ("claude-*", [""], [3]):
        with pytest.raises(ValueError, match="model_aliases"):
            AppSettings.from_args({"model": "m", "model_aliases": bad})


def test_aliased_names_are_served_and_others_are_404(tiny_model_dir):
    async def anthropic_side():
        async with in_process(tiny_model_dir, httpx2, model_aliases=ALIASES) as http:
            client = anthropic.AsyncAnthropic(base_url="http://pomona.test", api_key="x", http_client=http,
                                              max_retries=0)
            message = await client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
            count = await client.messages.count_tokens(model="claude-opus-4-1", messages=ASK)
            with pytest.raises(anthropic.NotFoundError) as err:
                await client.messages.create(model="claude", max_tokens=4, messages=ASK)
            return message, count, err.value

    async def openai_side():
        async with in_process(tiny_model_dir, httpx, model_aliases=ALIASES) as http:
            client = openai.AsyncOpenAI(base_url="http://pomona.test/v1", api_key="x", http_client=http,
                                        max_retries=0)
            chat = await client.chat.completions.create(model="gpt-5", messages=ASK, max_tokens=4)
            response = await client.responses.create(model="gpt-5", input="hi", max_output_tokens=4, store=False)
            with pytest.raises(openai.NotFoundError) as err:
                await client.responses.create(model="gpt-5-mini", input="hi", max_output_tokens=4)
            return chat, response, err.value
    message, count, refused = asyncio.run(anthropic_side())
    assert message.type == "message" and message.model == "tiny" and count.input_tokens > 0
    assert refused.body["error"]["type"] == "not_found_error" and "model_aliases" in refused.body["error"]["message"]
    chat, response, refused = asyncio.run(openai_side())
    assert chat.choices[0].message.content is not None and response.status in ("completed", "incomplete")
    assert refused.body["code"] == "model_not_found" and refused.body["param"] == "model"
