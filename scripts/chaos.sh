#!/usr/bin/env bash
# The full fault run behind `make chaos`: producers, four `outbox relay`
# processes and a deduplicating checker, against RabbitMQ and then Kafka
# (kfake), while relays are killed and paused and the broker and PostgreSQL
# restart. It starts servers of its own on loopback (scripts/services.sh,
# installing PostgreSQL and RabbitMQ with apt-get when root and missing),
# prints the accounting and fails unless nothing was lost, nothing phantom,
# nothing out of order and no effect applied twice. Kafka runs with the plain
# publisher and with the exactly-once one (brokers.kafka.exactly_once), which
# fails on any duplicate; a last table puts their duplicates per fault kind
# side by side.
# Then the oracle's long run (internal/oracle): generated histories in every
# relay mode, with relay kills and PostgreSQL restarts, checked against the
# model of the promises; a failure prints its seed and a shrunk history.
#   OUTBOX_CHAOS_EVENTS      events per broker (default 100000)
#   OUTBOX_ORACLE_HISTORIES  oracle histories per mode (default 40; 0 skips the oracle)
#   OUTBOX_ORACLE_STEPS      steps per oracle history (default 16)
#   OUTBOX_ORACLE_SEED       the oracle's first seed (default: from the clock, printed)
# Usage: scripts/chaos.sh [-brokers amqp,kafka] [-kafka-paths plain,exactly-once] [-events N] [-repeat N] [-v]
set -euo pipefail
cd "$(dirname "$0")/.."
go run ./cmd/outbox-chaos "$@"

histories=${OUTBOX_ORACLE_HISTORIES:-40}
if [ "$histories" != 0 ]; then
  OUTBOX_ORACLE_HISTORIES=$histories OUTBOX_ORACLE_STEPS=${OUTBOX_ORACLE_STEPS:-16} OUTBOX_ORACLE_PG_RESTARTS=1 \
    scripts/services.sh --no-rabbitmq go test -count=1 -timeout 120m -run 'TestOracle$' -v ./internal/oracle/ |
    grep -v -e '^=== ' -e '^        --- PASS'
fi
