package logrelay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/outboxhq/outbox/core"
)

// stream is one session's reading of the slot. The reader (run) owns the
// connection and confirms positions; the events it reads wait in the
// stream's buffer, from which a core.Relay, the engine, claims them (see
// source.go).
type stream struct {
	r         *Relay
	conn      *pgconn.PgConn
	tracker   *tracker
	relations map[uint32]*pglogrepl.RelationMessage
	engine    *core.Relay
	marks     *marker // marks the published rows of every claim

	// horizon is the end of the server's WAL when this session took the
	// slot: a relay that read it before read nothing past it.
	horizon pglogrepl.LSN

	// reader state
	txn        *txn
	commitTime time.Time
	received   pglogrepl.LSN
	confirmed  pglogrepl.LSN // the position last sent as flushed
	statusAt   time.Time     // when a status was last sent
	lastRecv   time.Time     // when the server last sent anything
	drained    bool          // the reader ended in drain: the engine stopped

	// clockOffset is the server's clock minus this host's (nanoseconds),
	// from the send time of the server's last message: deliver-at times
	// are the database's, compared with its clock.
	clockOffset atomic.Int64

	freed  chan struct{} // a token whenever an event is done
	bytes  atomic.Int64  // payload bytes in flight
	events atomic.Int64

	// stopping is closed when the server is shutting down (serverStops).
	stopping  chan struct{}
	stopOnce  sync.Once
	stopCause error

	mu       sync.Mutex
	buffered []*item // read, not yet claimed
	// handedOff holds the aggregates whose events go to the table (see
	// handOffNote). Entries go when a lookup or a sweep finds the
	// aggregate with nothing pending handed off.
	handedOff map[string]handOffNote
	notes     uint64    // the stamp of the last note
	sweepAt   int       // the size of handedOff that starts a sweep at once
	sweptAt   time.Time // when the last sweep began
	sweeping  atomic.Bool

	// The position of the last events done, for recordPositions.
	toRecord   atomic.Uint64
	recordWake chan struct{}

	// What runs beside the reader (goAside) ends with the session.
	aside    sync.WaitGroup
	asideCtx context.Context
}

// item is one event read from the slot.
type item struct {
	ev   core.Event
	txn  *txn
	row  bool  // from a row of the table (ev.Seq is its seq), not a message
	size int64 // payload and header bytes
	bad  error // cannot be relayed: held in the table
	wait bool  // inserted to wait (retry_at set): the table path's
	// deliverAt, when in the future, is when a scheduled event is due;
	// until then it is the table path's too.
	deliverAt time.Time
	// retryAt, once set, is when the table path retries an event handed
	// over after transient failures; it is not held.
	retryAt time.Time
	raw     []byte
	// maybeSent: an event read from before the session's horizon, which
	// the relay that read the slot before may have published or handed
	// off.
	maybeSent bool
}

// run reads the slot until ctx ends (then it drains), the server ends the
// stream or the connection fails. Each turn it sends what the status
// clock says is due, then either waits for an event to be done (the
// in-flight bounds are reached) or handles what the server sent.
func (s *stream) run(ctx context.Context) error {
	stop, err := s.start()
	if err != nil {
		return err
	}
	defer stop()
	clock := newStatusClock(s.r.opts.StatusInterval)
	var recv deadline
	defer recv.stop()
	s.lastRecv = time.Now()
	for {
		if ctx.Err() != nil {
			return s.drain()
		}
		select {
		case <-s.stopping:
			return fmt.Errorf("end the stream so the server can shut down: %w", s.stopCause)
		default:
		}
		if err := s.keepTime(ctx, &clock); err != nil {
			return s.end(err)
		}
		wake := s.wakeAt(clock)
		if s.full() {
			s.waitFreed(ctx, wake)
			continue
		}
		// One deadline per wake time, not per message: at a steady rate
		// a context and its timer for each of a transaction's messages
		// were a tenth of the relay's CPU.
		if err := s.receive(ctx, recv.until(ctx, wake)); err != nil {
			return s.end(err)
		}
	}
}

// errDrain ends the reading with the connection still sound: ctx ended
// while the reader waited on the server. The stream then drains.
var errDrain = errors.New("stopped: drain the stream")

// end ends the reading with err, draining first for errDrain.
func (s *stream) end(err error) error {
	if errors.Is(err, errDrain) {
		return s.drain()
	}
	return err
}

