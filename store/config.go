package store

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core/event"
)

// Config names the database objects of one outbox and bounds what the
// relay reads. Names are quoted wherever they appear in SQL, so any value
// is safe; the zero Config uses the defaults below. The koanf tags are the
// keys of the binary's "store" section.
type Config struct {
	Schema         string `koanf:"schema"`          // default "public"
	Table          string `koanf:"table"`           // outbox table; default "events_outbox"
	ProcessedTable string `koanf:"processed_table"` // consumer dedupe table; default "processed_events"
	// NotifyChannel is the LISTEN/NOTIFY channel the table's trigger
	// signals and the relay listens on; default: the outbox table's name.
	// Migration 4 fixes the trigger's channel when it runs.
	NotifyChannel string `koanf:"notify_channel"`

	// MaxEventBytes is the largest row the relay reads, payload and headers
	// as stored; a larger row is held for an operator without its payload
	// leaving the server. Defaults to 4 MiB, room above the Go writer's
	// 1 MiB payload limit; at most 1 GiB.
	MaxEventBytes int `koanf:"max_event_bytes"`
	// MaxClaimBytes bounds the payload and header bytes of one claim, so a
	// backlog of large rows does not grow the relay's memory; a claim
	// always takes at least one row. Defaults to 16 MiB; at least
	// MaxEventBytes, at most 1 GiB.
	MaxClaimBytes int `koanf:"max_claim_bytes"`

	// ShareInterval is how often an ordered relay reads who shares the
	// table and takes or frees partitions (see Store.Share): a relay that
	// joins gets its share, and the partitions of one that died are taken,
	// within about one. Default 500ms, at least 10ms.
	ShareInterval time.Duration `koanf:"share_interval"`
	// ShareTimeout is how long PostgreSQL keeps the partitions of a relay
	// that stopped answering (frozen, cut off) before it ends the relay's
	// sharing session and the others take them; at least three
	// ShareInterval. Default 10s.
	ShareTimeout time.Duration `koanf:"share_timeout"`
}

// minShareInterval bounds how often a relay reads pg_locks.
const minShareInterval = 10 * time.Millisecond

// Byte limits of a claim.
const (
	DefaultMaxEventBytes = 4 << 20
	DefaultMaxClaimBytes = 16 << 20
	maxBytesLimit        = 1 << 30
)

// WithDefaults fills unset names and checks them.
func (c Config) WithDefaults() (Config, error) {
	if c.Schema == "" {
		c.Schema = "public"
	}
	if c.Table == "" {
		c.Table = "events_outbox"
	}
	if c.ProcessedTable == "" {
		c.ProcessedTable = "processed_events"
	}
	if c.NotifyChannel == "" {
		c.NotifyChannel = c.Table
	}
	for _, f := range []struct{ field, v string }{
		{"schema", c.Schema}, {"table", c.Table}, {"processed_table", c.ProcessedTable}, {"notify_channel", c.NotifyChannel},
	} {
		if err := checkName(f.v); err != nil {
			return c, fmt.Errorf("store config: %s %q: %w", f.field, f.v, err)
		}
	}
	if c.MaxEventBytes == 0 {
		c.MaxEventBytes = DefaultMaxEventBytes
	}
	if c.MaxClaimBytes == 0 {
		c.MaxClaimBytes = max(DefaultMaxClaimBytes, c.MaxEventBytes)
	}
	switch {
	case c.MaxEventBytes < 0 || c.MaxEventBytes > maxBytesLimit:
		return c, fmt.Errorf("store config: max_event_bytes %d is out of range 1..%d", c.MaxEventBytes, maxBytesLimit)
	case c.MaxClaimBytes < c.MaxEventBytes || c.MaxClaimBytes > maxBytesLimit:
		return c, fmt.Errorf("store config: max_claim_bytes %d is out of range %d (max_event_bytes)..%d", c.MaxClaimBytes, c.MaxEventBytes, maxBytesLimit)
	}
	if c.ShareInterval == 0 {
		c.ShareInterval = 500 * time.Millisecond
	}
	if c.ShareTimeout == 0 {
		c.ShareTimeout = max(10*time.Second, 3*c.ShareInterval)
	}
	switch {
	case c.ShareInterval < minShareInterval:
		return c, fmt.Errorf("store config: share_interval %s is below %s: each round reads pg_locks", c.ShareInterval, minShareInterval)
	case c.ShareTimeout < 3*c.ShareInterval:
		return c, fmt.Errorf("store config: share_timeout %s is below three share_interval (%s)", c.ShareTimeout, 3*c.ShareInterval)
	}
	if c.Table == c.ProcessedTable {
		return c, errors.New("store config: table and processed_table must differ")
	}
	return c, nil
}

