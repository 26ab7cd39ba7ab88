package brokertest

import (
	"log/slog"
	"sync"
	"testing"
)

// Logger returns a logger writing into t's output, shown when t fails,
// for the publisher under test and the relays the suite runs: a case that
// fails on a loaded machine then says what the publisher saw. Lines
// logged after t ends (a library goroutine that outlives Close) are
// dropped, not a panic.
func Logger(t testing.TB) *slog.Logger {
	w := &testOutput{t: t}
	t.Cleanup(w.end) // registered first, so it runs after later cleanups
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelInfo}))
}

type testOutput struct {
	mu    sync.Mutex
	t     testing.TB
	ended bool
}

func (w *testOutput) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.ended {
		w.t.Helper()
		w.t.Log(string(p[:len(p)-min(len(p), 1)])) // without the newline
	}
	return len(p), nil
}

func (w *testOutput) end() {
	w.mu.Lock()
	w.ended = true
	w.mu.Unlock()
}
