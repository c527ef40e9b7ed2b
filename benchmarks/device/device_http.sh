#!/usr/bin/env bash
# On the device machine, after benchmarks/device/device_install.sh: the whole stack side by side.
#
#   bash benchmarks/device/device_http.sh probe,1b,smollm2     # any of them, in that order
#
# probe:   benchmarks/device/token_path.py (no model): Serve's token path, pacing off / 1000 / 2000 items/s.
# hostreads: benchmarks/device/host_reads.py (no model, ~30 s): whether host reads of blocks (the SSD writer's)
#          slow the GPU's later work on them, or beside them (CUDA's managed memory). $OUT/host_reads.log.
# engine:  benchmarks/engine/engine_loop.py on the 1B model at 32 and 128 concurrent, with and without the SSD tier
#          (ENGINE_FLAGS: comma-separated variants, default ",--no-ssd"; e.g. "--no-ssd,--no-ssd --burn 4";
#          "--burn 8 --cpus @ENGINE_CPUS@ --burn-cpus @BURN_CPUS@": the engine on two physical cores, burners elsewhere).
# profile: benchmarks/device/device_http_profile.py: py-spy on the Serve processes at 128 concurrent, 1B model
#          (variants default, ingress4, throughput: tok/s and CPU of each).
# 1b, smollm2: a random bf16 model of that shape (device_serve_model.py), then benchmarks/harness/side_by_side.py:
#          bare BatchGenerator loop, Pomona's engine in process, Pomona over HTTP (`ray start` with the
#          apple_silicon resource + `serve run`), mlx_lm.server over HTTP; the full suite's random
#          workload at 1, 8, 32, 128 concurrent, 128 decoding together everywhere, one untimed pass first.
#
# The agent workload (issue 31), on the smollm2 shape in bf16 at device_models.CONTEXT (32k; AGENT_SHAPE and
# AGENT_DTYPE change the model, e.g. smollm2-mini / float32 for a dry run on a CPU), Pomona on the default
# serve_config.yaml (SSD tier on, a fresh ssd_dir in the run's directory) beside mlx_lm.server's defaults:
# agent:   benchmarks/agent/agent_session.py: the 10-turn agent trace (15-20k-token prompts), both servers up,
#          each turn sent to one then the other (interleaved). ~190 s on the H200; AGENT_TIMEOUT (420 s),
#          AGENT_TURNS (10), AGENT_SERVERS (default pomona,mlx_lm.server; e.g. a third,
#          pomona-set:first_token_read=hits, to A/B one engine setting in the same run). $OUT/agent-<shape>.json, $OUT/logs-agent.tgz.
# path:    benchmarks/agent/serving_path.py, Pomona alone: the agent turns over HTTP, each turn's TTFT split into the
#          engine's, the hops (ingress <-> replica <-> engine process) and the front (proxy, parse, template,
#          tokenize, SSE), twice (the second pass under another cache salt). ~90 s; PATH_TIMEOUT (200 s).
#          $OUT/path-<shape>.json.
# reuse:   benchmarks/harness/side_by_side.py --parts prefix,multiturn: prefix repetition (4 x 2,000-token prefixes,
#          32 requests, 4 concurrent) and multi-turn (4 conversations x 8 turns), both servers one after the
#          other, one untimed warm pass at 1 and 4 first. ~150 s a server pair, and 90-120 s for each Pomona to serve on a fresh machine (H100, session 26); REUSE_TIMEOUT (420 s).
#          $OUT/reuse-<shape>.json, $OUT/logs-reuse.tgz.
# prefixpart: benchmarks/engine/prefix_part.py: the reuse part's prefix workload through the engine in process, each
#          warm request's TTFT split by the step log (to admission, the admitting step, the steps after it);
#          PREFIXPART_VARIANTS (space-separated NAME:KEY=VALUE,... engine settings; default "default:"),
#          PREFIXPART_PYSPY=1: under py-spy, Python frames at 100 Hz ($OUT/prefixpart.pyspy; --native stalled the
#          engine on the H200: it never got ready within 240 s).
#          ~30 s a variant; PREFIXPART_TIMEOUT (240 s). $OUT/prefixpart.log.
# ssd:     benchmarks/engine/ssd_growth.py, Pomona alone: SSD bytes left by one conversation growing ~250 tokens a
#          turn for 8 turns over its final KV size (/admin/cache's ssd.bytes), then the chunk gaps of 4
#          decoding streams while a 15k-token turn is prefilled and persisted. ~100 s; SSD_TIMEOUT (210 s),
#          SSD_FLAGS (ssd_growth flags; default --fixed-replies: a random model's 64-token reply re-tokenizes
#          to ~500 tokens, so each turn re-sends a fixed 64-token text instead, as ~250 tokens a turn needs).
#          $OUT/ssd-<shape>.json, $OUT/logs-ssd.tgz.
# breakdown: benchmarks/agent/agent_breakdown.py under py-spy (the agent trace's turns in process, twice: the
#          second pass under another cache salt, its shapes seen before). $OUT/breakdown.json, .pyspy.
#          BREAKDOWN_FLAGS (e.g. "--engine cudnn_attention=true"), BREAKDOWN_TAG (a suffix for its files),
#          BREAKDOWN_PYSPY=0 (no py-spy).
# spec:    benchmarks/engine/speculative.py (issue 34): speculation off / on in process on a real model
#          (SPEC_MODEL, default /tmp/models/smollm2-real: the default model's directory, carried), code-edit,
#          random and agent workloads at 1, 8, 32 (SPEC_LEVELS, SPEC_WORKLOADS, SPEC_ON, SPEC_TOKENS; SPEC_FLAGS, e.g.
#          "--repeats 2 --alone 8": warm shapes, and batched greedy output against each prompt alone), each workload in
#          a process of its own within SPEC_TIMEOUT. $OUT/spec$SPEC_TAG-<workload>.log.
# restore: benchmarks/engine/restore_stall.py on the agent model: an SSD hit after a restart, a second one, then a RAM
#          hit of a RESTORE_TOKENS-token prompt (15000) beside two decoding streams; its last line is what the
#          engine learned of SSD reads against prefills (`cache.ssd_reads`). ~60 s; RESTORE_TIMEOUT (240 s).
#          $OUT/restore_stall.log.
# goals:   benchmarks/device/device_goals.py: the issue's ratios from whichever of those files $OUT holds (each
#          part also prints its own). Each part runs under `timeout -s INT -k 45` (on the interrupt the
#          benchmark stops its servers and keeps what it measured) and reports its time as "[part] N s".
#          Three calls of <= 10 minutes: `agent` (worst 420 + 45 s), then `reuse` (420 + 45 s), then `ssd,goals` (210 + 45 s).
# Environment: SIDE_TAG: a suffix for the 1b/smollm2 parts' files (two runs in one call). NO_SSD=1 runs without the SSD tier (serve_config.yaml's ssd_dir: null) everywhere; SERVERS,
# LEVELS (concurrencies) and SIDE_FLAGS (e.g. --no-bare) narrow the side by side.
# Results: $OUT/token_path.json, $OUT/side-<model>.json, $OUT/logs-<model>.tgz (few files: $OUT takes 8).
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
export RAY_memory_monitor_refresh_ms=0   # MemTotal starts small on these VMs and grows: no OOM killer
OUTDIR=${OUT:-/tmp/out}; mkdir -p "$OUTDIR"
if [ -x /tmp/site/bin/ray ]; then  # the servers the benchmarks start run .venv/bin/ray and .venv/bin/serve
  mkdir -p .venv/bin && ln -sf /tmp/site/bin/ray .venv/bin/ray && ln -sf /tmp/site/bin/serve .venv/bin/serve
