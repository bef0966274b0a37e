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
	// alertsPerWindow bounds the tool call alerts (log line and callback)
	// of all ids together per window: a client that changes its id every
	// 16 requests must not turn each id into a line and a webhook.
	alertsPerWindow = 10
	// perIDMax bounds the requests of one tool_call_id in the queue, the
	// one running included: they run one at a time, so more than a few
	// only wait, and one id must not fill the queue everyone shares.
	perIDMax = 8
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

// join takes a place among id's requests, unless perIDMax of them are in
// the queue already (nil). The caller holds q.mu and hands the place back
// with unref, or through the release lock returns.
func (q *queue) join(id string) *idLock {
	l := q.locks[id]
	if l == nil {
		l = &idLock{sem: make(chan struct{}, 1)}
		q.locks[id] = l
	} else if l.refs >= perIDMax {
		return nil
	}
	l.refs++
	return l
}

// lock waits, on the place join took, until no other request with id
// runs, or ctx ends (and then gives the place back).
func (q *queue) lock(ctx context.Context, id string, l *idLock) (release func(), err error) {
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
// in bounded memory, and the alerts raised for all ids together.
type alertBook struct {
	mu  sync.Mutex
	ids *lru[uint64, alertState]
	// raised counts the alerts of the window that began at raisedStart.
	raisedStart int64
	raised      int
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

// raise reports whether one more alert fits in the current window's
// alertsPerWindow, and counts it if so.
func (a *alertBook) raise(now time.Time) bool {
	t := now.UnixNano()
	a.mu.Lock()
	defer a.mu.Unlock()
	if t-a.raisedStart >= int64(alertWindow) || t < a.raisedStart {
		a.raisedStart, a.raised = t, 0
	}
	if a.raised >= alertsPerWindow {
		return false
	}
	a.raised++
	return true
}

// Admit applies the delay queue to the request's Result (enforce mode only;
// in observe and off modes, and without a Result, it returns at once).
//
// A request scoring at least Threshold waits 200 ms + score × 800 ms
// (halved with X-AITF-Opt-In: true) on its own timer. Once the backlog (the
// requests waiting now) passes DegradeBacklog, requests scoring above 0.7
// skip the wait and are marked degraded. At MaxQueue waiting, suspicious
// requests are refused with a *QueueFullError (errors.Is ErrQueueFull); so
// is a request whose tool_call_id has eight requests in the queue already
// (the one running included), so one id never fills the queue for others.
// A request with a tool_call_id then waits until no other request with
// that id runs; the returned release ends its turn and must be called when
// the handler has started answering, or finished (it is safe to call
// twice; Delay calls it at the first byte of the answer). If the client
// goes away, Admit leaves the queue at once and returns ctx.Err(); if the
// request's own deadline passes first, the client is still there and gets
// the *QueueFullError, never a silent nothing.
//
// The decision, degraded flag and time held are recorded in the context's
// Result; X-AITF-Decision is set on w only for allowed debug requests.
func (g *Guard) Admit(w http.ResponseWriter, r *http.Request) (release func(), err error) {
	release, _, err = g.admit(w, r)
	return release, err
}

// admit is Admit; held reports that release ends a tool_call_id's turn
// (and is not the no-op).
func (g *Guard) admit(w http.ResponseWriter, r *http.Request) (release func(), held bool, err error) {
	noop := func() {}
	e, ok := r.Context().Value(ctxKey{}).(*entry)
	if !ok || g.o.Mode != ModeEnforce {
		return noop, false, nil
	}
	res := &e.res
	defer func() {
		if e.debug {
			w.Header().Set(HeaderDecision, res.Decision)
		}
	}()

	id := res.ToolCallID
	suspicious := res.Score >= g.o.Threshold
	if !suspicious && id == "" {
		res.Decision = DecisionPass
		return noop, false, nil
	}
	route := g.o.Route(r)
	start := time.Now()
	tk, ok := g.enter(res, suspicious)
	if !ok {
		return nil, false, g.refuse(res, route)
	}
	if id != "" {
		g.countToolCall(r, id, route)
	}
	release, ok = g.await(r, id, tk)
	if !ok {
		// A deadline is this server being too slow: the client is still
		// there, and is answered.
		if errors.Is(r.Context().Err(), context.DeadlineExceeded) {
			return nil, false, g.refuse(res, route)
		}
		return nil, false, r.Context().Err()
	}
	res.Delayed = time.Since(start)
	switch {
	case tk.degrade:
		res.Decision, res.Degraded = DecisionDegraded, true
		g.m.degraded.WithLabelValues(route).Inc()
	case tk.wait > 0:
		res.Decision = DecisionDelayed
		g.m.delayed.WithLabelValues(route).Inc()
	default:
		res.Decision = DecisionPass
	}
	return release, tk.place != nil, nil
}

// refuse records a refusal of res and returns the *QueueFullError.
func (g *Guard) refuse(res *Result, route string) error {
	res.Decision = DecisionRefused
	g.m.refused.WithLabelValues(route).Inc()
	return &QueueFullError{RetryAfter: queueFullRetry}
}

// ticket is a request's place in the delay queue.
type ticket struct {
	wait    time.Duration // on the request's own timer; 0: none
	place   *idLock       // its tool_call_id's place in line; nil: none
	queued  bool          // it counts in the backlog until it leaves
	degrade bool          // suspicious, but the backlog lets it skip the wait
}

// enter gives res's request its ticket, under the queue's lock, or
// reports false when it is refused: a suspicious one at MaxQueue, or one
// whose tool_call_id has its bound of requests in the queue.
func (g *Guard) enter(res *Result, suspicious bool) (ticket, bool) {
	g.q.mu.Lock()
	defer g.q.mu.Unlock()
	backlog := g.q.depth
	if suspicious && backlog >= g.o.MaxQueue {
		return ticket{}, false
	}
	var tk ticket
	if id := res.ToolCallID; id != "" {
		if tk.place = g.q.join(id); tk.place == nil {
			return ticket{}, false
		}
	}
	tk.degrade = suspicious && res.Score > degradeFrom && backlog > g.o.DegradeBacklog
	if suspicious && !tk.degrade {
		tk.wait = baseWait + time.Duration(res.Score*float64(scoreWait))
		if res.OptIn {
			tk.wait /= 2
		}
	}
	// Lock waiters count in the backlog too: they hold a place in line.
	tk.queued = tk.wait > 0 || res.ToolCallID != ""
	if tk.queued {
		g.q.depth++
		g.m.depth.Inc()
	}
	return tk, true
}

// await holds the request for tk's wait, then until its tool_call_id's
// turn comes (release ends the turn), and takes it out of the backlog. It
// reports false, the request out of the queue, when the request's context
// ended first.
func (g *Guard) await(r *http.Request, id string, tk ticket) (release func(), ok bool) {
	if tk.wait > 0 {
		t := time.NewTimer(tk.wait)
		select {
		case <-t.C:
		case <-r.Context().Done():
			t.Stop()
			g.leave(tk)
			if tk.place != nil {
				g.q.unref(id, tk.place)
			}
			return nil, false
		}
	}
	release = func() {}
	if tk.place != nil {
		// Degraded requests skip the delay, not this: one tool call never
		// runs twice at once.
		var err error
		if release, err = g.q.lock(r.Context(), id, tk.place); err != nil {
			g.leave(tk)
			return nil, false
		}
	}
	g.leave(tk)
	return release, true
}

// leave takes tk's request out of the backlog.
func (g *Guard) leave(tk ticket) {
	if !tk.queued {
		return
	}
	g.q.mu.Lock()
	g.q.depth--
	g.q.mu.Unlock()
	g.m.depth.Dec()
}

// countToolCall counts one queueing of a tool_call_id (every Admit of it
// that is not refused, whatever it then waits for) and raises the
// operator's alert on the 16th within a window: one metric increment per
// id per window, and one WARN line and one Options.ToolCallLoop call per
// id per window as long as the window has raised fewer than ten for all
// ids together (a client can make up ids faster than anyone reads alerts).
func (g *Guard) countToolCall(r *http.Request, id, route string) {
	now := g.o.Now()
	n := g.alerts.count(maphash.String(g.seed, id), now)
	if n != alertAfter+1 {
		return
	}
	g.m.alerts.WithLabelValues(route).Inc()
	if !g.alerts.raise(now) {
		return
	}
	g.o.Logger.WarnContext(r.Context(), "aitf: tool_call_id queued repeatedly",
		"visitor", g.o.VisitorKey(r), "route", route, "count", n,
		"window", alertWindow.String())
	if g.o.ToolCallLoop != nil {
		g.o.ToolCallLoop(r.Context(), id, int(n))
	}
}

// Delay is middleware that calls Admit and then next, releasing the
// tool_call_id turn as soon as next starts answering (its first header,
// byte or flush), or returns: an event stream's turn ends when the stream
// begins, not when it ends. A full queue, and a request out of time in it,
// are answered through Options.Refuse; a client that went away gets no
// answer at all.
func (g *Guard) Delay(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		release, held, err := g.admit(w, r)
		var full *QueueFullError
		switch {
		case errors.As(err, &full):
			g.o.Refuse(w, r, full.RetryAfter)
			return
		case err != nil:
			return
		}
		defer release()
		if held {
			w = &releaseOnAnswer{ResponseWriter: w, release: release}
		}
		next.ServeHTTP(w, r)
	})
}

// releaseOnAnswer ends a tool_call_id's turn when the handler starts
// answering. Unwrap lets http.ResponseController reach the writer's
// deadlines; FlushError is what the controller's Flush finds first.
type releaseOnAnswer struct {
	http.ResponseWriter
	release func()
}

func (w *releaseOnAnswer) WriteHeader(code int) {
	if code >= 200 {
		w.release()
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *releaseOnAnswer) Write(b []byte) (int, error) {
	w.release()
	return w.ResponseWriter.Write(b)
}

func (w *releaseOnAnswer) FlushError() error {
	w.release()
	return http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *releaseOnAnswer) Unwrap() http.ResponseWriter { return w.ResponseWriter }
