package aitf

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"net/http"
	"sync"
	"time"
)

// ErrQueueFull is returned (inside a *QueueFullError) by Admit when the
// delay queue is at MaxQueue.
var ErrQueueFull = errors.New("aitf: queue full")

// QueueFullError carries the Retry-After to send with the 503.
type QueueFullError struct {
	RetryAfter time.Duration
}

// Error implements error.
func (e *QueueFullError) Error() string {
	return fmt.Sprintf("%v, retry after %v", ErrQueueFull, e.RetryAfter)
}

// Unwrap makes errors.Is(err, ErrQueueFull) hold.
func (e *QueueFullError) Unwrap() error { return ErrQueueFull }

const (
	baseWait    = 200 * time.Millisecond
	scoreWait   = 800 * time.Millisecond
	degradeFrom = 0.7 // scores above this pass degraded when the backlog is long
	// queueFullRetry: no timed wait exceeds one second, so two seconds
	// later the queue has turned over.
	queueFullRetry = 2 * time.Second
	alertAfter     = 15 // queueings of one tool_call_id tolerated per window
	alertWindow    = 10 * time.Minute
)

// queue is the delay queue: a depth counter bounded by MaxQueue (checked
// under the same lock that increments it) and the per-tool_call_id locks.
// Each waiter sleeps on its own timer; nothing polls.
type queue struct {
	mu    sync.Mutex
	depth int
	locks map[string]*idLock
}

// idLock serialises requests of one tool_call_id; refs counts holders and
// waiters so the map entry goes when the last one leaves.
type idLock struct {
	sem  chan struct{}
	refs int
}

func newQueue() *queue { return &queue{locks: make(map[string]*idLock)} }

// Depth returns the number of waiting requests.
func (q *queue) Depth() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.depth
}

// lock waits until no other request with id runs, or ctx ends.
func (q *queue) lock(ctx context.Context, id string) (release func(), err error) {
	q.mu.Lock()
	l := q.locks[id]
	if l == nil {
		l = &idLock{sem: make(chan struct{}, 1)}
		q.locks[id] = l
	}
	l.refs++
	q.mu.Unlock()

	select {
	case l.sem <- struct{}{}:
		return sync.OnceFunc(func() {
			<-l.sem
			q.unref(id, l)
		}), nil
	case <-ctx.Done():
		q.unref(id, l)
		return nil, ctx.Err()
	}
}

func (q *queue) unref(id string, l *idLock) {
	q.mu.Lock()
	defer q.mu.Unlock()
	l.refs--
	if l.refs == 0 {
		delete(q.locks, id)
	}
}

// alertBook counts queueings per tool_call_id (by hash) in fixed windows,
// in bounded memory.
type alertBook struct {
	mu  sync.Mutex
	ids *lru[uint64, alertState]
}

type alertState struct {
	start int64 // window start, unix nanoseconds
	n     int32
}

func newAlertBook(capacity int) *alertBook {
	return &alertBook{ids: newLRU[uint64, alertState](capacity)}
}

// count records one queueing and returns the count in the current window.
func (a *alertBook) count(id uint64, now time.Time) int32 {
	t := now.UnixNano()
	a.mu.Lock()
	defer a.mu.Unlock()
	st, existed := a.ids.touch(id)
	if !existed || t-st.start >= int64(alertWindow) {
		*st = alertState{start: t}
	}
	st.n++
	return st.n
}