fi
cat REVISION 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
SHAPE=${AGENT_SHAPE:-smollm2} DTYPE=${AGENT_DTYPE:-bfloat16}
AGENT_PORT=${AGENT_PORT:-18140} REUSE_PORT=${REUSE_PORT:-18100} SSD_PORT=${SSD_PORT:-18160}
agent_model() {  # the random $SHAPE model in $DTYPE at device_models.CONTEXT, built once per lease, and again
  # whenever device_models.py changed since (a directory an older harness built, e.g. one whose tokenizer
  # spelled ChatML's markers out, must not be measured: it is marked with the builder's hash)
  local dir=/tmp/models/$SHAPE-$DTYPE sig
  sig=$(cat benchmarks/device/device_models.py benchmarks/device/device_serve_model.py | sha1sum | cut -c1-16) || return 1
  if [ "$(cat "$dir/.built-by" 2>/dev/null)" != "$sig" ]; then
    rm -rf "$dir" && python3 -m benchmarks.device.device_serve_model "$SHAPE" "$dir" --dtype "$DTYPE" >/dev/null || return 1
    echo "$sig" > "$dir/.built-by"
  fi
  echo "$dir"
}
bounded() {  # seconds, command...: SIGINT at the limit (the benchmark stops its servers), SIGKILL 45 s later
  local limit=$1 rc; shift
  timeout -s INT -k 45 "$limit" "$@"; rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "TIMED OUT after $limit s (rc $rc): $*"; fi
  return $rc
}
leftovers() {  # run dir, ports: after a failure, stop by pid what its servers left (they run in their own
  local run=$1 port; shift  # sessions): Ray's daemons and workers, `serve run` (its config is in the run
  for port in "$@"; do      # dir), mlx_lm.server (its port)
    python3 -c "from benchmarks.harness.servers import _stop_marked as s; s('/tmp/pomona-bench-ray-$port'); s('--port $port '); s('$run/')"
  done
}
python3 -c "import ray, mlx.core as mx, mlx_lm, starlette; print('ray', ray.__version__, 'mlx', mx.__version__, mx.default_device(), 'mlx_lm', mlx_lm.__version__, 'starlette', starlette.__version__)"
if [ -n "${NO_SSD:-}" ]; then  # serve_config.yaml without the SSD tier, for the HTTP server and engine_loop alike
  sed -i 's|^\( *ssd_dir:\).*|\1 null|' serve_config.yaml && grep -n "ssd_dir" serve_config.yaml
