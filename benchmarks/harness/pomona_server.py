"""How the side-by-side run starts Pomona: a private one-node Ray cluster plus `serve run` on a
config generated from the repository's serve_config.yaml with the benchmark's model directory.

The cluster gets its own temp dir and ports, so it never joins (or stops) a cluster a colleague's
tests started on the same machine; its daemons are found by that temp dir and stopped by pid.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path
from typing import Any

from benchmarks.harness.servers import ROOT, ServerSpec, blas_env

SERVE_CONFIG = ROOT / "serve_config.yaml"
APPLE_SILICON_RESOURCE = "apple_silicon"  # what api.service.settings asks the LLM replica for


def generated_config(model_dir: Path, port: int, run_dir: Path, base: Path = SERVE_CONFIG,
                     engine: dict[str, Any] | None = None, app_args: dict[str, Any] | None = None,
                     name: str = "pomona") -> Path:
    """serve_config.yaml with http_options on `port`, every application's model = `model_dir`,
    `engine` (EngineConfig fields) laid over its engine settings and `app_args` over its args."""
    import yaml

    config: dict[str, Any] = yaml.safe_load(base.read_text()) or {}
    http = dict(config.get("http_options") or {})
    http.update(host="127.0.0.1", port=port)
    config["http_options"] = http
    for app in config.get("applications") or []:
        args = dict(app.get("args") or {})
        args["model"] = str(model_dir)
        args.update(app_args or {})
        if engine:
            args["engine"] = _merged(args.get("engine") or {}, engine)
        cache = ((args.get("engine") or {}).get("cache") or {})
        if cache.get("ssd_dir"):
            # Keep the SSD tier as configured, but empty: the default directory outlives runs, and an
            # earlier run's entries would turn this run's "cold" prompts into SSD hits.
            # One per server (not each other's hits), and emptied here: an --out directory used again
            # kept the last run's entries, and its second server read 100 % of the prefix part from
            # them against the first's 85 % (session 27).
            ssd = run_dir / f"{name}-ssd-cache"
            shutil.rmtree(ssd, ignore_errors=True)
            cache["ssd_dir"] = str(ssd)
        app["args"] = args
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / f"{name}_serve_config.yaml"
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` laid over `base`, mappings merged key by key (`{"cache": {"ssd_dir": None}}` keeps the
    rest of the cache settings)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def pomona_server(model_dir: Path, port: int, run_dir: Path, extra_body: dict[str, Any],
                  engine: dict[str, Any] | None = None, app_args: dict[str, Any] | None = None,
                  name: str = "pomona", env: dict[str, str] | None = None) -> ServerSpec:
    if not SERVE_CONFIG.exists():
        return ServerSpec("pomona", ("true",), port, str(model_dir), extra_body,
                          skip_reason=f"{SERVE_CONFIG} does not exist yet (deployments not landed)")
    config = generated_config(model_dir, port, run_dir, engine=engine, app_args=app_args, name=name)
    # Short path: Ray's socket paths must stay under the 107-byte limit of AF_UNIX addresses.
    ray_tmp = f"/tmp/pomona-bench-ray-{port}"
    # Ports of our own, outside Ray's defaults (6379, 10001, 52365, workers 10002-19999), so a
    # colleague's cluster on this machine and this one never collide.
    slot = port % 100
    gcs_port, client_port, agent_port = 6500 + slot, 6600 + slot, 6700 + slot
    workers = (21000 + slot * 100, 21000 + slot * 100 + 99)
    venv_bin = ROOT / ".venv" / "bin"
    ncpu = os.cpu_count() or 2
    ray_start = [str(venv_bin / "ray"), "start", "--head", f"--port={gcs_port}", f"--temp-dir={ray_tmp}",
                 f"--num-cpus={ncpu}", f"--resources={json.dumps({APPLE_SILICON_RESOURCE: 1})}",
                 "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={client_port}",
                 f"--dashboard-agent-listen-port={agent_port}", f"--min-worker-port={workers[0]}",
                 f"--max-worker-port={workers[1]}"]
    serve_run = [str(venv_bin / "serve"), "run", f"--address=127.0.0.1:{gcs_port}", str(config)]
    script = f"set -e\n{shlex.join(ray_start)}\nexec {shlex.join(serve_run)}\n"
    return ServerSpec(name, ("bash", "-c", script), port, str(model_dir), extra_body,
                      env={**blas_env(), "RAY_TMPDIR": ray_tmp, "RAY_worker_niceness": "0",
                           # the same auth mode for `ray start` and `serve run` (a ~/.ray/auth_token left by
                           # another Ray session would otherwise turn auth on for the head only)
                           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
                           "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", **(env or {})}, ready_timeout_s=900.0,
                      cleanup_marker=ray_tmp, display=f"{shlex.join(ray_start)}\n{shlex.join(serve_run)}")
