"""Why the engine's step is longer in its own process than in engine_loop's (H200 probe, session 14).

    python -m benchmarks.step_probe MODEL --variant plain|process|spawned [--levels 32,128,128]
        [--profile-level 2] [--profile-s 8] [--out DIR]

`benchmarks/engine_loop.py`'s workload (its engine settings, prompts and closed loop), level by
level, no SSD tier; one line per level: tok/s, ms per step, the MLX thread's CPU per step, tokens
per step, and the probe's counters, which both processes keep the same way: commands taken per
batch, runner steps that carried prompt work, and mlx-lm's own prompt/decode time
(`BatchGenerator.stats()` windows around each step). At `--profile-level`, `py-spy record --nonblocking` samples the
engine's process (this one, or the worker) twice for `--profile-s`: every sample (`--idle`), then
the GIL holder's only (`--idle --gil`); raw stacks to DIR/<variant>-all.raw and -gil.raw, and a
summary of the MLX thread's samples (top inclusive frames) plus each thread's CPU over the level.

Variants:
- plain: `AsyncEngine` in this process (engine_loop without --process);
- process: `EngineProcess`, its worker run as `benchmarks.step_probe_worker` (the product's
  `deployments.engine_worker.main`, after the same counters; POMONA_PROBE_SWITCH_S sets the worker's
  `sys.setswitchinterval`, POMONA_PROBE_STATS_S its stats publish period);
- spawned: `plain`, in a child spawned the way EngineProcess spawns its worker (the parent's
  sys.path as PYTHONPATH, stdin from /dev/null, stdout/stderr inherited) by a parent that imported
  what engine_loop's does (MLX included);
- plain --wire: `plain`, with the worker's per-step wire work done in this process (`WireEngine`).
Nothing here changes product code: the counters are wrappers installed at run time.
"""

from __future__ import annotations

import asyncio
import collections
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Sequence

COUNTS: collections.Counter = collections.Counter()
SIZES: list[int] = []  # adds taken per command batch, in order
GEN: dict[str, float] = {}  # the running BatchGenerator's own counters (prompt_time, decode_time, ...)


def install_counters() -> None:
    """Count, on the MLX thread, what differs between the two processes' steps (wrappers only)."""
    from engine.loop import AsyncEngine
    from engine.batch_generator import BatchGeneratorRunner as Runner

    handle_commands, handle, stats = AsyncEngine._handle_commands, AsyncEngine._handle, AsyncEngine.stats

    def _handle_commands(self: Any, engine: Any, block: bool) -> Any:
        adds = COUNTS["cmd_add"]
        n = handle_commands(self, engine, block)
        if n:
            COUNTS["command_batches"] += 1
            if COUNTS["cmd_add"] > adds:
                COUNTS["add_batches"] += 1
                SIZES.append(COUNTS["cmd_add"] - adds)
        return n

    def _handle(self: Any, engine: Any, kind: str, arg: Any) -> None:
        COUNTS[f"cmd_{kind}"] += 1
        handle(self, engine, kind, arg)

    def counted(runner_step: Any) -> Any:
        def step(self: Any) -> Any:
            generator = getattr(self, "_generator", None)  # mlx-lm's BatchGenerator (engine_step: mlx_lm)
            if generator is None:
                prompts, generated = runner_step(self)
            else:  # its public stats() window around the step: prompt and decode time
                with generator.stats() as window:
                    prompts, generated = runner_step(self)
                for k, v in asdict(window).items():
                    if k != "peak_memory" and isinstance(v, (int, float)):
                        GEN[k] = GEN.get(k, 0) + v
            COUNTS["runner_steps"] += 1
            if prompts:
                COUNTS["steps_with_prompts"] += 1
            if any(p.end_of_prompt for p in prompts):
                COUNTS["steps_joining_batch"] += 1
            return prompts, generated
        return step

    def _stats(self: Any) -> dict[str, Any]:
        return {**stats(self), "probe": {**COUNTS, **{f"gen_{k}": v for k, v in GEN.items()}},
                "probe_sizes": SIZES[-400:]}

    AsyncEngine._handle_commands, AsyncEngine._handle, AsyncEngine.stats = _handle_commands, _handle, _stats
    Runner.step = counted(Runner.step)
    try:
        from engine.step.step_runner import StepRunner
    except ImportError:
        return
    StepRunner.step = counted(StepRunner.step)


