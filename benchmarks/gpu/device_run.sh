#!/usr/bin/env bash
# One prepared run on the lent GPU machine (see benchmarks/gpu/device_bench.py):
#   run(command="bash benchmarks/gpu/device_run.sh", carry=[".device"])
# .device/ is built locally by benchmarks/gpu/prepare_device.sh. Results land in $OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/kwe-device-out}"; mkdir -p "$OUT"; export OUT
export PYTHONPATH="$PWD/.device/pylibs:$PWD"
# The image's interpreter that has onnxruntime and numpy (python3, or a conda python).
PY=python3
for c in python3 python /opt/conda/bin/python /usr/bin/python3; do
  if command -v "$c" >/dev/null && "$c" -c 'import onnxruntime, numpy' 2>/dev/null; then PY="$c"; break; fi
done
$PY -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || export PYTHONPATH="$PWD/.device/shim:$PYTHONPATH"   # tomllib from tomli
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY --version;
  $PY -m pip list 2>/dev/null | grep -iE "onnx|torch|numpy|cupy|tensorrt|pycuda"; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
timeout "${DEVICE_BENCH_TIMEOUT:-480}" $PY benchmarks/gpu/device_bench.py 2>&1 | tee "$OUT/log.txt"
