package core

import (
	"context"
	"sync"
	"time"
)

// publishCtx is a lane's context with a deadline that moves: it bounds
// the lane's publishes, one at a time, by PublishTimeout. A context and a
// timer made for every publish were 6% of the relay's CPU and four
// allocations per event; this one is made once per lane.
//
// It behaves as context.WithTimeout would for each publish: Done closes
// and Err is context.DeadlineExceeded when the publish outlives its
// deadline, and Err is the lane's when the lane ends. A publish that ran
// out gets a fresh Done for the next. Like any context, it must not be
// kept after Publish returns.
type publishCtx struct {
	context.Context // the lane's

	timeout   time.Duration
	timer     *time.Timer
	stopLane  func() bool
	mu        sync.Mutex
	deadline  time.Time
	done      chan struct{}
	err       error
	callbacks map[*func()]struct{} // AfterFunc's, run when done closes
}

func newPublishCtx(lane context.Context, timeout time.Duration) *publishCtx {
	p := &publishCtx{Context: lane, timeout: timeout, done: make(chan struct{})}
	p.timer = time.AfterFunc(timeout, p.expire)
	p.timer.Stop()
	p.stopLane = context.AfterFunc(lane, func() { p.end(lane.Err(), false) })
	return p
}

// start opens one publish's time, from now.
func (p *publishCtx) start(now time.Time) {
	p.mu.Lock()
	if p.err == context.DeadlineExceeded {
		if err := p.Context.Err(); err != nil {
			p.err = err // the lane ended meanwhile: done stays closed
		} else {
			p.done, p.err = make(chan struct{}), nil
		}
	}
	p.deadline = now.Add(p.timeout)
	p.mu.Unlock()
	p.timer.Reset(p.timeout)
}

// stop ends the publish's time.
func (p *publishCtx) stop() { p.timer.Stop() }

// close releases the lane's hold on p.
func (p *publishCtx) close() {
	p.stopLane()
	p.timer.Stop()
}

// expire ends the publish that is running, if its deadline has passed: a
// timer set for an earlier publish can fire after the next one started.
func (p *publishCtx) expire() {
	p.end(context.DeadlineExceeded, true)
}

// end closes done with err, unless it is closed already or, when
// ifLate, the deadline has not passed.
func (p *publishCtx) end(err error, ifLate bool) {
	p.mu.Lock()
	if p.err != nil || ifLate && time.Now().Before(p.deadline) {
		p.mu.Unlock()
		return
	}
	p.err = err
	close(p.done)
	callbacks := p.callbacks
	p.callbacks = nil
	p.mu.Unlock()
	for f := range callbacks {
		go (*f)()
	}
}

func (p *publishCtx) Deadline() (time.Time, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.deadline, true
}

func (p *publishCtx) Done() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

func (p *publishCtx) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// AfterFunc lets contexts made from p hang off it without a goroutine
// each (package context looks for this method).
func (p *publishCtx) AfterFunc(f func()) (stop func() bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.err != nil {
		go f()
		return func() bool { return false }
	}
	key := &f
	if p.callbacks == nil {
		p.callbacks = map[*func()]struct{}{}
	}
	p.callbacks[key] = struct{}{}
	return func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		_, ok := p.callbacks[key]
		delete(p.callbacks, key)
		return ok
	}
}
