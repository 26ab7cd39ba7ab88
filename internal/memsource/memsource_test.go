package memsource_test

import (
	"context"
	"errors"
	"testing"

	"go.uber.org/goleak"

	"github.com/outboxhq/outbox/core"
	"github.com/outboxhq/outbox/core/claimtest"
	"github.com/outboxhq/outbox/internal/memsource"
)

type harness struct{}

func (harness) Open(t *testing.T) claimtest.Instance { return instance{memsource.New()} }

type instance struct{ s *memsource.Source }

func (in instance) Source() core.Source { return in.s }

func (in instance) Produce(ctx context.Context, events []core.Event, commit bool) error {
	if commit {
		in.s.Add(events...)
	}
	return nil
}

func (in instance) Pending(ctx context.Context) ([]int64, error) { return in.s.Pending(), nil }

func TestConformance(t *testing.T) { claimtest.Run(t, harness{}) }

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestHeldAndRetry(t *testing.T) {
	ctx := context.Background()
	s := memsource.New()
	ids := s.Add(core.Event{AggregateID: "a"}, core.Event{AggregateID: "a"})
	c, err := s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if c.Events()[0].ID == "" {
		t.Fatal("Add left the UID empty")
	}
	if err := c.Complete(ctx, nil, []core.Failure{{Seq: ids[0], Reason: "rejected"}}); err != nil {
		t.Fatal(err)
	}
	if !s.Held(ids[0]) || s.LastError(ids[0]) != "rejected" {
		t.Fatalf("held=%v last error=%q, want held with the reason", s.Held(ids[0]), s.LastError(ids[0]))
	}
	s.Retry(ids[0])
	c, err = s.Claim(ctx, core.ClaimOptions{Limit: 10})
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Events(); len(got) != 2 || got[0].Seq != ids[0] || got[0].Attempts != 1 {
		t.Fatalf("after Retry claimed %+v, want both events, the first with one attempt", got)
	}
	if err := c.Complete(ctx, ids, nil); err != nil {
		t.Fatal(err)
	}
	if err := c.Release(ctx); err == nil {
		t.Fatal("a claim ended twice without an error")
	}
}

func TestCompleteRejectsForeignIDs(t *testing.T) {
	ctx := context.Background()
	s := memsource.New()
	ids := s.Add(core.Event{AggregateID: "a"}, core.Event{AggregateID: "b"})
	c, err := s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(ctx, []int64{ids[1]}, nil); err == nil {
		t.Fatal("completed an event the claim does not hold")
	}
	if err := c.Complete(ctx, nil, []core.Failure{{Seq: 99}}); err == nil {
		t.Fatal("recorded a failure of an unknown event")
	}
	if err := c.Complete(ctx, []int64{ids[0]}, nil); err != nil {
		t.Fatalf("complete after rejected attempts: %v", err)
	}
	if p := s.Pending(); len(p) != 1 || p[0] != ids[1] {
		t.Fatalf("pending = %v, want only %d", p, ids[1])
	}
}

func TestClaimErr(t *testing.T) {
	ctx := context.Background()
	s := memsource.New()
	s.Add(core.Event{AggregateID: "a"})
	down := errors.New("connection refused")
	s.SetClaimErr(down)
	if _, err := s.Claim(ctx, core.ClaimOptions{Limit: 1}); !errors.Is(err, down) {
		t.Fatalf("claim error = %v, want %v", err, down)
	}
	s.SetClaimErr(nil)
	c, err := s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if err != nil || len(c.Events()) != 1 {
		t.Fatalf("claim after recovery: %v, %d events", err, len(c.Events()))
	}
}

func TestClaimedEventIsACopy(t *testing.T) {
	ctx := context.Background()
	s := memsource.New()
	s.Add(core.Event{AggregateID: "a", Payload: []byte(`{}`), Headers: map[string]string{"k": "v"}})
	c, _ := s.Claim(ctx, core.ClaimOptions{Limit: 1})
	e := c.Events()[0]
	e.Headers["k"] = "changed"
	e.Payload[0] = '['
	_ = c.Release(ctx)
	c, _ = s.Claim(ctx, core.ClaimOptions{Limit: 1})
	if e := c.Events()[0]; e.Headers["k"] != "v" || string(e.Payload) != `{}` {
		t.Fatalf("stored event changed through a claimed copy: %+v", e)
	}
}
