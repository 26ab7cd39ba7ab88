# The two commands a newcomer needs are `make demo` and `make test`; both
# start a throwaway PostgreSQL (and, for tests, RabbitMQ) on loopback
# unless DATABASE_URL / OUTBOX_TEST_DATABASE_URL name an existing server.
GO ?= go
SERVICES := scripts/services.sh

.PHONY: demo test build lint fuzz bench bench-quick chaos

demo:
	@if [ -n "$$DATABASE_URL" ]; then $(GO) run ./cmd/outbox demo; \
	else $(SERVICES) --no-rabbitmq sh -c 'DATABASE_URL=$$OUTBOX_TEST_DATABASE_URL $(GO) run ./cmd/outbox demo'; fi

test:
	$(SERVICES) $(GO) test -race -count=1 -timeout 12m ./...

build:
	$(GO) build -o bin/outbox ./cmd/outbox

# The seed corpora run in `make test`; this explores beyond them.
fuzz:
	$(SERVICES) --no-rabbitmq scripts/fuzz.sh

lint:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...

# Benchmarks against throwaway servers (see docs/benchmarks.md). `bench`
# rewrites docs/benchmarks.md, its chart and figures; `bench-quick` runs
# small sizes and only prints.
bench:
	$(GO) build -o bin/outbox-bench ./cmd/outbox-bench
	$(SERVICES) bin/outbox-bench -out docs/benchmarks.md

bench-quick:
	$(GO) build -o bin/outbox-bench ./cmd/outbox-bench
	$(SERVICES) bin/outbox-bench -quick

chaos:
	scripts/chaos.sh
