#!/usr/bin/env bash
# GPU container entry point: build the TensorRT plan for this GPU unless one is mounted, then
# run the worker on it. Arguments are passed on to `keyword-embedder run`.
#
# Environment (besides the worker's own KWE_* settings):
#   KWE_ENGINE_PATH      where the plan is read from or built to (default /engines/model.plan)
#   KWE_PROFILE          bucket profile of the plan (default gpu; 'auto' means gpu here)
#   REBUILD_ENGINE=1     build even when a plan is present (after a TensorRT or GPU change)
#   BUILD_ENGINE_ARGS    extra arguments for `keyword-embedder build-engine`, word-split
#
# A present plan is used as is: the worker checks its sidecar (GPU, TensorRT version, ONNX
# hash, buckets) at load and exits naming the rebuild command when it does not fit.
set -euo pipefail

engine="${KWE_ENGINE_PATH:-/engines/model.plan}"
profile="${KWE_PROFILE:-gpu}"
[[ "$profile" == "auto" ]] && profile=gpu

if [[ ! -s "$engine" || "${REBUILD_ENGINE:-0}" == "1" ]]; then
  echo "gpu-entrypoint: building the TensorRT plan $engine (profile $profile); this takes minutes" >&2
  mkdir -p "$(dirname "$engine")"
  # Build beside the target and rename: a container killed mid-build must not leave a
  # truncated plan that the next start would take for a mounted one.
  tmp="$engine.tmp.$$"
  # shellcheck disable=SC2086  # BUILD_ENGINE_ARGS is word-split on purpose
  keyword-embedder build-engine --profile "$profile" --output "$tmp" ${BUILD_ENGINE_ARGS:-}
  [[ -f "$tmp.json" ]] && mv -f "$tmp.json" "$engine.json"
  mv -f "$tmp" "$engine"
else
  echo "gpu-entrypoint: using the plan at $engine" >&2
fi

# exec: the worker becomes PID 1 and gets SIGTERM directly, which starts its drain.
exec keyword-embedder run --backend tensorrt --engine-path "$engine" --profile "$profile" "$@"
