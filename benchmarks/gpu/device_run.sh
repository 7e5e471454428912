#!/usr/bin/env bash
# One prepared run on the lent GPU machine (see benchmarks/gpu/device_bench.py):
#   run(command="bash benchmarks/gpu/device_run.sh", carry=[".device"])
# .device/ is built locally by benchmarks/gpu/prepare_device.py. Results land in $OUT (the lent
# H200's are kept in benchmarks/results/device/).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh" "onnxruntime, numpy"
timeout "${DEVICE_BENCH_TIMEOUT:-480}" $PY -m benchmarks.gpu.device_bench 2>&1 | tee "$OUT/log.txt"
