"""Pomona, vllm-mlx and mlx_lm.server on one model directory, the same workloads, one table.

    python -m benchmarks.harness.side_by_side --quick            # ~20-30 min on a 2-core Linux box
    python -m benchmarks.harness.side_by_side --servers mlx_lm.server,vllm-mlx --no-docs

Each server is started in turn on its own port, made ready, given a warm-up request, run through
the suite (concurrency sweep, prefix repetition, multi-turn, request-rate mode in the full suite),
and stopped. A bare `BatchGenerator` loop runs the same random prompts without HTTP, so the cost of
the serving stack is a ratio. Results: JSON + plots under --out, and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

from benchmarks.harness.client import EndpointConfig, wait_serving
from benchmarks.harness.goals import all_goals
from benchmarks.harness.models import benchmark_model_dir
from benchmarks.harness.proc_cpu import diff, machine_cpu_seconds
from benchmarks.harness.pomona_server import pomona_server
from benchmarks.harness.report import plot_sweep
from benchmarks.harness.serve_bench import eos_extra_body, eos_ids_of, run_suite, run_workload, write_json
from benchmarks.harness.servers import (ROOT, Running, ServerSpec, available, blas_env, launched, mlx_lm_server,
                                vllm_mlx_server)
from benchmarks.harness.workloads import Suite, TextMaker, build, full_suite, quick_suite

ALL_SERVERS = ("pomona", "vllm-mlx", "mlx_lm.server")
# Also runnable: "pomona-unpaced", Pomona sending one stream item per engine step per request
# (stream_items_per_s: 0 and stream_pacing_steps: 0, as before deployments/engine_host.py paced its
# streams), and "pomona-budget", Pomona pacing by a budget of 1,000 items/s instead of by time (the
# default before issue 35), and
# "pomona-throughput", Pomona on Ray Serve's throughput-optimized mode with its HTTP proxy kept, and
# "pomona-haproxy", Pomona behind Ray Serve's HAProxy ingress (RAY_SERVE_ENABLE_HA_PROXY=1: HAProxy, in C,
# forwards each request to the ingress replica's own HTTP server, in place of Serve's Python proxy, which
# relays every streamed chunk through a Ray call), and "pomona-haproxy-throughput", the same with the
# throughput-optimized mode (gRPC between deployments), and
# "pomona-nochannel", Pomona without step channels (step_channel: false: each request's own stream), and
# "pomona-nofast", Pomona without its CPU float32 llama paths (engine.cpu_fast_paths: false), and
# "pomona-inproc", Pomona with the engine inside the replica's process (engine_process: false), and
# "pomona-mlxlm", Pomona on mlx-lm's BatchGenerator instead of its own engine step (engine_step: mlx_lm), and
# "pomona-set:KEY=VALUE", Pomona with one engine setting replaced (VALUE read as YAML; a dotted KEY
# names one inside a block, e.g. cache.ssd_write), to A/B a default in one run
# (e.g. pomona,pomona-set:mlx_cache_limit=null).
SET_PREFIX = "pomona-set:"
THROUGHPUT_ENV = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
# maxconn 1024: HAProxy asks for ~2.5 file descriptors a connection, and importing mlx_lm (as this
# harness does) caps the process and every server it starts at 4,096 (mlx_lm/utils.py), below what
# Serve's default 4,096 connections need (10,276): HAProxy would not start.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_HAPROXY_MAXCONN": "1024"}
VARIANT_ENV = {"pomona-throughput": THROUGHPUT_ENV, "pomona-haproxy": HAPROXY_ENV,
               "pomona-haproxy-throughput": {**HAPROXY_ENV, "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}}
OVERHEAD_CONCURRENCY = 16  # the serving-overhead goal compares HTTP and bare loop here


def make_spec(name: str, model_dir: Path, port: int, run_dir: Path, max_batch: int | None = None) -> ServerSpec:
    """`max_batch`: sequences decoding together (Pomona's engine.max_running, mlx_lm.server's
    --decode-concurrency); None keeps each server's default (32 for both)."""
    bias = eos_extra_body("logit_bias", eos_ids_of(model_dir))
    if name.startswith(SET_PREFIX):
        import yaml

        key, sep, value = name[len(SET_PREFIX):].partition("=")
        if not sep or not key:
            raise ValueError(f"{name!r}: write {SET_PREFIX}KEY=VALUE (an engine setting)")
        engine: dict = {"max_running": max_batch} if max_batch else {}
        *outer, last = key.split(".")  # cache.ssd_write=idle: a setting inside engine.cache
        inner = engine
        for part in outer:
            inner = inner.setdefault(part, {})
        inner[last] = yaml.safe_load(value)
        return pomona_server(model_dir, port, run_dir, eos_extra_body("ignore_eos", []), engine=engine,
                             name=name.replace(":", "-").replace("=", "-"))
    if name in ("pomona", "pomona-unpaced", "pomona-budget", "pomona-nochannel", "pomona-nofast", "pomona-inproc",
                "pomona-mlxlm", "pomona-nossd", *VARIANT_ENV):
        app_args = {"pomona-unpaced": {"stream_items_per_s": 0, "stream_pacing_steps": 0},
                    "pomona-budget": {"stream_items_per_s": 1000, "stream_pacing_steps": 0}, "pomona-nochannel": {"step_channel": False},
                    "pomona-inproc": {"engine_process": False}}
        engine = {"max_running": max_batch} if max_batch else {}
        if name == "pomona-nofast":
            engine["cpu_fast_paths"] = False
        if name == "pomona-mlxlm":
            engine["engine_step"] = "mlx_lm"
        if name == "pomona-nossd":  # the SSD tier off, the rest of the cache settings as configured
            engine["cache"] = {"ssd_dir": None}
        env = VARIANT_ENV.get(name)
        if env is not None and HAPROXY_ENV.items() <= env.items():  # HAProxy's own ports, per server
            env = {**env, "RAY_SERVE_HAPROXY_METRICS_PORT": str(port + 300), "RAY_SERVE_HAPROXY_STATS_PORT": str(port + 400)}
        return pomona_server(model_dir, port, run_dir, eos_extra_body("ignore_eos", []), engine=engine or None,
                             app_args=app_args.get(name), name=name, env=env)
    if name == "vllm-mlx":
        return vllm_mlx_server(model_dir, port, bias, run_dir / "vllm-mlx-home")
    if name == "mlx_lm.server":
        return mlx_lm_server(model_dir, port, bias, max_batch)
    raise ValueError(f"unknown server {name!r}; known: {ALL_SERVERS}")


