#!/usr/bin/env bash
# A real single-node Apache Kafka 4.x broker (KRaft, combined broker+controller) on 127.0.0.1,
# for development, tests and the demo. Needs only Java 17+ and Maven.
#
#   deploy/local/kafka.sh start    start (or reuse) the broker; last line: KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:PORT
#   deploy/local/kafka.sh stop     stop it and wait until its JVM is gone
#   deploy/local/kafka.sh status   exit 0 and print the address when it runs, exit 1 otherwise
#   deploy/local/kafka.sh restart [--hard] [--down-for SECONDS]
#                                  stop (SIGTERM, or SIGKILL with --hard) and start again on the same
#                                  port with the same data: a broker restart as clients see it;
#                                  --down-for keeps it down that long first (an outage)
#   deploy/local/kafka.sh libs     print the classpath folder (resolving the jars first)
#   deploy/local/kafka.sh topics ARGS...
#                                  Kafka's own kafka-topics.sh (org.apache.kafka.tools.TopicCommand) run from
#                                  those jars, for a machine without a Kafka distribution, e.g.
#                                  topics --bootstrap-server HOST:PORT --create --topic T --partitions 6
#                                  (and --describe, --delete, --list: the same arguments as kafka-topics.sh)
#   deploy/local/kafka.sh groups ARGS...
#                                  Kafka's own kafka-consumer-groups.sh (ConsumerGroupCommand), the same way, e.g.
#                                  groups --bootstrap-server HOST:PORT --describe --group G (LAG per partition),
#                                  --delete --group G, --list
#
#   --brokers N (with start): a cluster of N KRaft nodes (combined broker+controller, node ids 1..N,
#   one static controller quorum) in $KWE_KAFKA_RUN/node-I, with default.replication.factor=N
#   (at most 3), min.insync.replicas=2 and the internal topics (offsets, transactions) replicated the
#   same way. Its last line is KAFKA_BOOTSTRAP_SERVERS=HOST:P1,HOST:P2,...; 'status' lists each node,
#   'stop' stops them all; 'restart --node I [--hard] [--down-for S]' restarts one node on its own
#   ports with its own data (the others keep serving). A run folder holds either one broker or one
#   cluster: give the cluster a KWE_KAFKA_RUN of its own.
#
#   --secure (with start, stop, status, restart): a second, secured broker of its own: one SASL_SSL
#   listener (SCRAM-SHA-512 users made at format time, a local CA and broker certificate), an mTLS
#   controller listener, the StandardAuthorizer with the ACLs of docs/security.md; all on 127.0.0.1. Its start
#   prints KAFKA_SECURE_CONFIG_DIR=DIR (ca.pem and one librdkafka properties file per user: admin,
#   worker, producer, reader, intruder) and then KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:PORT as the last
#   line. Passwords are random per fresh start. Needs openssl as well (the CA and certificate).
#
# Environment:
#   KAFKA_PORT         listener port (default: a free one)
#   KWE_KAFKA_HOME     state folder (default: ~/.cache/keyword-embedder/kafka); the jar cache under it
#                      survives between runs, the broker's data is wiped at each fresh start
#   KWE_KAFKA_RUN      the broker's own folder (config, data, logs, pid; default: $KWE_KAFKA_HOME/run),
#                      so that a second broker can run beside the first with the same jar cache
#   KWE_KAFKA_SECURE_RUN  the secured broker's folder (default: "$KWE_KAFKA_RUN-secure", i.e. beside the
#                      plain one); its client files are in $KWE_KAFKA_SECURE_RUN/client
#   KAFKA_SECURE_PORT  the secured broker's SASL_SSL port (default: a free one)
#   KAFKA_HEAP_OPTS    JVM heap (default: -Xms256m -Xmx768m; a cluster's nodes: -Xms128m -Xmx384m each)
#   KAFKA_HOST         the address a cluster's nodes listen on and advertise (default 127.0.0.1)
#   KWE_KAFKA_NETNS    a network namespace (made by the caller, 'ip netns add') that a cluster's nodes
#                      and this script's probes run in; with KAFKA_HOST set to an address of that
#                      namespace, clients elsewhere reach the cluster only over the links given to it
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
home="${KWE_KAFKA_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/keyword-embedder/kafka}"
run="${KWE_KAFKA_RUN:-$home/run}"
secure=0
brokers=0
args=()
while (( $# )); do
  case "$1" in
    --secure) secure=1 ;;
    --brokers) brokers="${2:?--brokers needs a count}"; shift ;;
    *) args+=("$1") ;;
  esac
  shift
