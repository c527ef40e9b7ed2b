"""Several people on one server, without Ray: key sources that fail closed, scopes, tenants, the
cache salt on every hop to the engine, owned stored responses, and the per-request bounds
(tokenizer queue, grammar caches, route labels). tests/e2e/test_tenants_e2e.py has the same promises
over real HTTP on a real Ray Serve."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from starlette.testclient import TestClient

from api.service.auth import ADMIN, INFERENCE, KeyRing, cache_salt, key_tenant
from api.core.errors import ApiError
from api.core.metrics import OTHER, ROUTE_LABELS, route_label
from api.service.server import OpenAIServer
from api.service.settings import AppSettings, KeyConfigError
from api.service.tokenizer_pool import TokenizerPool
from api.core.wire import SALT_KEY, request_from_wire

A, B, C1, C2, ADMIN_KEY = "sk-a-0001", "sk-b-0002", "sk-c-0003", "sk-c-0004", "sk-admin-0005"
ADMIN_ROUTES = [("GET", "/admin/requests"), ("GET", "/admin/cache"), ("POST", "/admin/cache/clear"),
                ("POST", "/admin/cache/flush"), ("POST", "/admin/reset"), ("GET", "/admin/models"),
                ("GET", "/metrics")]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ------------------------------------------------------------------------------------------ key sources


def test_a_key_source_that_yields_no_key_stops_the_app(tmp_path, monkeypatch):
    monkeypatch.delenv("POMONA_API_KEYS", raising=False)
    monkeypatch.delenv("POMONA_ADMIN_API_KEYS", raising=False)
    comments = tmp_path / "keys"
    comments.write_text("# one key per line\n\n   \n# sk-commented-out\n")
    for setting in ("api_keys_file", "admin_api_keys_file"):
        settings = AppSettings.from_args({setting: str(comments)})
        with pytest.raises(KeyConfigError, match=f"{setting} '{comments}' holds no key.*add one key per line"):
            settings.key_ring()
        with pytest.raises(KeyConfigError, match="holds no key"):
            settings.check_key_files()  # what build_app runs, so `serve run` stops at once
    with pytest.raises(KeyConfigError, match="cannot be read"):
        AppSettings.from_args({"api_keys_file": str(tmp_path / "missing")}).key_ring()
    for variable in ("POMONA_API_KEYS", "POMONA_ADMIN_API_KEYS"):
        with pytest.raises(KeyConfigError, match=f"{variable} is set but holds no key"):
            AppSettings.from_args({}).key_ring({variable: " , ,"})
    with pytest.raises(KeyConfigError, match="api_keys_required is true but no inference key"):
        AppSettings.from_args({"api_keys_required": True}).key_ring({})
    with pytest.raises(KeyConfigError, match="tenant 'team' has no key"):
        AppSettings.from_args({"tenants": {"team": []}})
    with pytest.raises(KeyConfigError, match="also listed in tenant 'one'"):
        AppSettings.from_args({"tenants": {"one": [A], "two": [A]}}).key_ring({})
    with pytest.raises(KeyConfigError, match="also listed in api_keys"):
        AppSettings.from_args({"api_keys": [A], "tenants": {"two": [A]}}).key_ring({})
    with pytest.raises(ValueError, match="tenant name"):
        AppSettings.from_args({"tenants": {"key-abc": [A]}})
    with pytest.raises(ValueError, match="engine.cache"):
        AppSettings.from_args({"cache": {"ram_bytes": 1}})


def test_build_app_refuses_an_empty_key_file(tmp_path):
    from deployments.app import build_app

    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    with pytest.raises(KeyConfigError, match="holds no key"):
        build_app({"api_keys_file": str(empty)})


def test_keys_have_a_tenant_and_scopes(tmp_path):
    team_file = tmp_path / "team"
    team_file.write_text(f"# team keys\n{C2}\n")
    settings = AppSettings.from_args({"api_keys": [A], "api_keys_file": None, "admin_api_keys": [ADMIN_KEY, A],
                                      "tenants": {"team": {"keys": [C1], "keys_file": str(team_file)}}})
    ring = settings.key_ring({"POMONA_API_KEYS": B})
    a, b, c1, c2, admin = (ring.lookup(k) for k in (A, B, C1, C2, ADMIN_KEY))
    assert a.scopes == {INFERENCE, ADMIN} and a.tenant == key_tenant(A)  # listed in both: both scopes
    assert b.scopes == {INFERENCE} and b.tenant == key_tenant(B) != a.tenant
    assert c1.tenant == c2.tenant == "team"
    assert admin.scopes == {ADMIN}
    assert ring.lookup("sk-unknown") is None and ring.lookup("") is None
    assert A not in key_tenant(A)  # the tenant id never reveals the key
    assert not settings.share_cache_across_tenants(ring)
    assert AppSettings.from_args({}).share_cache_across_tenants(KeyRing())  # no keys: one tenant
    assert AppSettings.from_args({"cache": {"share_across_tenants": True}}).share_cache_across_tenants(ring)


# ------------------------------------------------------------------------------------------ the door


class Recording:
    """A model server that records what each request would have run with, then refuses it."""

    def __init__(self) -> None:
        self.params: list[dict[str, Any]] = []

    async def stream(self, prompt_tokens: list[int], params: dict[str, Any], request_id: str):
        self.params.append(params)
        yield {"rejected": {"kind": "invalid", "message": "recorded"}}

    async def info(self) -> dict[str, Any]:
        return {"model": "tiny", "context_length": 2048, "max_tokens_limit": 256, "default_max_tokens": 16}

    async def stats(self) -> dict[str, Any]:
        return {"waiting": 0}

    async def admin(self, action: str, tier: str = "all") -> dict[str, Any]:
        return {"replica": {"pid": 1, "host": "h"}, "requests": []}

    async def model_status(self) -> list[dict[str, Any]]:
        return []


def server_for(tiny_model_dir, backend: Any = None, **args: Any) -> OpenAIServer:
    from modelio import models

    settings = AppSettings.from_args({"model": str(tiny_model_dir), "served_model_name": "tiny", **args})
    return OpenAIServer(settings, backend or Recording(), lambda: models.tokenizer_for(str(tiny_model_dir)),
                        keys=settings.key_ring({}))


KEYED = {"api_keys": [A, B], "admin_api_keys": [ADMIN_KEY], "tenants": {"team": [C1, C2]}}


def test_inference_keys_get_403_on_every_admin_route_and_admin_keys_on_inference(tiny_model_dir):
    with TestClient(server_for(tiny_model_dir, **KEYED).app()) as client:
        for method, path in ADMIN_ROUTES:
            for key in (A, C1):
                r = client.request(method, path, headers=bearer(key))
                assert r.status_code == 403, (path, r.text)
                error = r.json()["error"]
                assert error["type"] == "permission_error" and "needs an admin key" in error["message"], error
            assert client.request(method, path).status_code == 401
        for method, path in ADMIN_ROUTES[:2] + [("GET", "/metrics")]:
            assert client.request(method, path, headers=bearer(ADMIN_KEY)).status_code == 200, path
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post("/v1/chat/completions", json=chat, headers=bearer(ADMIN_KEY))
        assert r.status_code == 403 and "needs an inference key" in r.json()["error"]["message"]
        anthropic = client.post("/v1/messages", json=chat, headers={"x-api-key": ADMIN_KEY})
        assert anthropic.status_code == 403 and anthropic.json()["error"]["type"] == "permission_error"
        for key in (A, ADMIN_KEY):  # either scope lists the models
            assert client.get("/v1/models", headers=bearer(key)).status_code == 200
        assert client.get("/health").status_code in (200, 503)  # open, whatever its state


def test_metrics_open_leaves_only_metrics_open(tiny_model_dir):
    with TestClient(server_for(tiny_model_dir, **KEYED, metrics_open=True).app()) as client:
        assert client.get("/metrics").status_code == 200
        assert client.get("/admin/cache").status_code == 401
        assert client.get("/admin/cache", headers=bearer(A)).status_code == 403


def test_without_keys_every_route_stays_open(tiny_model_dir):
    with TestClient(server_for(tiny_model_dir).app()) as client:
        for method, path in ADMIN_ROUTES[:2] + [("GET", "/metrics"), ("GET", "/v1/models")]:
            assert client.request(method, path).status_code == 200, path


def test_unknown_paths_are_counted_under_one_label(tiny_model_dir):
    server = server_for(tiny_model_dir, **KEYED)
    with TestClient(server.app()) as client:
        for i in range(40):
            assert client.get(f"/probe-{i}/x").status_code == 401
            assert client.put(f"/v1/responses/resp_{i:032x}", headers=bearer(A)).status_code == 405
        assert client.get("/nowhere", headers=bearer(A)).status_code == 404
        text = client.get("/metrics", headers=bearer(ADMIN_KEY)).text
    routes = {route for route, _ in server.metrics.requests}
    assert routes <= ROUTE_LABELS | {OTHER}, routes
    assert server.metrics.requests[(OTHER, 401)] == 40 and server.metrics.requests[(OTHER, 404)] == 1
    assert server.metrics.requests[("/v1/responses/{response_id}", 405)] == 40
    assert "probe-" not in text and "resp_" not in text


def test_every_route_of_the_app_has_its_own_label(tiny_model_dir):
    app = server_for(tiny_model_dir).app()
    for route in app.routes:
        assert route_label(route.path) == route.path, route.path


# ------------------------------------------------------------------------------------------ the salt


def test_cache_salt_is_the_tenant_and_the_request_own_salt():
    assert cache_salt("", "", False) == ""  # no keys, no salt: the one partition, as before
    assert cache_salt("team", "", False) == "team\x1f"
    assert cache_salt("team", "s", False) == "team\x1fs"
    assert cache_salt("team", "s", True) == "\x1fs" and cache_salt("team", "", True) == ""


def test_each_dialect_sends_the_callers_salt(tiny_model_dir):
    backend = Recording()
    with TestClient(server_for(tiny_model_dir, backend, **KEYED).app()) as client:
        wait_ready(client, A)
        msgs = [{"role": "user", "content": "hi"}]
        bodies = [("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "hi"}),
                  ("/v1/messages", {"messages": msgs, "max_tokens": 4}), ("/v1/responses", {"input": "hi"})]
        for key, own in [(A, ""), (B, "s1"), (C1, ""), (C2, "s2")]:
            for path, body in bodies:
                before = len(backend.params)
                r = client.post(path, json={"model": "tiny", **body, **({"cache_salt": own} if own else {})},
                                headers=bearer(key))
                assert r.status_code == 400 and "recorded" in r.text, r.text
                tenant = "team" if key in (C1, C2) else key_tenant(key)
                assert backend.params[before][SALT_KEY] == f"{tenant}\x1f{own}", (path, key)


def test_share_across_tenants_leaves_the_tenant_out(tiny_model_dir):
    backend = Recording()
    server = server_for(tiny_model_dir, backend, **KEYED, cache={"share_across_tenants": True})
    with TestClient(server.app()) as client:
        wait_ready(client, A)
        backend.params.clear()
        client.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=bearer(A))
        client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "cache_salt": "x"}, headers=bearer(B))
    assert [p[SALT_KEY] for p in backend.params] == ["", "\x1fx"]


def wait_ready(client: TestClient, key: str) -> None:
    deadline = time.monotonic() + 60
    while client.get("/v1/models", headers=bearer(key)).status_code == 200 and time.monotonic() < deadline:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers=bearer(key))
        if r.status_code != 503:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


class Capturing:
    """An engine that records the Request it was given and ends it at once."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def stream(self, request, text: bool = True):
        from engine.types import FinishReason, TokenEvent

        self.requests.append(request)
        yield [TokenEvent(request.request_id, None, "", finish_reason=FinishReason.STOP)]

    def abort(self, request_id: str) -> None:
        pass


