#!/usr/bin/env bash
# CUDA graphs vs eager PyTorch, bucketed (gpu, cpu profiles) vs monolithic, through the real
# bucketer (benchmarks/gpu/torch_graphs.py). Under 5 minutes on the lent H200; JSON and Markdown
# under $OUT. First run 2026-12-04 on an H200 (benchmarks/results/device/2026-12-04/) with the
# benchmark's own PyTorch backend; it now runs the worker's torch backend, not yet on a GPU. On the
# GPU machine (PyTorch + CUDA, no network), after `python -m benchmarks.gpu.prepare_device` here:
#   run(command="bash benchmarks/gpu/torch_graphs.sh", carry=[".device"], timeout_s=330)
set -u
OUT="${OUT:-/tmp/kwe-torch-graphs}"
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh" "torch, numpy, safetensors, structlog, tokenizers"
timeout "${GRAPHS_TIMEOUT:-290}" $PY -m benchmarks.gpu.torch_graphs 2>&1 | tee "$OUT/torch-graphs.log"
exit "${PIPESTATUS[0]}"