def served_model_name(spec: ServerSpec) -> str:
    """The id the server lists in /v1/models (servers differ in what they accept), else the spec's."""
    import httpx

    try:
        data = httpx.get(f"{spec.base_url}/models", timeout=10, trust_env=False).json()
        return data["data"][0]["id"]
    except Exception:  # noqa: BLE001 - mlx_lm.server's /v1/models fails without a HF cache
        return spec.model_name


def unavailable(name: str, spec: ServerSpec) -> dict[str, Any] | None:
    """The result of a server that cannot run here, its reason printed; else None, its start announced."""
    why = available(spec)
    if why:
        print(f"[{name}] skipped: {why}", flush=True)
        return {"label": name, "skipped": why}
    print(f"[{name}] starting: {spec.command_text}", flush=True)
    return None


@contextlib.contextmanager
def serving(spec: ServerSpec, out: Path) -> Iterator[tuple[Running, EndpointConfig, float]]:
    """The server started (logs under `out`/logs) and serving: its processes, its endpoint, and the
    seconds from its start until it served. Stopped on leaving."""
    with launched(spec, out / "logs") as running:
        cfg = EndpointConfig(spec.base_url, served_model_name(spec), spec.extra_body)
        yield running, cfg, running.up_s + asyncio.run(wait_serving(cfg, spec.ready_timeout_s))