// start starts what runs beside the reader for the session: the
// recording of positions, the marker and the engine. stop ends them: the
// engine at once unless the stream drained it, then the marker, then
// what runs aside (sweeps of the handed-off aggregates too).
func (s *stream) start() (stop func(), err error) {
	s.freed = make(chan struct{}, 1)
	s.recordWake = make(chan struct{}, 1)
	var cancelAside context.CancelFunc
	s.asideCtx, cancelAside = context.WithCancel(context.Background())
	stopAside := func() { cancelAside(); s.aside.Wait() }
	s.goAside(s.recordPositions)
	engine, err := core.New(s, s.r.pub, s.r.opts.Options)
	if err != nil {
		stopAside()
		return nil, fmt.Errorf("start engine: %w", err)
	}
	s.engine = engine
	// The marker outlives the engine: a stopping engine still records what
	// it published.
	s.marks = newMarker(s.writeMarks)
	mctx, mcancel := context.WithCancel(context.Background())
	marking := make(chan struct{})
	go func() {
		defer close(marking)
		s.marks.run(mctx)
	}()
	stopMarker := func() { mcancel(); <-marking }
	if err := engine.Start(context.Background()); err != nil {
		stopMarker()
		stopAside()
		return nil, fmt.Errorf("start engine: %w", err)
	}
	return func() {
		if !s.drained {
			// The session failed: what is in flight is dropped with it and
			// read again by the next one; what the broker took is still
			// recorded.
			cut, cancel := context.WithCancel(context.Background())
			cancel()
			_ = engine.Stop(cut)
		}
		stopMarker()
		s.r.inFlight.Add(-s.events.Load())
		stopAside()
	}, nil
}

// goAside runs f beside the reader until the session ends.
func (s *stream) goAside(f func(ctx context.Context)) {
	s.aside.Add(1)
	go func() {
		defer s.aside.Done()
		f(s.asideCtx)
	}()
}

// statusClock is when the next status and the next confirmation are due.
type statusClock struct {
	status, confirm time.Time
	confirmAfter    time.Duration
}

func newStatusClock(statusInterval time.Duration) statusClock {
	now := time.Now()
	return statusClock{status: now, confirm: now, confirmAfter: min(statusInterval, confirmEvery)}
}

// keepTime sends what the clock says is due: each status interval a
// status asking for a reply (see status), and in between a confirmation
// of a position that moved.
func (s *stream) keepTime(ctx context.Context, c *statusClock) error {
	now := time.Now()
	switch {
	case !now.Before(c.status):
		if err := s.status(ctx); err != nil {
			return err
		}
		c.status, c.confirm = now.Add(s.r.opts.StatusInterval), now.Add(c.confirmAfter)
	case !now.Before(c.confirm):
		if s.unconfirmed() {
			if err := s.sendStatus(false); err != nil {
				return err
			}
		}
		c.confirm = now.Add(c.confirmAfter)
	}
	return nil
}

// status is the work of each status interval: a check of the
// publication, a status asking for a reply, and a sweep of the handed-off
// aggregates when one is due.
func (s *stream) status(ctx context.Context) error {
	// The publication can change under a running relay: checked with
	// each status, so it is noticed within one.
	qctx, qcancel := context.WithTimeout(ctx, s.r.opts.StatusInterval)
	err := s.r.checkPublication(qctx)
	qcancel()
	if err != nil {
		if ctx.Err() != nil {
			return errDrain
		}
		if errors.Is(err, ErrNotPublished) || errors.Is(err, ErrPublicationFiltered) {
			return err
		}
		if serverStopping(err) {
			// Whatever the engine is doing (a broker outage, a hand-off),
			// a server shutting down waits for this stream: ended here,
			// within a status interval.
			return fmt.Errorf("end the stream so the server can shut down: %w", err)
		}
		s.r.log.Warn("log relay: check publication failed", "error", err)
	}
	if err := s.sendStatus(true); err != nil {
		return err
	}
	if s.sweepDue() {
		s.goAside(s.sweepHandedOff)
	}
	return nil
}

// wakeAt is when the reader stops waiting for the server: at the next
// status, or at the next confirmation while a position can move.
func (s *stream) wakeAt(c statusClock) time.Time {
	// A position moves only while events are in flight (finish marks the
	// tracker before the count drops, so the count is read first): an
	// idle reader sleeps until the next status, not every confirmEvery,
	// and whatever it reads wakes it.
	wake := c.status
	if c.confirm.Before(wake) && (s.events.Load() > 0 || s.unconfirmed()) {
		wake = c.confirm
	}
	return wake
}

