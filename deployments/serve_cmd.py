"""`pomona serve CONFIG`: `serve run CONFIG`, except that SIGTERM and Ctrl-C drain before Serve stops.

Why a wrapper (seen with Ray 2.60): `serve run` exits on SIGTERM without stopping Serve, so the
application keeps serving with nobody watching it; on Ctrl-C its `serve.shutdown()` kills the HTTP
proxy first, which cuts every running stream without an error event or `[DONE]`. Here a stop signal
1. re-applies the config with `user_config: {draining: true}` on the LLMServer deployment: a
   lightweight update that Serve's controller delivers to every replica (`LLMServer.reconfigure`).
   Each engine refuses new requests (503 + Retry-After), gives running ones `drain_s`, ends the rest
   with an error event, stops and flushes its SSD write queue, while the proxy and the ingress still
   carry all of it to the clients;
2. waits out the drain, then sends SIGINT to `serve run`, whose `serve.shutdown()` now cuts nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import yaml

APP_IMPORT = "deployments.app:build_app"
SETTLE_S = 2.0  # after the drain: the last error events travel through the ingress and the proxy
DEFAULT_DRAIN_S = 30.0  # AppSettings.drain_s


def draining_config(config: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The config with every LLM server deployment of each Pomona app told to drain, and the longest
    `drain_s`. (The shared multiplexed deployment of a `models:` list is not told: Serve's own stop
    drains it.)"""
    out = dict(config)
    apps, longest = [], 0.0
    for app in config.get("applications", []):
        app = dict(app)
        if app.get("import_path") == APP_IMPORT:
            names, drain_s = _llm_deployments(app.get("args") or {})
            kept = [d for d in app.get("deployments", []) if d.get("name") not in names]
            told = []
            for name in names:
                override = next((d for d in app.get("deployments", []) if d.get("name") == name), {})
                told.append({**override, "name": name,
                             "user_config": {**override.get("user_config", {}), "draining": True}})
            app["deployments"] = kept + told
            longest = max(longest, drain_s)
        apps.append(app)
    out["applications"] = apps
    return out, longest


def _llm_deployments(args: dict[str, Any]) -> tuple[list[str], float]:
    """The app's pinned LLM server deployments (names as deployments/app.py gives them) and their
    longest drain."""
    from deployments.model_list import deployment_name, plan

    models = plan(args)
    if len(models.models) == 1 and not models.multiplexed:
        return ["LLMServer"], models.models[0].drain_s
    pinned = models.pinned()
    return [deployment_name(s) for s in pinned], max((s.drain_s for s in pinned), default=DEFAULT_DRAIN_S)


def _serve_run(args: list[str], **kwargs: Any) -> subprocess.Popen:
    # SIGINT back to its default: a shell's background job inherits it ignored, and then
    # `serve run` would never see the KeyboardInterrupt it shuts Serve down on.
    return subprocess.Popen([_serve_binary(), "run", *args],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def _serve_binary() -> str:
    beside = Path(sys.executable).with_name("serve")
    return str(beside) if beside.exists() else "serve"


def drain(config_path: Path, address: list[str]) -> None:
    """Tell every LLM replica to drain, then wait for it (step 1 of the module docstring)."""
    config, drain_s = draining_config(yaml.safe_load(config_path.read_text()))
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pomona-drain-", delete=False) as f:
        yaml.safe_dump(config, f)
    try:
        print(f"pomona serve: draining for up to {drain_s:g} s", file=sys.stderr, flush=True)
        applied = _serve_run([f.name, "--non-blocking", *address], stdout=subprocess.DEVNULL).wait()
        if applied != 0:
            print("pomona serve: could not apply the drain; stopping Serve directly", file=sys.stderr)
            return
        threading.Event().wait(drain_s + SETTLE_S)
    finally:
        os.unlink(f.name)


def serve(config: str, address: str | None = None) -> int:
    """Run `serve run CONFIG` until it exits or a stop signal arrives; on a signal, drain first."""
    config_path = Path(config)
    addr = [f"--address={address}"] if address else []
    # Its own session: a terminal's Ctrl-C reaches only this process, which stops Serve in order.
    child = _serve_run([str(config_path), *addr], start_new_session=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while child.poll() is None and not stop.wait(0.5):
        pass
    if child.poll() is not None:
        return child.returncode
    drain(config_path, addr)
    child.send_signal(signal.SIGINT)
    return child.wait()
