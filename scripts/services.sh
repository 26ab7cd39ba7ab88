#!/usr/bin/env bash
# Runs a command with throwaway PostgreSQL and RabbitMQ servers on loopback,
# then stops them. Existing servers are used instead when named:
#   OUTBOX_TEST_DATABASE_URL  postgres://user:pass@host:port/db
#   OUTBOX_TEST_AMQP_URL      amqp://user:pass@host:port/   (or "none" to skip RabbitMQ)
#   OUTBOX_TEST_CHROMIUM      a Chromium or Chrome binary, with --chromium (the console's browser test)
# A throwaway PostgreSQL is Debian's newest installed, unless
#   OUTBOX_TEST_PG_BIN        names a folder of PostgreSQL server binaries (initdb, pg_ctl, postgres)
# With OUTBOX_SERVICES_ENV set to a file name, the variables are also written
# there (for a shell that keeps servers running: scripts/services.sh sleep 3600 &).
# Missing server packages are installed with apt-get when running as root,
# and a system user postgres is created where none exists (the server will
# not run as root).
# A throwaway PostgreSQL runs with fsync off, which is fine for tests; with
# --durable it keeps production durability (fsync, synchronous_commit and
# full_page_writes on, as PostgreSQL ships), for benchmarks; then
# OUTBOX_TEST_DATABASE_URL is not used (it usually names a test server with
# fsync off) and OUTBOX_DURABLE_DATABASE_URL may name a durable server.
# Usage: scripts/services.sh [--no-rabbitmq] [--chromium] [--durable] command args...
set -euo pipefail

want_rabbit=1 want_chromium=0 durable=0
while :; do
  case "${1:-}" in
    --no-rabbitmq) want_rabbit=0; shift ;;
    --chromium) want_chromium=1; shift ;;
    --durable) durable=1; shift ;;
    *) break ;;
  esac
done
[ "${OUTBOX_TEST_AMQP_URL:-}" = "none" ] && want_rabbit=0

