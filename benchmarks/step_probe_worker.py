"""`deployments.engine_worker` with the step probe's counters (benchmarks/step_probe.py --variant process).

    python -m benchmarks.step_probe_worker SOCKET_PATH     (spawned by EngineProcess under the probe)

POMONA_PROBE_SWITCH_S: `sys.setswitchinterval` in the worker; POMONA_PROBE_STATS_S: the worker's
stats publish period (deployments/engine_worker.py STATS_EVERY_S).
"""

from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    import deployments.engine_worker as worker
    from benchmarks.step_probe import install_counters

    if os.environ.get("POMONA_PROBE_SWITCH_S"):
        sys.setswitchinterval(float(os.environ["POMONA_PROBE_SWITCH_S"]))
    if os.environ.get("POMONA_PROBE_STATS_S"):
        worker.STATS_EVERY_S = float(os.environ["POMONA_PROBE_STATS_S"])
    install_counters()
    return worker.main(argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
