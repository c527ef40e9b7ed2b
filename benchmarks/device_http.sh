#!/usr/bin/env bash
# On the device machine, after benchmarks/device_install.sh: the whole stack side by side.
#
#   bash benchmarks/device_http.sh probe,1b,smollm2     # any of them, in that order
#
# probe:   benchmarks/token_path.py (no model): Serve's token path, pacing off / 1000 / 2000 items/s.
# engine:  benchmarks/engine_loop.py on the 1B model at 32 and 128 concurrent, with and without the SSD tier
#          (ENGINE_FLAGS: comma-separated variants, default ",--no-ssd"; e.g. "--no-ssd,--no-ssd --burn 4";
#          "--burn 8 --cpus @ENGINE_CPUS@ --burn-cpus @BURN_CPUS@": the engine on two physical cores, burners elsewhere).
# profile: benchmarks/device_http_profile.py: py-spy on the Serve processes at 128 concurrent, 1B model
#          (variants default, ingress4, throughput: tok/s and CPU of each).
# 1b, smollm2: a random bf16 model of that shape (device_serve_model.py), then benchmarks/side_by_side.py:
#          bare BatchGenerator loop, Pomona's engine in process, Pomona over HTTP (`ray start` with the
#          apple_silicon resource + `serve run`), mlx_lm.server over HTTP; the full suite's random
#          workload at 1, 8, 32, 128 concurrent, 128 decoding together everywhere, one untimed pass first.
# Environment: NO_SSD=1 runs without the SSD tier (serve_config.yaml's ssd_dir: null) everywhere; SERVERS,
# LEVELS (concurrencies) and SIDE_FLAGS (e.g. --no-bare) narrow the side by side.
# Results: $OUT/token_path.json, $OUT/side-<model>.json, $OUT/logs-<model>.tgz (few files: $OUT takes 8).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
export RAY_memory_monitor_refresh_ms=0   # MemTotal starts small on these VMs and grows: no OOM killer
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
mkdir -p .venv/bin && ln -sf /tmp/site/bin/ray .venv/bin/ray && ln -sf /tmp/site/bin/serve .venv/bin/serve
cat REVISION 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader
python3 -c "import ray, mlx.core as mx, mlx_lm, starlette; print('ray', ray.__version__, 'mlx', mx.__version__, mx.default_device(), 'mlx_lm', mlx_lm.__version__, 'starlette', starlette.__version__)"
if [ -n "${NO_SSD:-}" ]; then  # serve_config.yaml without the SSD tier, for the HTTP server and engine_loop alike
  sed -i 's|^\( *ssd_dir:\).*|\1 null|' serve_config.yaml && grep -n "ssd_dir" serve_config.yaml
fi
for what in ${1//,/ }; do
  t0=$(date +%s)
  case $what in
    probe)
      timeout "${PROBE_TIMEOUT:-240}" python3 -m benchmarks.token_path --pacing 0,1000,2000 --streams 1,8,32,128 \
        --tokens 256 --num-cpus 16 --json "$OUTDIR/token_path.json" 2>"/tmp/token_path.stderr"
      tail -c 1500 /tmp/token_path.stderr ;;
    engine)
      [ -d /tmp/models/1b ] || python3 -m benchmarks.device_serve_model 1b /tmp/models/1b >/dev/null
      IFS=',' read -ra variants <<< "${ENGINE_FLAGS-,--no-ssd}"
      # @ENGINE_CPUS@ / @BURN_CPUS@ in a variant: two physical cores (with their SMT siblings) / the rest
      read -r eng_cpus burn_cpus <<< "$(python3 -m benchmarks.cpu_topology split 2)"
      echo "cpu topology: $(python3 -m benchmarks.cpu_topology show); engine cpus $eng_cpus, burners $burn_cpus"
      for flag in "${variants[@]}"; do   # 128 twice: the first pass compiles the shapes
        flag=${flag//@ENGINE_CPUS@/$eng_cpus}; flag=${flag//@BURN_CPUS@/$burn_cpus}
        timeout 300 python3 -m benchmarks.engine_loop /tmp/models/1b --concurrency 32,128,128 --max-running 128 \
          $flag 2>/tmp/engine_loop.stderr | tail -1 | sed "s/^/engine_loop $flag: /" || tail -c 1500 /tmp/engine_loop.stderr
      done ;;
    profile)
      [ -d /tmp/models/1b ] || python3 -m benchmarks.device_serve_model 1b /tmp/models/1b >/dev/null
      for v in ${PROFILE_VARIANTS:-default ingress4 throughput}; do
        timeout "${PROFILE_TIMEOUT:-240}" python3 -m benchmarks.device_http_profile /tmp/models/1b --variant "$v" \
          --concurrency 128 --seconds 12 2>"/tmp/profile-$v.stderr" || tail -c 1500 "/tmp/profile-$v.stderr"
      done
      tar -czf "$OUTDIR/pyspy.tgz" -C /tmp pyspy ;;
    1b|smollm2)
      python3 -m benchmarks.device_serve_model "$what" "/tmp/models/$what" >/dev/null &&
      timeout "${SIDE_TIMEOUT:-500}" python3 -m benchmarks.side_by_side --model "/tmp/models/$what" \
        --servers "${SERVERS:-pomona,mlx_lm.server}" --parts sweep --concurrency "${LEVELS:-1,8,32,128}" --engine \
        --max-batch 128 --warm "${LEVELS:-1,8,32,128}" --docs "" --out "/tmp/side-$what" ${SIDE_FLAGS:-} \
        2>"/tmp/side-$what.stderr"
      mv "/tmp/side-$what.stderr" "/tmp/side-$what/logs/" 2>/dev/null
      cp "/tmp/side-$what/results.json" "$OUTDIR/side-$what.json"
      tar -czf "$OUTDIR/logs-$what.tgz" -C "/tmp/side-$what" logs
      python3 -m benchmarks.device_http_report "$OUTDIR/side-$what.json" ;;
  esac
  echo "[$what] $(( $(date +%s) - t0 )) s"
done