log() { printf 'services: %s\n' "$*" >&2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/outbox-services.XXXXXX")
chmod 755 "$tmp"
pg_started="" rabbit_started=""

cleanup() {
  set +e
  if [ -n "$rabbit_started" ]; then
    rabbit_env "$RABBITMQ_CTL" shutdown >/dev/null 2>&1 || kill "$rabbit_pid" 2>/dev/null
    wait "$rabbit_pid" 2>/dev/null
    rabbit_env epmd -kill >/dev/null 2>&1
  fi
  if [ -n "$pg_started" ]; then
    as_pg "$pgbin/pg_ctl" -D "$tmp/pg" -m fast stop >/dev/null 2>&1
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

listening() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Ports are picked below the kernel's ephemeral range, so no outgoing
# connection or port-0 listener of a test can take one between the pick and
# the server binding it; another picker still can, so every server started
# here is started again on other ports when its bind fails.
read -r ephemeral_lo _ </proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || ephemeral_lo=32768
port_lo=10000 port_span=$((ephemeral_lo - 10000))
[ "$port_span" -ge 1000 ] || { port_lo=20000 port_span=30000; }

free_port() {
  local p
  for _ in $(seq 1 200); do
    p=$((port_lo + (RANDOM * 32768 + RANDOM) % port_span))
    listening "$p" || { echo "$p"; return; }
  done
  log "no free port found"; return 1
}

apt_install() {
  if [ "$(id -u)" != 0 ]; then
    log "$1 is not installed and this is not root: install it, or set the URL variable"; exit 1
  fi
  log "installing $* with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  [ -n "${apt_updated:-}" ] || { apt-get update -qq >/dev/null; apt_updated=1; }
  # Keep the package's own service from starting; we start our own.
  printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -qq --no-install-recommends "$@" >/dev/null
  rm -f /usr/sbin/policy-rc.d
}

as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start_postgres() {
  pgbin=${OUTBOX_TEST_PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)}
  if [ -z "$pgbin" ]; then
    apt_install postgresql
    pgbin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
  fi
  # Server binaries from elsewhere may link libraries this system lacks.
  local lib pkgs=()
  for lib in $(ldd "$pgbin/postgres" "$pgbin/initdb" 2>/dev/null | awk '/not found/ {print $1}' | sort -u); do
    case $lib in
      libc.so.*|libm.so.*|libdl.so.*|librt.so.*|libpthread.so.*) pkgs+=(libc6) ;;
      libz.so.1) pkgs+=(zlib1g) ;;
      libxml2.so.2) pkgs+=(libxml2) ;;
      liblzma.so.5) pkgs+=(liblzma5) ;;
      libzstd.so.1) pkgs+=(libzstd1) ;;
      liblz4.so.1) pkgs+=(liblz4-1) ;;
      *) log "$pgbin/postgres needs $lib, which is not installed"; exit 1 ;;
    esac
  done
  [ "${#pkgs[@]}" = 0 ] || apt_install "${pkgs[@]}"
  # The server runs as the postgres user when this runs as root.
  if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    useradd --system --user-group --home-dir /nonexistent --shell /usr/sbin/nologin postgres
  fi
  mkdir -p "$tmp/pg" "$tmp/pgsock"
  [ "$(id -u)" = 0 ] && chown postgres "$tmp/pg" "$tmp/pgsock"
  as_pg "$pgbin/initdb" -D "$tmp/pg" -U postgres -A trust --no-sync -E UTF8 >"$tmp/initdb.log" 2>&1 ||
    { cat "$tmp/initdb.log" >&2; exit 1; }
  # In single-user mode, before the start: a folder of server binaries
  # need not hold psql.
  echo "CREATE DATABASE outbox_test" |
    as_pg "$pgbin/postgres" --single -D "$tmp/pg" -c exit_on_error=on postgres >"$tmp/initdb.log" 2>&1 ||
    { cat "$tmp/initdb.log" >&2; exit 1; }
  # fsync off: a throwaway server; commits stay synchronous so a restart
  # of the server keeps every acknowledged commit. --durable states the
  # shipped settings explicitly, so a changed default cannot creep in.
  # wal_level=logical and the slots and senders for the log relay's tests,
  # which run in parallel, each with a slot of its own.
  local durability="-c fsync=off -c full_page_writes=off"
  [ "$durable" = 1 ] && durability="-c fsync=on -c synchronous_commit=on -c full_page_writes=on"
  local port attempt
  for attempt in 1 2 3 4 5; do
    port=$(free_port)
    as_pg "$pgbin/pg_ctl" -D "$tmp/pg" -l "$tmp/pgsock/pg.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -k $tmp/pgsock $durability -c max_connections=300 -c wal_level=logical -c max_replication_slots=40 -c max_wal_senders=40" \
      start >/dev/null && break
    if [ "$attempt" = 5 ] || ! grep -q 'could not bind\|Address already in use' "$tmp/pgsock/pg.log"; then
      cat "$tmp/pgsock/pg.log" >&2; exit 1
    fi
    log "PostgreSQL could not bind port $port (attempt $attempt): starting it on another"
    : >"$tmp/pgsock/pg.log"
  done
  pg_started=1
  export OUTBOX_TEST_DATABASE_URL="postgres://postgres@127.0.0.1:$port/outbox_test?sslmode=disable"
  export OUTBOX_TEST_PG_BIN="$pgbin" OUTBOX_TEST_PG_DATA="$tmp/pg" OUTBOX_TEST_WAL_LEVEL=logical
  local kind="fsync off"
  [ "$durable" = 1 ] && kind="production durability"
  log "PostgreSQL $("$pgbin/postgres" --version | awk '{print $3}') on 127.0.0.1:$port ($kind)"
}

rabbit_env() {
  # A node that fails writes erl_crash.dump into the working directory
  # unless told where: into the throwaway folder.
  env HOME="$tmp/rabbit" RABBITMQ_NODENAME="$RABBITMQ_NODENAME" ERL_EPMD_ADDRESS=127.0.0.1 \
    ERL_CRASH_DUMP="$tmp/erl_crash.dump" \
    ERL_EPMD_PORT="$RABBITMQ_EPMD_PORT" "$@"
}