def test_the_salt_reaches_the_engine_request_on_every_hop():
    from deployments.engine_host import EngineHost
    from deployments.engine_worker import Worker
    from engine.config import EngineConfig

    assert request_from_wire([1, 2], {"max_tokens": 2, SALT_KEY: "t\x1fs"}, "r").cache_salt == "t\x1fs"
    assert request_from_wire([1, 2], {"max_tokens": 2}, "r").cache_salt == ""
    engine = Capturing()
    host = EngineHost(EngineConfig(), engine_factory=lambda _: engine)

    async def through_host() -> None:
        async for _ in host.stream([1, 2, 3], {"max_tokens": 2, SALT_KEY: "team\x1f"}, "r1"):
            pass
    asyncio.run(through_host())

    class Sink:
        def write(self, data: bytes) -> None:
            pass

    async def through_worker() -> None:  # the engine's own process rebuilds the Request from the frame
        worker = Worker(engine, Sink())  # type: ignore[arg-type]
        worker.handle(["add", "r2", [1, 2, 3], {"max_tokens": 2}, 0, "team\x1fown"])
        await asyncio.wait_for(worker.tasks["r2"], 10)
    asyncio.run(through_worker())
    assert [(r.request_id, r.cache_salt) for r in engine.requests] == [("r1", "team\x1f"), ("r2", "team\x1fown")]