// waitFreed is the back-pressure: it reads nothing until an event is done
// or wake, when the clock keeps confirming so the server keeps the
// connection.
func (s *stream) waitFreed(ctx context.Context, wake time.Time) {
	t := time.NewTimer(time.Until(wake))
	defer t.Stop()
	select {
	case <-s.freed:
	case <-t.C:
	case <-s.stopping:
	case <-ctx.Done():
	}
	// lastRecv stays: reading resumes with what the server sent meanwhile
	// (the replies to these statuses at least), so a live connection
	// answers at once and a dead one is noticed at the first receive.
}

// receive handles the next message from the server, waiting for it until
// rctx ends (the wake time): a wait that ends is no error unless nothing
// came for ReceiveTimeout, when the connection is presumed dead.
func (s *stream) receive(ctx, rctx context.Context) error {
	o := s.r.opts
	msg, err := s.conn.ReceiveMessage(rctx)
	if err != nil {
		if ctx.Err() != nil {
			// Stopped while waiting for the server: the connection is
			// still good (only the wait was cut short).
			return errDrain
		}
		if pgconn.Timeout(err) {
			if since := time.Since(s.lastRecv); since > o.ReceiveTimeout {
				return fmt.Errorf("no message from the server for %s (limit %s): connection presumed dead", since.Round(time.Millisecond), o.ReceiveTimeout)
			}
			return nil
		}
		return fmt.Errorf("receive from slot %s: %w", o.Slot.Name, err)
	}
	s.lastRecv = time.Now()
	switch msg := msg.(type) {
	case *pgproto3.CopyData:
		return s.handle(ctx, msg.Data)
	case *pgproto3.ErrorResponse:
		return fmt.Errorf("slot %s: %w", o.Slot.Name, pgconn.ErrorResponseToPgError(msg))
	case *pgproto3.CopyDone:
		return fmt.Errorf("slot %s: the server ended the stream", o.Slot.Name)
	}
	return nil
}

// confirmEvery is how soon a position that moved is confirmed, not only at
// each status: what a kill makes the next relay re-send is what was done
// since the last confirmation.
const confirmEvery = 100 * time.Millisecond

// unconfirmed says whether the position moved since it was last confirmed.
func (s *stream) unconfirmed() bool {
	pos, _ := s.tracker.position()
	return pos > s.confirmed
}

// full says whether the in-flight bounds are reached; one event is always
// let in.
func (s *stream) full() bool {
	n := s.events.Load()
	return n > 0 && (n >= int64(s.r.opts.MaxInFlight) || s.bytes.Load() >= int64(s.r.opts.MaxInFlightBytes))
}

// drain stops the engine, which finishes the events read (bounded by
// ShutdownTimeout), confirming meanwhile, confirms a last time and ends
// the stream. It reads nothing from the server, so its statuses keep to
// the clock, however often events finish: the server ends a session that
// sends none for wal_sender_timeout, and a confirmation sent after that is
// lost.
func (s *stream) drain() error {
	s.drained = true
	o := s.r.opts
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		ctx, cancel := context.WithTimeout(context.Background(), o.ShutdownTimeout)
		defer cancel()
		_ = s.engine.Stop(ctx)
	}()
	tick := time.NewTicker(min(o.StatusInterval, confirmEvery))
	defer tick.Stop()
	for waiting := true; waiting; {
		select {
		case <-stopped:
			waiting = false
		case <-tick.C:
			if pos, _ := s.tracker.position(); pos > s.confirmed || time.Since(s.statusAt) >= o.StatusInterval {
				_ = s.sendStatus(false)
			}
		}
	}
	if n := s.events.Load(); n > 0 {
		s.r.log.Warn("log relay stopped with events in flight; the next relay republishes them", "events", n)
	}
	if err := s.sendStatus(false); err != nil {
		return err
	}
	s.recordLast()
	return s.endCopy()
}

