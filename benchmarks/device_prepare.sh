#!/usr/bin/env bash
# Prepare the device run of benchmarks/device_bench.py on a lent NVIDIA machine (MLX's CUDA backend).
#
# The device image has no MLX and no network. mlx-cuda-13's wheel (~90 MB) is over the 64 MiB one
# `run` call carries, so it travels in two parts, in two calls, the machine staying warm between them
# (30 s): call 1 stashes part one and the mlx wheel in /root/stash; call 2 carries part two, the
# mlx-lm wheel and a snapshot of Pomona's code, joins, installs into /tmp/site and runs.
#
#   benchmarks/device_prepare.sh [DIR]      # DIR defaults to .device_wheels (git-ignored here)
#
# Afterwards DIR/a holds part one + mlx; DIR/b holds part two + mlx-lm + DIR/b/src, the committed
# tree (git archive HEAD) with the working tree's benchmarks/device_*.py. The two `run` calls
# are printed at the end (docs/accelerators.md explains them).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
DIR=${1:-.device_wheels}
PY=${PY:-.venv/bin/python}
grep -qx "/$DIR/" .git/info/exclude 2>/dev/null || echo "/$DIR/" >> .git/info/exclude

mkdir -p "$DIR/a" "$DIR/b"
for spec in mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2; do
  "$PY" -m pip download -q --python-version 3.12 --platform manylinux_2_35_x86_64 \
    --only-binary=:all: --no-deps -d "$DIR" "$spec"
done
CUDA_WHL=$(cd "$DIR" && ls mlx_cuda_13-0.32.4-*.whl)
rm -f "$DIR"/a/part.* "$DIR"/b/part.*
split -b 46000000 "$DIR/$CUDA_WHL" "$DIR/b/part."
mv "$DIR/b/part.aa" "$DIR/a/"
cp "$DIR"/mlx-0.32.4-*.whl "$DIR/a/"
cp "$DIR"/mlx_lm-0.32.2-*.whl "$DIR/b/"
(cd "$DIR" && sha256sum "$CUDA_WHL") > "$DIR/b/cuda.sha256"

rm -rf "$DIR/b/src" && mkdir -p "$DIR/b/src"
git archive HEAD engine cache_tiers benchmarks/__init__.py tests pyproject.toml | tar -x -C "$DIR/b/src"
cp benchmarks/device_*.py "$DIR/b/src/benchmarks/"
echo "HEAD $(git rev-parse HEAD) + working-tree benchmarks/device_*.py" > "$DIR/b/src/REVISION"
du -sh "$DIR/a" "$DIR/b"

cat <<EOF

run 1 (carry ["$DIR/a"]):
  mkdir -p /root/stash && cp $DIR/a/* /root/stash/ && ls -l /root/stash && nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv

run 2 (carry ["$DIR/b"]), within 30 s of run 1:
  set -o pipefail; R=\$PWD; cat /root/stash/part.aa \$R/$DIR/b/part.ab > /tmp/$CUDA_WHL && (cd /tmp && sha256sum -c \$R/$DIR/b/cuda.sha256) && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/$CUDA_WHL /root/stash/mlx-0.32.4-*.whl \$R/$DIR/b/mlx_lm-*.whl && cd \$R/$DIR/b/src && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 -m benchmarks.device_bench --repeats 2 --profile 2>&1 | tee \$OUT/device_bench.log
EOF
