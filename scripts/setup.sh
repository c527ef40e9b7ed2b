#!/usr/bin/env bash
# Set up Pomona in ./.venv: the project (editable) with its dev and benchmark extras. On Linux also Debian's
# OpenBLAS, which the LLM server preloads: MLX's bundled reference BLAS is ~15x slower on the CPU.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0

if [ "$(uname -s)" = "Linux" ] && [ ! -e "$BLAS" ]; then
  echo "setup: installing libopenblas0-pthread (Debian/Ubuntu) for fast float32 matmuls"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libopenblas0-pthread
  else
    echo "setup: no apt-get here; install OpenBLAS so that $BLAS exists (serving still works, slowly)" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev,bench]"
echo "setup: done. Next: . .venv/bin/activate && pomona node start --head && serve run serve_config.yaml"
if [ "$(uname -s)" != "Darwin" ]; then
  echo "setup: (not a Mac: add --dev-apple-silicon to 'pomona node start' so the model server may run here)"
fi