done
set -- "${args[@]+"${args[@]}"}"
if (( secure )); then
  run="${KWE_KAFKA_SECURE_RUN:-$run-secure}"
fi
pidfile="$run/broker.pid"
portfile="$run/broker.port"

die() { echo "kafka.sh: $*" >&2; exit 1; }
log() { echo "kafka.sh: $*" >&2; }

# need_java, port_busy, free_port, stop_and_wait
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The jars are resolved once per pom.xml content and kept: a second start needs no network.
libs_dir() {
  local key
  key="$(sha256sum "$here/pom.xml" | cut -c1-16)"
  echo "$home/libs-$key"
}

resolve_libs() {
  local dir tmp
  dir="$(libs_dir)"
  if [[ -f "$dir/.complete" ]]; then echo "$dir"; return; fi
  command -v mvn >/dev/null 2>&1 || die "Maven is required to fetch the Kafka jars but 'mvn' is not on PATH (Debian: apt-get install maven)"
  log "resolving Apache Kafka jars with Maven into $dir"
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"; mkdir -p "$tmp"
  if ! mvn -q -B -f "$here/pom.xml" dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$tmp" >"$tmp.log" 2>&1; then
    tail -n 30 "$tmp.log" >&2
    die "Maven could not resolve the Kafka jars (see above)"
  fi
  touch "$tmp/.complete"
  rm -rf "$dir"; mv "$tmp" "$dir"; rm -f "$tmp.log"
  echo "$dir"
}

