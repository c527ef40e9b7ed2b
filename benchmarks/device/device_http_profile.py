"""Where Pomona's time goes over HTTP: py-spy on the LLM server, ingress and proxy during a load.

    python -m benchmarks.device.device_http_profile MODEL_DIR --concurrency 128 --seconds 12 [--variant ingress4]

Starts Pomona as side_by_side does (`ray start` + `serve run`, 128 decoding together), runs one
untimed pass, then the suite's random workload at `--concurrency` while `py-spy record` samples each
Serve process (raw collapsed stacks, all threads, GIL holder marked) for `--seconds`. Prints per
process: CPU seconds over the load, and per thread the share of samples and the top frames by
self samples; the raw stacks go to $PYSPY_DIR/<variant>/pyspy-<process>.txt (default /tmp/pyspy). Variants: `ingress4` (4 ingress
replicas), `unpaced` (stream_items_per_s 0), `throughput` (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, proxy kept), `haproxy`
(Serve's HAProxy ingress in place of its Python proxy, as `pomona node start --haproxy`); `-nossd`: the same without the SSD tier; `nocache`: no prefix cache; `inproc-nossd`: the engine
inside the replica's process (engine_process: false).
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from benchmarks.harness.client import EndpointConfig, wait_serving
from benchmarks.harness.pomona_server import pomona_server
from benchmarks.harness.proc_cpu import diff
from benchmarks.harness.serve_bench import eos_extra_body, run_workload
from benchmarks.harness.servers import launched
from benchmarks.harness.side_by_side import HAPROXY_ENV
from benchmarks.harness.workloads import TextMaker, build, full_suite

# Ray's processes by their "ray::" names; "engine_worker" is the engine's own process (engine_process: true)
PROCESSES = ("ServeReplica:pomona:LLMServer", "ServeReplica:pomona:Ingress", "ProxyActor", "engine_worker")
THROUGHPUT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
NO_SSD = {"ssd_dir": None}
# name -> (app args over serve_config.yaml's, environment of `ray start` and so of every Serve process,
# prefix-cache settings over serve_config.yaml's)
VARIANTS = {
    "default": ({}, {}, {}),
    "ingress4": ({"ingress": {"num_replicas": 4, "num_cpus": 0}}, {}, {}),
    "unpaced": ({"stream_items_per_s": 0}, {}, {}),
    # Ray Serve's throughput-optimized mode (user code on the replica's main loop, router in the same
    # loop, gRPC between proxy and replicas, buffered access logs), keeping its HTTP proxy.
    "throughput": ({}, THROUGHPUT_ENV, {}),
    # HAProxy forwards to the ingress replica's own HTTP server: no Python proxy relaying each chunk.
    "haproxy": ({}, HAPROXY_ENV, {}),
    # The same without the SSD tier: what the stack costs apart from the prefix cache's host work.
    "nossd": ({}, {}, NO_SSD),
    "unpaced-nossd": ({"stream_items_per_s": 0}, {}, NO_SSD),
    "throughput-nossd": ({}, THROUGHPUT_ENV, NO_SSD),
    # No prefix cache at all: what its offers and restores cost the engine behind Serve.
    "nocache": ({}, {}, {"enabled": False}),
    # The engine inside the replica's process, as before engine_process (deployments/engine_process.py).
    "inproc-nossd": ({"engine_process": False}, {}, NO_SSD),
}


def base_cache() -> dict:
    """serve_config.yaml's prefix-cache settings (a variant changes some of them)."""
    import yaml

    from benchmarks.harness.pomona_server import SERVE_CONFIG

    app = (yaml.safe_load(SERVE_CONFIG.read_text()).get("applications") or [{}])[0]
    return dict(((app.get("args") or {}).get("engine") or {}).get("cache") or {})


