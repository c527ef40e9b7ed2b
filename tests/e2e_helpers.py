"""Start the real Pomona app on a real local Ray Serve, once per test module, and tear it all down."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent


# Below Linux's ephemeral range (32768-60999), above Ray's worker ports (10002-19999) and the test
# clusters' port bases (tests/fleet_cluster.py: 21000-25800): a port the kernel hands out to
# some Ray process's outgoing connection between this pick and the bind collided once
# ("Failed to bind to address 127.0.0.1:44217" at serve.start).
PORTS = range(32000, 32768)


def free_port() -> int:
    """A port nobody listens on now, from a range the kernel never hands out on its own."""
    for port in random.sample(PORTS, len(PORTS)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def tiny_args(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """App args for the tiny model: small CPU share so two apps fit a 2-core CI box."""
    args: dict[str, Any] = {
        "model": str(model_dir),
        "served_model_name": "tiny",
        "drain_s": 1,
        "engine": {"max_running": 8, "max_waiting": 64, "request_timeout_s": 120,
                   "cache": {"enabled": True, "ram_bytes": 64 * 2**20, "min_restore_tokens": 16}},
        "llm_server": {"num_cpus": 0.5, "resources": {"apple_silicon": 1}},
        "ingress": {"num_cpus": 0},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(args.get(key), dict):
            args[key] = {**args[key], **value}
        else:
            args[key] = value
    return args


def long_context_copy(model_dir: Path, out: Path, context: int) -> Path:
    """The tiny model with a longer context (same weights), so a stream can surely outlast a
    drain or a kill: its 2,048 tokens take only seconds."""
    import json
    import shutil

    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": context}))
    return out


def wait_healthy(base: str, timeout_s: float = 180.0, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/health", timeout=5, headers=headers).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"{base}/health did not turn 200 within {timeout_s} s")


@contextlib.contextmanager
def serve_apps(apps: dict[str, dict[str, Any]], apple_silicon: int = 2) -> Iterator[str]:
    """Run each app (route prefix -> args) on one fresh local cluster; yields the HTTP base URL."""
    # Ray enables token auth for a new local cluster by default; tests keep the cluster local and
    # set the mode explicitly so workers and drivers agree (see platform notes).
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    ray.init(num_cpus=2, object_store_memory=150 * 2**20, include_dashboard=False,
             resources={"apple_silicon": apple_silicon}, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for prefix, args in apps.items():
            serve.run(build_app(args), name=prefix.strip("/") or "default", route_prefix=prefix)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


def metric(base: str, name: str, headers: dict[str, str] | None = None) -> float | None:
    text = httpx.get(f"{base}/metrics", timeout=10, headers=headers).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None
