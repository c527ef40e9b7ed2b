"""Ray Serve model multiplexing over real Ray Serve: one replica with room for one model serves two,
swapping (least recently used out) and answering each request with the right model; a model still
loading past `multiplex.load_wait_s` is a 503 with Retry-After, and served once loaded."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from e2e_helpers import serve_apps, tiny_args, wait_healthy
from test_multi_model_e2e import _greedy

NAMES = ("mx-a", "mx-b")


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tiny_model import build_tiny_model

    return {"mx-a": tiny_model_dir, "mx-b": build_tiny_model(tmp_path_factory.mktemp("mx-b"), seed=7)}


def _app(models: dict[str, Path], load_wait_s: float) -> dict[str, Any]:
    args: dict[str, Any] = tiny_args(next(iter(models.values())))
    del args["model"], args["served_model_name"]
    args["models"] = [{"model": str(path), "served_model_name": name, "multiplexed": True}
                      for name, path in models.items()]
    args["multiplex"] = {"max_models_per_replica": 1, "load_wait_s": load_wait_s,
                         "llm_server": {"num_cpus": 0.5, "resources": {"apple_silicon": 1}}}
    return args


@pytest.fixture(scope="module")
def base(model_dirs: dict[str, Path]) -> Iterator[str]:
    apps = {"/": _app(model_dirs, 120.0), "/nowait": _app({"nowait-a": model_dirs["mx-a"]}, 0.0)}
    with serve_apps(apps) as url:
        wait_healthy(url)
        wait_healthy(f"{url}/nowait")
        yield url


def _complete(url: str, model: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=180,
                      json={"model": model, "prompt": "hello there", "max_tokens": 10, "temperature": 0})


def test_one_slot_replica_swaps_between_two_models(base: str, model_dirs: dict[str, Path]) -> None:
    listed = httpx.get(f"{base}/v1/models", timeout=10).json()
    assert sorted(m["id"] for m in listed["data"]) == sorted(NAMES)
    expected = {name: _greedy(path, "hello there", 10) for name, path in model_dirs.items()}
    assert expected["mx-a"] != expected["mx-b"]
    for name in ("mx-a", "mx-b", "mx-a", "mx-b"):  # every request after the first swaps models
        r = _complete(base, name)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected[name], name
    phases = {e["model"]: e for e in httpx.get(f"{base}/admin/models", timeout=10).json()["models"]}
    assert phases["mx-b"]["phase"] == "ready" and phases["mx-a"]["phase"] == "unloaded"
    assert phases["mx-a"]["pid"] == phases["mx-b"]["pid"]  # one replica held both, in turn


def test_a_load_longer_than_the_bound_is_503_then_served(base: str) -> None:
    first = _complete(f"{base}/nowait", "nowait-a")
    assert first.status_code == 503, first.text
    assert first.headers.get("retry-after") and "being loaded" in first.json()["error"]["message"]
    deadline = time.monotonic() + 120
    while (r := _complete(f"{base}/nowait", "nowait-a")).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.5)  # the load went on without the request that gave up
    assert r.status_code == 200, r.text
