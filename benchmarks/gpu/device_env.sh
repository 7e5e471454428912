# Sourced by the GPU scripts (device_run.sh, trt_check.sh, torch_graphs.sh): the repository root as
# working directory, $OUT, PYTHONPATH with .device's libraries (prepare_device.py), PY = the first
# interpreter that can import "$1" (comma-separated modules), and $OUT/host.txt describing the host.
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT="${OUT:-/tmp/kwe-device-out}"; mkdir -p "$OUT"; export OUT
export PYTHONPATH="$PWD/.device/pylibs:$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=python3
for c in .venv/bin/python python3 python /opt/conda/bin/python /usr/bin/python3; do
  if command -v "$c" >/dev/null 2>&1 && "$c" -c "import $1" 2>/dev/null; then PY="$c"; break; fi
done
# Wheels built for one CPython (prepare_device.py: pylibs-cp312) only for that interpreter.
tag="$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
if [ -d ".device/pylibs-$tag" ]; then export PYTHONPATH="$PWD/.device/pylibs-$tag:$PYTHONPATH"; fi
$PY -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || export PYTHONPATH="$PWD/.device/shim:$PYTHONPATH"   # tomllib from tomli
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; $PY --version;
  $PY -m pip list 2>/dev/null | grep -iE "onnx|torch|numpy|cupy|tensorrt|pycuda|safetensors|structlog|tokenizers|orjson"; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
