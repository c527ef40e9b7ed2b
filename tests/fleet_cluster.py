"""A local multi-node Pomona cluster on one machine: a head and extra nodes, each its own "host".

Each node is started with `pomona node start/join` (so the node CLI is what is exercised), with its
own `--temp-dir`, `--host-name` and `--port-base`. Stopping a node kills exactly the processes whose
command line names that node's temp dir: `ray stop` would stop every Ray process of this user on the
machine, colleagues' clusters included. A test fixture (tests/fleet/test_fleet_e2e.py,
tests/deployments/test_drain_e2e.py), which benchmarks/fleet/fleet_affinity.py borrows as it borrows
tests/tiny_model.py: tests never import benchmarks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class LocalNode:
    name: str  # host identity: the node declares pomona_host_<name>
    temp_dir: str  # short: Ray's socket paths must stay under 107 bytes
    port_base: int


def node_pids(temp_dir: str) -> list[int]:
    """Processes of one node: every Ray process of it names its temp dir on its command line."""
    marker = temp_dir.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def node_tree(temp_dir: str) -> list[int]:
    """The node's processes and their descendants: workers retitle themselves ("ray::...") and so
    no longer show the temp dir, but they are children of the node's raylet."""
    import psutil

    pids = set(node_pids(temp_dir))
    for pid in list(pids):
        with contextlib.suppress(psutil.Error):
            pids.update(child.pid for child in psutil.Process(pid).children(recursive=True))
    pids.discard(os.getpid())
    return sorted(pids)


def stop_node(node: LocalNode, grace_s: float = 8.0) -> None:
    """SIGTERM, then SIGKILL, the node's own processes only, waiting `grace_s` after each."""
    import psutil

    procs = []  # listed once: once stopped, its processes cannot be found by dir
    for pid in node_tree(node.temp_dir):
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                stop(proc)
        _, procs = psutil.wait_procs(procs, timeout=grace_s)
        if not procs:
            break
    shutil.rmtree(node.temp_dir, ignore_errors=True)


def _pomona(args: list[str], env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "deployments.cli", "node", *args]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


@contextlib.contextmanager
def local_cluster(names: tuple[str, ...] = ("a", "b"), cpus_per_node: int = 1,
                  port_base: int = 24000, object_store_bytes: int = 100 * 2**20,
                  flags: tuple[str, ...] = ()) -> Iterator[tuple[str, list[LocalNode]]]:
    """Yields (GCS address, nodes); the first node is the head. Every node declares apple_silicon
    (`--dev-apple-silicon`), so one LLM replica may run on each; `flags`: more node flags for all."""
    tag = uuid.uuid4().hex[:6]
    nodes = [LocalNode(n, f"/tmp/pf-{tag}-{n}", port_base + 200 * (i + 1)) for i, n in enumerate(names)]
    gcs_port = port_base
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    common = ["--dev-apple-silicon", f"--num-cpus={cpus_per_node}", f"--object-store-memory={object_store_bytes}",
              "--node-ip-address=127.0.0.1", "--auth=disabled", *flags]
    try:
        for i, node in enumerate(nodes):
            where = ["start", "--head", f"--port={gcs_port}"] if i == 0 else ["join", f"127.0.0.1:{gcs_port}"]
            _pomona(where + common + [f"--host-name={node.name}", f"--temp-dir={node.temp_dir}",
                                      f"--port-base={node.port_base}"], env)
        yield f"127.0.0.1:{gcs_port}", nodes
    finally:
        for node in reversed(nodes):
            stop_node(node)