def thread_cpu(pid: int) -> dict[int, tuple[float, int, int]]:
    """(CPU seconds (user + system), voluntary and involuntary context switches) of each thread of
    `pid`, by native thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        switches = dict(line.split(":\t") for line in status.splitlines() if "ctxt_switches" in line)
        out[int(tid)] = ((int(fields[11]) + int(fields[12])) / tick, int(switches.get("voluntary_ctxt_switches", 0)),
                         int(switches.get("nonvoluntary_ctxt_switches", 0)))
    return out


def parse_raw(path: Path) -> dict[str, collections.Counter]:
    """py-spy raw lines 'thread (TID): NAME;frame;frame... count' -> {thread: Counter(stack tuple)}."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        threads[frames[0]][tuple(frames[1:])] += int(count)
    return threads


def _frame(frame: str) -> str:
    """'f (path/to/file.py:123)' -> 'f (file.py)': inclusive shares per function, not per line."""
    name, _, where = frame.partition(" (")
    file = where.rsplit(":", 1)[0].rsplit("/", 1)[-1].rstrip(")")
    return f"{name} ({file})"


def summarize(path: Path, label: str, top: int = 25) -> list[str]:
    threads = parse_raw(path)
    total = sum(sum(c.values()) for c in threads.values())
    out = [f"  {label}: {total} samples; per thread: " + ", ".join(
        f"{t} {sum(c.values())}" for t, c in sorted(threads.items(), key=lambda kv: -sum(kv[1].values()))[:6])]
    for thread, stacks in threads.items():
        if "pomona-mlx" not in thread:
            continue
        n = sum(stacks.values())
        inclusive: collections.Counter = collections.Counter()
        leaves: collections.Counter = collections.Counter()
        for stack, k in stacks.items():
            for f in set(_frame(f) for f in stack):
                inclusive[f] += k
            leaves[_frame(stack[-1]) if stack else "(none)"] += k
        out.append(f"  MLX thread {thread}: {n} samples; top inclusive frames:")
        out += [f"    {100 * k / n:5.1f}%  {f[:140]}" for f, k in inclusive.most_common(top)]
        out.append("  top self frames:")
        out += [f"    {100 * k / n:5.1f}%  {f[:140]}" for f, k in leaves.most_common(12)]
    return out


class Profiler:
    """py-spy on `pid` from `delay` s on: `--idle` then `--idle --gil`, `seconds` each, in a thread."""

    def __init__(self, pid: int, out: Path, variant: str, delay: float, seconds: int) -> None:
        self.pid, self.out, self.variant, self.delay, self.seconds = pid, out, variant, delay, seconds
        self.files: list[tuple[str, Path]] = []
        self.errors: list[str] = []
        self.cpu: dict[int, tuple[float, int, int]] = {}
        self.wall = 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        time.sleep(self.delay)
        cpu0, t0 = thread_cpu(self.pid), time.perf_counter()
        for kind, flags in (("all", ["--idle"]), ("gil", ["--idle", "--gil"])):
            dest = self.out / f"{self.variant}-{kind}.raw"
            proc = subprocess.run(["py-spy", "record", "--pid", str(self.pid), "--duration", str(self.seconds),
                                   "--rate", "200", "--format", "raw", "--threads", "--nonblocking", *flags,
                                   "-o", str(dest)], capture_output=True, text=True)
            if dest.exists():
                self.files.append((kind, dest))
            else:
                self.errors.append(f"py-spy {kind}: rc {proc.returncode} {proc.stderr[-400:]}")
        self.wall = time.perf_counter() - t0
        cpu1 = thread_cpu(self.pid)
        self.cpu = {tid: tuple(a - b for a, b in zip(v, cpu0.get(tid, (0.0, 0, 0)))) for tid, v in cpu1.items()}

    def report(self) -> list[str]:
        self.thread.join()
        out = [f"py-spy on pid {self.pid} ({self.variant}):", *self.errors]
        names: dict[int, str] = {}
        for kind, path in self.files:
            for thread in parse_raw(path):
                tid = thread.split("(", 1)[1].split(")", 1)[0] if "(" in thread else ""
                if tid.isdigit():
                    names[int(tid)] = thread.split(":", 1)[-1].strip()
        busy = sorted(((v, t) for t, v in self.cpu.items() if v[0] > 0.02 * self.wall), reverse=True)
        wall = max(self.wall, 1e-9)
        out.append(f"  threads over the {self.wall:.1f} s sampled: CPU cores, voluntary / involuntary switches per s: "
                   + ", ".join(f"{names.get(t, t)} {v[0] / wall:.2f} {v[1] / wall:.0f}/{v[2] / wall:.0f}" for v, t in busy))
        for kind, path in self.files:
            out += summarize(path, kind)
        return out


