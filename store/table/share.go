package table

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxhq/outbox/core"
)

// Partitions is how many parts ordered relays divide aggregates into; one
// relay at a time claims from each. Migration 11 indexes pending events by
// partitionOf, so the number is fixed by the schema.
const Partitions = 32

// partitionOf is an event's partition, as migration 11's index computes it.
const partitionOf = "(hashtext(aggregate_id) & 31)"

var _ core.Sharer = (*Source)(nil)

// share is how this store divides ordered work with the relays of other
// stores on the same table. Each relay's sharing session holds a session
// advisory lock that says it is a member, and one per partition it owns;
// pg_locks shows them all, so every member computes the same fair split
// and takes free partitions or frees its surplus at each round. A lock
// goes when its session ends: at once for a relay that dies, and after
// store.Config.ShareTimeout (the session's idle_session_timeout) for one that
// froze or lost its network. Correctness never rests on it: a claim skips
// rows another session has locked and holds back their aggregates, so
// two relays that both believe they own a partition stay disjoint and in
// order; sharing only keeps them out of each other's way.
type share struct {
	mu   sync.Mutex // the session's life
	stop context.CancelFunc
	done chan struct{}

	changedMu sync.Mutex
	changed   map[*func(float64)]struct{} // the relays' callbacks
	// owned, or its parts, is nil while the store claims from every
	// partition: no relay shares through it, its session is lost, or its
	// first round has not come.
	owned atomic.Pointer[owned]
}

// owned is a set of partitions and the ordered claim over them.
type owned struct {
	parts []int
	claim string
}

// part is the share of the partitions owned, 1 for every partition (nil).
func (o *owned) part() float64 {
	if o.parts == nil {
		return 1
	}
	return float64(len(o.parts)) / Partitions
}

// Share implements core.Sharer. Relays that share one Source share its
// partitions too: the first starts the sharing session, the last to
// return ends it, and the store claims from every partition again.
func (s *Source) Share(ctx context.Context, changed func(part float64)) error {
	sh := &s.share
	sh.mu.Lock()
	sh.changedMu.Lock()
	if sh.changed == nil {
		sh.changed = map[*func(float64)]struct{}{}
	}
	sh.changed[&changed] = struct{}{}
	if o := sh.owned.Load(); o != nil && o.parts != nil {
		changed(o.part()) // another relay of this store shares already
	}
	sh.changedMu.Unlock()
	if sh.stop == nil {
		// Every partition until the first round says otherwise: a relay
		// that starts claims at once, in the others' way at worst.
		s.setOwned(nil, false)
		sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		sh.stop, sh.done = cancel, make(chan struct{})
		go func(done chan struct{}) {
			defer close(done)
			s.shareLoop(sctx)
		}(sh.done)
	}
	sh.mu.Unlock()
	<-ctx.Done()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.changedMu.Lock()
	delete(sh.changed, &changed)
	last := len(sh.changed) == 0
	sh.changedMu.Unlock()
	if last {
		sh.stop()
		<-sh.done
		sh.stop, sh.done = nil, nil
		sh.owned.Store(nil)
	}
	return nil
}

// Owned lists the partitions this store's relays own, in order; nil when
// none shares through it, or its sharing session is lost: its claims then
// read every partition.
func (s *Source) Owned() []int {
	if o := s.share.owned.Load(); o != nil {
		return slices.Clone(o.parts)
	}
	return nil
}

// setOwned records parts as owned; announced, it logs the change and
// tells the relays their new part.
func (s *Source) setOwned(parts []int, announce bool) {
	old := s.share.owned.Load()
	if old != nil && slices.Equal(old.parts, parts) && (old.parts == nil) == (parts == nil) {
		return
	}
	claim := s.claimAll // one scan rather than a merge of every partition
	if parts != nil && len(parts) < Partitions {
		claim = s.orderedClaim(parts)
	}
	now := &owned{parts: parts, claim: claim}
	s.share.owned.Store(now)
	if !announce {
		return
	}
	if parts == nil {
		s.log.Info("partitions owned", "table", s.cfg.Table, "count", Partitions, "partitions", "all, unshared")
	} else {
		s.log.Info("partitions owned", "table", s.cfg.Table, "count", len(parts), "partitions", parts)
	}
	s.share.changedMu.Lock()
	defer s.share.changedMu.Unlock()
	for f := range s.share.changed {
		(*f)(now.part())
	}
}

// shareLoop runs sharing sessions until ctx is done, reconnecting after a
// lost one. Without a session the relay knows nothing of the others'
// partitions and claims from all of them, as an unshared store does: row
// locks keep that correct, and a relay never stops for want of sharing
// (a server that refuses the session, one older than PostgreSQL 14).
func (s *Source) shareLoop(ctx context.Context) {
	_ = sessionBackoff.Retry(ctx, func(connected func()) error { return s.shareOnce(ctx, connected) },
		func(err error, wait time.Duration) {
			s.setOwned(nil, true)
			s.log.Warn("partition sharing lost its session; claiming from every partition until it is back", "error", err, "retry_in", wait)
		})
	s.setOwned([]int{}, false)
}