def run_bare(model_dir: Path, quick: bool, concurrencies: Sequence[int], log_dir: Path,
             module: str = "benchmarks.engine.bare_loop", extra: Sequence[str] = ()) -> dict[str, Any]:
    """The bare loop (or `module`: benchmarks.engine.engine_loop, Pomona's engine in process) in its own
    process, so it runs with the same LD_PRELOAD as the servers."""
    cmd = [sys.executable, "-m", module, str(model_dir),
           "--concurrency", ",".join(map(str, concurrencies)), *extra] + (["--quick"] if quick else [])
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{module.rsplit('.', 1)[-1]}.log", "a") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT,
                              env={**os.environ, **blas_env()}, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_server(name: str, model_dir: Path, port: int, out: Path, suite: Suite,
               maker: TextMaker, parts: Sequence[str], max_batch: int | None = None,
               warm: Sequence[int] = ()) -> dict[str, Any]:
    spec = make_spec(name, model_dir, port, out, max_batch)
    skipped = unavailable(name, spec)
    if skipped is not None:
        return skipped
    load_before = os.getloadavg()[0]
    try:
        with serving(spec, out) as (running, cfg, ready_s):
            print(f"[{name}] serving after {ready_s:.1f} s", flush=True)
            for c in warm:  # untimed: a GPU backend compiles kernels for each new batch shape
                spec_c = replace(suite.sweep_spec(c), seed=7, num_requests=max(c, 2))
                run_workload(cfg, build(spec_c, maker), f"{name} warm c={c}", concurrency=c)
            cpu0, machine0, t0 = running.cpu(), machine_cpu_seconds(), time.perf_counter()
            result = run_suite(cfg, suite, maker, name, parts=parts)
            wall = time.perf_counter() - t0
            # Where the machine's time went during the workloads: this server's processes by name,
            # and everything else (the benchmark client, other people's jobs) as the remainder.
            cpu = diff(running.cpu(), cpu0)
            machine = machine_cpu_seconds() - machine0
            result.update(ready_s=ready_s, command=spec.command_text, wall_s=wall,
                          cpu_s_by_process=cpu, cpu_s_server=sum(cpu.values()), cpu_s_machine=machine,
                          loadavg_1m_before=load_before, loadavg_1m_after=os.getloadavg()[0])
            print(f"[{name}] CPU s over {wall:.0f} s wall: server {sum(cpu.values()):.0f}, machine "
                  f"{machine:.0f}; top: {dict(list(cpu.items())[:5])}", flush=True)
            return result
    except Exception as exc:  # noqa: BLE001 - one server failing must not lose the others' numbers
        print(f"[{name}] FAILED: {exc}", flush=True)
        return {"label": name, "failed": str(exc)[-3000:]}


