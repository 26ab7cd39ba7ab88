package event_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// nonStandardDeps lists the packages outside the standard library that pkg
// links.
func nonStandardDeps(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

// The rules stay a leaf that everything may import, core among them: they
// link only the standard library.
func TestEventIsALeaf(t *testing.T) {
	for _, p := range nonStandardDeps(t, "github.com/outboxhq/outbox/core/event") {
		if p != "github.com/outboxhq/outbox/core/event" {
			t.Errorf("package event links %s", p)
		}
	}
}

// The engine links nothing but the standard library and the event rules.
func TestCoreLinksOnlyTheStandardLibrary(t *testing.T) {
	for _, p := range nonStandardDeps(t, "github.com/outboxhq/outbox/core") {
		if p != "github.com/outboxhq/outbox/core" && p != "github.com/outboxhq/outbox/core/event" {
			t.Errorf("package core links %s", p)
		}
	}
}

// A producer, which links the root package, does not link the log relay
// or the replication protocol.
func TestProducerDoesNotLinkTheLogRelay(t *testing.T) {
	deps := nonStandardDeps(t, "github.com/outboxhq/outbox")
	if !slices.Contains(deps, "github.com/outboxhq/outbox/core/event") {
		t.Fatalf("the root package does not link package event: %v", deps)
	}
	for _, p := range deps {
		if strings.Contains(p, "pglogrepl") || strings.HasPrefix(p, "github.com/outboxhq/outbox/store/logrelay") {
			t.Errorf("the root package links %s", p)
		}
	}
}
