#!/usr/bin/env bash
# The README's first command (via `make demo`): starts the local Kafka broker unless one is
# given in KAFKA_BOOTSTRAP_SERVERS, runs `keyword-embedder demo` (topics, two workers, publish
# the shipped sample, read every embedding back, summary), and stops the broker it started.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec bash "$here/with-kafka.sh" keyword-embedder demo "$@"
