package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// schedTimes is what Linux's scheduler counted for a set of threads: time
// on a CPU, and time runnable but waiting for one. A session that
// pg_stat_activity shows active with no wait event may be in either; on a
// small machine the second is where a tail can hide.
type schedTimes struct{ run, wait time.Duration }

func (t schedTimes) sub(o schedTimes) schedTimes { return schedTimes{t.run - o.run, t.wait - o.wait} }

func (t schedTimes) String() string {
	return fmt.Sprintf("%s on a CPU, %s waiting for one", fmtDur(t.run), fmtDur(t.wait))
}

// readSchedstat reads one thread's /proc schedstat: nanoseconds run,
// nanoseconds waited on a run queue, time slices.
func readSchedstat(path string) (schedTimes, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return schedTimes{}, false
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return schedTimes{}, false
	}
	run, err1 := strconv.ParseInt(f[0], 10, 64)
	wait, err2 := strconv.ParseInt(f[1], 10, 64)
	if err1 != nil || err2 != nil {
		return schedTimes{}, false
	}
	return schedTimes{time.Duration(run), time.Duration(wait)}, true
}

// schedOf sums every thread of the processes pids.
func schedOf(pids []int) schedTimes {
	var sum schedTimes
	for _, pid := range pids {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
		for _, p := range tasks {
			if t, ok := readSchedstat(p); ok {
				sum.run += t.run
				sum.wait += t.wait
			}
		}
	}
	return sum
}

// schedWatch follows, through a latency run, the server sessions of the
// relay (application app), the server's other client sessions, and this
// process. It counts only sessions open when it starts, and only when the
// server runs on this machine (its sessions' pids are PostgreSQL
// processes here); otherwise it reports nothing.
type schedWatch struct {
	relay, others []int
	start         [3]schedTimes
}

func watchSched(ctx context.Context, pool *pgxpool.Pool, app string) *schedWatch {
	rows, err := pool.Query(ctx, `SELECT pid, application_name = $1 FROM pg_stat_activity
WHERE backend_type = 'client backend' AND datname = current_database() AND pid <> pg_backend_pid()`, app)
	if err != nil {
		return nil
	}
	defer rows.Close()
	w := &schedWatch{}
	for rows.Next() {
		var pid int
		var relay bool
		if rows.Scan(&pid, &relay) != nil {
			return nil
		}
		if comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid)); err != nil || strings.TrimSpace(string(comm)) != "postgres" {
			return nil // not a server on this machine
		}
		if relay {
			w.relay = append(w.relay, pid)
		} else {
			w.others = append(w.others, pid)
		}
	}
	if rows.Err() != nil || len(w.relay) == 0 {
		return nil
	}
	w.start = w.now()
	return w
}

func (w *schedWatch) now() [3]schedTimes {
	return [3]schedTimes{schedOf(w.relay), schedOf(w.others), schedOf([]int{os.Getpid()})}
}

// summary gives what each set used and waited since the watch began.
func (w *schedWatch) summary() string {
	if w == nil {
		return ""
	}
	end := w.now()
	return fmt.Sprintf("; scheduler over the run (schedstat): the relay's %d sessions %s; the %d other sessions %s; this process %s",
		len(w.relay), end[0].sub(w.start[0]), len(w.others), end[1].sub(w.start[1]), end[2].sub(w.start[2]))
}
