#!/usr/bin/env bash
# On the device machine, after benchmarks/device_install.sh: why engine_loop's step is ~1.7x longer with
# the engine in its own process (deployments/engine_worker.py) than in engine_loop's (session 13:
# 47.2 against 27.4 ms per step at 128 concurrent, 1B llama bf16, no SSD tier). benchmarks/step_probe.py,
# variants in order (default: all but stats):
#   plain    AsyncEngine in process, 32,128,128, py-spy on it at the last level
#   process  EngineProcess, 32,128,128, py-spy on the worker at the last level
#   spawned  plain, in a child spawned as EngineProcess spawns its worker (32,128)
#   wire     plain, with the worker's per-step wire work (event_to_wire, msgpack, socket) in process (32,128)
#   switch   process, the worker's sys.setswitchinterval(0.0005) (32,128)
#   stats    process, the worker's stats publish every 10 s instead of 0.1 s (32,128; not by default:
#            its step counters arrive late, so only its tok/s compares)
# Raw py-spy stacks go to $OUT (PLAIN-all.raw, -gil.raw, ...). ENGINE_STEP: engine.engine_step (default
# mlx_lm, BatchGenerator, as in session 13; '' for the configured default).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
MODEL=${MODEL:-/tmp/models/1b}
DEST=${OUT:-/tmp/step_probe}
STEP=${ENGINE_STEP-mlx_lm}
echo "revision: $(cat REVISION 2>/dev/null || git rev-parse HEAD 2>/dev/null)"
command -v py-spy >/dev/null && echo "py-spy: $(command -v py-spy)" || echo "py-spy: absent (ls /tmp/site/bin: $(ls /tmp/site/bin | tr '\n' ' '))"
[ -d "$MODEL" ] || python3 -m benchmarks.device_serve_model 1b "$MODEL" >/dev/null
probe() {  # label, then env assignments and step_probe flags
  local label=$1; shift
  echo "== $label"
  timeout 240 env "$@" 2>/tmp/step_probe_$label.err || { echo "[$label] failed:"; tail -c 1500 /tmp/step_probe_$label.err; }
}
P="python3 -m benchmarks.step_probe $MODEL --engine-step=$STEP --out $DEST"
IFS=',' read -ra todo <<< "${1:-plain,process,spawned,wire,switch}"
for what in "${todo[@]}"; do
  t0=$(date +%s)
  case $what in
    plain) probe plain X=1 $P --variant plain --levels 32,128,128 --profile-level 2 ;;
    process) probe process X=1 $P --variant process --levels 32,128,128 --profile-level 2 ;;
    spawned) probe spawned X=1 $P --variant spawned --levels 32,128 ;;
    wire) probe wire X=1 $P --variant plain --wire --levels 32,128 ;;
    switch) probe switch POMONA_PROBE_SWITCH_S=0.0005 $P --variant process --levels 32,128 ;;
    stats) probe stats POMONA_PROBE_STATS_S=10 $P --variant process --levels 32,128 ;;
  esac
  echo "[$what] $(( $(date +%s) - t0 )) s"
done
