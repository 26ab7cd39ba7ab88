package store

import (
	"bytes"
	"context"
	"text/template"
)

// RenderMigrationFile fills the names of cfg into the text of a migration
// file, as releases before the step runner did, for tests that build a
// schema as they left it.
func RenderMigrationFile(cfg Config, raw string) (string, error) {
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

// SetDispatchedScanRows bounds filtered listings of dispatched events to n
// rows until the returned function restores the bound.
func SetDispatchedScanRows(n int64) (restore func()) {
	old := dispatchedScanRows
	dispatchedScanRows = n
	return func() { dispatchedScanRows = old }
}

// CloseSleeper closes the connection Sleep opened, as the end of Listen
// does, for tests that sleep without listening.
func (s *Store) CloseSleeper(ctx context.Context) { s.closeSleeper(ctx) }

// ShareKeys are the advisory lock classes of cfg's sharing members and
// partitions.
func ShareKeys(cfg Config) (member, part int32) {
	cfg, _ = cfg.WithDefaults()
	return (&Store{cfg: cfg}).shareKeys()
}
