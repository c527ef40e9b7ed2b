"""Helpers for the agent-API tests: a tiny model whose chat template knows tools, an in-process app
(the real Starlette app over a real engine, no Ray) reachable by the official SDKs, and tool sets."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any, AsyncIterator

import httpx

# A Hermes/Qwen2.5-style template: tools listed in the system turn, calls as <tool_call> JSON, tool
# results as <tool_response> in a user turn. mlx-lm infers its `json_tools` parser from the
# "<tool_call>" and "tool_call.name" in it, so this is the native path (not Pomona's fallback).
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "# Tools\n<tools>\n{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a tool as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "<tool_call>\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n"
    "</tool_call>{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "unit"],
    "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 32},
                                           "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search_docs", "description": "Search the docs.",
                                      "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search_docs": SEARCH}


def tools_model_dir(base: Path, out: Path) -> Path:
    """A copy of the tiny model whose tokenizer's chat template knows tools."""
    if not out.exists():
        shutil.copytree(base, out)
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = TOOLS_TEMPLATE
        config_path.write_text(json.dumps(config))
    return out


class AsyncReplica:
    """A real EngineHost as the ingress reaches it: Ray's handle makes `info`/`stats` awaitable."""

    def __init__(self, host: Any) -> None:
        self.host = host

    def stream(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str) -> Any:
        return self.host.stream(prompt_tokens, params, request_id)

    async def info(self) -> dict[str, Any]:
        return self.host.info()

    async def stats(self) -> dict[str, Any]:
        return self.host.stats()


@contextlib.asynccontextmanager
async def in_process(model_dir: Path, http_lib: Any = httpx, wrap: Any = None, raise_app_exceptions: bool = True,
                     **app_args: Any) -> AsyncIterator[Any]:
    """The real app on a real engine in this process; an async client whose transport is the app.

    `http_lib` is httpx, or httpx2 for the anthropic SDK (which refuses httpx objects); `wrap` goes
    around the loaded model (tests/engine_helpers.FaultyModel injects faults); with
    `raise_app_exceptions=False` the client gets the 500 the server sends, as over a socket."""
    from engine.loop import AsyncEngine
    from engine_helpers import tiny_loader
    from deployments.engine_host import EngineHost
    from modelio import models
    from api.service.server import OpenAIServer
    from api.service.settings import AppSettings

    from e2e_helpers import tiny_args

    settings = AppSettings.from_args(tiny_args(model_dir, **app_args))
    factory = None if wrap is None else (lambda config: AsyncEngine(config, loader=tiny_loader(model_dir, wrap)))
    host = EngineHost(settings.engine, engine_factory=factory)
    await host.start()
    server = OpenAIServer(settings, AsyncReplica(host), lambda: models.tokenizer_for(str(model_dir)),
                          keys=settings.key_ring())
    try:
        await server.refresh()
        assert server.ready is not None, "the in-process engine did not become ready"
        transport = http_lib.ASGITransport(app=server.app(), raise_app_exceptions=raise_app_exceptions)
        async with http_lib.AsyncClient(transport=transport, base_url="http://pomona.test", timeout=120) as client:
            yield client
    finally:
        await host.shutdown(0)


# A template whose generation prompt opens a think section unless enable_thinking is false (Qwen3's way).
THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


def think_model_dir(out: Path) -> Path:
    """A tiny model with <think>/</think> special tokens (mlx-lm's has_thinking) and THINK_TEMPLATE."""
    from tiny_model import build_tiny_model

    if not (out / "config.json").exists():
        build_tiny_model(out, extra_special=("<think>", "</think>"))
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    return out


def special_tools_model_dir(out: Path) -> Path:
    """A tiny model whose tool markers are single special tokens (as Qwen's are) and whose template
    knows tools: the grammar must match the marker as that token."""
    from tiny_model import build_tiny_model

    if not (out / "config.json").exists():
        build_tiny_model(out, extra_special=("<tool_call>", "</tool_call>"))
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    return out