running_pid() {
  [[ -f "$pidfile" ]] || return 1
  local pid; pid="$(cat "$pidfile")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && grep -q "kafka.Kafka" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}

# A real metadata round trip (ApiVersions + Metadata through the admin client), not just an open port.
metadata_ok() {
  local port="$1" libs; libs="$(libs_dir)"
  local auth=()
  (( secure )) && auth=(--command-config "$run/admin-java.properties")
  timeout 30 java -Xmx128m -XX:TieredStopAtLevel=1 -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" \
    org.apache.kafka.tools.TopicCommand --bootstrap-server "127.0.0.1:$port" "${auth[@]}" --list >/dev/null 2>&1
}

write_configs() {
  local port="$1" cport="$2"
  mkdir -p "$run/data"
  if (( secure )); then write_secure_server_config "$port" "$cport"; else
  cat >"$run/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$cport
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$run/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Tests create many groups; make a new group's first join fast.
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
log.retention.hours=24
log.segment.bytes=67108864
PROPS
  fi
  cat >"$run/log4j2.properties" <<'L4J'
status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = file
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
L4J
  cat >"$run/log4j2-tools.properties" <<'L4J'
status = error
appender.err.type = Console
appender.err.name = err
appender.err.target = SYSTEM_ERR
appender.err.layout.type = PatternLayout
appender.err.layout.pattern = %p %m%n
rootLogger.level = WARN
rootLogger.appenderRef.err.ref = err
L4J
}


# ---------------------------------------------------------------------------------- secured broker
# The users of the ACLs of docs/security.md; 'intruder' is not a user: its file has worker's name and a wrong password.
users=(admin worker producer reader)

need_openssl() {
  command -v openssl >/dev/null 2>&1 || die "--secure needs 'openssl' on PATH (Debian: apt-get install openssl)"
}

# A CA and a broker certificate for 127.0.0.1/localhost signed by it, in $run/tls; ca.pem also goes to
# the client folder. The broker's key sits in a PKCS12 keystore; the CA is a PEM truststore.
make_certs() {
  local tls="$run/tls" client="$run/client"
  mkdir -p "$tls" "$client"
  ( cd "$tls"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 30 -subj "/CN=keyword-embedder local CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
    openssl req -newkey rsa:2048 -nodes -keyout broker.key -out broker.csr -subj "/CN=kwe-broker"
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' >broker.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out broker.pem -days 30 -extfile broker.ext
    openssl pkcs12 -export -in broker.pem -inkey broker.key -certfile ca.pem -name broker -out broker.p12 \
      -passout "pass:$(cat "$run/secrets/keystore")"
  ) >"$run/tls.log" 2>&1 || { cat "$run/tls.log" >&2; die "making the CA and broker certificate with openssl failed"; }
  cp "$tls/ca.pem" "$client/ca.pem"
}

make_passwords() {
  mkdir -p "$run/secrets"; chmod 700 "$run/secrets"
  local u
  for u in "${users[@]}" keystore intruder; do openssl rand -hex 16 >"$run/secrets/$u"; done
}

# One librdkafka properties file per user (what --kafka-config-file reads), plus the admin's
# Java client config for the Kafka tools.
write_client_files() {
  local client="$run/client" u name pw
  mkdir -p "$client"; chmod 700 "$client"
  for u in "${users[@]}" intruder; do
    name="$u"; pw="$(cat "$run/secrets/$u")"
    [[ "$u" == intruder ]] && name=worker   # a real user name with a password that is not its own
    ( umask 077
      cat >"$client/$u.properties" <<PROPS
# $u on the local secured broker (deploy/local/kafka.sh start --secure); librdkafka properties
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.username=$name
sasl.password=$pw
ssl.ca.location=$client/ca.pem
PROPS
    )
  done
  ( umask 077
    cat >"$run/admin-java.properties" <<PROPS
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(cat "$run/secrets/admin")";
ssl.truststore.type=PEM
ssl.truststore.location=$client/ca.pem
PROPS
  )
}

write_secure_server_config() {
  local port="$1" cport="$2"
  ( umask 077
    cat >"$run/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:$cport
# Clients: SASL_SSL only. Controller: TLS with client certificates (SCRAM cannot guard the
# controller, whose metadata log holds the SCRAM credentials); only the broker's cert is signed.
listeners=SASL_SSL://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=SASL_SSL://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:SSL,SASL_SSL:SASL_SSL
inter.broker.listener.name=SASL_SSL
sasl.enabled.mechanisms=SCRAM-SHA-512
sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="admin" password="$(cat "$run/secrets/admin")";
listener.name.controller.ssl.client.auth=required
ssl.keystore.type=PKCS12
ssl.keystore.location=$run/tls/broker.p12
ssl.keystore.password=$(cat "$run/secrets/keystore")
ssl.truststore.type=PEM
ssl.truststore.location=$run/tls/ca.pem
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
# admin by SCRAM; the broker itself by its certificate on the controller listener.
super.users=User:admin;User:CN=kwe-broker
log.dirs=$run/data
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
log.retention.hours=24
log.segment.bytes=67108864
PROPS
  )
}

# The ACLs of docs/security.md. Each base name is granted as a LITERAL pattern (the defaults themselves) and as
# a PREFIXED pattern with a dot ('keywords.' ...), so that tests and side deployments can use
# 'keywords.<anything>' with the same rights, while 'keywords' never covers 'keywords-dlq'.
# AclCommand takes one principal and one pattern type per call: the calls run side by side.
create_acls() {
  local port="$1" libs="$2" pids=() i=0 failed=0
  acl() {
    local out="$run/acl-$i.log"; i=$((i + 1))
    java -Xmx128m -XX:TieredStopAtLevel=1 -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" \
      org.apache.kafka.tools.AclCommand --bootstrap-server "127.0.0.1:$port" \
      --command-config "$run/admin-java.properties" --add --force "$@" >"$out" 2>&1 &
    pids+=($!)
  }
  acl --allow-principal User:worker --operation Read --operation Describe \
      --topic keywords --group keyword-embedder --resource-pattern-type literal
  acl --allow-principal User:worker --operation Read --operation Describe \
      --topic keywords. --group keyword-embedder. --resource-pattern-type prefixed
  acl --allow-principal User:worker --operation Write --operation Describe \
      --topic embeddings --topic keywords-dlq --resource-pattern-type literal
  acl --allow-principal User:worker --operation Write --operation Describe \
      --topic embeddings. --topic keywords-dlq. --transactional-id keyword-embedder --resource-pattern-type prefixed
  acl --allow-principal User:producer --operation Write --operation Describe --topic keywords --resource-pattern-type literal
  acl --allow-principal User:producer --operation Write --operation Describe --topic keywords. --resource-pattern-type prefixed
  acl --allow-principal User:reader --operation Read --operation Describe \
      --topic embeddings --topic keywords-dlq --resource-pattern-type literal
  acl --allow-principal User:reader --operation Read --operation Describe \
      --topic embeddings. --topic keywords-dlq. --group keyword-embedder-reader --resource-pattern-type prefixed
  local pid
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  if (( failed )); then
    cat "$run"/acl-*.log >&2
    die "creating the ACLs failed (above)"
  fi
}

cmd_start_secure() {
  need_java; need_openssl
  local pid port
  if pid="$(running_pid)"; then
    port="$(cat "$portfile")"
    if metadata_ok "$port"; then
      log "reusing the secured broker already running (pid $pid)"
      echo "KAFKA_SECURE_CONFIG_DIR=$run/client"
      echo "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$port"
      return 0
    fi
    log "secured broker pid $pid does not answer; restarting it"
    cmd_stop
  fi
  local libs cport cluster scram=() u
  libs="$(resolve_libs)"
  port="${KAFKA_SECURE_PORT:-$(free_port)}"
  port_busy "$port" && die "port $port on 127.0.0.1 is already in use"
  cport="$(free_port)"
  [[ "$cport" == "$port" ]] && cport="$(free_port)"
  rm -rf "$run"; mkdir -p "$run"; chmod 700 "$run"
  make_passwords
  make_certs
  write_client_files
  write_configs "$port" "$cport"
  for u in "${users[@]}"; do scram+=(--add-scram "SCRAM-SHA-512=[name=$u,password=$(cat "$run/secrets/$u")]"); done
  cluster="$(java -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" kafka.tools.StorageTool random-uuid)"
  java -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" \
    kafka.tools.StorageTool format --standalone -t "$cluster" -c "$run/server.properties" "${scram[@]}" \
    >"$run/format.log" 2>&1 || { cat "$run/format.log" >&2; die "formatting the KRaft storage failed"; }
  log "starting the secured Apache Kafka broker (SASL_SSL, SCRAM-SHA-512, ACLs) on 127.0.0.1:$port"
  launch "$libs" "$port"
  create_acls "$port" "$libs"
  log "ACLs created; client files in $run/client"
  echo "KAFKA_SECURE_CONFIG_DIR=$run/client"
  echo "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$port"
}

