#!/usr/bin/env bash
# CUDA graphs vs eager PyTorch, bucketed (gpu, cpu profiles) vs monolithic, through the real
# bucketer (benchmarks/gpu/torch_graphs.py). Under 5 minutes on the lent H200; JSON and Markdown
# under $OUT. NOT YET RUN. On the GPU machine (PyTorch + CUDA, no network), after
# `python benchmarks/gpu/prepare_device.py` here:
#   run(command="bash benchmarks/gpu/torch_graphs.sh", carry=[".device"], timeout_s=330)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/kwe-torch-graphs}"; mkdir -p "$OUT"; export OUT
export PYTHONPATH="$PWD/.device/pylibs:$PWD"
PY=python3
for c in python3 python /opt/conda/bin/python /usr/bin/python3; do
  if command -v "$c" >/dev/null && "$c" -c 'import torch, onnx, numpy' 2>/dev/null; then PY="$c"; break; fi
done
$PY -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || export PYTHONPATH="$PWD/.device/shim:$PYTHONPATH"   # tomllib from tomli
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY --version;
  $PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
timeout "${GRAPHS_TIMEOUT:-290}" $PY benchmarks/gpu/torch_graphs.py 2>&1 | tee "$OUT/torch-graphs.log"
exit "${PIPESTATUS[0]}"
