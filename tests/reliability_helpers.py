"""Helpers for the reliability and admin e2e tests: admin calls, polling, token prompts, background streams."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx

from e2e_helpers import ROOT, free_port


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def admin(base: str, path: str, key: str | None = None, method: str = "GET", **params: str) -> dict[str, Any]:
    r = httpx.request(method, f"{base}/admin/{path}", headers=auth(key), params=params, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def live_requests(base: str, key: str | None = None) -> list[dict[str, Any]]:
    return [req for replica in admin(base, "requests", key)["data"] for req in replica["requests"]]


def cache_stats(base: str, key: str | None = None) -> dict[str, Any]:
    return admin(base, "cache", key)["data"][0]["cache"]


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, every_s: float = 0.02) -> Any:
    """Poll until `predicate()` is truthy; returns its value (a bound on waiting, not a speed claim)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def wait_idle(base: str, key: str | None = None, timeout_s: float = 30.0) -> None:
    """Every slot free: no running or queued request on any replica."""
    wait_for(lambda: not live_requests(base, key), timeout_s, 0.05)


def token_prompt(n: int, salt: int = 0) -> list[int]:
    """`n` token ids inside the tiny model's vocabulary; `salt` makes prompts differ from the first token."""
    return [20 + (i * 7 + salt * 13) % 400 for i in range(n)]  # the tiny vocabulary has 437 ids


@dataclass
class Background:
    """A streaming completion read on a thread, closable at any moment (a client that goes away)."""

    url: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    status: int | None = None
    error: BaseException | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def start(self) -> "Background":
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", self.url, json=self.body, headers=self.headers) as resp:
                    self.status = resp.status_code
                    for line in resp.iter_lines():
                        if line:
                            self.lines.append(line)
                        if self.stop.is_set():
                            return
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def close(self) -> None:
        """Leave: the connection closes once the thread notices (at the next line)."""
        self.stop.set()

    def join(self, timeout_s: float = 120.0) -> "Background":
        assert self.thread is not None
        self.thread.join(timeout_s)
        return self


@contextlib.contextmanager
def own_cluster(apps: dict[str, dict[str, Any]], apple_silicon: int = 2) -> Iterator[str]:
    """Like e2e_helpers.serve_apps, on a cluster of our own: `address="local"` never joins a colleague's
    cluster, and a private RAY_TMPDIR keeps sockets and logs apart. Yields the HTTP base URL."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = tempfile.mkdtemp(prefix="pomona-rel-", dir="/tmp")  # short: Ray's unix socket paths are bounded
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    import ray
    from ray import serve

    from deployments.app import build_app

    port = free_port()
    ray.init(address="local", num_cpus=2, object_store_memory=150 * 2**20, include_dashboard=False,
             resources={"apple_silicon": apple_silicon}, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for prefix, args in apps.items():
            serve.run(build_app(args), name=app_name(prefix), route_prefix=prefix)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        if previous is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = previous
        shutil.rmtree(tmp, ignore_errors=True)


def app_name(prefix: str) -> str:
    return prefix.strip("/") or "default"


def deploy(prefix: str, args: dict[str, Any]) -> None:
    """Add (or replace) one app on the running cluster; returns once its replicas started."""
    from ray import serve

    from deployments.app import build_app

    serve.run(build_app(args), name=app_name(prefix), route_prefix=prefix)


def undeploy(prefix: str) -> None:
    """Delete an app the way an operator stops it: graceful shutdown, drain, SSD flush."""
    from ray import serve

    serve.delete(app_name(prefix))