cmd_start() {
  (( secure )) && { cmd_start_secure; return; }
  need_java
  local pid port
  if pid="$(running_pid)"; then
    port="$(cat "$portfile")"
    if metadata_ok "$port"; then
      log "reusing the broker already running (pid $pid)"
      echo "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$port"
      return 0
    fi
    log "broker pid $pid does not answer; restarting it"
    cmd_stop
  fi
  local libs cport cluster
  libs="$(resolve_libs)"
  port="${KAFKA_PORT:-$(free_port)}"
  port_busy "$port" && die "port $port on 127.0.0.1 is already in use"
  cport="$(free_port)"
  [[ "$cport" == "$port" ]] && cport="$(free_port)"
  rm -rf "$run"; mkdir -p "$run"
  write_configs "$port" "$cport"
  cluster="$(java -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" kafka.tools.StorageTool random-uuid)"
  java -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" \
    kafka.tools.StorageTool format --standalone -t "$cluster" -c "$run/server.properties" >"$run/format.log" 2>&1 \
    || { cat "$run/format.log" >&2; die "formatting the KRaft storage failed"; }
  log "starting Apache Kafka $(ls "$libs" | sed -nE 's/^kafka_2\.13-(.*)\.jar$/\1/p') (KRaft) on 127.0.0.1:$port"
  launch "$libs" "$port"
  echo "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$port"
}

# Starts the JVM on the configured $run folder and waits for a metadata round trip.
launch() {
  local libs="$1" port="$2" pid
  # setsid: the broker outlives the shell that started it (tests, CI steps) until 'stop'.
  # shellcheck disable=SC2086
  setsid java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} -XX:+UseG1GC -Djava.awt.headless=true \
    -Dkafka.logs.dir="$run" -Dlog4j2.configurationFile="$run/log4j2.properties" \
    -cp "$libs/*" kafka.Kafka "$run/server.properties" >"$run/stdout.log" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" >"$pidfile"
  echo "$port" >"$portfile"
  local deadline=$(( SECONDS + 90 ))
  until metadata_ok "$port"; do
    if ! kill -0 "$pid" 2>/dev/null; then
      tail -n 40 "$run/stdout.log" "$run/server.log" >&2 2>/dev/null || true
      die "the broker exited during start (logs above, full logs in $run)"
    fi
    (( SECONDS < deadline )) || { cmd_stop; die "the broker did not answer a metadata request within 90 s (logs in $run)"; }
    sleep 0.5
  done
  log "broker ready (pid $pid, logs in $run)"
}

