package oracle

import "math/rand/v2"

// Shape sizes generated histories.
type Shape struct {
	Steps int // steps per history
	// RestartPostgres adds PostgreSQL restarts: only for runs that own
	// the server and run one history at a time.
	RestartPostgres bool
	// Path is the way the relays publish; the Kafka paths add the
	// cluster's faults to the steps.
	Path Path
}

// Generate returns a random history of mode, the same for the same seed
// and shape.
func Generate(mode Mode, seed uint64, shape Shape) History {
	steps := shape.Steps
	g := &gen{r: rand.New(rand.NewPCG(seed, uint64(mode)+1)), mode: mode, keys: 2 + int(seed%2)}
	h := History{Mode: mode, Path: shape.Path, Seed: seed, StartStopped: g.chance(0.2)}
	running := !h.StartStopped
	for len(h.Steps) < steps {
		var s Step
		switch x := g.r.Float64(); {
		case !running && x < 0.3:
			s, running = Step{Kind: StartRelay}, true
		case running && x < 0.07:
			s, running = Step{Kind: StopRelay}, false
		case running && x < 0.13:
			s = Step{Kind: KillRelay}
		case shape.RestartPostgres && x < 0.17:
			s = Step{Kind: RestartPostgres}
		case x < 0.35:
			var ok bool
			if s, ok = g.operator(); !ok {
				continue
			}
		case shape.Path.Kafka() && running && x < 0.39:
			s = Step{Kind: Takeover}
		case shape.Path.Kafka() && x < 0.45:
			s = Step{Kind: FailProduce, Target: 1 + g.r.IntN(3)}
			if shape.Path == ExactlyOnce && g.chance(0.5) {
				s = Step{Kind: FailCommit, Target: 1 + g.r.IntN(2)}
			}
		default:
			s = g.write()
		}
		h.Steps = append(h.Steps, s)
	}
	if !running {
		h.Steps = append(h.Steps, Step{Kind: StartRelay})
	}
	return h
}

type gen struct {
	r       *rand.Rand
	mode    Mode
	keys    int
	n       int
	written []EventSpec // committed or not
	parked  []int
}

func (g *gen) chance(p float64) bool { return g.r.Float64() < p }

func (g *gen) write() Step {
	k := 1
	if g.chance(0.3) {
		k = 2 + g.r.IntN(2)
	}
	s := Step{Kind: Write}
	stopper := false
	for range k {
		t := Tx{Lock: g.chance(0.5), Rollback: g.chance(0.12)}
		for range 1 + g.r.IntN(3) {
			e := g.event()
			stopper = stopper || e.Sched == Far || e.Fault == Permanent || e.Fault == Bad
			t.Events = append(t.Events, e)
		}
		s.Txs = append(s.Txs, t)
	}
	// A held or far-scheduled event holds back the events after it in the
	// claims' order. Unlocked concurrent producers make that order differ
	// from commit order, so whether an event is behind it would be a race.
	if k > 1 && stopper {
		for i := range s.Txs {
			s.Txs[i].Lock = true
		}
	}
	return s
}

func (g *gen) event() EventSpec {
	g.n++
	e := EventSpec{N: g.n, Key: 1 + g.r.IntN(g.keys), Producer: g.producer()}
	switch x := g.r.Float64(); {
	case x < 0.08:
		e.Sched = Soon
	case x < 0.13:
		e.Sched = Far
	case x < 0.20:
		e.Fault = Transient
	case x < 0.25:
		e.Fault = Permanent
	case x < 0.29:
		e.Fault = Bad
		e.Producer = SQLInsert
		if g.mode == LogOnly || g.mode == LogRows && g.chance(0.3) {
			e.Producer = SQLLogWrite
		}
	}
	g.written = append(g.written, e)
	return e
}

func (g *gen) producer() Producer {
	x := g.r.Float64()
	switch g.mode {
	case LogOnly:
		if x < 0.6 {
			return GoLog
		}
		return SQLLogWrite
	case LogRows:
		switch {
		case x < 0.15:
			return GoLog
		case x < 0.25:
			return SQLLogWrite
		}
	}
	switch {
	case x < 0.6:
		return GoRows
	case x < 0.8:
		return SQLFunc
	}
	return SQLInsert
}

// operator picks an operator action on an event written so far.
func (g *gen) operator() (Step, bool) {
	if len(g.written) == 0 {
		return Step{}, false
	}
	pick := func(ok func(EventSpec) bool) (int, bool) {
		var c []int
		for _, e := range g.written {
			if ok(e) {
				c = append(c, e.N)
			}
		}
		if len(c) == 0 {
			return 0, false
		}
		return c[g.r.IntN(len(c))], true
	}
	var s Step
	var ok bool
	switch x := g.r.Float64(); {
	case x < 0.3:
		s.Kind = Retry
		s.Target, ok = pick(func(e EventSpec) bool { return e.Fault == Permanent || e.Fault == Bad })
	case x < 0.6:
		s.Kind = Park
		s.Target, ok = pick(func(e EventSpec) bool {
			return e.Sched == Far || e.Fault == Permanent || e.Fault == Bad || g.chance(0.2)
		})
		if ok {
			g.parked = append(g.parked, s.Target)
		}
	case x < 0.75:
		if len(g.parked) == 0 {
			return s, false
		}
		s.Kind, s.Target, ok = Unpark, g.parked[g.r.IntN(len(g.parked))], true
	default:
		s.Kind = Replay
		s.Target, ok = pick(func(e EventSpec) bool { return e.Producer.Row() })
	}
	return s, ok
}
