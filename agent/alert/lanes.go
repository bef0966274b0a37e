package alert

import (
	"strings"
	"sync"
	"time"
)

// Alerts travel in two lanes, each with its own queue and worker, so that a
// flood the public can cause never delays or drops what only the operator's
// own systems raise:
//
//   - the operator lane: policy_reload_failed, breaker_open, breaker_closed,
//     ledger_backlog, ledger_lost, and budget_warning and budget_exhausted
//     for the site, the spend cap or a tier: events whose scopes the
//     operator's configuration bounds;
//   - the traffic lane: everything else, whose scope a request chooses (a
//     tool_call_id, a visitor, a task): tool_call_loop, anomaly, overage,
//     invalid_ratio, principal_throttled, a visitor's or a task's own
//     budget, and any event not listed above.
//
// On top of the per-scope deduplication each lane lets through at most
// Options.EventLimit alerts of one event per Window; the rest are counted
// (outcome "limited") and the next alert of that event that is sent says
// how many were held back (details "suppressed").
type lane uint8

const (
	laneOperator lane = iota
	laneTraffic
	laneCount
)

// laneNames label the lanes in log lines.
var laneNames = [laneCount]string{"operator", "traffic"}

// laneOf classifies a cleaned alert.
func laneOf(a Alert) lane {
	switch a.Event {
	case PolicyReloadFailed, BreakerOpen, BreakerClosed, LedgerBacklog, LedgerLost:
		return laneOperator
	case BudgetWarning, BudgetExhausted:
		// "principal:…" and "task:…" are one visitor's, key's or task's own
		// budget: as many scopes as there are visitors.
		if strings.HasPrefix(a.Scope, "principal:") || strings.HasPrefix(a.Scope, "task:") {
			return laneTraffic
		}
		return laneOperator
	}
	return laneTraffic
}

// limiter is one lane's rate bound: a fixed window per event. Its map holds
// one entry per event name, which are the package's constants (and the few
// other names callers use), so it stays small.
type limiter struct {
	limit  int
	window time.Duration

	mu     sync.Mutex
	events map[string]*eventWindow
}

type eventWindow struct {
	start      time.Time
	n          int  // alerts let through in this window
	suppressed int  // alerts held back since the last one let through
	warned     bool // the window's limit was logged
}

func newLimiter(limit int, window time.Duration) *limiter {
	return &limiter{limit: limit, window: window, events: make(map[string]*eventWindow)}
}

// take lets one alert of event through if its window has room and returns
// how many were held back before it (to be reported with it). When it does
// not, first reports whether this is the window's first refusal.
func (l *limiter) take(event string, now time.Time) (ok bool, suppressed int, first bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.events[event]
	if w == nil {
		w = &eventWindow{start: now}
		l.events[event] = w
	}
	if now.Sub(w.start) >= l.window || now.Before(w.start) {
		w.start, w.n, w.warned = now, 0, false
	}
	if w.n >= l.limit {
		w.suppressed++
		first = !w.warned
		w.warned = true
		return false, 0, first
	}
	w.n++
	suppressed, w.suppressed = w.suppressed, 0
	return true, suppressed, false
}

// giveBack undoes a take whose alert was not queued after all (a duplicate,
// or a full queue), so it neither uses the window's room nor loses the
// count of the ones held back before it.
func (l *limiter) giveBack(event string, suppressed int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if w := l.events[event]; w != nil {
		w.n = max(w.n-1, 0)
		w.suppressed += suppressed
	}
}