cmd_restart() {
  local pid port signal=TERM down=0
  while (( $# )); do
    case "$1" in
      --hard) signal=KILL ;;
      --down-for) down="${2:?--down-for needs seconds}"; shift ;;
      *) die "restart: unknown option $1" ;;
    esac
    shift
  done
  pid="$(running_pid)" || die "no broker of ours is running (start it first)"
  port="$(cat "$portfile")"
  kill "-$signal" "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
  rm -f "$pidfile"
  log "broker stopped (SIG$signal, pid $pid); starting it again on port $port with its data"
  while port_busy "$port"; do sleep 0.2; done
  sleep "$down"
  launch "$(resolve_libs)" "$port"
  (( secure )) && echo "KAFKA_SECURE_CONFIG_DIR=$run/client"
  echo "KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$port"
}

cmd_stop() {
  local pid
  if ! pid="$(running_pid)"; then
    rm -f "$pidfile"
    log "no broker of ours is running"
    return 0
  fi
  stop_and_wait "$pid" "$pidfile" broker
}

cmd_status() {
  local pid
  if pid="$(running_pid)"; then
    (( secure )) && echo "running: pid $pid, KAFKA_SECURE_CONFIG_DIR=$run/client"
    echo "running: pid $pid, KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:$(cat "$portfile")"
  else
    echo "not running"; return 1
  fi
}

