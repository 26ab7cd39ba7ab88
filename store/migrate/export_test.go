package migrate

import (
	"bytes"
	"text/template"

	"github.com/outboxhq/outbox/store"
)

// RenderMigrationFile fills the names of cfg into the text of a migration
// file, as releases before the step runner did, for tests that build a
// schema as they left it.
func RenderMigrationFile(cfg store.Config, raw string) (string, error) {
	cfg, err := cfg.WithDefaults()
	if err != nil {
		return "", err
	}
	tmpl, err := template.New("file").Option("missingkey=error").Parse(raw)
	if err != nil {
		return "", err
	}
	var b bytes.Buffer
	if err := tmpl.Execute(&b, cfg.Names()); err != nil {
		return "", err
	}
	return b.String(), nil
}
