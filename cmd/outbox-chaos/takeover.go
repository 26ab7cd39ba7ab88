package main

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// TakeoverSLO bounds, in log mode, the time from a fault on the relay
// reading the slot (SIGKILL, SIGSTOP, every relay killed) until another
// walsender reads it.
const TakeoverSLO = 5 * time.Second

// takeoverLimit bounds the wait for a takeover; one not seen by then
// counts as the limit.
const takeoverLimit = 30 * time.Second

// slotHolder finds the relay reading the slot and its walsender's process
// id; pid is 0 when no one reads it, and s nil when the walsender's client
// is none of the relays.
func (f *faulter) slotHolder(ctx context.Context) (s *relaySlot, pid int32, err error) {
	var port *int32
	err = f.db.admin.QueryRow(ctx, `SELECT s.active_pid, a.client_port FROM pg_replication_slots s
JOIN pg_stat_activity a ON a.pid = s.active_pid WHERE s.slot_name = $1`, f.slot).Scan(&pid, &port)
	if errors.Is(err, pgx.ErrNoRows) || port == nil {
		return nil, pid, nil
	}
	if err != nil {
		return nil, 0, err
	}
	for _, r := range f.slots {
		if ports, err := r.clientPorts(); err == nil && slices.Contains(ports, *port) {
			return r, pid, nil
		}
	}
	return nil, pid, nil
}

// watchTakeover times, in the background, how long after since a
// walsender other than old reads the slot. The result is collected by
// takeovers.
func (f *faulter) watchTakeover(ctx context.Context, kind string, since time.Time, old int32) {
	ch := make(chan time.Duration, 1)
	f.pending = append(f.pending, pendingTakeover{kind: kind, d: ch})
	go func() {
		for {
			var pid *int32
			err := f.db.admin.QueryRow(ctx, `SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1`, f.slot).Scan(&pid)
			if err == nil && pid != nil && *pid != old {
				ch <- time.Since(since)
				return
			}
			if time.Since(since) > takeoverLimit || !sleep(ctx, 50*time.Millisecond) {
				ch <- takeoverLimit
				return
			}
		}
	}()
}

type pendingTakeover struct {
	kind string
	d    chan time.Duration
}

// takeovers waits for the takeovers being watched and records them.
func (f *faulter) takeovers() {
	for _, p := range f.pending {
		d := <-p.d
		f.log.Info("slot taken over", "kind", p.kind, "after", d.Round(10*time.Millisecond))
		f.takeover[p.kind] = append(f.takeover[p.kind], d)
	}
	f.pending = f.pending[:0]
}