# ---------------------------------------------------------------------------------- cluster
# N combined broker+controller nodes, each in $run/node-I with its own ports and data. The nodes
# run in $KWE_KAFKA_NETNS when set (the caller made it); so do the probes of this script.
host="${KAFKA_HOST:-127.0.0.1}"
netns="${KWE_KAFKA_NETNS:-}"
in_ns() { if [[ -n "$netns" ]]; then ip netns exec "$netns" "$@"; else "$@"; fi; }
node_busy() { in_ns bash -c "exec 3<>/dev/tcp/$host/$1" 2>/dev/null; }
node_dir() { echo "$run/node-$1"; }
node_pid() {
  local f; f="$(node_dir "$1")/broker.pid"
  [[ -f "$f" ]] || return 1
  local pid; pid="$(cat "$f")"
  [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && grep -q "kafka.Kafka" "/proc/$pid/cmdline" 2>/dev/null && echo "$pid"
}
cluster_nodes() { cat "$run/cluster.nodes"; }
cluster_bootstrap() {
  local i out=()
  for i in $(seq 1 "$(cluster_nodes)"); do out+=("$host:$(cat "$(node_dir "$i")/broker.port")"); done
  (IFS=,; echo "${out[*]}")
}

# The broker ids a node's metadata answer lists (live, unfenced brokers), through the admin client.
live_ids() {
  local bootstrap="$1" libs; libs="$(libs_dir)"
  in_ns timeout 30 java -Xmx128m -XX:TieredStopAtLevel=1 -XX:+UseSerialGC -cp "$libs/*" \
    -Dlog4j2.configurationFile="$run/log4j2-tools.properties" \
    org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$bootstrap" 2>/dev/null \
    | sed -nE 's/.*\(id: ([0-9]+) .*/\1/p' | sort -n | tr '\n' ' '
}

# Waits until a metadata answer from BOOTSTRAP lists every id in WANT (space separated).
wait_live() {
  local bootstrap="$1" want="$2" what="$3" deadline=$(( SECONDS + 120 )) got id ok
  while :; do
    got=" $(live_ids "$bootstrap" || true) "; ok=1
    for id in $want; do [[ "$got" == *" $id "* ]] || ok=0; done
    (( ok )) && return 0
    (( SECONDS < deadline )) || die "$what: brokers$got answer, [$want] expected, after 120 s (logs in $run/node-*)"
    sleep 1
  done
}

write_node_config() {
  local i="$1" n="$2" voters="$3" dir; dir="$(node_dir "$i")"
  local rf=$(( n < 3 ? n : 3 )) isr=$(( n < 3 ? 1 : 2 ))
  mkdir -p "$dir/data"
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=$i
controller.quorum.voters=$voters
listeners=PLAINTEXT://$host:$(cat "$dir/broker.port"),CONTROLLER://$host:$(cat "$dir/controller.port")
advertised.listeners=PLAINTEXT://$host:$(cat "$dir/broker.port")
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs=$dir/data
num.partitions=1
default.replication.factor=$rf
min.insync.replicas=$isr
offsets.topic.replication.factor=$rf
offsets.topic.num.partitions=6
transaction.state.log.replication.factor=$rf
transaction.state.log.min.isr=$isr
transaction.state.log.num.partitions=6
share.coordinator.state.topic.replication.factor=$rf
share.coordinator.state.topic.min.isr=$isr
group.initial.rebalance.delay.ms=0
auto.create.topics.enable=false
unclean.leader.election.enable=false
log.retention.hours=24
log.segment.bytes=67108864
# A small, shared box: few threads per node.
num.network.threads=2
num.io.threads=2
num.replica.fetchers=1
background.threads=2
PROPS
}

launch_node() {
  local i="$1" libs="$2" dir pid; dir="$(node_dir "$i")"
  local pre=(); [[ -n "$netns" ]] && pre=(ip netns exec "$netns")
  # shellcheck disable=SC2086
  setsid "${pre[@]}" java ${KAFKA_HEAP_OPTS:--Xms128m -Xmx384m} -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Djava.awt.headless=true -Dkafka.logs.dir="$dir" -Dlog4j2.configurationFile="$run/log4j2.properties" \
    -cp "$libs/*" kafka.Kafka "$dir/server.properties" >>"$dir/stdout.log" 2>&1 < /dev/null &
  pid=$!
  echo "$pid" >"$dir/broker.pid"
}

cluster_start() {
  (( secure )) && die "--brokers and --secure together are not supported"
  need_java
  local n="$brokers" i libs cluster voters=() bootstrap
  if [[ -f "$run/cluster.nodes" ]] && (( $(cluster_nodes) == n )); then
    local all=1
    for i in $(seq 1 "$n"); do node_pid "$i" >/dev/null || all=0; done
    if (( all )); then
      log "reusing the $n-node cluster already running in $run"
      echo "KAFKA_BOOTSTRAP_SERVERS=$(cluster_bootstrap)"; return 0
    fi
  fi
  [[ -f "$run/cluster.nodes" ]] && cluster_stop
  cmd_stop >/dev/null 2>&1 || true   # a single broker in the same folder
  libs="$(resolve_libs)"
  rm -rf "$run"; mkdir -p "$run"
  echo "$n" >"$run/cluster.nodes"
  write_configs 0 0   # the log4j2 files; the single broker's server.properties is removed below
  rm -f "$run/server.properties"; rmdir "$run/data" 2>/dev/null || true
  local used=" "
  for i in $(seq 1 "$n"); do
    mkdir -p "$(node_dir "$i")"
    local p c
    p="$(free_port node_busy)"; while [[ "$used" == *" $p "* ]]; do p="$(free_port node_busy)"; done; used+="$p "
    c="$(free_port node_busy)"; while [[ "$used" == *" $c "* ]]; do c="$(free_port node_busy)"; done; used+="$c "
    echo "$p" >"$(node_dir "$i")/broker.port"; echo "$c" >"$(node_dir "$i")/controller.port"
    voters+=("$i@$host:$c")
  done
  cluster="$(java -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" kafka.tools.StorageTool random-uuid)"
  for i in $(seq 1 "$n"); do
    write_node_config "$i" "$n" "$(IFS=,; echo "${voters[*]}")"
  done
  # Formatting is a JVM each: side by side.
  local pids=() failed=0 pid
  for i in $(seq 1 "$n"); do
    java -Xmx128m -XX:TieredStopAtLevel=1 -cp "$libs/*" -Dlog4j2.configurationFile="$run/log4j2-tools.properties" \
      kafka.tools.StorageTool format -t "$cluster" -c "$(node_dir "$i")/server.properties" \
      >"$(node_dir "$i")/format.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  (( failed )) && { cat "$run"/node-*/format.log >&2; die "formatting the KRaft storage failed"; }
  log "starting a $n-node Apache Kafka cluster on $host${netns:+ (network namespace $netns)}"
  for i in $(seq 1 "$n"); do launch_node "$i" "$libs"; done
  bootstrap="$(cluster_bootstrap)"
  if ! ( wait_live "$bootstrap" "$(seq 1 "$n" | tr '\n' ' ')" "cluster start" ); then
    for i in $(seq 1 "$n"); do tail -n 20 "$(node_dir "$i")/server.log" >&2 2>/dev/null || true; done
    cluster_stop; die "the cluster did not start"
  fi
  log "cluster ready: $n brokers (logs in $run/node-*)"
  echo "KAFKA_BOOTSTRAP_SERVERS=$bootstrap"
}