class WireEngine:
    """`AsyncEngine` with the worker's per-step asyncio work done in this process (`--wire`): each
    batch's events become wire dicts (`event_to_wire`) in an outbox, flushed once per loop pass as one
    msgpack frame onto a socket that a thread drains: deployments/engine_worker.py's `Worker.run` and
    `flush`, without the other process."""

    def __init__(self, engine: Any) -> None:
        import socket

        self.engine = engine
        self.outbox: dict[str, list[dict[str, Any]]] = {}
        self.flush_scheduled = False
        self.sock, sink = socket.socketpair()
        threading.Thread(target=self._drain, args=(sink,), daemon=True).start()

    @staticmethod
    def _drain(sink: Any) -> None:
        while sink.recv(1 << 20):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def stream(self, request: Any) -> Any:
        from api.core.wire import event_to_wire

        async for batch in self.engine.stream(request):
            self.outbox.setdefault(request.request_id, []).extend(event_to_wire(e) for e in batch)
            if not self.flush_scheduled:
                self.flush_scheduled = True
                asyncio.get_running_loop().call_soon(self.flush)
            yield batch

    def flush(self) -> None:
        from deployments.engine_ipc import pack

        self.flush_scheduled = False
        if self.outbox:
            out, self.outbox = self.outbox, {}
            self.sock.sendall(pack(["events", out]))


def _counters_of(engine: Any) -> dict[str, float]:
    return dict(engine.stats().get("probe") or {})


def _make_engine(config: Any, variant: str, wire: bool) -> tuple[Any, str]:
    """The engine of a variant: "process" spawns the probe's worker in the product's place."""
    from deployments.engine_process import EngineProcess
    from engine.loop import AsyncEngine

    if variant == "process":
        popen = subprocess.Popen

        def spawn(args: list[str], **kw: Any) -> Any:  # the product's spawn, our module in its place
            args = [("benchmarks.step_probe_worker" if a == "deployments.engine_worker" else a) for a in args]
            return popen(args, **kw)

        subprocess.Popen = spawn  # type: ignore[misc]
        try:
            return EngineProcess(config), variant
        finally:
            subprocess.Popen = popen  # type: ignore[misc]
    install_counters()
    engine: Any = AsyncEngine(config)
    if wire:
        return WireEngine(engine), f"{variant}-wire"
    return engine, variant


def _report_level(variant: str, i: int, c: int, profiled: bool, r: dict[str, Any], before: dict[str, float],
                  after: dict[str, float], sizes: list[int]) -> None:
    d = {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in after}
    s = r["engine_steps"] or {}
    steps = max(d.get("runner_steps", 0), 1)
    print(f"[{variant}] level {i} c={c}{' (profiled)' if profiled else ''}: {r['output_throughput']:.0f} tok/s, "
          f"{s.get('ms_per_step')} ms/step, cpu {s.get('step_cpu_ms')}, tokens/step {s.get('tokens_per_step')}, "
          f"prompt tokens/step {s.get('prompt_tokens_per_step')}, deliver {s.get('deliver_ms_per_step')} ms, "
          f"commands {s.get('commands_ms_per_step')} ms, busy {s.get('busy_share')}, {r['duration_s']:.1f} s",
          flush=True)
    print(f"    per runner step: prompt_time {1000 * d.get('gen_prompt_time', 0) / steps:.2f} ms, "
          f"decode_time {1000 * d.get('gen_decode_time', 0) / steps:.2f} ms; "
          f"command batches {d.get('command_batches', 0)}, add batches {d.get('add_batches', 0)}, "
          f"adds {d.get('cmd_add', 0)}, aborts {d.get('cmd_abort', 0)}, calls {d.get('cmd_call', 0)}, "
          f"runner steps {d.get('runner_steps', 0)}, with prompt work {d.get('steps_with_prompts', 0)}, "
          f"joining the batch {d.get('steps_joining_batch', 0)}", flush=True)
    print(f"    adds per command batch, in order: {' '.join(map(str, sizes[:60]))}", flush=True)


