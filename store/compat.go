package store

// The log table's statements still use these names.

func (c Config) names() Names { return c.Names() }

func literal(s string) string { return Literal(s) }

func handOffPrefix(schema, table string) string { return HandOffPrefix(schema, table) }

func asText(s string) string { return AsText(s) }

// Execer is DBTX.
type Execer = DBTX
