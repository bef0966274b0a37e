package api

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"faregate/agent/taskstore"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
	"faregate/protect/turnstile"
)

// The dependencies whose outages the gate reports by state change: one
// line when one is seen down, one when it answers again. (The model's
// state is the breaker's, which logs its own changes.)
const (
	depRedis     = "redis"
	depTurnstile = "turnstile"
)

// dependency is one dependency's state as the gate last saw it. A flood of
// 503s during an outage is counted by the refusal summary; this says once
// that the outage began and once that it ended.
//
// A dependency that fails every other request would flip on every request:
// a change is therefore logged at most once per hold, and a change that
// comes sooner waits for the next request after the hold has passed. So
// each dependency writes at most one line per hold, however it flaps.
type dependency struct {
	name string
	hold time.Duration
	now  func() time.Time
	lg   *slog.Logger

	// down is read on every request; the mutex guards the change.
	down atomic.Bool
	mu   sync.Mutex
	// since is when the state last changed; failures counts the failures
	// seen since it went down.
	since    time.Time
	failures atomic.Int64
}

func newDependency(name string, hold time.Duration, now func() time.Time, lg *slog.Logger) *dependency {
	return &dependency{name: name, hold: hold, now: now, lg: lg}
}

// failed records a failure of the dependency seen by the request st; the
// first one after it was up (past the hold) logs the line that says it is
// down, naming the error and the request that met it.
func (d *dependency) failed(st *state, err error) {
	if d == nil {
		return
	}
	if d.down.Load() {
		d.failures.Add(1)
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.now()
	if d.down.Load() || (!d.since.IsZero() && now.Sub(d.since) < d.hold) {
		d.failures.Add(1)
		return
	}
	d.since = now
	d.failures.Store(1)
	d.down.Store(true)
	attrs := []slog.Attr{slog.String("dependency", d.name), slog.String("err", err.Error())}
	if st != nil {
		attrs = append(attrs, slog.String("request_id", st.id), slog.String("code", st.code),
			slog.String("principal", st.principalLabel()))
	}
	d.lg.LogAttrs(context.Background(), slog.LevelWarn, "dependency down", attrs...)
}

// ok records an answer of the dependency; the first one after it was down
// (past the hold) logs the line that says it is back. The common case, up
// and answering, is one atomic load.
func (d *dependency) ok() {
	if d == nil || !d.down.Load() {
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.now()
	if !d.down.Load() || now.Sub(d.since) < d.hold {
		return
	}
	d.lg.LogAttrs(context.Background(), slog.LevelInfo, "dependency back", slog.String("dependency", d.name),
		slog.Int64("down_ms", now.Sub(d.since).Milliseconds()), slog.Int64("failures", d.failures.Load()))
	d.since = now
	d.down.Store(false)
}

// dependencies are the gate's dependencies by name (nil ones, in a
// server built by hand in a test, record nothing).
type dependencies struct {
	redis, turnstile *dependency
}

// depHold is the least time between two state lines of one dependency when
// the summary interval names none.
const depHold = 10 * time.Second

func newDependencies(hold time.Duration, now func() time.Time, lg *slog.Logger) dependencies {
	if hold <= 0 {
		hold = depHold
	}
	return dependencies{
		redis:     newDependency(depRedis, hold, now, lg),
		turnstile: newDependency(depTurnstile, hold, now, lg),
	}
}

// failedBy finds the dependency whose failure err reports (nil: none of
// them; then the error is not an outage of a dependency).
func (ds dependencies) failedBy(err error) *dependency {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, turnstile.ErrUnavailable):
		return ds.turnstile
	case errors.Is(err, quota.ErrUnavailable), errors.Is(err, ratelimit.ErrUnavailable),
		errors.Is(err, budget.ErrUnavailable), errors.Is(err, taskstore.ErrUnavailable):
		return ds.redis
	}
	return nil
}

// summarised reports whether a 5xx with code is counted by the refusal
// summary rather than logged on its own (the project's third-round rule):
// refusals that shed load or report a dependency's outage. Any other 5xx,
// internal_error first, is a failure worth its own line.
func summarised(code string) bool {
	switch code {
	case codes.ServerBusy, codes.AITFQueueFull, codes.DemoProtectionUnavailable, codes.ModelUnavailable:
		return true
	}
	return false
}
