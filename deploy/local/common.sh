# Shell functions shared by the local services' scripts (kafka.sh, registry.sh); sourced, not run.
# The sourcing script defines die() first (its own name in the message).

need_java() {
  command -v java >/dev/null 2>&1 || die "Java 17+ is required but 'java' is not on PATH (Debian: apt-get install openjdk-17-jre-headless)"
  local v
  v="$(java -version 2>&1 | head -n1 | sed -E 's/.*version "([0-9]+).*/\1/')"
  [[ "$v" =~ ^[0-9]+$ ]] && (( v >= 17 )) || die "Java 17+ is required, found: $(java -version 2>&1 | head -n1)"
}

# Ports below the kernel's ephemeral range: a client that keeps reconnecting to a stopped broker's
# port inside that range can be given that very port as its source port and connect to itself (TCP
# simultaneous open); the restarted broker then fails with "Address already in use".
port_range_top() {
  local low
  low="$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || true)"
  [[ "$low" =~ ^[0-9]+$ ]] && (( low > 21000 )) || low=32768
  echo "$low"
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# A free port on 127.0.0.1, or wherever BUSY (a function: port_busy, kafka.sh's node_busy) looks.
free_port() {
  local busy="${1:-port_busy}" p top; top="$(port_range_top)"
  for _ in $(seq 1 200); do
    p=$(( 20000 + RANDOM % (top - 20000) ))
    "$busy" "$p" || { echo "$p"; return; }
  done
  die "no free port found"
}

# Stops the process of `pidfile` (SIGTERM, SIGKILL after 30 s) and waits until it is gone.
# $1: the pid, $2: the pid file, $3: what it is, for the log lines.
stop_and_wait() {
  local pid="$1" pidfile="$2" what="$3"
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$(( SECONDS + 30 ))
  while kill -0 "$pid" 2>/dev/null; do
    if (( SECONDS >= deadline )); then log "$what did not stop in 30 s; killing it"; kill -KILL "$pid" 2>/dev/null || true; fi
    sleep 0.2
  done
  rm -f "$pidfile"
  log "$what stopped (pid $pid)"
}
