"""How each server under test is started, made ready and stopped, one at a time on its own port.

Each server runs in its own process group so stopping it also stops whatever it spawned (Ray's
raylet, workers); SIGTERM first because `serve run` and uvicorn shut down cleanly on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from benchmarks.harness.client import wait_ready

ROOT = Path(__file__).resolve().parents[2]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
VLLM_MLX_VENV = ROOT / ".bench" / "venvs" / "vllm-mlx"


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: tuple[str, ...]
    port: int
    model_name: str  # what requests put in "model"
    extra_body: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 600.0
    cwd: str = str(ROOT)
    skip_reason: str | None = None  # set when the server cannot run here (not installed, no config)
    # Processes whose command line contains this string are ours (e.g. a Ray session directory made
    # for this run): daemons that left the process group are found by it and stopped by pid.
    cleanup_marker: str | None = None
    display: str | None = None  # the command as a reader would type it (docs), when argv is a wrapper

    @property
    def command_text(self) -> str:
        return self.display or " ".join(self.argv)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def blas_env() -> dict[str, str]:
    """The same BLAS for every server: Debian's OpenBLAS on Linux (MLX's bundled one is ~15x slower)."""
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        return {"LD_PRELOAD": OPENBLAS}
    return {}


def ensure_blas() -> None:
    """Re-exec this process with OpenBLAS preloaded (Linux), as the servers run: LD_PRELOAD only
    takes effect at process start, and MLX's bundled BLAS is ~15x slower on float32 GEMM."""
    preload = blas_env().get("LD_PRELOAD")
    if preload and preload not in os.environ.get("LD_PRELOAD", ""):
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "LD_PRELOAD": preload})


def mlx_lm_server(model_dir: Path, port: int, eos_bias: dict[str, Any],
                  decode_concurrency: int | None = None) -> ServerSpec:
    batch = ("--decode-concurrency", str(decode_concurrency)) if decode_concurrency else ()
    return ServerSpec("mlx_lm.server", (sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                                        "--port", str(port), *batch),
                      port=port, model_name=str(model_dir), extra_body=eos_bias, env=blas_env())


def vllm_mlx_server(model_dir: Path, port: int, eos_bias: dict[str, Any], home: Path) -> ServerSpec:
    """vllm-mlx saves its prefix cache under ~/.cache/vllm-mlx at shutdown and reloads it at start;
    a fresh HOME per run keeps an earlier run's cache from making this one look faster."""
    exe = VLLM_MLX_VENV / "bin" / "vllm-mlx"
    home.mkdir(parents=True, exist_ok=True)
    return ServerSpec("vllm-mlx", (str(exe), "serve", str(model_dir), "--continuous-batching",
                                   "--port", str(port), "--host", "127.0.0.1"),
                      port=port, model_name=str(model_dir), extra_body=eos_bias,
                      env={**blas_env(), "HOME": str(home)})


def available(spec: ServerSpec) -> str | None:
    """None when the server can be started, else why not (so a run skips it and says so)."""
    if spec.skip_reason:
        return spec.skip_reason
    exe = Path(spec.argv[0])
    if exe.is_absolute() and not exe.exists():
        return f"{exe} not found (see docs/benchmarks.md for how to install it)"
    return None


def _stop(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass(frozen=True)
class Running:
    """A started server: how long it took to answer, and how to find its processes."""

    up_s: float
    session: int
    marker: str | None

    def cpu(self) -> dict[str, float]:
        from benchmarks.harness.proc_cpu import cpu_by_process

        return cpu_by_process(self.session, self.marker)


@contextlib.contextmanager
def launched(spec: ServerSpec, log_dir: Path) -> Iterator[Running]:
    """Start `spec`, wait until it answers, yield it, stop it (and what it spawned) on exit."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{spec.name}.log"
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(spec.argv), stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=spec.cwd, start_new_session=True)
        try:
            asyncio.run(wait_ready(spec.base_url, spec.ready_timeout_s, alive=lambda: proc.poll() is None))
            yield Running(time.perf_counter() - t0, proc.pid, spec.cleanup_marker)
        except Exception as exc:
            tail = log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{spec.name} failed: {exc}\n--- log tail ({log_path}) ---\n{tail}") from exc
        finally:
            _stop(proc)
            if spec.cleanup_marker:
                _stop_marked(spec.cleanup_marker)


def _marked_pids(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def terminate(list_pids: Callable[[], list[int]], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL, the processes `list_pids()` names, waiting `grace_s` after each."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = list_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            time.sleep(0.2)
            pids = [p for p in list_pids() if Path(f"/proc/{p}").exists()]
        if not pids:
            return


def _stop_marked(marker: str, grace_s: float = 10.0) -> None:
    """Stop each process of this run that outlived its process group, and what those started: a
    process a Ray worker spawned (Serve's HAProxy) names no marker and, once the raylet is gone,
    lives on under init holding its ports, so the tree is listed before anything is stopped."""
    import psutil

    tree: set[int] = set()
    for pid in _marked_pids(marker):
        tree.add(pid)
        with contextlib.suppress(psutil.Error):
            tree.update(child.pid for child in psutil.Process(pid).children(recursive=True))
    tree.discard(os.getpid())
    terminate(lambda: sorted(set(_marked_pids(marker)) | {p for p in tree if psutil.pid_exists(p)}), grace_s)