# The ports are picked free but can be taken before the node binds them
# (tests running beside it open ports of their own), so a node that dies
# before it is ready is started again on other ports.
start_rabbitmq() {
  [ -x /usr/lib/rabbitmq/bin/rabbitmq-server ] || apt_install rabbitmq-server
  RABBITMQ_CTL=/usr/lib/rabbitmq/bin/rabbitmqctl
  local attempt
  for attempt in 1 2 3; do
    try_rabbitmq && return
    log "RabbitMQ did not start (attempt $attempt of 3)"
    if [ -n "${RABBITMQ_EPMD_PORT:-}" ]; then
      rabbit_env "$RABBITMQ_CTL" shutdown >/dev/null 2>&1 || kill "${rabbit_pid:-}" 2>/dev/null || true
      wait "${rabbit_pid:-}" 2>/dev/null || true
      rabbit_env epmd -kill >/dev/null 2>&1 || true
    fi
    rabbit_started=""
    rm -rf "$tmp/rabbit"
  done
  cat "$tmp/rabbit.log" >&2; exit 1
}

try_rabbitmq() {
  local port dist epmd
  port=$(free_port); dist=$(free_port); epmd=$(free_port)
  export RABBITMQ_NODENAME="outbox-test-$port@localhost" RABBITMQ_EPMD_PORT="$epmd"
  mkdir -p "$tmp/rabbit/mnesia" "$tmp/rabbit/log"
  printf '[].\n' >"$tmp/rabbit/enabled_plugins"
  rabbit_env RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT="$port" RABBITMQ_DIST_PORT="$dist" \
    RABBITMQ_MNESIA_BASE="$tmp/rabbit/mnesia" RABBITMQ_LOG_BASE="$tmp/rabbit/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$tmp/rabbit/enabled_plugins" \
    RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS='-kernel inet_dist_use_interface {127,0,0,1}' \
    /usr/lib/rabbitmq/bin/rabbitmq-server >"$tmp/rabbit.log" 2>&1 &
  rabbit_pid=$!
  rabbit_started=1
  for _ in $(seq 1 120); do
    listening "$port" && break
    kill -0 "$rabbit_pid" 2>/dev/null || return 1
    sleep 0.5
  done
  rabbit_env "$RABBITMQ_CTL" await_startup >/dev/null || return 1
  export OUTBOX_TEST_AMQP_URL="amqp://guest:guest@127.0.0.1:$port/"
  # For tests that stop and start the broker (the reliability suite).
  export OUTBOX_TEST_RABBITMQ_NODE="$RABBITMQ_NODENAME" OUTBOX_TEST_RABBITMQ_HOME="$tmp/rabbit" \
    OUTBOX_TEST_RABBITMQ_EPMD_PORT="$RABBITMQ_EPMD_PORT"
  log "RabbitMQ on 127.0.0.1:$port"
}

# The browser the console's test drives: one on PATH, else Debian's
# chromium. Without root and without a browser the test skips (fails in CI).
find_chromium() {
  if [ -n "${OUTBOX_TEST_CHROMIUM:-}" ]; then return; fi
  local c
  for c in chromium chromium-browser google-chrome; do
    if command -v "$c" >/dev/null; then export OUTBOX_TEST_CHROMIUM; OUTBOX_TEST_CHROMIUM=$(command -v "$c"); return; fi
  done
  if [ "$(id -u)" != 0 ]; then
    log "chromium is not installed and this is not root: the console's browser test will not run"
    return
  fi
  apt_install chromium
  export OUTBOX_TEST_CHROMIUM; OUTBOX_TEST_CHROMIUM=$(command -v chromium)
  log "chromium $("$OUTBOX_TEST_CHROMIUM" --version 2>/dev/null | awk '{print $2}') for the browser test"
}

if [ "$durable" = 1 ]; then
  if [ -n "${OUTBOX_DURABLE_DATABASE_URL:-}" ]; then
    export OUTBOX_TEST_DATABASE_URL="$OUTBOX_DURABLE_DATABASE_URL"
  else
    start_postgres
  fi
elif [ -z "${OUTBOX_TEST_DATABASE_URL:-}" ]; then
  start_postgres
fi
if [ "$want_chromium" = 1 ]; then find_chromium; fi
if [ "$want_rabbit" = 1 ] && [ -z "${OUTBOX_TEST_AMQP_URL:-}" ]; then start_rabbitmq; fi

if [ -n "${OUTBOX_SERVICES_ENV:-}" ]; then
  env | grep '^OUTBOX_TEST_' | sed 's/^/export /' >"$OUTBOX_SERVICES_ENV"
fi
"$@"
