#!/usr/bin/env bash
# The full fault run behind `make chaos`: producers, four `outbox relay`
# processes and a deduplicating checker, against RabbitMQ and then Kafka
# (kfake), while relays are killed and paused and the broker and PostgreSQL
# restart. It starts servers of its own on loopback (scripts/services.sh,
# installing PostgreSQL and RabbitMQ with apt-get when root and missing),
# prints the accounting and fails unless nothing was lost, nothing phantom,
# nothing out of order and no effect applied twice.
#   OUTBOX_CHAOS_EVENTS  events per broker (default 100000)
# Usage: scripts/chaos.sh [-brokers amqp,kafka] [-events N] [-repeat N] [-v]
set -euo pipefail
cd "$(dirname "$0")/.."
exec go run ./cmd/outbox-chaos "$@"