def test_the_engine_process_frame_carries_the_salt():
    from test_process_frames import RecordingWriter, process_with

    from deployments.engine_ipc import receive
    from engine.types import Request, SamplingParams

    async def main() -> list:
        writer = RecordingWriter()
        engine = process_with(writer)
        engine._streams, engine._gone, engine._closing = {}, None, False
        stream = engine.stream(Request((1, 2), SamplingParams(max_tokens=2), request_id="r", cache_salt="t\x1fs"))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        task.cancel()
        reader = asyncio.StreamReader()
        reader.feed_data(b"".join(writer.writes))
        reader.feed_eof()
        return await receive(reader)
    frame = asyncio.run(main())
    assert frame[0] == "add" and frame[1] == "r" and frame[-1] == "t\x1fs"


# ------------------------------------------------------------------------------------------ stored responses


def test_a_stored_response_belongs_to_its_tenant(tmp_path):
    from api.responses.store import ResponseStore, ResponseStoreSettings, StoredResponse

    store = ResponseStore(ResponseStoreSettings(), str(tmp_path / "responses"))
    rid = "resp_" + "1" * 32
    store.put(rid, StoredResponse({"id": rid}, (), (), tenant="team"))
    assert store.get(rid, "other") is None and store.get(rid) is None
    assert not store.delete(rid, "other") and store.get(rid, "team") is not None  # not deleted by another
    assert store.delete(rid, "team") and store.get(rid, "team") is None


