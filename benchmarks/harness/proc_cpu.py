"""CPU seconds per process of one server under test, read from /proc (Linux; empty elsewhere).

A server's processes are those of its session (each server starts with `start_new_session`) plus
any whose command line holds its marker. Sampled before and after a workload, the difference says
where the machine's time went: the engine, the HTTP layer, Ray's daemons, or other people's jobs.
"""

from __future__ import annotations

import os
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _name(argv: list[str]) -> str:
    """A readable, stable name: Ray's proctitle, the `-m` module, or the program's basename."""
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0]
    base = os.path.basename(argv[0])
    if base.startswith("python"):
        if len(argv) > 2 and argv[1] == "-m":
            return argv[2]
        if len(argv) > 1:
            return os.path.basename(argv[1])
    return base


def _read(pid_dir: Path) -> tuple[int, float, str] | None:
    """(session id, CPU seconds, name) of one process, or None if it is gone or unreadable."""
    try:
        stat = (pid_dir / "stat").read_text()
        argv = (pid_dir / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2:].split()
    cpu = (int(rest[11]) + int(rest[12])) / _TICK  # utime + stime
    return int(rest[3]), cpu, _name([a.decode(errors="replace") for a in argv if a])


def cpu_by_process(session: int, marker: str | None = None) -> dict[str, float]:
    """Cumulative CPU seconds of the server's live processes, summed by name."""
    out: dict[str, float] = {}
    proc = Path("/proc")
    if not proc.exists():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        info = _read(entry)
        if info is None:
            continue
        sid, cpu, name = info
        if sid == session or (marker and _has_marker(entry, marker)):
            out[name] = out.get(name, 0.0) + cpu
    return out


def pids_of(session: int, marker: str | None = None) -> list[int]:
    """The server's live processes: its session's, and any whose command line holds its marker."""
    proc = Path("/proc")
    if not proc.exists():
        return []
    out = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        info = _read(entry)
        if info is not None and (info[0] == session or (marker and _has_marker(entry, marker))):
            out.append(int(entry.name))
    return out


def _has_marker(pid_dir: Path, marker: str) -> bool:
    try:
        return marker.encode() in (pid_dir / "cmdline").read_bytes()
    except OSError:
        return False


def machine_cpu_seconds() -> float:
    """All CPU time spent on the machine so far (user + system + ...), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    busy = sum(int(x) for i, x in enumerate(fields) if i not in (3, 4))  # minus idle and iowait
    return busy / _TICK


def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Per-name CPU seconds spent between two samples, largest first."""
    spent = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in spent.items() if v > 0.005), key=lambda kv: -kv[1]))
