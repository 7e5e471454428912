#!/usr/bin/env bash
# A real Confluent-compatible Schema Registry on 127.0.0.1 for development and tests: Apicurio
# Registry (in-memory storage), whose ccompat API (/apis/ccompat/v7) is what confluent-kafka's
# SchemaRegistryClient speaks. Needs only Java 17+ and Maven, like kafka.sh.
#
#   deploy/local/registry.sh start    start (or reuse) it; last line:
#                                     SCHEMA_REGISTRY_URL=http://127.0.0.1:PORT/apis/ccompat/v7
#   deploy/local/registry.sh stop     stop it and wait until its JVM is gone
#   deploy/local/registry.sh status   exit 0 and print the URL when it runs, exit 1 otherwise
#   deploy/local/registry.sh app      print the unpacked app's folder (fetching it first)
#
# Environment:
#   REGISTRY_PORT       HTTP port (default: a free one)
#   KWE_REGISTRY_HOME   state folder (default: ~/.cache/keyword-embedder/registry); the unpacked app
#                       under it survives between runs; the registry's schemas do not (in memory)
#   KWE_REGISTRY_RUN    the registry's own folder (logs, pid, port; default: $KWE_REGISTRY_HOME/run),
#                       so that a second registry can run beside the first with the same app
#   APICURIO_VERSION    the Apicurio Registry release from Maven Central (default 3.0.9; 3.3+ needs Java 21)
set -euo pipefail

version="${APICURIO_VERSION:-3.0.9}"
home="${KWE_REGISTRY_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/keyword-embedder/registry}"
run="${KWE_REGISTRY_RUN:-$home/run}"
pidfile="$run/registry.pid"
portfile="$run/registry.port"
api="/apis/ccompat/v7"

die() { echo "registry.sh: $*" >&2; exit 1; }
log() { echo "registry.sh: $*" >&2; }

# need_java, port_busy, free_port, stop_and_wait
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The app is unpacked once per version and kept: a second start needs no network.
app_dir() { echo "$home/apicurio-registry-app-$version"; }

resolve_app() {
  local dir tmp
  dir="$(app_dir)"
  if [[ -f "$dir/.complete" ]]; then echo "$dir"; return; fi
  command -v mvn >/dev/null 2>&1 || die "Maven is required to fetch Apicurio Registry but 'mvn' is not on PATH (Debian: apt-get install maven)"
  log "fetching Apicurio Registry $version (io.apicurio:apicurio-registry-app, about 100 MB) with Maven into $dir"
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  # dependency:copy and then tar, not dependency:unpack: Maven's unarchiver misreads this archive's
  # PAX headers (it writes them out as 28-byte files in place of the jars).
  # From inside $tmp: without a pom, Maven's project folder is the working directory.
  if ! (cd "$tmp" && mvn -q -B dependency:copy -Dartifact="io.apicurio:apicurio-registry-app:$version:tar.gz:all" \
      -DoutputDirectory="$tmp" >"$tmp.log" 2>&1); then
    tail -n 30 "$tmp.log" >&2
    rm -rf "$tmp"
    die "Maven could not fetch io.apicurio:apicurio-registry-app:$version:tar.gz:all (see above)"
  fi
  tar -xzf "$tmp/apicurio-registry-app-$version-all.tar.gz" -C "$tmp" || { rm -rf "$tmp"; die "unpacking the Apicurio archive failed"; }
  rm -f "$tmp/apicurio-registry-app-$version-all.tar.gz"
  [[ -f "$tmp/apicurio-registry-app-$version-runner.jar" && -d "$tmp/lib" ]] \
    || { rm -rf "$tmp"; die "the Apicurio archive has no apicurio-registry-app-$version-runner.jar beside lib/"; }
  ln -sfn "apicurio-registry-app-$version-runner.jar" "$tmp/runner.jar"
  touch "$tmp/.complete"
  rm -rf "$dir"; mv "$tmp" "$dir"; rm -f "$tmp.log"
  echo "$dir"
}

running_pid() {
  [[ -f "$pidfile" ]] || return 1
  local pid; pid="$(cat "$pidfile")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && grep -q "apicurio-registry" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

url() { echo "http://127.0.0.1:$1$api"; }

# A real API round trip (GET /subjects answers a JSON list), not just an open port: Quarkus opens
# the port before the registry's storage is ready, and Apicurio logs no "started" line to wait for.
api_ok() {
  local body
  body="$(timeout 5 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$0"; printf "GET %s/subjects HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n" "$1" >&3; cat <&3' "$1" "$api" 2>/dev/null)" || return 1
  [[ "$body" == "HTTP/1."*" 200"* && "${body##*$'\r\n\r\n'}" == \[* ]]
}

cmd_start() {
  need_java
  local pid port
  if pid="$(running_pid)"; then
    port="$(cat "$portfile")"
    if api_ok "$port"; then
      log "reusing the registry already running (pid $pid)"
      echo "SCHEMA_REGISTRY_URL=$(url "$port")"
      return 0
    fi
    log "registry pid $pid does not answer; restarting it"
    cmd_stop
  fi
  local app
  app="$(resolve_app)"
  port="${REGISTRY_PORT:-$(free_port)}"
  port_busy "$port" && die "port $port on 127.0.0.1 is already in use"
  rm -rf "$run"; mkdir -p "$run"
  log "starting Apicurio Registry $version on 127.0.0.1:$port"
  # setsid: the registry outlives the shell that started it (tests, CI steps) until 'stop'.
  # C1 only and a small heap: it serves a few test schemas (RSS about 200 MB).
  ( cd "$run" && exec setsid java -Xmx256m -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \
      -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$port" -Dquarkus.log.console.json=false \
      -jar "$app/runner.jar" >"$run/registry.log" 2>&1 < /dev/null ) &
  pid=$!
  echo "$pid" >"$pidfile"
  echo "$port" >"$portfile"
  local deadline=$(( SECONDS + 120 ))
  until api_ok "$port"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 40 "$run/registry.log" >&2 2>/dev/null || true
      rm -f "$pidfile"
      die "the registry exited during start (log above, full log in $run)"
    fi
    (( SECONDS < deadline )) || { cmd_stop; die "the registry did not answer GET $api/subjects within 120 s (log in $run)"; }
    sleep 0.5
  done
  log "registry ready (pid $pid, log in $run)"
  echo "SCHEMA_REGISTRY_URL=$(url "$port")"
}

cmd_stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$pidfile"
    log "no registry of ours is running"
    return 0
  fi
  stop_and_wait "$pid" "$pidfile" registry
}

cmd_status() {
  local pid
  if pid="$(running_pid)"; then
    echo "running: pid $pid, SCHEMA_REGISTRY_URL=$(url "$(cat "$portfile")")"
  else
    echo "not running"; return 1
  fi
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  app) need_java; resolve_app ;;
  *) echo "usage: $0 start|stop|status|app" >&2; exit 2 ;;
esac