# ------------------------------------------------------------------------------------------ bounds


def test_the_tokenizer_queue_is_bounded():
    async def main() -> None:
        pool = TokenizerPool(max_queue=2)
        release = threading.Event()
        busy = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(ApiError) as refused:
            await pool.run(lambda: 1)
        assert refused.value.status == 429 and dict(refused.value.headers)["Retry-After"] == "1"
        own = asyncio.ensure_future(pool.run(lambda: 2, bounded=False))  # the server's own work: never refused
        release.set()
        await asyncio.gather(*busy)
        assert await own == 2
        assert await pool.run(lambda: 3) == 3 and pool.queued == 0
        pool.shutdown()
    asyncio.run(main())


def test_a_burst_the_engine_would_queue_is_not_refused_by_the_tokenizer():
    """Clients whose requests end in the same step send their next ones together; behind an ingress
    that forwards them at once the whole burst waits here, and the engine's queue (not this
    backstop) is what refuses: 64 refused 61 of 384 requests at 128 concurrent on the H100."""
    from api.core.fields import Limits
    from engine.config import EngineConfig

    engine = EngineConfig(model="tiny")
    burst = engine.max_waiting + engine.max_running

    async def main() -> None:
        pool = TokenizerPool(Limits().max_tokenizer_queue)
        release = threading.Event()
        jobs = [asyncio.ensure_future(pool.run(release.wait)) for _ in range(burst)]
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(*jobs, return_exceptions=True)
        assert not [r for r in results if isinstance(r, BaseException)]
        pool.shutdown()
    asyncio.run(main())


def test_count_tokens_waits_in_the_same_bounded_queue(tiny_model_dir):
    server = server_for(tiny_model_dir, **KEYED, limits={"max_tokenizer_queue": 1})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(server.app()) as client:
        wait_ready(client, A)
        release = threading.Event()
        blocker = client.portal.start_task_soon(server.on_tok, release.wait)  # the one slot, taken
        try:
            time.sleep(0.05)
            r = client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": A})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
            chat = client.post("/v1/chat/completions", json=body, headers=bearer(A))
            assert chat.status_code == 429, chat.text
        finally:
            release.set()
            blocker.result(10)
        assert client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": A}).status_code == 200


def test_grammar_caches_are_bounded_by_bytes():
    from api.output import grammars
    from api.output.grammars import BytesLRU

    cache = BytesLRU(max_bytes=1000)
    for i in range(50):
        cache.get((f"schema-{i}" * 10,), lambda: "g" * 100)
        assert cache.size <= 1000
    assert len(cache) < 50
    assert cache.get(("huge",), lambda: "x" * 5000) == "x" * 5000 and ("huge",) not in cache._entries
    calls = []
    assert cache.get(("k",), lambda: calls.append(1) or "v") == cache.get(("k",), lambda: calls.append(1) or "v")
    assert calls == [1]
    for fn in (grammars._schema_grammar, grammars._tool_lark):
        assert isinstance(fn.cache, BytesLRU) and fn.cache.max_bytes <= 64 * 2**20


def test_compiled_matchers_are_bounded_by_bytes(tiny_model_dir):
    import json

    from engine.constraints import ConstraintFactory
    from modelio import models

    from api.output.grammars import answer_grammar
    from api.core.conversation import OutputFormat

    factory = ConstraintFactory(models.tokenizer_for(str(tiny_model_dir)), cache_bytes=60_000)
    sizes = []
    for i in range(12):
        schema = {"type": "object", "properties": {f"field_{i}_{j}": {"type": "string", "description": "d" * 200}
                                                   for j in range(20)}}
        grammar = answer_grammar(OutputFormat("json_schema", json.loads(json.dumps(schema))))
        sizes.append(len(grammar))
        factory.matcher(grammar)
        assert factory.cached_bytes <= 60_000
    assert factory.cached < 12 and sum(sizes) > 60_000