def run(model_dir: str, variant: str, levels: Sequence[int], profile_level: int | None, profile_s: int,
        out: Path, waves: int, profile_waves: int, wire: bool = False, engine_step: str = "") -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from benchmarks.bare_loop import chat_prompts
    from benchmarks.engine_loop import closed_loop, engine_config
    from benchmarks.workloads import TextMaker, build, first_turn_messages, full_suite

    suite = replace(full_suite(), sweep_waves=waves)
    maker = TextMaker(model_dir)
    tokenizer = load_tokenizer(Path(model_dir))
    config = engine_config(model_dir, 128, None)
    if engine_step:
        config = replace(config, engine_step=engine_step)
    print(f"[{variant}] engine_step: {getattr(config, 'engine_step', 'mlx_lm (no choice at this commit)')}",
          flush=True)
    engine, variant = _make_engine(config, variant, wire)

    async def main() -> None:
        await engine.wait_ready()
        warm = chat_prompts(tokenizer, [[{"role": "user", "content": "warm up"}]] * 2)
        await closed_loop(engine, warm, 4, 2, "warm")
        pid = engine.process.pid if variant == "process" else os.getpid()
        for i, c in enumerate(levels):
            await engine.clear_cache("all")
            spec = suite.sweep_spec(c)
            if i == profile_level:  # long enough for both recordings
                spec = replace(spec, num_requests=profile_waves * c)
            convs = build(spec, maker)
            prompts = chat_prompts(tokenizer, [first_turn_messages(conv) for conv in convs])
            await asyncio.sleep(0.5)  # the worker's stats publish catches up (counters read from it)
            before = _counters_of(engine)
            sizes0 = engine.stats().get("probe_sizes") or []
            profiler = Profiler(pid, out, variant, 2.0, profile_s) if i == profile_level else None
            r = await closed_loop(engine, prompts, suite.random.output_len, c, f"c{c}-{i}")
            await asyncio.sleep(0.5)
            after = _counters_of(engine)
            sizes = engine.stats().get("probe_sizes") or []
            sizes = sizes[len(sizes0):] if len(sizes) < 400 else sizes[-int(after.get("add_batches", 0) - before.get("add_batches", 0)):]
            _report_level(variant, i, c, profiler is not None, r, before, after, sizes)
            if profiler:
                print("\n".join(profiler.report()), flush=True)
        await engine.shutdown(drain_s=0)

    asyncio.run(main())


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir")
    p.add_argument("--variant", choices=("plain", "process", "spawned"), default="plain")
    p.add_argument("--levels", default="32,128,128")
    p.add_argument("--profile-level", type=int, default=None, help="index into --levels; none: no py-spy")
    p.add_argument("--profile-s", type=int, default=8)
    p.add_argument("--waves", type=int, default=3, help="requests per level: waves x concurrency (engine_loop: 3)")
    p.add_argument("--profile-waves", type=int, default=6, help="the profiled level's requests: this x concurrency")
    p.add_argument("--wire", action="store_true",
                   help="plain, with the worker's per-step wire work (event_to_wire, msgpack, a socket write) in process")
    p.add_argument("--engine-step", default="mlx_lm",
                   help="engine.engine_step (mlx_lm: BatchGenerator, as in the session-13 runs; '': the default)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/step_probe"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if os.environ.get("POMONA_PROBE_SWITCH_S") and args.variant == "plain":
        sys.setswitchinterval(float(os.environ["POMONA_PROBE_SWITCH_S"]))
    if args.variant == "spawned":
        # What engine_loop's parent holds (MLX imported: a GPU context), then the child as the worker is spawned.
        import mlx.core  # noqa: F401
        from mlx_lm.tokenizer_utils import load  # noqa: F401

        import engine.loop  # noqa: F401
        argv2 = [a for a in (argv if argv is not None else sys.argv[1:])]
        argv2[argv2.index("spawned")] = "plain"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = subprocess.Popen([sys.executable, "-m", "benchmarks.step_probe", *argv2], env=env,
                                stdin=subprocess.DEVNULL).wait()
        print(f"[spawned] child exit code {code}", flush=True)
        sys.stdout.flush()
        os._exit(code)
    levels = [int(c) for c in args.levels.split(",")]
    run(args.model_dir, args.variant, levels, args.profile_level, args.profile_s, out, args.waves,
        args.profile_waves, args.wire, args.engine_step)
    sys.stdout.flush()
    os._exit(0)  # MLX's CUDA backend can abort at interpreter exit once a second thread used it


if __name__ == "__main__":
    raise SystemExit(main())
