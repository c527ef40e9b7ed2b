"""The Starlette app without Ray: readiness (503 before a replica answers) and the key check."""

from __future__ import annotations

import asyncio
from typing import Any

from backend_fakes import NoReplica
from starlette.testclient import TestClient

from api.service.auth import ApiKeyMiddleware, KeyRing
from api.service import server as api_server
from api.service.server import OpenAIServer
from api.core.metrics import IngressMetrics
from api.service.settings import AppSettings


def test_503_until_a_replica_can_serve():
    server = OpenAIServer(AppSettings.from_args({"model": "m"}), NoReplica(), load_tokenizer=lambda: None)
    with TestClient(server.app()) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "service_unavailable"
        r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        bad = client.post("/v1/completions", json={"model": "m", "prompt": ""})
        assert bad.status_code == 400  # bad input is still told apart from unavailability
        assert "pomona_engine_up 0" in client.get("/metrics").text


def test_key_check_compares_every_key():
    mw = ApiKeyMiddleware(app=None, keys=KeyRing.of(("a" * 40, "b")), metrics=IngressMetrics())  # type: ignore[arg-type]
    assert mw.allowed("b") and mw.allowed("a" * 40)
    assert not mw.allowed("") and not mw.allowed("a") and not mw.allowed("c")


class CountingTokenizer:
    """Counts `get_vocab` calls: each builds a dict of the whole vocabulary."""

    def __init__(self, size: int) -> None:
        self.size, self.vocab_calls = size, 0

    def get_vocab(self) -> dict[str, int]:
        self.vocab_calls += 1
        return {f"t{i}": i for i in range(self.size)}


class InfoOnly(NoReplica):
    async def info(self) -> dict[str, Any]:
        return {"model": "m"}


def test_vocabulary_is_read_once_and_bounds_prompt_token_ids():
    tokenizer = CountingTokenizer(50)
    server = OpenAIServer(AppSettings.from_args({"model": "m"}), InfoOnly(), load_tokenizer=lambda: tokenizer)
    with TestClient(server.app()) as client:
        for _ in range(3):
            client.portal.call(server.refresh)  # readiness polls, as the poller runs them
        assert server.ready is not None and server.ready.vocab_size == 50
        assert tokenizer.vocab_calls == 1
        r = client.post("/v1/completions", json={"model": "m", "prompt": [3, 50]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "prompt" and "below the vocabulary size 50" in r.json()["error"]["message"]


class Flaky(InfoOnly):
    """Answers, then stalls (`stall` True) or fails (`fail` True) when asked."""

    stall = fail = False

    async def info(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("no replica")
        if self.stall:
            await asyncio.sleep(10)
        return await super().info()


def test_a_timed_out_poll_does_not_turn_a_serving_ingress_away(monkeypatch):
    """A replica busy with a long prefill can miss a poll's deadline while it serves: the ingress
    keeps answering until POLL_MISSES polls in a row time out; an error still counts at once."""
    monkeypatch.setattr(api_server, "POLL_TIMEOUT_S", 0.05)
    backend = Flaky()
    server = OpenAIServer(AppSettings.from_args({"model": "m"}), backend, load_tokenizer=lambda: CountingTokenizer(5))

    async def main() -> list[bool]:
        seen = []
        await server.refresh()
        backend.stall = True
        for _ in range(api_server.POLL_MISSES):
            await server.refresh()
            seen.append(server.ready is not None)
        backend.stall = False
        await server.refresh()
        seen.append(server.ready is not None)
        backend.fail = True
        await server.refresh()
        seen.append(server.ready is not None)
        return seen

    misses = api_server.POLL_MISSES
    assert asyncio.run(main()) == [True] * (misses - 1) + [False, True, False]
