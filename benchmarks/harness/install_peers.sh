#!/usr/bin/env bash
# Install the peer servers the side-by-side benchmark compares against, away from Pomona's venv:
# vllm-mlx pins an older mlx-lm, so it gets its own virtual environment under .bench/venvs/.
# On Linux its heavy optional dependencies (torch, vision, gradio) are skipped with --no-deps;
# the light ones it needs to serve a text model are listed explicitly. mlx_lm.server needs
# nothing extra: it ships with mlx-lm in ./.venv.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.bench/venvs/vllm-mlx
python3 -m venv "$VENV"
"$VENV/bin/pip" install --no-deps vllm-mlx==0.6.0 "mlx-lm==0.31.3"
EXTRA=""
if [ "$(uname -s)" = "Linux" ]; then EXTRA="mlx[cpu]"; else EXTRA="mlx"; fi
"$VENV/bin/pip" install "$EXTRA" transformers fastapi uvicorn prometheus-client psutil jsonschema \
  pyyaml tabulate requests tqdm pillow mcp pytz jinja2
"$VENV/bin/vllm-mlx" serve --help >/dev/null && echo "vllm-mlx installed in $VENV"
