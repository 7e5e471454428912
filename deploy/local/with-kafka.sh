#!/usr/bin/env bash
# Runs a command with a real local broker: reuses KAFKA_BOOTSTRAP_SERVERS when set, otherwise starts
# the broker with kafka.sh, exports its address, runs the command, and stops the broker it started
# whatever the command's outcome. Exits with the command's status.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
started=0
if [[ -z "${KAFKA_BOOTSTRAP_SERVERS:-}" ]]; then
  if ! bash "$here/kafka.sh" status >/dev/null 2>&1; then started=1; fi
  line="$(bash "$here/kafka.sh" start | tail -n 1)" || { echo "with-kafka.sh: could not start the broker" >&2; exit 1; }
  export "${line?}"
  echo "with-kafka.sh: using the local broker at $KAFKA_BOOTSTRAP_SERVERS" >&2
fi
stop() { if (( started )); then bash "$here/kafka.sh" stop; fi; }
trap stop EXIT
trap 'exit 130' INT TERM
"$@"