// shareKeys are the advisory lock classes of the table's members and
// partitions (two-key locks: class, then pid or partition).
func (s *Source) shareKeys() (member, part int32) {
	h := func(what string) int32 {
		f := fnv.New32a()
		_, _ = f.Write([]byte("outbox-" + what + ":" + s.cfg.Schema + "." + s.cfg.Table))
		return int32(f.Sum32() & 0x7fffffff)
	}
	return h("members"), h("partitions")
}

func (s *Source) shareOnce(ctx context.Context, connected func()) error {
	cc := s.pool.Config().ConnConfig.Copy()
	// A frozen or cut-off relay's session ends after this long without a
	// round, and its locks with it.
	cc.RuntimeParams["idle_session_timeout"] = fmt.Sprint(s.cfg.ShareTimeout.Milliseconds())
	cc.RuntimeParams["application_name"] = "outbox share " + s.cfg.Schema + "." + s.cfg.Table
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		return fmt.Errorf("connect sharing session: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	member, part := s.shareKeys()
	var pid int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid(), pg_advisory_lock($1::int, pg_backend_pid())", member).Scan(&pid, nil); err != nil {
		return fmt.Errorf("join partition sharing: %w", err)
	}
	connected()
	for {
		short, err := s.rebalance(ctx, conn, pid, member, part)
		if err != nil {
			return err
		}
		// Below its share, the relay waits for others to free their
		// surplus at their next round, and looks again soon.
		wait := s.cfg.ShareInterval
		if short {
			wait /= 10
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// rebalance runs one round: read who is a member and who owns what, then
// free this relay's surplus over its fair share or take free partitions
// up to it. The members in pid order get Partitions/members each, the
// first Partitions%members one more. It reports whether this relay is
// left below its share.
func (s *Source) rebalance(ctx context.Context, conn *pgx.Conn, pid, member, part int32) (short bool, err error) {
	rctx, cancel := context.WithTimeout(ctx, s.cfg.ShareTimeout)
	defer cancel()
	rows, err := conn.Query(rctx, `SELECT classid::bigint, objid::bigint, pid FROM pg_locks
WHERE locktype = 'advisory' AND objsubid = 2 AND granted
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid IN ($1::int::oid, $2::int::oid)`, member, part)
	if err != nil {
		return false, fmt.Errorf("read partition owners: %w", err)
	}
	var members []int32
	ownerOf := map[int]int32{}
	for rows.Next() {
		var class, obj int64
		var holder int32
		if err := rows.Scan(&class, &obj, &holder); err != nil {
			rows.Close()
			return false, fmt.Errorf("read partition owners: %w", err)
		}
		if int32(class) == member {
			members = append(members, holder)
		} else if obj >= 0 && obj < Partitions {
			ownerOf[int(obj)] = holder
		}
	}
	if err := rows.Err(); err != nil {
		return false, fmt.Errorf("read partition owners: %w", err)
	}
	slices.Sort(members)
	i := slices.Index(members, pid)
	if i < 0 {
		return false, errors.New("read partition owners: this session's member lock is missing")
	}
	want := Partitions / len(members)
	if i < Partitions%len(members) {
		want++
	}
	var mine, free []int
	for p := range Partitions {
		switch holder, ok := ownerOf[p]; {
		case !ok:
			free = append(free, p)
		case holder == pid:
			mine = append(mine, p)
		}
	}
	switch {
	case len(mine) > want:
		// The surplus goes first, so no claim starts in it meanwhile; a
		// claim already open in it keeps its rows locked, and the next
		// owner waits for them (see share).
		surplus := mine[want:]
		mine = mine[:want]
		s.setOwned(slices.Clone(mine), true)
		if _, err := conn.Exec(rctx, `SELECT pg_advisory_unlock($1::int, p) FROM unnest($2::int[]) p`, part, surplus); err != nil {
			return false, fmt.Errorf("free partitions: %w", err)
		}
	case len(mine) < want && len(free) > 0:
		rows, err := conn.Query(rctx, `SELECT p FROM unnest($2::int[]) p WHERE pg_try_advisory_lock($1::int, p) LIMIT $3`,
			part, free, want-len(mine))
		if err != nil {
			return false, fmt.Errorf("take partitions: %w", err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return false, fmt.Errorf("take partitions: %w", err)
		}
		for _, p := range got {
			mine = append(mine, int(p))
		}
		slices.Sort(mine)
	}
	s.setOwned(mine, true)
	return len(mine) < want, nil
}