fi
for what in ${1//,/ }; do
  t0=$(date +%s)
  case $what in
    probe)
      timeout "${PROBE_TIMEOUT:-240}" python3 -m benchmarks.device.token_path --pacing 0,1000,2000 --streams 1,8,32,128 \
        --tokens 256 --num-cpus 16 --json "$OUTDIR/token_path.json" 2>"/tmp/token_path.stderr"
      tail -c 1500 /tmp/token_path.stderr ;;
    hostreads)
      timeout "${HOSTREADS_TIMEOUT:-150}" python3 -m benchmarks.device.host_reads >"$OUTDIR/host_reads.log" \
        2>/tmp/host_reads.stderr || tail -c 1500 /tmp/host_reads.stderr
      grep -v '^{' "$OUTDIR/host_reads.log" ;;
    engine)
      [ -d /tmp/models/1b ] || python3 -m benchmarks.device.device_serve_model 1b /tmp/models/1b >/dev/null
      IFS=',' read -ra variants <<< "${ENGINE_FLAGS-,--no-ssd}"
      # @ENGINE_CPUS@ / @BURN_CPUS@ in a variant: two physical cores (with their SMT siblings) / the rest
      read -r eng_cpus burn_cpus <<< "$(python3 -m benchmarks.device.cpu_topology split 2)"
      echo "cpu topology: $(python3 -m benchmarks.device.cpu_topology show); engine cpus $eng_cpus, burners $burn_cpus"
      for flag in "${variants[@]}"; do   # 128 twice: the first pass compiles the shapes
        flag=${flag//@ENGINE_CPUS@/$eng_cpus}; flag=${flag//@BURN_CPUS@/$burn_cpus}
        timeout 300 python3 -m benchmarks.engine.engine_loop /tmp/models/1b --concurrency 32,128,128 --max-running 128 \
          $flag 2>/tmp/engine_loop.stderr | tail -1 | sed "s/^/engine_loop $flag: /" || tail -c 1500 /tmp/engine_loop.stderr
      done ;;
    profile)
      [ -d /tmp/models/1b ] || python3 -m benchmarks.device.device_serve_model 1b /tmp/models/1b >/dev/null
      for v in ${PROFILE_VARIANTS:-default ingress4 throughput}; do
        timeout "${PROFILE_TIMEOUT:-240}" python3 -m benchmarks.device.device_http_profile /tmp/models/1b --variant "$v" \
          --concurrency 128 --seconds 12 2>"/tmp/profile-$v.stderr" || tail -c 1500 "/tmp/profile-$v.stderr"
      done
      tar -czf "$OUTDIR/pyspy.tgz" -C /tmp pyspy ;;
    1b|smollm2)
      python3 -m benchmarks.device.device_serve_model "$what" "/tmp/models/$what" >/dev/null &&
      timeout "${SIDE_TIMEOUT:-500}" python3 -m benchmarks.harness.side_by_side --model "/tmp/models/$what" \
        --servers "${SERVERS:-pomona,mlx_lm.server}" --parts sweep --concurrency "${LEVELS:-1,8,32,128}" --engine \
        --max-batch 128 --warm "${LEVELS:-1,8,32,128}" --docs "" --out "/tmp/side-$what" ${SIDE_FLAGS:-} \
        2>"/tmp/side-$what.stderr"
      mv "/tmp/side-$what.stderr" "/tmp/side-$what/logs/" 2>/dev/null
      cp "/tmp/side-$what/results.json" "$OUTDIR/side-$what${SIDE_TAG:-}.json"
      tar -czf "$OUTDIR/logs-$what${SIDE_TAG:-}.tgz" -C "/tmp/side-$what" logs
      python3 -m benchmarks.device.device_http_report "$OUTDIR/side-$what${SIDE_TAG:-}.json" ;;
    spec)  # issue 34: speculation off / on, engine in process, on a real model ($SPEC_MODEL: SmolLM2-135M-
      # Instruct as Pomona serves it, 4-bit; its context raised to 16k for the agent turns, 5-8k tokens).
      # SPEC_ON's default is quoted: an unquoted } in it would end the ${...:-} early.
      # A process per workload, within one SPEC_TIMEOUT: one workload's fault (session 28: the agent turns
      # at 8 streams ran the device out of memory, and the process aborted) keeps the others' figures.
      deadline=$(( $(date +%s) + ${SPEC_TIMEOUT:-360} ))
      IFS=, read -ra spec_works <<< "${SPEC_WORKLOADS:-code-edit,random,agent}"
      for w in "${spec_works[@]}"; do
        left=$(( deadline - $(date +%s) ))
        [ "$left" -gt 30 ] || { echo "[spec] no time left for $w"; break; }
        bounded "$left" python3 -m benchmarks.engine.speculative "${SPEC_MODEL:-/tmp/models/smollm2-real}" \
          --concurrency "${SPEC_LEVELS:-1,8,32}" --workloads "$w" \
          --spec "${SPEC_ON:-"{method: prompt_lookup}"}" --max-tokens "${SPEC_TOKENS:-300}" ${SPEC_FLAGS:-} \
          >"$OUTDIR/spec${SPEC_TAG:-}-$w.log" 2>"/tmp/spec-$w.stderr" || tail -c 2000 "/tmp/spec-$w.stderr"
        grep -v '^{' "$OUTDIR/spec${SPEC_TAG:-}-$w.log"
      done ;;
    agent)
      M=$(agent_model) || { echo "[agent] could not build the $SHAPE model"; continue; }
      run=/tmp/agent-$SHAPE; rm -rf "$run"; mkdir -p "$run/logs"
      bounded "${AGENT_TIMEOUT:-420}" python3 -m benchmarks.agent.agent_session --model "$M" --servers "${AGENT_SERVERS:-pomona,mlx_lm.server}" \
        --order interleaved --turns "${AGENT_TURNS:-10}" --base-port "$AGENT_PORT" --docs "" --out "$run" \
        2>"$run/logs/agent_session.stderr" || { tail -c 2000 "$run/logs/agent_session.stderr"
                                              leftovers "$run" "$AGENT_PORT" $((AGENT_PORT + 1)) $((AGENT_PORT + 2)); }
      cp "$run/results.json" "$OUTDIR/agent-$SHAPE.json" 2>/dev/null
      tar -czf "$OUTDIR/logs-agent.tgz" -C "$run" logs
      python3 -m benchmarks.device.device_goals --shape "$SHAPE" --agent "$OUTDIR/agent-$SHAPE.json" --only-given ;;
    path)
      M=$(agent_model) || { echo "[path] could not build the $SHAPE model"; continue; }
      bounded "${PATH_TIMEOUT:-200}" python3 -m benchmarks.agent.serving_path "$M" --passes 2 --port "$AGENT_PORT" \
        --out "$OUTDIR/path-$SHAPE.json" 2>/tmp/serving_path.stderr || tail -c 2000 /tmp/serving_path.stderr ;;
    breakdown)  # the agent turns in process (benchmarks/agent/agent_breakdown.py) under py-spy: where a turn goes
      M=$(agent_model) || { echo "[breakdown] could not build the $SHAPE model"; continue; }
      spy=(py-spy record -r 200 --threads -f raw -o "$OUTDIR/breakdown${BREAKDOWN_TAG:-}.pyspy" --)
      [ "${BREAKDOWN_PYSPY:-1}" = 0 ] && spy=()
      # shellcheck disable=SC2086
      bounded "${BREAKDOWN_TIMEOUT:-240}" "${spy[@]}" \
        python3 -m benchmarks.agent.agent_breakdown "$M" --passes 2 ${BREAKDOWN_FLAGS:-} >"$OUTDIR/breakdown${BREAKDOWN_TAG:-}.json" \
        2>/tmp/breakdown.stderr || tail -c 2000 /tmp/breakdown.stderr
      grep -h "^pass" "$OUTDIR/breakdown${BREAKDOWN_TAG:-}.json" ;;
    reuse)
      M=$(agent_model) || { echo "[reuse] could not build the $SHAPE model"; continue; }
      run=/tmp/reuse-$SHAPE; rm -rf "$run"; mkdir -p "$run/logs"
      bounded "${REUSE_TIMEOUT:-420}" python3 -m benchmarks.harness.side_by_side --model "$M" \
        --servers "${SERVERS:-pomona,mlx_lm.server}" --parts prefix,multiturn --no-bare --warm 1,4 \
        --base-port "$REUSE_PORT" --docs "" --out "$run" 2>"$run/logs/side_by_side.stderr" ||
        { tail -c 2000 "$run/logs/side_by_side.stderr"; leftovers "$run" "$REUSE_PORT" $((REUSE_PORT + 1)); }
      cp "$run/results.json" "$OUTDIR/reuse-$SHAPE.json" 2>/dev/null
      tar -czf "$OUTDIR/logs-reuse.tgz" -C "$run" logs
      python3 -m benchmarks.device.device_goals --shape "$SHAPE" --reuse "$OUTDIR/reuse-$SHAPE.json" --only-given ;;
    prefixpart)
      M=$(agent_model) || { echo "[prefixpart] could not build the $SHAPE model"; continue; }
      vflags=(); for v in ${PREFIXPART_VARIANTS:-default:}; do vflags+=(--variant "$v"); done
      spy=(); [ -n "${PREFIXPART_PYSPY:-}" ] && spy=(py-spy record -r 100 --threads -f raw -o "$OUTDIR/prefixpart.pyspy" --)
      bounded "${PREFIXPART_TIMEOUT:-240}" "${spy[@]}" python3 -m benchmarks.engine.prefix_part "$M" "${vflags[@]}" \
        >"$OUTDIR/prefixpart.log" 2>/tmp/prefixpart.stderr || tail -c 2000 /tmp/prefixpart.stderr
      grep -v '^{' "$OUTDIR/prefixpart.log" ;;
    ssd)
      M=$(agent_model) || { echo "[ssd] could not build the $SHAPE model"; continue; }
      run=/tmp/ssd-$SHAPE; rm -rf "$run"; mkdir -p "$run/logs"
      # shellcheck disable=SC2086
      bounded "${SSD_TIMEOUT:-210}" python3 -m benchmarks.engine.ssd_growth --model "$M" --port "$SSD_PORT" --out "$run" \
        --json "$OUTDIR/ssd-$SHAPE.json" ${SSD_FLAGS---fixed-replies} 2>"$run/logs/ssd_growth.stderr" ||
        { tail -c 2000 "$run/logs/ssd_growth.stderr"; leftovers "$run" "$SSD_PORT"; }
      tar -czf "$OUTDIR/logs-ssd.tgz" -C "$run" logs
      python3 -m benchmarks.device.device_goals --shape "$SHAPE" --ssd "$OUTDIR/ssd-$SHAPE.json" --only-given ;;
    restore)
      M=$(agent_model) || { echo "[restore] could not build the $SHAPE model"; continue; }
      bounded "${RESTORE_TIMEOUT:-240}" python3 -m benchmarks.engine.restore_stall --model "$M" \
        --tokens "${RESTORE_TOKENS:-15000}" >"$OUTDIR/restore_stall.log" 2>/tmp/restore_stall.stderr ||
        tail -c 2000 /tmp/restore_stall.stderr
      grep -v '^{' "$OUTDIR/restore_stall.log" ;;
    goals)
      python3 -m benchmarks.device.device_goals --shape "$SHAPE" --dir "$OUTDIR" ;;
    *) echo "unknown part $what" ;;
  esac
  echo "[$what] $(( $(date +%s) - t0 )) s"
done
