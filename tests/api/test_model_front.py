"""api/service/model_front.py without Ray: routing by the body's model, auth first, merged listings."""

from __future__ import annotations

from typing import Any

from backend_fakes import NoReplica
from starlette.testclient import TestClient

from api.service.server import OpenAIServer
from api.service.model_front import ModelFront
from api.service.settings import AppSettings


class Loading(NoReplica):
    """A model whose replica is still downloading: not ready, and the status board says how far."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def model_status(self) -> list[dict[str, Any]]:
        return [{"model": self.name, "phase": "downloading", "bytes_done": 10**6, "bytes_total": 4 * 10**6,
                 "host": "h", "pid": 1}]


def _front(keys: tuple[str, ...] = (), **extra: Any) -> ModelFront:
    servers = [OpenAIServer(AppSettings.from_args({"model": name, **extra}), Loading(name),
                            load_tokenizer=lambda: None, api_keys=keys) for name in ("org/a", "org/b")]
    return ModelFront(servers)


def _handled(front: ModelFront, route: str = "/v1/completions") -> list[int]:
    return [sum(n for (r, _), n in s.metrics.requests.items() if r == route) for s in front.servers]


def test_requests_go_to_the_model_they_name() -> None:
    front = _front(model_aliases=[])
    with TestClient(front) as client:
        assert client.post("/v1/completions", json={"model": "org/b", "prompt": "hi"}).status_code == 503
        assert _handled(front) == [0, 1]
        assert client.post("/v1/completions", json={"model": "org/a", "prompt": "hi"}).status_code == 503
        assert _handled(front) == [1, 1]
        missing = client.post("/v1/completions", json={"model": "org/c", "prompt": "hi"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert sorted(m["id"] for m in client.get("/v1/models").json()["data"]) == ["org/a", "org/b"]


def test_health_names_each_model_and_its_download() -> None:
    with TestClient(_front()) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.headers["Retry-After"]
        assert "org/a: downloading 1.0/4.0 MB (25%)" in health.json()["error"]["message"]
        assert [m["model"] for m in health.json()["models"]] == ["org/a", "org/b"]
        phases = client.get("/admin/models").json()["models"]
        assert [(e["model"], e["phase"]) for e in phases] == [("org/a", "downloading"), ("org/b", "downloading")]


def test_the_key_is_checked_before_the_model() -> None:
    with TestClient(_front(keys=("k1",))) as client:
        assert client.post("/v1/completions", json={"model": "org/c", "prompt": "hi"}).status_code == 401
        assert client.get("/v1/models").status_code == 401
        assert client.get("/admin/models").status_code == 401
        assert client.get("/health").status_code == 503  # open, as on a one-model app
        auth = {"Authorization": "Bearer k1"}
        assert len(client.get("/v1/models", headers=auth).json()["data"]) == 2
        r = client.post("/v1/completions", json={"model": "org/c", "prompt": "hi"}, headers=auth)
        assert r.status_code == 404


def test_query_model_picks_the_app_of_other_routes() -> None:
    front = _front()
    with TestClient(front) as client:
        client.get("/admin/cache?model=org/b")
        assert _handled(front, "/admin/cache") == [0, 1]
        client.get("/admin/cache")
        assert _handled(front, "/admin/cache") == [1, 1]


def test_an_oversized_body_is_413() -> None:
    front = _front(limits={"max_body_bytes": 1024})
    with TestClient(front) as client:
        r = client.post("/v1/completions", content=b'{"model": "org/b", "prompt": "' + b"x" * 4096 + b'"}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 413