// endCopy ends the stream the way the protocol does (CopyDone, answered by
// the server's CopyDone and the end of the command), bounded by
// ReceiveTimeout. The server handles messages in order, so once it
// answers, the last confirmation is recorded; a connection merely closed
// can lose it, when the server is busy sending or already gave up on us.
func (s *stream) endCopy() error {
	ctx, cancel := context.WithTimeout(context.Background(), s.r.opts.ReceiveTimeout)
	defer cancel()
	s.conn.Frontend().Send(&pgproto3.CopyDone{})
	if err := s.conn.Frontend().Flush(); err != nil {
		return fmt.Errorf("end stream of slot %s: %w", s.r.opts.Slot.Name, err)
	}
	for {
		msg, err := s.conn.ReceiveMessage(ctx)
		if err != nil {
			return fmt.Errorf("end stream of slot %s: the server did not acknowledge position %s: %w", s.r.opts.Slot.Name, s.confirmed, err)
		}
		switch msg := msg.(type) {
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("end stream of slot %s: %w", s.r.opts.Slot.Name, pgconn.ErrorResponseToPgError(msg))
		case *pgproto3.ReadyForQuery:
			return nil
		}
	}
}

func (s *stream) sendStatus(reply bool) error {
	pos, _ := s.tracker.position()
	if pos > s.confirmed || s.events.Load() == 0 {
		s.confirmed = pos
		s.r.advanced.Store(time.Now().UnixNano())
	}
	if e := uint64(s.tracker.lastEvents()); e > s.toRecord.Load() {
		s.toRecord.Store(e)
		select {
		case s.recordWake <- struct{}{}:
		default:
		}
	}
	err := pglogrepl.SendStandbyStatusUpdate(context.Background(), s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: max(s.received, pos), WALFlushPosition: pos, WALApplyPosition: pos, ReplyRequested: reply,
	})
	if err != nil {
		return fmt.Errorf("confirm position %s: %w", pos, err)
	}
	s.statusAt = time.Now()
	s.r.progress.Store(s.statusAt.UnixNano())
	return nil
}

// handle decodes one message of the replication stream: a keepalive, or
// WAL data carrying a pgoutput message.
func (s *stream) handle(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		k, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("parse keepalive: %w", err)
		}
		s.serverClock(k.ServerTime)
		if s.txn == nil {
			s.tracker.idleAt(k.ServerWALEnd)
		}
		if k.ReplyRequested {
			return s.sendStatus(false)
		}
	case pglogrepl.XLogDataByteID:
		x, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("parse WAL data: %w", err)
		}
		s.serverClock(x.ServerTime)
		s.received = max(s.received, x.WALStart+pglogrepl.LSN(len(x.WALData)))
		m, err := pglogrepl.Parse(x.WALData)
		if err != nil {
			return fmt.Errorf("decode pgoutput message: %w", err)
		}
		return s.apply(ctx, m, x.WALStart)
	}
	return nil
}

// apply follows one pgoutput message, read at WAL position at: the
// transactions' bounds, the tables' descriptions, and the events.
func (s *stream) apply(ctx context.Context, m pglogrepl.Message, at pglogrepl.LSN) error {
	switch m := m.(type) {
	case *pglogrepl.RelationMessage:
		s.relations[m.RelationID] = m
	case *pglogrepl.BeginMessage:
		s.txn = s.tracker.begin()
		s.txn.xid = m.Xid
		s.commitTime = m.CommitTime
	case *pglogrepl.CommitMessage:
		if s.txn == nil {
			return errors.New("commit without begin in the replication stream")
		}
		s.tracker.commit(s.txn, m.TransactionEndLSN)
		s.committed(s.txn, m.TransactionEndLSN)
		s.txn = nil
	case *pglogrepl.InsertMessage:
		return s.insert(ctx, m, at)
	case *pglogrepl.LogicalDecodingMessage:
		s.message(ctx, m)
	}
	return nil
}

// insert dispatches a row inserted into the outbox table, unless the log
// relay must not publish it (see decodeRow).
func (s *stream) insert(ctx context.Context, m *pglogrepl.InsertMessage, at pglogrepl.LSN) error {
	cfg := s.r.opts.Store
	rel := s.relations[m.RelationID]
	if rel == nil {
		return fmt.Errorf("insert into unknown relation %d", m.RelationID)
	}
	if rel.Namespace != cfg.Schema || rel.RelationName != cfg.Table || s.txn == nil {
		return nil
	}
	it, skip := decodeRow(rel, m.Tuple, s.commitTime, cfg)
	if !skip {
		it.maybeSent = at <= s.horizon
		s.dispatch(ctx, it)
	}
	return nil
}

