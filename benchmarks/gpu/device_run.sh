#!/usr/bin/env bash
# The one prepared run of the worker's torch backend on a lent GPU machine, under 6 minutes, every
# result written to $OUT as soon as it is measured (a run cut short keeps what it did):
#   here:  .venv/bin/python -m benchmarks.gpu.prepare_device        # .device/, about 52 MiB
#   there: run(command="bash benchmarks/gpu/device_run.sh", carry=[".device"], timeout_s=360)
# 1. the backend as `run` opens it (the parity gate picks its precision), parity on the golden rows
#    through the worker's tokenizer and Bucketer, and the forward time of every captured graph
#    (benchmarks/gpu/device_check.py: open.json, parity.json, shapes.json);
# 2. bucketed against monolithic, eager and CUDA graphs, through the real Bucketer
#    (benchmarks/gpu/torch_graphs.py: torch-graphs.json, .md);
# 3. the broker-free host path of `run` into the GPU, 1 and 8 processes sharing it, each count
#    also with every process's Python threads held on a CPU of its own, as `run --processes N`
#    does on a GPU (interpreter_cpu auto), paired (benchmarks/host/pipeline_bench.py --backend torch
#    --hold --free: host-path.json, the default (auto: on a GPU backend one process is held where it
#    starts), held by the benchmark, and interpreter_cpu=off; DEVICE_HOST_HOLD=0 leaves the last two out);
# 4. the GPU's utilisation through it all (nvidia-smi every 250 ms: gpu-util.csv), per stage in
#    summary.md. Results are committed under benchmarks/results/device/<date>/ (docs/gpu.md).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh" "torch, numpy, safetensors, structlog, tokenizers"
# The worker's own dependencies that machine lacks (confluent-kafka, prometheus-client, tqdm: the
# pipeline imports them, though no broker is used), carried as wheels and installed out of tree.
if ls .device/wheels/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/kwe-site .device/wheels/*.whl \
    && export PYTHONPATH="/tmp/kwe-site:$PYTHONPATH"
fi
export KWE_MODEL_DIR="${KWE_MODEL_DIR:-$PWD/.device/model}" KWE_CACHE_DIR="${KWE_CACHE_DIR:-/tmp/kwe-cache}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits -lms 250 \
  > "$OUT/gpu-util.csv" 2>/dev/null &
sampler=$!
trap 'kill $sampler 2>/dev/null' EXIT
stage() {  # NAME TIMEOUT_S COMMAND...: runs one stage, its output in $OUT/NAME.log, its span in stages.json
  local name="$1" limit="$2"; shift 2
  case " ${DEVICE_SKIP:-} " in *" $name "*) echo "== $name: skipped (DEVICE_SKIP)"; return;; esac
  local t0; t0=$(date +%s.%N)
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  $PY -m benchmarks.gpu.device_check --stage "$name" "$t0" "$(date +%s.%N)" "$rc"
  echo "== $name: exit $rc"; tail -n 5 "$OUT/$name.log"
}
timeout 90 $PY -m benchmarks.gpu.device_check 2>&1 | tee "$OUT/check.log"
GRAPHS_ROUNDS="${GRAPHS_ROUNDS:-3}" GRAPHS_LIMIT="${GRAPHS_LIMIT:-10000}" stage torch-graphs 60 \
  $PY -m benchmarks.gpu.torch_graphs
# shellcheck disable=SC2086  # the process counts are words
stage host-path 190 $PY -m benchmarks.host.pipeline_bench --backend torch --processes ${DEVICE_HOST_PROCESSES:-1 8} \
  --rounds "${DEVICE_HOST_ROUNDS:-2}" -n "${DEVICE_HOST_N:-200000}" --warmup "${DEVICE_HOST_WARMUP:-3000}" \
  --warmup-s "${DEVICE_HOST_WARMUP_S:-1.5}" $([ "${DEVICE_HOST_HOLD:-1}" = 0 ] || echo --hold --free) \
  --setting "model_dir=$KWE_MODEL_DIR" ${KWE_PROFILES_FILE:+--setting "profiles_file=$KWE_PROFILES_FILE"} \
  --json "$OUT/host-path.json"
kill $sampler 2>/dev/null
$PY -m benchmarks.gpu.device_check --summary
