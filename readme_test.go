package outbox_test

import (
	"os"
	"strings"
	"testing"
)

// README's first program is examples/quickstart, which the module builds:
// the copy must stay equal to it. The first screen also says how to get
// the library and the binary.
func TestReadmeQuickstartIsTheBuiltExample(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	prog, err := os.ReadFile("examples/quickstart/main.go")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "```go\n")
	if !ok {
		t.Fatal("README has no Go block")
	}
	block, _, _ := strings.Cut(rest, "```\n")
	if block != string(prog) {
		t.Errorf("README's first Go block differs from examples/quickstart/main.go; copy the file into README")
	}
	first := string(readme)[:strings.Index(string(readme), "```go\n")]
	for _, want := range []string{"go get github.com/outboxhq/outbox\n", "go install github.com/outboxhq/outbox/cmd/outbox@latest"} {
		if !strings.Contains(first, want) {
			t.Errorf("README's first screen lacks %q", want)
		}
	}
	for _, want := range []string{"## Try it", "make demo", "## Develop", "make test"} {
		if !strings.Contains(string(readme), want) {
			t.Errorf("README lacks %q", want)
		}
	}
}