// Admit applies the delay queue to the request's Result (enforce mode only;
// in observe and off modes, and without a Result, it returns at once).
//
// A request scoring at least Threshold waits 200 ms + score × 800 ms
// (halved with X-AITF-Opt-In: true) on its own timer. Once the backlog (the
// requests waiting now) passes DegradeBacklog, requests scoring above 0.7
// skip the wait and are marked degraded. At MaxQueue waiting, suspicious
// requests are refused with a *QueueFullError (errors.Is ErrQueueFull). A
// request with a tool_call_id then waits until no other request with that id
// runs; the returned release ends its turn and must be called when the
// handler finishes (it is safe to call twice). If the client goes away,
// Admit leaves the queue at once and returns ctx.Err().
//
// The decision, degraded flag and time held are recorded in the context's
// Result; X-AITF-Decision is set on w only for allowed debug requests.
func (g *Guard) Admit(w http.ResponseWriter, r *http.Request) (release func(), err error) {
	noop := func() {}
	e, ok := r.Context().Value(ctxKey{}).(*entry)
	if !ok || g.o.Mode != ModeEnforce {
		return noop, nil
	}
	res := &e.res
	defer func() {
		if e.debug {
			w.Header().Set(HeaderDecision, res.Decision)
		}
	}()

	suspicious := res.Score >= g.o.Threshold
	if !suspicious && res.ToolCallID == "" {
		res.Decision = DecisionPass
		return noop, nil
	}

	route := g.o.Route(r)
	start := time.Now()
	var wait time.Duration
	g.q.mu.Lock()
	backlog := g.q.depth
	if suspicious && backlog >= g.o.MaxQueue {
		g.q.mu.Unlock()
		res.Decision = DecisionRefused
		g.m.refused.WithLabelValues(route).Inc()
		return nil, &QueueFullError{RetryAfter: queueFullRetry}
	}
	degrade := suspicious && res.Score > degradeFrom && backlog > g.o.DegradeBacklog
	if suspicious && !degrade {
		wait = baseWait + time.Duration(res.Score*float64(scoreWait))
		if res.OptIn {
			wait /= 2
		}
	}
	// Lock waiters count in the backlog too: they hold a place in line.
	queued := wait > 0 || res.ToolCallID != ""
	if queued {
		g.q.depth++
		g.m.depth.Inc()
	}
	g.q.mu.Unlock()

	leave := func() {
		if !queued {
			return
		}
		g.q.mu.Lock()
		g.q.depth--
		g.q.mu.Unlock()
		g.m.depth.Dec()
	}

	if res.ToolCallID != "" {
		g.countToolCall(r, res.ToolCallID, route)
	}

	if wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			leave()
			return nil, r.Context().Err()
		}
	}
	release = noop
	if res.ToolCallID != "" {
		// Degraded requests skip the delay, not this: one tool call never
		// runs twice at once.
		release, err = g.q.lock(r.Context(), res.ToolCallID)
		if err != nil {
			leave()
			return nil, err
		}
	}
	leave()

	res.Delayed = time.Since(start)
	switch {
	case degrade:
		res.Decision, res.Degraded = DecisionDegraded, true
		g.m.degraded.WithLabelValues(route).Inc()
	case wait > 0:
		res.Decision = DecisionDelayed
		g.m.delayed.WithLabelValues(route).Inc()
	default:
		res.Decision = DecisionPass
	}
	return release, nil
}

// countToolCall counts one queueing of a tool_call_id (every Admit of it
// that is not refused, whatever it then waits for) and raises the
// operator's alert on the 16th within a window: one WARN line, one metric
// increment and one Options.ToolCallLoop call, per id per window. The
// count is kept per id, so the line is rate-limited per id.
func (g *Guard) countToolCall(r *http.Request, id, route string) {
	n := g.alerts.count(maphash.String(g.seed, id), g.o.Now())
	if n != alertAfter+1 {
		return
	}
	g.m.alerts.WithLabelValues(route).Inc()
	g.o.Logger.WarnContext(r.Context(), "aitf: tool_call_id queued repeatedly",
		"visitor", g.o.VisitorKey(r), "route", route, "count", n,
		"window", alertWindow.String())
	if g.o.ToolCallLoop != nil {
		g.o.ToolCallLoop(r.Context(), id, int(n))
	}
}

// Delay is middleware that calls Admit and then next, releasing the
// tool_call_id turn when next returns. A full queue is answered through
// Options.Refuse; a client that went away gets no answer at all.
func (g *Guard) Delay(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, err := g.Admit(w, r)
		var full *QueueFullError
		switch {
		case errors.As(err, &full):
			g.o.Refuse(w, r, full.RetryAfter)
			return
		case err != nil:
			return
		}
		defer release()
		next.ServeHTTP(w, r)
	})
}