// message dispatches a log-only event of the outbox's prefix, and notes
// a hand-off notice.
func (s *stream) message(ctx context.Context, m *pglogrepl.LogicalDecodingMessage) {
	if m.Prefix == s.r.sql.handOffPrefix {
		s.noteHandOff(m)
		return
	}
	if m.Prefix != s.r.prefix {
		return
	}
	it := decodeMessage(m, s.commitTime, s.r.opts.Store)
	it.maybeSent = m.LSN <= s.horizon
	if s.txn != nil {
		s.readMessage(it)
		s.dispatch(ctx, it)
		return
	}
	// A non-transactional message: a transaction of its own, which ends
	// at the message.
	s.txn = s.tracker.begin()
	it.ev.CreatedAt = time.Now()
	s.readMessage(it)
	s.dispatch(ctx, it)
	s.tracker.commit(s.txn, m.LSN)
	s.committed(s.txn, m.LSN)
	s.txn = nil
}

// readMessage records a log-only event in the ledger, once a publisher
// asks for it (core.Settler).
func (s *stream) readMessage(it *item) {
	if s.r.ledger.on.Load() {
		s.r.ledger.read(it.ev.Seq)
		s.txn.msgs = append(s.txn.msgs, it.ev.Seq)
	}
}

// committed records in the ledger where the log-only events of x end.
func (s *stream) committed(x *txn, end pglogrepl.LSN) {
	if len(x.msgs) > 0 {
		s.r.ledger.committed(x.msgs, end)
		x.msgs = nil
	}
}

// recordPositions writes the position of the last events done to the
// table (logTable.recordPosition), each time it moves, one write at
// a time, until ctx ends: the server keeps its slot's confirmed position
// on disk only from time to time, and a relay resuming after a crash of
// the server starts from the later of the two, so it sends again only
// what was not done.
func (s *stream) recordPositions(ctx context.Context) {
	var recorded uint64
	warned := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.recordWake:
		}
		lsn := s.toRecord.Load()
		if lsn <= recorded {
			continue
		}
		err := s.r.sql.recordPosition(ctx, s.r.pool, s.r.opts.Slot.Name, pglogrepl.LSN(lsn).String())
		switch {
		case ctx.Err() != nil:
			return
		case err != nil && !warned:
			// Tried again at the next confirmation; meanwhile a crash of
			// the server sends more again.
			warned = true
			s.r.log.Warn("log relay: record the confirmed position failed", "error", err)
		case err == nil:
			recorded = lsn
		}
	}
}

// recordLast records the position of the last events done, once the
// stream drained, bounded by a second.
func (s *stream) recordLast() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if lsn := s.toRecord.Load(); lsn > 0 {
		_ = s.r.sql.recordPosition(ctx, s.r.pool, s.r.opts.Slot.Name, pglogrepl.LSN(lsn).String())
	}
}

// hostClock is this host's clock; tests skew it.
var hostClock = time.Now

// serverClock notes the server's clock at sent, the send time of one of
// its messages.
func (s *stream) serverClock(sent time.Time) {
	if !sent.IsZero() {
		s.clockOffset.Store(int64(sent.Sub(hostClock())))
	}
}

// serverNow is the server's clock now, as last measured.
func (s *stream) serverNow() time.Time {
	return hostClock().Add(time.Duration(s.clockOffset.Load()))
}

// dispatch puts it in the buffer and wakes the engine to claim it.
func (s *stream) dispatch(_ context.Context, it *item) {
	it.txn = s.txn
	s.tracker.add(it.txn)
	s.events.Add(1)
	s.bytes.Add(it.size)
	s.r.inFlight.Add(1)
	s.mu.Lock()
	s.buffered = append(s.buffered, it)
	s.mu.Unlock()
	s.engine.Wake()
}

// finish records it as done: its transaction may now be confirmed.
func (s *stream) finish(it *item) {
	// Done in the tracker before the count drops: a drain that sees
	// nothing in flight then confirms every transaction it read.
	s.tracker.done(it.txn)
	s.events.Add(-1)
	s.bytes.Add(-it.size)
	s.r.inFlight.Add(-1)
	select {
	case s.freed <- struct{}{}:
	default:
	}
}

// deadline is a context with a deadline, made anew only when the
// deadline changes.
type deadline struct {
	ctx    context.Context
	cancel context.CancelFunc
	at     time.Time
}

// until returns a context of parent that ends at at.
func (d *deadline) until(parent context.Context, at time.Time) context.Context {
	if d.ctx == nil || !at.Equal(d.at) {
		d.stop()
		d.ctx, d.cancel = context.WithDeadline(parent, at)
		d.at = at
	}
	return d.ctx
}

func (d *deadline) stop() {
	if d.cancel != nil {
		d.cancel()
	}
}
