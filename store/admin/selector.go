package admin

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/outboxhq/outbox/core/event"
)

// Selector names the events an operator command (replay, retry, park,
// unpark) acts on. Set fields are combined with AND; at least one must be
// set, so that no command acts on every event by accident.
type Selector struct {
	Seqs           []int64   // event positions (column seq); at most MaxSelected
	FromSeq, ToSeq int64     // inclusive seq range; 0 leaves that end open
	AggregateID    string    // the aggregate key, exactly as written
	Type           string    // exact event type
	CreatedAfter   time.Time // created at or after; zero leaves it open
	CreatedBefore  time.Time // created before; zero leaves it open
	// Fingerprint selects events whose last error has this fingerprint
	// (FailureGroup.Fingerprint): one failure across many events.
	Fingerprint string
}

// String describes the selector for logs and messages.
func (sel Selector) String() string {
	var parts []string
	if len(sel.Seqs) > 0 {
		ids := make([]string, 0, min(len(sel.Seqs), 10))
		for i, id := range sel.Seqs {
			if i == 10 {
				ids = append(ids, fmt.Sprintf("... %d in all", len(sel.Seqs)))
				break
			}
			ids = append(ids, strconv.FormatInt(id, 10))
		}
		parts = append(parts, "seqs "+strings.Join(ids, ","))
	}
	switch {
	case sel.FromSeq > 0 && sel.ToSeq > 0:
		parts = append(parts, fmt.Sprintf("seqs %d..%d", sel.FromSeq, sel.ToSeq))
	case sel.FromSeq > 0:
		parts = append(parts, fmt.Sprintf("seqs from %d", sel.FromSeq))
	case sel.ToSeq > 0:
		parts = append(parts, fmt.Sprintf("seqs up to %d", sel.ToSeq))
	}
	if sel.AggregateID != "" {
		parts = append(parts, "aggregate "+sel.AggregateID)
	}
	if sel.Type != "" {
		parts = append(parts, "type "+strconv.Quote(sel.Type))
	}
	if !sel.CreatedAfter.IsZero() {
		parts = append(parts, "created from "+sel.CreatedAfter.UTC().Format(time.RFC3339))
	}
	if !sel.CreatedBefore.IsZero() {
		parts = append(parts, "created before "+sel.CreatedBefore.UTC().Format(time.RFC3339))
	}
	if sel.Fingerprint != "" {
		parts = append(parts, "error like "+strconv.Quote(sel.Fingerprint))
	}
	if len(parts) == 0 {
		return "nothing"
	}
	return strings.Join(parts, " and ")
}

// where returns SQL conditions on the outbox's columns (qualified by alias
// when set) and their arguments, numbered from $next.
func (sel Selector) where(alias string, next int) (string, []any, error) {
	var (
		conds []string
		args  []any
	)
	col := func(c string) string {
		if alias == "" {
			return c
		}
		return alias + "." + c
	}
	param := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(next+len(args)-1)
	}
	switch {
	case len(sel.Seqs) > MaxSelected:
		return "", nil, invalid("selector: %d seqs, over the maximum of %d", len(sel.Seqs), MaxSelected)
	case sel.FromSeq < 0 || sel.ToSeq < 0:
		return "", nil, invalid("selector: seqs must be positive")
	case sel.ToSeq > 0 && sel.ToSeq < sel.FromSeq:
		return "", nil, invalid("selector: seq range %d..%d is empty", sel.FromSeq, sel.ToSeq)
	case !sel.CreatedAfter.IsZero() && !sel.CreatedBefore.IsZero() && !sel.CreatedBefore.After(sel.CreatedAfter):
		return "", nil, invalid("selector: created-before is not after created-after")
	}
	if len(sel.Seqs) > 0 {
		for _, id := range sel.Seqs {
			if id <= 0 {
				return "", nil, invalid("selector: seq %d is not a valid event position", id)
			}
		}
		conds = append(conds, col("seq")+" = ANY("+param(sel.Seqs)+"::bigint[])")
	}
	if sel.FromSeq > 0 {
		conds = append(conds, col("seq")+" >= "+param(sel.FromSeq))
	}
	if sel.ToSeq > 0 {
		conds = append(conds, col("seq")+" <= "+param(sel.ToSeq))
	}
	if sel.AggregateID != "" {
		if err := event.CheckKey(sel.AggregateID); err != nil {
			return "", nil, invalid("selector: aggregate id %q %w", event.Truncate(sel.AggregateID, 64), err)
		}
		conds = append(conds, col("aggregate_id")+" = "+param(sel.AggregateID))
	}
	if sel.Type != "" {
		conds = append(conds, col("type")+" = "+param(sel.Type))
	}
	if !sel.CreatedAfter.IsZero() {
		conds = append(conds, col("created_at")+" >= "+param(sel.CreatedAfter))
	}
	if !sel.CreatedBefore.IsZero() {
		conds = append(conds, col("created_at")+" < "+param(sel.CreatedBefore))
	}
	if sel.Fingerprint != "" {
		conds = append(conds, col("last_error")+" IS NOT NULL AND "+fingerprint(col("last_error"))+" = "+param(sel.Fingerprint))
	}
	if len(conds) == 0 {
		return "", nil, invalid("selector is empty: name event seqs, a seq range, an aggregate, a type, a time range or an error fingerprint")
	}
	return strings.Join(conds, " AND "), args, nil
}

// Validate reports what is wrong with sel (empty, a bad id or range, an
// aggregate id the table cannot hold) without touching the database: the
// check Retry, Park, Unpark and Replay make first.
func (sel Selector) Validate() error {
	_, _, err := sel.where("", 1)
	return err
}
