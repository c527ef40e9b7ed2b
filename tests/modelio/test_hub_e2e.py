"""A hub model over real Ray Serve: the replica downloads it from a loopback hub (tests/hub_server.py)
before it counts as started, /health and /admin/models show the phase with bytes done meanwhile, and
once ready the model answers under its repo id."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from e2e_helpers import ROOT, free_port, tiny_args, wait_healthy
from hub_server import Hub, serve_hub

MODEL = "test-org/tiny"


def _watch(base: str, hub: Hub, seen: list[dict[str, Any]], stop: threading.Event) -> None:
    """Poll /health until it reports bytes downloaded, then let the held download finish."""
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(f"{base}/health", timeout=5)
            body = r.json()
            if r.status_code == 503 and any(e["phase"] == "downloading" and e["bytes_done"] > 0
                                            for e in body.get("models", [])):
                seen.append(body)
                seen.append(httpx.get(f"{base}/admin/models", timeout=5).json())
                hub.hold.set()  # type: ignore[union-attr]
                return
        time.sleep(0.2)


def test_hub_model_downloads_with_visible_progress_then_serves(tiny_model_dir: Path, tmp_path: Path) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deployments.app import build_app

    hub = Hub(hold=threading.Event())
    hub.add_dir(MODEL, tiny_model_dir)
    hub_run = serve_hub(hub)
    next(hub_run)
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    args = tiny_args(tiny_model_dir, model=MODEL, served_model_name=None, env=env)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    seen: list[dict[str, Any]] = []
    stop = threading.Event()
    ray.init(num_cpus=2, object_store_memory=150 * 2**20, include_dashboard=False, resources={"apple_silicon": 1},
             configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})
    watcher = threading.Thread(target=_watch, args=(base, hub, seen, stop), daemon=True)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        watcher.start()
        serve.run(build_app(args), name="hub", route_prefix="/")  # returns once the replica is ready
        wait_healthy(base)
        health, admin = seen  # the watcher saw the download in progress before the app was ready
        entry = next(e for e in health["models"] if e["phase"] == "downloading")
        assert entry["model"] == MODEL and entry["source"] == MODEL
        assert 0 < entry["bytes_done"] < entry["bytes_total"]
        assert "downloading" in health["error"]["message"] and "MB" in health["error"]["message"]
        assert [e["phase"] for e in admin["models"]] == ["downloading"]

        ready = httpx.get(f"{base}/admin/models", timeout=10).json()["models"]
        assert [e["phase"] for e in ready] == ["ready"]
        assert ready[0]["bytes_done"] == ready[0]["bytes_total"]
        listed = httpx.get(f"{base}/v1/models", timeout=10).json()
        assert [m["id"] for m in listed["data"]] == [MODEL]
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        stop.set()
        hub.hold.set()  # type: ignore[union-attr]
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        with contextlib.suppress(StopIteration):
            next(hub_run)