def _bare_as_server(bare: dict[str, Any]) -> dict[str, Any]:
    return {"sweep": {c: {"output_throughput": b["output_throughput"], "ttft_ms": {"p50": b["ttft_ms_p50"]}}
                      for c, b in bare.items()}}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="mlx-lm model dir; default: the default model, float32")
    p.add_argument("--quick", action="store_true", help="small workloads sized for a 2-core box")
    p.add_argument("--servers", default=",".join(ALL_SERVERS))
    p.add_argument("--concurrency", default=None, help="comma list overriding the suite's sweep")
    p.add_argument("--no-bare", action="store_true", help="skip the bare BatchGenerator loop")
    p.add_argument("--engine", action="store_true",
                   help="also run Pomona's engine in process (benchmarks/engine/engine_loop.py) on the same prompts")
    p.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoding together, every server and loop (default: each one's own, 32)")
    p.add_argument("--warm", default="", help="comma list of concurrencies run untimed before each server's suite")
    p.add_argument("--parts", default="sweep,prefix,multiturn,rate", help="workloads to run (comma list)")
    p.add_argument("--base-port", type=int, default=18100)
    p.add_argument("--out", default=f"benchmarks/results/side-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--docs", default="docs/benchmarks.md", help="page to regenerate ('' to skip)")
    p.add_argument("--note", action="append", default=[], help="a line for the page's Notes (repeatable)")
    p.add_argument("--from-results", default=None, metavar="JSON",
                   help="re-render plots and docs from this results.json instead of measuring")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """Run the bare loop and every server; the returned dict is what results.json holds."""
    suite = quick_suite() if args.quick else full_suite()
    if args.concurrency:
        suite = replace(suite, concurrencies=tuple(int(x) for x in args.concurrency.split(",")))
    model_dir = benchmark_model_dir(args.model)
    out = Path(args.out).resolve()
    maker = TextMaker(model_dir)
    data: dict[str, Any] = {"command": command, "suite": asdict(suite), "model_dir": str(model_dir),
                            "servers": {}, "bare_loop": {}}
    warm = tuple(int(c) for c in args.warm.split(",") if c)
    # The loops run the warm concurrencies first, in the same process; the last run of each level is kept.
    loop_levels = (*warm, *suite.concurrencies)
    if not args.no_bare:
        data["bare_loop"] = run_bare(model_dir, args.quick, loop_levels, out / "logs")
        tok_s = {c: round(b["output_throughput"], 1) for c, b in data["bare_loop"].items()}
        print(f"[bare loop] {json.dumps(tok_s)} tok/s", flush=True)
    if args.engine:
        extra = ["--max-running", str(args.max_batch)] if args.max_batch else []
        data["engine_in_process"] = run_bare(model_dir, args.quick, loop_levels, out / "logs",
                                             "benchmarks.engine.engine_loop", extra)
        tok_s = {c: round(b["output_throughput"], 1) for c, b in data["engine_in_process"].items()}
        print(f"[engine in process] {json.dumps(tok_s)} tok/s", flush=True)
    for i, name in enumerate(args.servers.split(",")):
        data["servers"][name] = run_server(name, model_dir, args.base_port + i, out, suite, maker,
                                           args.parts.split(","), args.max_batch, warm)
        if name == "pomona" and data["bare_loop"] and OVERHEAD_CONCURRENCY in suite.concurrencies:
            # Bracket Pomona's run with a second bare run, so drift in the machine's load shows.
            data["bare_loop_after_pomona"] = run_bare(model_dir, args.quick, [OVERHEAD_CONCURRENCY],
                                                      out / "logs")
        write_json(out / "results.json", data)  # after each server, so a crash keeps the others
    return data


def publish(data: dict[str, Any], out: Path, docs_path: str, extra_notes: Sequence[str]) -> None:
    """Plots, the goals printed as ratios, and (unless docs_path is '') the docs page."""
    results, bare = data["servers"], data["bare_loop"]
    plots = plot_sweep({**{k: v for k, v in results.items() if "sweep" in v},
                        **({"bare loop (no HTTP)": _bare_as_server(bare)} if bare else {})}, out)
    goals = all_goals(results, bare, data.get("bare_loop_after_pomona"))
    for g in goals:
        ratio = "n/a" if g.ratio is None else f"{g.ratio:.2f}"
        print(f"{g.name}: {ratio} (target {g.target}; {g.detail})")
    if not docs_path:
        return
    from benchmarks.harness import docs

    notes = [f"{k}: {v.get('skipped') or v.get('failed')}" for k, v in results.items()
             if "skipped" in v or "failed" in v]
    notes += [f"{k}: 1-minute load average {v['loadavg_1m_before']:.1f} before its run, "
              f"{v['loadavg_1m_after']:.1f} after (this machine has {os.cpu_count()} cores)"
              for k, v in results.items() if "loadavg_1m_before" in v]
    commands = [data.get("command", "python -m benchmarks.harness.side_by_side")]
    commands += [v["command"] for v in results.values() if "command" in v]
    page = docs.write(ROOT / docs_path, results=results, bare=bare, goals=goals, plots=plots,
                      commands=commands, model_dir=Path(data["model_dir"]), suite=data["suite"],
                      notes=[*notes, *extra_notes])
    print(f"docs: {page}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.from_results:  # re-render plots and docs from an earlier run, measuring nothing
        path = Path(args.from_results)
        publish(json.loads(path.read_text()), path.parent, args.docs, args.note)
        return 0
    command = "python -m benchmarks.harness.side_by_side " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out).resolve()
    data = measure(args, command.strip())
    publish(data, out, args.docs, args.note)
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