def pids_of(name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith(f"ray::{name}") or (name == "engine_worker" and "deployments.engine_worker" in cmd):
                found.append(int(entry.name))
    return found


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of `pid` so far (/proc/PID/task/TID/stat: utime + stime), by name."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = collections.Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] += (int(fields[11]) + int(fields[12])) / tick
    return out


def summarize(path: Path, top: int = 12) -> list[str]:
    """py-spy raw lines: 'thread (idle);frame;frame... count' -> per-thread share and top self frames."""
    threads: collections.Counter = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        threads[thread] += n
        leaves[thread][frames[-1] if len(frames) > 1 else "(no python frame)"] += n
        total += n
    out = []
    for thread, n in threads.most_common(6):
        out.append(f"  {thread}: {100 * n / max(total, 1):.1f}% of samples")
        for frame, k in leaves[thread].most_common(top):
            out.append(f"      {100 * k / max(total, 1):5.1f}%  {frame[:150]}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--seconds", type=int, default=12)
    p.add_argument("--variant", default="default", choices=sorted(VARIANTS))
    p.add_argument("--port", type=int, default=18150)
    args = p.parse_args(argv)
    out = Path(os.environ.get("PYSPY_DIR", "/tmp/pyspy")) / args.variant
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model_dir)
    app_args, env, cache = VARIANTS[args.variant]
    engine = {"max_running": 128, "cache": {**base_cache(), **cache}}
    spec = pomona_server(model, args.port, Path("/tmp/prof-run"), eos_extra_body("ignore_eos", []),
                         engine=engine, app_args=app_args,
                         name=f"pomona-{args.variant}")  # its own SSD cache directory: cold prompts
    spec = replace(spec, env={**spec.env, **env})
    suite = full_suite()
    maker = TextMaker(model)
    with launched(spec, Path("/tmp/prof-run/logs")) as running:
        cfg = EndpointConfig(spec.base_url, spec.model_name, spec.extra_body)
        import asyncio

        asyncio.run(wait_serving(cfg, 600))
        c = args.concurrency
        run_workload(cfg, build(replace(suite.sweep_spec(c), seed=7, num_requests=c), maker), "warm", concurrency=c)
        spies = []
        for name in PROCESSES:
            for i, pid in enumerate(pids_of(name)):
                dest = out / f"pyspy-{name.split(':')[-1]}{i or ''}.txt"
                spies.append((name, dest, subprocess.Popen(
                    ["py-spy", "record", "--pid", str(pid), "--duration", str(args.seconds), "--rate", "200",
                     "--format", "raw", "--threads", "--nonblocking", "-o", str(dest)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
        watched = {f"{n.split(':')[-1]}{i or ''}": pid for n in PROCESSES for i, pid in enumerate(pids_of(n))}
        threads0 = {k: thread_cpu(pid) for k, pid in watched.items()}
        cpu0, t0 = running.cpu(), time.perf_counter()
        agg = run_workload(cfg, build(suite.sweep_spec(c), maker), f"c={c}", concurrency=c)
        wall = time.perf_counter() - t0
        cpu = diff(running.cpu(), cpu0)
        threads = {k: {t: v - threads0[k].get(t, 0.0) for t, v in thread_cpu(pid).items()}
                   for k, pid in watched.items()}
        for _, _, proc in spies:
            proc.wait(timeout=60)
    print(f"[{args.variant}] c={c}: {agg['output_throughput']:.0f} tok/s, TPOT p50 {agg['tpot_ms']['p50']:.1f} ms, "
          f"chunk gap p50 {agg['itl_ms']['p50']:.1f} ms; CPU s over {wall:.0f} s: "
          + ", ".join(f"{k} {v:.1f}" for k, v in list(cpu.items())[:6]))
    for proc_name, by_thread in threads.items():  # measured CPU, not samples: py-spy counts some waits
        busy = sorted(((v, t) for t, v in by_thread.items() if v >= 0.05 * wall / 100), reverse=True)[:8]
        print(f"{proc_name} thread CPU over the load (cores): "
              + ", ".join(f"{t} {v / wall:.2f}" for v, t in busy))
    print("py-spy (samples of threads not idle, 200/s):")
    for name, dest, proc in spies:
        err = proc.stderr.read().decode(errors="replace")[-300:] if proc.stderr else ""
        print(f"{name} -> {dest.name}" + (f" (py-spy: {err.strip()})" if not dest.exists() else ""))
        if dest.exists():
            print("\n".join(summarize(dest)))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
