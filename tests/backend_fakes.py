"""Backends for the ingress without Ray: what `OpenAIServer` sees while no LLM server can answer."""

from __future__ import annotations

from typing import Any


class NoReplica:
    """What the ingress sees while no LLM server replica is up: every call fails."""

    def stream(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str):
        raise AssertionError("must not be called while not ready")

    async def info(self) -> dict[str, Any]:
        raise RuntimeError("no replica")

    async def stats(self) -> dict[str, Any]:
        raise RuntimeError("no replica")
