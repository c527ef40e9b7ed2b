#!/usr/bin/env bash
# On the device machine, after benchmarks/device_install.sh: what about the serving stack's environment
# slows the engine's step (1.4x behind Ray Serve even with the engine in its own process, while busy
# cores beside it cost at most 4 %). benchmarks/engine_loop.py on the 1B model, 32 then 128 twice, no
# SSD tier, in variants: plain; Ray's worker environment (OMP_NUM_THREADS=2, OpenBLAS preloaded as
# blas_preload: auto does where it is installed); beside a process holding an idle MLX GPU context;
# beside one using it every 10 ms; and through EngineProcess (deployments/engine_process.py).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
MODEL=${MODEL:-/tmp/models/1b}
[ -d "$MODEL" ] || python3 -m benchmarks.device_serve_model 1b "$MODEL" >/dev/null
python3 -c "import mlx.core, mlx_lm, time; time.sleep(6)" & sleep 4
echo "GPU contexts while a process has only imported mlx and mlx_lm:"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
wait
BLAS=/usr/lib/x86_64-linux-gnu/libopenblas.so.0; [ -e $BLAS ] || BLAS=""; echo "openblas: ${BLAS:-absent}"
loop() {  # label, then the command's prefix (env assignments) and extra flags
  local label=$1; shift
  timeout 200 env "$@" python3 -m benchmarks.engine_loop "$MODEL" --concurrency ${LEVELS:-32,128,128} --max-running 128 \
    --no-ssd ${FLAGS:-} 2>/tmp/engine_env.stderr | tail -1 | python3 -c "
import json, sys; r = json.load(sys.stdin)['128']; s = r['engine_steps']
print(f'$label: 128 -> {r[\"output_throughput\"]:.0f} tok/s, {s[\"ms_per_step\"]:.1f} ms/step, cpu {s[\"step_cpu_ms\"]:.1f}, tokens/step {s[\"tokens_per_step\"]:.0f}')" \
    || tail -c 800 /tmp/engine_env.stderr
}
IFS=',' read -ra todo <<< "${1:-plain,rayenv,idlectx,busyctx,process}"
for what in "${todo[@]}"; do
  t0=$(date +%s)
  case $what in
    plain) loop plain X=1 ;;
    rayenv) loop "rayenv" OMP_NUM_THREADS=2 ${BLAS:+LD_PRELOAD=$BLAS} ;;
    idlectx) python3 -m benchmarks.gpu_sidecar --seconds 120 & sleep 3; loop "idle context beside" X=1; kill %1 2>/dev/null ;;
    busyctx) python3 -m benchmarks.gpu_sidecar --seconds 120 --every-ms 10 & sleep 3; loop "context used every 10 ms beside" X=1; kill %1 2>/dev/null ;;
    process) FLAGS=--process loop "EngineProcess" X=1 ;;
  esac
  wait 2>/dev/null
  echo "[$what] $(( $(date +%s) - t0 )) s"
done
