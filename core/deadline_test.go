package core

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestPublishCtxTimesOutOnePublishAtATime(t *testing.T) {
	lane, cancel := context.WithCancel(context.Background())
	defer cancel()

	// Publishes within their time never see their deadline, however many.
	quick := newPublishCtx(lane, time.Minute)
	for range 200 {
		quick.start(time.Now())
		if err := quick.Err(); err != nil {
			t.Fatalf("a publish that just started: %v", err)
		}
		quick.stop()
	}
	quick.close()

	p := newPublishCtx(lane, 30*time.Millisecond)
	defer p.close()
	p.start(time.Now())
	if d, ok := p.Deadline(); !ok || time.Until(d) > 30*time.Millisecond {
		t.Fatalf("deadline %v %v, want within 30ms", d, ok)
	}
	child, cancelChild := context.WithCancel(p)
	defer cancelChild()
	select {
	case <-p.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a publish that outlived its timeout was not cut")
	}
	if !errors.Is(p.Err(), context.DeadlineExceeded) {
		t.Fatalf("err %v, want the deadline's", p.Err())
	}
	select {
	case <-child.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a context made from the publish's was not cancelled with it")
	}
	p.stop()

	// The next publish has its own time.
	p.start(time.Now())
	if err := p.Err(); err != nil {
		t.Fatalf("the publish after a timeout: %v", err)
	}
	select {
	case <-p.Done():
		t.Fatal("the publish after a timeout starts done")
	default:
	}
	p.stop()
}

func TestPublishCtxEndsWithItsLane(t *testing.T) {
	lane, cancel := context.WithCancel(context.Background())
	p := newPublishCtx(lane, time.Minute)
	defer p.close()
	p.start(time.Now())
	child, cancelChild := context.WithTimeout(p, time.Hour)
	defer cancelChild()
	cancel()
	select {
	case <-p.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("the lane ended and the publish went on")
	}
	<-child.Done()
	if !errors.Is(p.Err(), context.Canceled) || !errors.Is(child.Err(), context.Canceled) {
		t.Fatalf("errs %v and %v, want the lane's", p.Err(), child.Err())
	}
	p.stop()
	p.start(time.Now())
	if !errors.Is(p.Err(), context.Canceled) {
		t.Fatalf("a publish after the lane ended: %v", p.Err())
	}
}

func TestPublishCtxLaneEndsAfterATimeout(t *testing.T) {
	lane, cancel := context.WithCancel(context.Background())
	p := newPublishCtx(lane, time.Millisecond)
	defer p.close()
	p.start(time.Now())
	<-p.Done()
	p.stop()
	cancel()
	p.start(time.Now())
	if !errors.Is(p.Err(), context.Canceled) {
		t.Fatalf("err %v: a timed-out publish context came back to life after its lane ended", p.Err())
	}
	<-p.Done()
}
