#!/usr/bin/env bash
# Run the test suite inside ./.venv (made by scripts/setup.sh). On Linux, Debian's OpenBLAS is
# preloaded: MLX's bundled reference BLAS is ~15x slower and would make the model tests crawl.
set -euo pipefail
cd "$(dirname "$0")/.."
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
if [ "$(uname -s)" = "Linux" ] && [ -e "$BLAS" ]; then
  export LD_PRELOAD="$BLAS${LD_PRELOAD:+:$LD_PRELOAD}"
  # One BLAS thread: OpenBLAS 0.3.21's fork handler joins its pool threads and deadlocks when a fork
  # (Ray starting its processes from this test process) meets a BLAS call on another thread. That
  # hung CI once for 90 minutes; with no pool there is nothing to join. Tests use tiny models anyway.
  export OPENBLAS_NUM_THREADS=1
fi
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@" < /dev/null
