#!/usr/bin/env bash
# Run the test suite inside ./.venv (made by scripts/setup.sh). On Linux, Debian's OpenBLAS is
# preloaded: MLX's bundled reference BLAS is ~15x slower and would make the model tests crawl.
set -euo pipefail
cd "$(dirname "$0")/.."
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0
if [ "$(uname -s)" = "Linux" ] && [ -e "$BLAS" ]; then
  export LD_PRELOAD="$BLAS${LD_PRELOAD:+:$LD_PRELOAD}"
fi
export PYTHONUNBUFFERED=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
