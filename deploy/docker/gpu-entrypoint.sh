#!/usr/bin/env bash
# GPU container entry point: make sure a TensorRT plan for this GPU exists, then run the worker
# on it. Arguments are passed on to `keyword-embedder run`.
#
# Worker settings it reads (docs/settings.md):
#   KWE_ENGINE_PATH         where the plan is read from or built to (default /engines/model.plan)
#   KWE_PROFILE             bucket profile of the plan (default gpu; 'auto' means gpu here)
#   KWE_ONNX_PATH           the ONNX export to build from (the image sets its build-time export)
# Its own variables (not worker settings, hence no KWE_ prefix):
#   ENGINE_BUILD            when to build the plan:
#                             if-missing  (default) build when no plan is there or the one there
#                                         does not fit (`build-engine --check`: other GPU, TensorRT,
#                                         ONNX file or buckets), then run the worker
#                             always      build even when a fitting plan is there, then run the worker
#                             never       never build or check; exit 3 with a message when no plan is
#                                         there (Kubernetes' worker container: the init container
#                                         built it, and the worker checks it at load anyway)
#                             only        as if-missing, then exit 0 without running the worker
#                                         (Kubernetes' init container)
#   REBUILD_ENGINE=1        same as ENGINE_BUILD=always (kept for existing setups)
#   ENGINE_BUILD_TIMEOUT_S  the longest a build may take before it is stopped and the container
#                           exits 124 (default 1800); deploy/k8s/overlays/gpu checks the rollout
#                           deadline against it
#   BUILD_ENGINE_ARGS       extra arguments for `keyword-embedder build-engine`, word-split
#
# Signals: the build runs as a child of this script, which traps TERM and INT from its first
# line and passes them on, so `docker stop` or a pod deletion during a build stops it within
# seconds instead of waiting out the grace period; a half-written plan is removed. The worker
# itself is exec'd: it replaces this shell (same PID, PID 1 in a container) and gets the signal
# directly, which starts its drain.
#
# A kept plan (a volume that outlives the container) is checked before it is used, so a GPU,
# driver-stack or image change rebuilds it instead of leaving a worker that refuses to start.
set -euo pipefail

child=""
stop_signal=""
on_signal() {
  stop_signal="$1"
  if [[ -n "$child" ]]; then kill -TERM "$child" 2>/dev/null || true; fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT

say() { echo "gpu-entrypoint: $*" >&2; }

engine="${KWE_ENGINE_PATH:-/engines/model.plan}"
profile="${KWE_PROFILE:-gpu}"
[[ "$profile" == "auto" ]] && profile=gpu
mode="${ENGINE_BUILD:-if-missing}"
[[ "${REBUILD_ENGINE:-0}" == "1" ]] && mode=always
budget="${ENGINE_BUILD_TIMEOUT_S:-1800}"

case "$mode" in
  if-missing|always|never|only) ;;
  *) say "ENGINE_BUILD=$mode is not one of if-missing, always, never, only"; exit 2 ;;
esac
if ! [[ "$budget" =~ ^[1-9][0-9]*$ ]]; then
  say "ENGINE_BUILD_TIMEOUT_S=$budget is not a positive whole number of seconds"; exit 2
fi

onnx_args=()
[[ -n "${KWE_ONNX_PATH:-}" ]] && onnx_args=(--onnx "$KWE_ONNX_PATH")

# Runs "$@" as a child the TERM/INT trap can stop, and sets rc to its exit status. A trapped
# signal interrupts `wait` (status > 128); wait again until the child has really exited.
run_child() {
  "$@" &
  child=$!
  # A signal that came between the fork and the line above found no child to stop (the trap saw
  # child=""): stop it now, or the wait below outlasts the build (seen once in CI, under load).
  if [[ -n "$stop_signal" ]]; then kill -TERM "$child" 2>/dev/null || true; fi
  while :; do
    rc=0
    wait "$child" || rc=$?
    if [[ -z "$stop_signal" ]] || ! kill -0 "$child" 2>/dev/null; then break; fi
  done
  child=""
}

exit_on_signal() {
  say "stopped by SIG$stop_signal $1"
  [[ "$stop_signal" == "INT" ]] && exit 130
  exit 143
}

build_plan() {
  say "building the TensorRT plan $engine (profile $profile, at most ${budget}s); this takes minutes"
  mkdir -p "$(dirname "$engine")"
  # Build beside the target and rename: a container killed mid-build must not leave a
  # truncated plan that the next start would take for a good one.
  tmp="$engine.tmp.$$"
  # shellcheck disable=SC2086  # BUILD_ENGINE_ARGS is word-split on purpose
  run_child timeout --kill-after=30 "$budget" \
    keyword-embedder build-engine --profile "$profile" --output "$tmp" "${onnx_args[@]}" ${BUILD_ENGINE_ARGS:-}
  if [[ -n "$stop_signal" ]]; then
    rm -f "$tmp" "$tmp.json"
    exit_on_signal "during the plan build; nothing was written to $engine"
  fi
  if (( rc != 0 )); then
    rm -f "$tmp" "$tmp.json"
    if (( rc == 124 || rc == 137 )); then
      say "the plan build took longer than ENGINE_BUILD_TIMEOUT_S=${budget}s and was stopped"
      exit 124
    fi
    say "the plan build failed (exit $rc)"
    exit "$rc"
  fi
  [[ -f "$tmp.json" ]] && mv -f "$tmp.json" "$engine.json"
  mv -f "$tmp" "$engine"
  say "plan written to $engine"
}

# 0: the plan at $engine fits this GPU, TensorRT, ONNX file and profile; 1: it must be rebuilt.
plan_fits() {
  run_child keyword-embedder build-engine --profile "$profile" --output "$engine" "${onnx_args[@]}" --check
  [[ -n "$stop_signal" ]] && exit_on_signal "while checking the plan"
  case "$rc" in
    0) return 0 ;;
    1) say "the plan at $engine does not fit (see above): rebuilding it"; return 1 ;;
    *) say "could not check the plan at $engine (exit $rc)"; exit "$rc" ;;
  esac
}

if [[ "$mode" == "never" ]]; then
  if [[ ! -s "$engine" ]]; then
    say "no TensorRT plan at $engine and ENGINE_BUILD=never: it is built by the init container" \
        "(deploy/k8s/overlays/gpu) or by 'keyword-embedder build-engine --output $engine' on this GPU"
    exit 3
  fi
  say "using the plan at $engine"
elif [[ "$mode" == "always" || ! -s "$engine" ]]; then
  build_plan
elif plan_fits; then
  say "using the plan at $engine"
else
  build_plan
fi

if [[ "$mode" == "only" ]]; then
  exit 0
fi
# A signal that arrived after the build finished but before the exec must not be lost.
[[ -n "$stop_signal" ]] && exit_on_signal "before the worker started"
# exec: the worker replaces this shell and gets SIGTERM directly, which starts its drain.
exec keyword-embedder run --backend tensorrt --engine-path "$engine" --profile "$profile" "$@"
