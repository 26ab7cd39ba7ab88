package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strings"
	"testing"
)

// docs/consumers.md shows, for each broker, the body of the adapter's
// ExampleSubscriberConfig, which the module compiles; the consumer tests
// build their subscribers the same way. The copies must stay equal.
func TestConsumersDocQuotesSubscriberExamples(t *testing.T) {
	doc, err := os.ReadFile("docs/consumers.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range []string{"brokers/amqp/example_test.go", "brokers/kafka/example_test.go", "brokers/googlecloud/example_test.go"} {
		body := exampleBody(t, file, "ExampleSubscriberConfig")
		if !strings.Contains(string(doc), "```go\n"+body+"```\n") {
			t.Errorf("docs/consumers.md has no Go block equal to the body of ExampleSubscriberConfig in %s; copy it:\n%s", file, body)
		}
	}
}

// exampleBody returns the statements of function name in file, one tab of
// indentation removed, ending with a newline.
func exampleBody(t *testing.T, file, name string) string {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, file, src, parser.ParseComments)
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range f.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if !ok || fn.Name.Name != name {
			continue
		}
		inner := string(src[fset.Position(fn.Body.Lbrace).Offset+1 : fset.Position(fn.Body.Rbrace).Offset])
		lines := strings.Split(strings.TrimPrefix(inner, "\n"), "\n")
		for i, l := range lines {
			lines[i] = strings.TrimPrefix(l, "\t")
		}
		return strings.Join(lines, "\n")
	}
	t.Fatalf("%s has no %s", file, name)
	return ""
}
