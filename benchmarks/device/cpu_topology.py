"""Which logical CPUs share a physical core (SMT siblings), from Linux's sysfs.

    python -m benchmarks.device.cpu_topology show      # "0+8 1+9 ..." one group per physical core
    python -m benchmarks.device.cpu_topology split N   # "ENGINE BURN": N physical cores, then the rest

Why: a thread whose SMT sibling is busy runs 30-50 % slower; a host-bound MLX step beside a busy
serving stack can lose that much without any software cause (engine_loop --cpus / --burn-cpus).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def core_groups() -> list[tuple[int, ...]]:
    """Logical CPUs grouped by physical core, in order of their lowest CPU."""
    from benchmarks.engine.engine_loop import cpu_list

    groups: set[tuple[int, ...]] = set()
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings = cpu_list(path.read_text().strip()) if path.exists() else {cpu}
        groups.add(tuple(sorted(siblings)))
    return sorted(groups)


def spec(cpus: list[int]) -> str:
    return "+".join(str(c) for c in sorted(cpus))


def main(argv: list[str]) -> int:
    groups = core_groups()
    if argv[:1] == ["split"]:
        n = int(argv[1]) if len(argv) > 1 else 1
        engine = [c for g in groups[:n] for c in g]
        rest = [c for g in groups[n:] for c in g]
        print(spec(engine), spec(rest))
    else:
        print(" ".join(spec(list(g)) for g in groups))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
