"""Client errors vs server faults, in process (the real app on a real tiny engine, no Ray).

A fault in Pomona's own code is a 500 in the route's error shape (OpenAI's, Anthropic's on
/v1/messages) with a request id that the log line carries too, whatever the exception's type: a
ValueError from our tokenizer work is ours, not the client's. Only what the request caused (a
chat template that refuses its messages) is a 4xx. /metrics says when the engine's stats are gone.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from agent_helpers import in_process
from modelio import models as modelio_models
from api.service.server import OpenAIServer
from api.service.settings import AppSettings

TRIGGER = "trigger-an-internal-fault"
# Gemma-2-style: the template itself refuses a system turn (the client's to change: a 400).
NO_SYSTEM_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class FaultyTokenizer:
    """The real tokenizer, except that encoding TRIGGER raises: a bug in our tokenizer work."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        if TRIGGER in text:
            raise ValueError("injected fault in the ingress tokenizer")
        return self._inner.encode(text, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def no_system_model(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("no-system") / "model"
    shutil.copytree(tiny_model_dir, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": NO_SYSTEM_TEMPLATE}))
    return out


def run(model_dir: Path, body, monkeypatch) -> Any:
    real = modelio_models.tokenizer_for
    monkeypatch.setattr(modelio_models, "tokenizer_for", lambda model: FaultyTokenizer(real(model)))

    async def main():
        async with in_process(model_dir, raise_app_exceptions=False) as http:
            return await body(http)
    return asyncio.run(main())


ROUTES = {  # route -> a body that reaches the tokenizer with TRIGGER in its prompt
    "/v1/chat/completions": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": TRIGGER}]},
    "/v1/completions": {"model": "tiny", "max_tokens": 2, "prompt": TRIGGER},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": TRIGGER}]},
    "/v1/responses": {"model": "tiny", "max_output_tokens": 2, "input": TRIGGER},
}


def test_a_fault_in_our_code_is_a_500_with_the_request_id_in_the_log(no_system_model, monkeypatch, caplog):
    async def body(http):
        faults = {route: await http.post(route, json=b) for route, b in ROUTES.items()}
        ok = await http.post("/v1/chat/completions", json={**ROUTES["/v1/chat/completions"],
                                                           "messages": [{"role": "user", "content": "hi"}]})
        metrics = (await http.get("/metrics")).text
        return faults, ok, metrics
    with caplog.at_level(logging.ERROR, logger="pomona.ingress"):
        faults, ok, metrics = run(no_system_model, body, monkeypatch)
    for route, r in faults.items():
        assert r.status_code == 500, (route, r.text)
        rid = r.headers["x-request-id"]
        assert rid.startswith("req_") and r.headers["request-id"] == rid
        if route == "/v1/messages":  # Anthropic's shape on its route
            assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
            assert r.json()["request_id"] == rid
            message = r.json()["error"]["message"]
        else:
            assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "internal_error"
            message = r.json()["error"]["message"]
        assert rid in message
        lines = [rec for rec in caplog.records if rid in rec.getMessage()]
        assert len(lines) == 1 and lines[0].exc_info is not None, route  # one line, with the traceback
        assert "injected fault" in lines[0].getMessage()
    assert len({r.headers["x-request-id"] for r in faults.values()}) == len(ROUTES)
    assert ok.status_code == 200  # a fault in one request leaves the server serving
    assert 'pomona_requests_total{route="/v1/completions",status="500"} 1' in metrics


def test_a_template_that_refuses_the_messages_is_the_clients_400(no_system_model, monkeypatch):
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]

    async def body(http):
        chat = await http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": system})
        anthropic = await http.post("/v1/messages", json={"model": "tiny", "max_tokens": 2, "system": "Be brief.",
                                                          "messages": [{"role": "user", "content": "hi"}]})
        responses = await http.post("/v1/responses", json={"model": "tiny", "max_output_tokens": 2,
                                                           "instructions": "Be brief.", "input": "hi"})
        return chat, anthropic, responses
    chat, anthropic, responses = run(no_system_model, body, monkeypatch)
    for r in (chat, responses):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and "System role not supported" in r.text
        assert "x-request-id" not in r.headers
    assert anthropic.status_code == 400 and anthropic.json()["error"]["type"] == "invalid_request_error"
    assert "System role not supported" in anthropic.json()["error"]["message"]


class StatsGoAway:
    """A backend whose stats call fails while `down` (as a Ray handle's does with the replica gone)."""

    def __init__(self) -> None:
        self.down = True

    def stream(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str):
        raise AssertionError("no generation in this test")

    async def info(self) -> dict[str, Any]:
        raise RuntimeError("no replica")

    async def stats(self) -> dict[str, Any]:
        if self.down:
            raise RuntimeError("replica unreachable")
        return {"running": 0, "waiting": 0}


def test_metrics_say_when_the_engine_stats_are_gone_and_log_it_once(caplog):
    backend = StatsGoAway()
    server = OpenAIServer(AppSettings.from_args({"model": "m"}), backend, load_tokenizer=lambda: None)
    with caplog.at_level(logging.INFO, logger="pomona.ingress"), TestClient(server.app()) as client:
        scrapes = [client.get("/metrics").text for _ in range(3)]
        backend.down = False
        back = client.get("/metrics").text
    assert all("pomona_engine_up 0" in s for s in scrapes)
    assert "pomona_engine_stats_errors_total 3" in scrapes[-1]
    assert "pomona_engine_up 1" in back and "pomona_engine_running 0" in back
    assert caplog.text.count("stats are unavailable (RuntimeError: replica unreachable)") == 1
    assert caplog.text.count("stats are back") == 1


def test_only_the_engines_refusals_are_rejections(tiny_model_dir):
    """EngineHost turns the engine's refusals (a limit, a grammar that does not compile) into the
    client's 4xx; any other exception before the first token (here a request id used twice, which
    only a bug of ours can cause) propagates, for the ingress to answer 500."""
    from api.core.wire import sampling_to_wire
    from deployments.engine_host import EngineHost
    from engine.types import SamplingParams
    from engine_helpers import make_engine

    engine = make_engine(tiny_model_dir, max_tokens_limit=64)
    host = EngineHost(engine.config, engine_factory=lambda _: engine)

    def params(**kw: Any) -> dict[str, Any]:
        return sampling_to_wire(SamplingParams(**{"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **kw}))

    async def items(rid: str, **kw: Any) -> list[Any]:
        return [item async for item in host.stream([1, 2, 3, 4], params(**kw), rid)]

    async def main() -> tuple[list[Any], list[Any], BaseException | None]:
        limit = await items("over-the-limit", max_tokens=65)
        grammar = await items("bad-grammar", grammar="%%% not a grammar")
        running = host.stream([1, 2, 3, 4], params(max_tokens=64), "twice")
        await running.__anext__()
        try:
            await items("twice")
        except ValueError as exc:
            return limit, grammar, exc
        finally:
            await running.aclose()
        return limit, grammar, None
    try:
        limit, grammar, dup = asyncio.run(main())
    finally:
        asyncio.run(engine.shutdown(drain_s=0))
    assert limit == [{"rejected": {"kind": "invalid", "message": "max_tokens must be at most 64 on this server",
                                   "retry_after_s": 0.0}}]
    assert grammar[0]["rejected"]["kind"] == "invalid" and len(grammar) == 1
    assert dup is not None and "already in use" in str(dup)  # not dressed as the client's "invalid"


def test_an_engine_fault_is_a_500_under_the_id_the_engine_logged(tiny_model_dir, caplog):
    from engine_helpers import FaultyModel

    models: list[FaultyModel] = []

    def wrap(model: Any) -> FaultyModel:
        models.append(FaultyModel(model))
        return models[-1]

    async def main():
        async with in_process(tiny_model_dir, wrap=wrap) as http:
            out = {}
            for route, body in (("/v1/chat/completions", ROUTES["/v1/chat/completions"]),
                                ("/v1/completions", ROUTES["/v1/completions"]), ("/v1/messages", ROUTES["/v1/messages"])):
                models[0].armed = True  # the next forward pass raises
                out[route] = await http.post(route, json={**body, "max_tokens": 4})
            return out
    with caplog.at_level(logging.WARNING):
        answers = asyncio.run(main())
    for route, r in answers.items():
        assert r.status_code == 500, (route, r.text)
        rid = r.headers["x-request-id"]
        assert rid in r.text and rid.startswith(("chatcmpl-", "cmpl-", "msg_")), r.text
        engine_lines = [rec for rec in caplog.records if rec.name == "pomona.engine" and rid in rec.getMessage()]
        assert engine_lines and engine_lines[0].exc_info is not None, (route, caplog.text[-2000:])