// PostgreSQL truncates identifiers to 63 bytes; derived index names add up
// to 16 bytes, so table names stay at 47.
func checkName(s string) error {
	switch {
	case !utf8.ValidString(s):
		return errors.New("not valid UTF-8")
	case len(s) > 47:
		return errors.New("longer than 47 bytes")
	}
	for _, r := range s {
		if r == 0 {
			return errors.New("contains a NUL byte")
		}
	}
	return nil
}

// Literal quotes s as an SQL string literal.
func Literal(s string) string {
	return "E'" + strings.NewReplacer(`\`, `\\`, "'", "''").Replace(s) + "'"
}

// LogWriteFunc is the quoted name of the function that writes a log-only
// event (migration 9).
func (c Config) LogWriteFunc() (string, error) {
	c, err := c.WithDefaults()
	if err != nil {
		return "", err
	}
	return c.Names().LogWriteFunc, nil
}

// autoIndexName is the name PostgreSQL gives CREATE INDEX ON table (column)
// when none is given: migrations 2 and 3 let it choose, and build their
// indexes concurrently now, which needs the name to resume. The table part
// is clipped first, as PostgreSQL does, to fit 63 bytes.
func autoIndexName(table, column string) string {
	const label = "idx"
	avail := 63 - len(label) - 2
	t, c := len(table), len(column)
	for t+c > avail {
		if t > c {
			t--
		} else {
			c--
		}
	}
	return clipUTF8(table, t) + "_" + clipUTF8(column, c) + "_" + label
}

// clipUTF8 cuts s to at most n bytes without splitting a character.
func clipUTF8(s string, n int) string {
	for n > 0 && n < len(s) && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// Ident quotes a possibly schema-qualified name for SQL.
func Ident(parts ...string) string { return pgx.Identifier(parts).Sanitize() }

// Names are the quoted SQL names derived from a Config.
type Names struct {
	Schema, Outbox, Processed, Migrations              string
	PendingIdx, AggregateIdx, RetryIdx, ProcessedAtIdx string
	EventIDIdx, TypeCheck, HeadersCheck, NotifyTrigger string
	EventIDFunc, NotifyFunc                            string
	KeyCheck, PayloadCheck, ContentTypeCheck           string // migration 7
	TopicCheck, DeliverCheck, ReservedCheck            string
	WriteFunc, ScheduleFunc, ScheduleTrigger           string
	HandoffView, HandoffIdx                            string // migration 8: the log relay's table path
	FailedIdx                                          string
	LogWriteFunc                                       string // migration 9
	LogSlot                                            string // migration 13
	PartitionIdx                                       string // migration 11
	RowCheck, RowCheckFunc, WakeKeyLiteral             string // migration 12
	LogPrefixLiteral, SchemaLiteral, TableLiteral      string // quoted literals
	HandOffPrefixLiteral                               string
	DispatchedIdx, ParkedIdx                           string // named by PostgreSQL before, see autoIndexName
	KeySyncFunc, KeySyncTrigger, KeyNotNull            string // migration 7's new column, until the swap
	AggregateIdxNew, RetryIdxNew                       string
	Channel                                            string // raw, for pg_notify and LISTEN
	WakeKey                                            string // raw, the sleeping relay's lock key (see WakeKeyLiteral)
	ChannelLiteral                                     string // quoted, for the notify trigger
}

// Names returns the quoted SQL names of the objects c names. c must have
// its defaults filled in (WithDefaults).
func (c Config) Names() Names {
	return Names{
		Schema:         Ident(c.Schema),
		Outbox:         Ident(c.Schema, c.Table),
		Processed:      Ident(c.Schema, c.ProcessedTable),
		Migrations:     Ident(c.Schema, c.Table+"_migrations"),
		PendingIdx:     Ident(c.Table + "_pending"),
		AggregateIdx:   Ident(c.Table + "_pending_agg"),
		RetryIdx:       Ident(c.Table + "_retrying"),
		ProcessedAtIdx: Ident(c.ProcessedTable + "_at"),
		EventIDIdx:     Ident(c.Table + "_uid"), // named before migration 5 renamed the column
		TypeCheck:      Ident(c.Table + "_type_check"),
		HeadersCheck:   Ident(c.Table + "_headers_check"),
		NotifyTrigger:  Ident(c.Table + "_notify"),
		EventIDFunc:    Ident(c.Schema, c.Table+"_uuidv7"),
		NotifyFunc:     Ident(c.Schema, c.Table+"_notify"),
		HandoffView:    Ident(c.Schema, c.Table+"_handoff"),
		HandoffIdx:     Ident(c.Table + "_handoff_agg"),
		FailedIdx:      Ident(c.Table + "_failed"),
		PartitionIdx:   Ident(c.Table + "_pending_part"),
		RowCheck:       Ident(c.Table + "_row_check"),
		RowCheckFunc:   Ident(c.Schema, c.Table+"_check_row"),
		WakeKeyLiteral: Literal(wakeKey(c.Schema, c.Table)),
		WakeKey:        wakeKey(c.Schema, c.Table),
		DispatchedIdx:  Ident(autoIndexName(c.Table, "dispatched_at")),
		ParkedIdx:      Ident(autoIndexName(c.Table, "id")),

		KeySyncFunc:     Ident(c.Schema, c.Table+"_key_sync"),
		KeySyncTrigger:  Ident(c.Table + "_key_sync"),
		KeyNotNull:      Ident(c.Table + "_key_notnull"),
		AggregateIdxNew: Ident(c.Table + "_agg_new"),
		RetryIdxNew:     Ident(c.Table + "_retry_new"),

		KeyCheck:             Ident(c.Table + "_key_check"),
		PayloadCheck:         Ident(c.Table + "_payload_check"),
		ContentTypeCheck:     Ident(c.Table + "_ctype_check"),
		TopicCheck:           Ident(c.Table + "_topic_check"),
		DeliverCheck:         Ident(c.Table + "_deliver_check"),
		ReservedCheck:        Ident(c.Table + "_reserved_check"),
		WriteFunc:            Ident(c.Schema, c.Table+"_write"),
		ScheduleFunc:         Ident(c.Schema, c.Table+"_schedule"),
		ScheduleTrigger:      Ident(c.Table + "_schedule"),
		LogWriteFunc:         Ident(c.Schema, c.Table+"_log_write"),
		LogSlot:              Ident(c.Schema, c.Table+"_log_slot"),
		LogPrefixLiteral:     Literal(event.MessagePrefix(c.Schema, c.Table)),
		HandOffPrefixLiteral: Literal(HandOffPrefix(c.Schema, c.Table)),
		SchemaLiteral:        Literal(c.Schema),
		TableLiteral:         Literal(c.Table),
		Channel:              c.NotifyChannel,
		ChannelLiteral:       Literal(c.NotifyChannel),
	}
}

// wakeKey is the text whose hash is the advisory lock a sleeping relay
// holds and a writing producer tries shared (the notify trigger's WHEN).
func wakeKey(schema, table string) string { return "outbox-wake:" + schema + "." + table }

// HandOff returns the configuration of the outbox's handoff view
// (migration 8): the table path of log mode claims through it only the
// rows the log relay handed to the table.
func (c Config) HandOff() (Config, error) {
	c, err := c.WithDefaults()
	if err != nil {
		return c, err
	}
	c.Table += "_handoff"
	if _, err := c.WithDefaults(); err != nil {
		return c, fmt.Errorf("handoff view of %s: %w", c.Table, err)
	}
	return c, nil
}
