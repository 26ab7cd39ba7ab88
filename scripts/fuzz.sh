#!/usr/bin/env bash
# Explores each fuzz target beyond its committed seed corpus (the seeds
# themselves run in `make test`). Some targets check accepted inputs
# against PostgreSQL, so this runs inside scripts/services.sh.
# A count rather than a duration: -fuzztime with a duration can end on a
# spurious deadline error in Go 1.26.
#   OUTBOX_FUZZ_COUNT  executions per target (default 20000)
set -euo pipefail
cd "$(dirname "$0")/.."
count=${OUTBOX_FUZZ_COUNT:-20000}
for t in .:FuzzWriterValidate ./store/table:FuzzClaimRows ./brokers:FuzzRouting ./dedupe:FuzzEventID ./cmd/outbox/outboxcli:FuzzLoadConfig ./brokers/stdout:FuzzAppendLine; do
  pkg=${t%%:*} fn=${t##*:}
  echo "fuzz $fn in $pkg ($count executions)"
  go test -run '^$' -fuzz "^$fn\$" -fuzztime "${count}x" "$pkg"
done