stop_node() {
  local i="$1" signal="${2:-TERM}" pid deadline
  pid="$(node_pid "$i")" || { rm -f "$(node_dir "$i")/broker.pid"; return 0; }
  kill "-$signal" "$pid" 2>/dev/null || true
  deadline=$(( SECONDS + 30 ))
  while kill -0 "$pid" 2>/dev/null; do
    if (( SECONDS >= deadline )); then log "node $i did not stop in 30 s; killing it"; kill -KILL "$pid" 2>/dev/null || true; fi
    sleep 0.2
  done
  rm -f "$(node_dir "$i")/broker.pid"
  log "node $i stopped (SIG$signal, pid $pid)"
}

cluster_stop() {
  local i n; n="$(cluster_nodes)"
  # SIGTERM to all at once (a controlled shutdown one by one would move every leader twice), then wait.
  for i in $(seq 1 "$n"); do
    local pid; if pid="$(node_pid "$i")"; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for i in $(seq 1 "$n"); do stop_node "$i"; done
}

cluster_status() {
  local i n pid up=0; n="$(cluster_nodes)"
  for i in $(seq 1 "$n"); do
    if pid="$(node_pid "$i")"; then
      echo "node $i: running, pid $pid, $host:$(cat "$(node_dir "$i")/broker.port")"; up=$((up + 1))
    else
      echo "node $i: not running ($host:$(cat "$(node_dir "$i")/broker.port"))"
    fi
  done
  echo "KAFKA_BOOTSTRAP_SERVERS=$(cluster_bootstrap)"
  (( up > 0 )) || return 1
}

cluster_restart() {
  local node="" signal=TERM down=0 n i others=""
  while (( $# )); do
    case "$1" in
      --node) node="${2:?--node needs a node id}"; shift ;;
      --hard) signal=KILL ;;
      --down-for) down="${2:?--down-for needs seconds}"; shift ;;
      *) die "restart: unknown option $1" ;;
    esac
    shift
  done
  n="$(cluster_nodes)"
  [[ "$node" =~ ^[0-9]+$ ]] && (( node >= 1 && node <= n )) || die "restart: --node 1..$n is required for a cluster"
  stop_node "$node" "$signal"
  while node_busy "$(cat "$(node_dir "$node")/broker.port")"; do sleep 0.2; done
  sleep "$down"
  log "starting node $node again on $host:$(cat "$(node_dir "$node")/broker.port") with its data"
  launch_node "$node" "$(resolve_libs)"
  wait_live "$host:$(cat "$(node_dir "$node")/broker.port")" "$node" "restart of node $node"
  log "node $node is back"
  echo "KAFKA_BOOTSTRAP_SERVERS=$(cluster_bootstrap)"
}

is_cluster() { [[ -f "$run/cluster.nodes" ]] && (( ! secure )); }

case "${1:-}" in
  start) if (( brokers > 1 )); then cluster_start; else cmd_start; fi ;;
  stop) if is_cluster; then cluster_stop; else cmd_stop; fi ;;
  status) if is_cluster; then cluster_status; else cmd_status; fi ;;
  restart) need_java; shift; if is_cluster; then cluster_restart "$@"; else cmd_restart "$@"; fi ;;
  libs) need_java; resolve_libs ;;
  topics) need_java; shift; libs="$(resolve_libs)"; exec java -cp "$libs/*" org.apache.kafka.tools.TopicCommand "$@" ;;
  groups) need_java; shift; libs="$(resolve_libs)"
          exec java -cp "$libs/*" org.apache.kafka.tools.consumer.group.ConsumerGroupCommand "$@" ;;
  *) echo "usage: $0 start [--brokers N]|stop|status|restart [--node I] [--hard] [--down-for S]|libs|topics ARGS|groups ARGS [--secure]" >&2
     exit 2 ;;
esac
