package aitf

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// tolerance is how far a measured wait may stray from the formula.
const tolerance = 50 * time.Millisecond

// atOnce bounds a request that must not wait: far below the shortest
// formula wait (200 ms), generous enough for a loaded CI machine.
const atOnce = 150 * time.Millisecond

// scored returns a request carrying a Result, as Middleware would leave it.
func scored(ctx context.Context, score float64, optIn bool, toolID string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/api/tasks", nil)
	return r.WithContext(NewContext(ctx, Result{Score: score, OptIn: optIn, ToolCallID: toolID}))
}

// waitFor polls cond until it holds or two seconds pass: it waits for a
// state, never for a guessed duration.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		<-tick.C
	}
}

// admitted runs Admit in a goroutine and reports its outcome on a channel.
type outcome struct {
	release func()
	err     error
	res     Result
}

func admitAsync(g *Guard, r *http.Request) <-chan outcome {
	ch := make(chan outcome, 1)
	go func() {
		rel, err := g.Admit(httptest.NewRecorder(), r)
		res, _ := FromContext(r.Context())
		ch <- outcome{rel, err, res}
	}()
	return ch
}

func TestAdmitWaitsByFormula(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
	tests := []struct {
		score float64
		optIn bool
		want  time.Duration
	}{
		{0.6, false, 680 * time.Millisecond},
		{1.0, false, 1000 * time.Millisecond},
		{1.0, true, 500 * time.Millisecond},
		{0.75, true, 400 * time.Millisecond},
	}
	for _, tc := range tests {
		name := tc.want.String()
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// Three samples at once; the median must be within tolerance,
			// so one late wake-up on a loaded machine does not fail it. A
			// whole round delayed by a CPU-starved moment (other packages'
			// tests run beside this one) is measured again, at most twice:
			// a wrong formula misses every round.
			const samples, rounds = 3, 3
			var got []time.Duration
			for round := 0; round < rounds; round++ {
				got = make([]time.Duration, samples)
				var wg sync.WaitGroup
				for i := range samples {
					wg.Go(func() {
						r := scored(context.Background(), tc.score, tc.optIn, "")
						start := time.Now()
						release, err := f.g.Admit(httptest.NewRecorder(), r)
						got[i] = time.Since(start)
						if err != nil {
							t.Errorf("Admit: %v", err)
							return
						}
						release()
						res, _ := FromContext(r.Context())
						if res.Decision != DecisionDelayed || res.Delayed < tc.want-tolerance {
							t.Errorf("Result %+v, want delayed about %v", res, tc.want)
						}
					})
				}
				wg.Wait()
				slices.Sort(got)
				if med := got[samples/2]; med >= tc.want-tolerance && med <= tc.want+tolerance {
					return
				}
			}
			t.Errorf("median wait %v (samples %v) in %d rounds, want %v ± %v", got[samples/2], got, rounds, tc.want, tolerance)
		})
	}
}

func TestAdmitBelowThresholdPassesAtOnce(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
	r := scored(context.Background(), 0.59, false, "")
	start := time.Now()
	release, err := f.g.Admit(httptest.NewRecorder(), r)
	if err != nil || time.Since(start) > atOnce {
		t.Fatalf("Admit = %v after %v, want nil at once", err, time.Since(start))
	}
	release()
	if res, _ := FromContext(r.Context()); res.Decision != DecisionPass || res.Delayed != 0 {
		t.Errorf("Result %+v, want pass without delay", res)
	}
}

func TestAdmitSerialisesToolCallID(t *testing.T) {
	// A high threshold leaves only the tool_call_id lock, so the test
	// needs no timed waits.
	f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.Threshold = 0.95 })
	ctx := context.Background()

	first, err := f.g.Admit(httptest.NewRecorder(), scored(ctx, 0.7, false, "call_same"))
	if err != nil {
		t.Fatalf("first Admit: %v", err)
	}
	second := admitAsync(f.g, scored(ctx, 0.7, false, "call_same"))
	third := admitAsync(f.g, scored(ctx, 0.7, false, "call_same"))
	waitFor(t, "two waiters", func() bool { return f.g.QueueDepth() == 2 })

	// Another id is not held up by them.
	other, err := f.g.Admit(httptest.NewRecorder(), scored(ctx, 0.7, false, "call_other"))
	if err != nil {
		t.Fatalf("other id: %v", err)
	}
	other()

	select {
	case <-second:
		t.Fatal("second request ran while the first held the id")
	case <-third:
		t.Fatal("third request ran while the first held the id")
	default:
	}
	first()
	// Whichever of the two gets the id next, the other must still wait.
	var last <-chan outcome
	var o outcome
	select {
	case o = <-second:
		last = third
	case o = <-third:
		last = second
	}
	if o.err != nil {
		t.Fatalf("Admit after release: %v", o.err)
	}
	waitFor(t, "one waiter left", func() bool { return f.g.QueueDepth() == 1 })
	select {
	case <-last:
		t.Fatal("two requests with one id ran at once")
	default:
	}
	o.release()
	o.release() // a second call is harmless
	o = <-last
	if o.err != nil {
		t.Fatalf("last Admit: %v", o.err)
	}
	o.release()
	if f.g.QueueDepth() != 0 || len(f.g.q.locks) != 0 {
		t.Errorf("after all released: depth %d, %d locks held", f.g.QueueDepth(), len(f.g.q.locks))
	}
}

func TestAdmitDegradesPastBacklog(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.DegradeBacklog = 2; o.MaxQueue = 10 })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var waiters []<-chan outcome
	for range 3 {
		waiters = append(waiters, admitAsync(f.g, scored(ctx, 1.0, false, "")))
	}
	waitFor(t, "a backlog of three", func() bool { return f.g.QueueDepth() == 3 })

	tests := []struct {
		name         string
		score        float64
		wantDecision string
		wantQueued   bool
	}{
		{"above 0.7 passes degraded", 0.8, DecisionDegraded, false},
		{"0.7 still waits", 0.7, DecisionDelayed, true},
		{"below threshold passes", 0.3, DecisionPass, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rctx, rcancel := context.WithCancel(ctx)
			r := scored(rctx, tc.score, false, "")
			ch := admitAsync(f.g, r)
			if tc.wantQueued {
				waitFor(t, "the request to queue", func() bool { return f.g.QueueDepth() == 4 })
				rcancel()
				if o := <-ch; !errors.Is(o.err, context.Canceled) {
					t.Fatalf("cancelled waiter: %v", o.err)
				}
				return
			}
			defer rcancel()
			select {
			case o := <-ch:
				if o.err != nil || o.res.Decision != tc.wantDecision || o.res.Degraded != (tc.wantDecision == DecisionDegraded) || o.res.Delayed > tolerance {
					t.Errorf("outcome %v, %+v; want %s at once", o.err, o.res, tc.wantDecision)
				}
			case <-time.After(time.Second / 2):
				t.Fatal("request waited")
			}
		})
	}
	cancel()
	for _, w := range waiters {
		<-w
	}
	if got := testutil.ToFloat64(f.g.m.degraded.WithLabelValues("tasks")); got != 1 {
		t.Errorf("degraded_total = %v, want 1", got)
	}
}

func TestAdmitQueueFull(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.MaxQueue = 2 })
	ctx, cancel := context.WithCancel(context.Background())
	var waiters []<-chan outcome
	for range 2 {
		waiters = append(waiters, admitAsync(f.g, scored(ctx, 1.0, false, "")))
	}
	waitFor(t, "a full queue", func() bool { return f.g.QueueDepth() == 2 })
	defer func() {
		cancel()
		for _, w := range waiters {
			<-w
		}
	}()

	t.Run("Admit returns QueueFullError", func(t *testing.T) {
		_, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.65, false, ""))
		var full *QueueFullError
		if !errors.As(err, &full) || !errors.Is(err, ErrQueueFull) {
			t.Fatalf("err = %v, want a *QueueFullError wrapping ErrQueueFull", err)
		}
		if full.RetryAfter < time.Second || full.RetryAfter > 30*time.Second {
			t.Errorf("RetryAfter = %v, want a few seconds", full.RetryAfter)
		}
	})
	t.Run("Delay answers 503 aitf_queue_full", func(t *testing.T) {
		w := httptest.NewRecorder()
		r := post(toolBody)
		called := false
		f.g.Middleware(f.g.Delay(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { called = true }))).ServeHTTP(w, r)
		body, _ := io.ReadAll(w.Body)
		if called || w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "2" ||
			!strings.Contains(string(body), `"code":"aitf_queue_full"`) {
			t.Errorf("handler called %v, status %d, Retry-After %q, body %s", called, w.Code, w.Header().Get("Retry-After"), body)
		}
	})
	t.Run("Delay uses Options.Refuse", func(t *testing.T) {
		var got time.Duration
		g := newFixture(t, func(o *Options) {
			o.Mode = ModeEnforce
			o.MaxQueue = 1
			o.Refuse = func(w http.ResponseWriter, r *http.Request, retryAfter time.Duration) {
				got = retryAfter
				w.WriteHeader(http.StatusTeapot)
			}
		}).g
		hctx, hcancel := context.WithCancel(context.Background())
		hold := admitAsync(g, scored(hctx, 1.0, false, ""))
		defer func() {
			hcancel()
			<-hold
		}()
		waitFor(t, "the queue to fill", func() bool { return g.QueueDepth() == 1 })
		w := httptest.NewRecorder()
		g.Delay(http.NotFoundHandler()).ServeHTTP(w, scored(context.Background(), 0.9, false, ""))
		if w.Code != http.StatusTeapot || got != queueFullRetry {
			t.Errorf("status %d, retryAfter %v; want the custom Refuse with %v", w.Code, got, queueFullRetry)
		}
	})
	t.Run("below threshold still passes", func(t *testing.T) {
		release, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.2, false, ""))
		if err != nil {
			t.Fatalf("Admit: %v", err)
		}
		release()
	})
	if got := testutil.ToFloat64(f.g.m.refused.WithLabelValues("tasks")); got != 2 {
		t.Errorf("refused_total = %v, want 2", got)
	}
}

func TestAdmitDisconnectLeavesAtOnce(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
	tests := []struct {
		name   string
		holdID string // a request holding this id makes the waiter wait on the lock
		score  float64
	}{
		{"waiting on the timer", "", 1.0},
		{"waiting on the tool_call_id", "call_held", 0.3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.holdID != "" {
				release, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.3, false, tc.holdID))
				if err != nil {
					t.Fatal(err)
				}
				defer release()
			}
			ctx, cancel := context.WithCancel(context.Background())
			ch := admitAsync(f.g, scored(ctx, tc.score, false, tc.holdID))
			waitFor(t, "the waiter", func() bool { return f.g.QueueDepth() == 1 })
			start := time.Now()
			cancel()
			o := <-ch
			if !errors.Is(o.err, context.Canceled) || time.Since(start) > atOnce {
				t.Errorf("Admit = %v after %v, want context.Canceled at once", o.err, time.Since(start))
			}
			if d := f.g.QueueDepth(); d != 0 {
				t.Errorf("queue depth %d after the client left, want 0", d)
			}
		})
	}
	if n := len(f.g.q.locks); n != 0 {
		t.Errorf("%d tool_call_id locks left", n)
	}
}

func TestObserveNeverDelays(t *testing.T) {
	for _, mode := range []Mode{ModeObserve, ModeOff} {
		t.Run(string(mode), func(t *testing.T) {
			f := newFixture(t, func(o *Options) { o.Mode = mode; o.MaxQueue = 1 })
			h := f.g.Middleware(f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusAccepted)
			})))
			body := `{"tool_call_id":"call_x","recursion_depth":5,"mode":"batch"}`
			for i := range 3 {
				w := httptest.NewRecorder()
				start := time.Now()
				h.ServeHTTP(w, post(body))
				if el := time.Since(start); el > atOnce || w.Code != http.StatusAccepted {
					t.Errorf("request %d: status %d after %v, want 202 at once", i, w.Code, el)
				}
			}
			r := scored(context.Background(), 1, false, "call_x")
			release, err := f.g.Admit(httptest.NewRecorder(), r)
			if err != nil {
				t.Fatal(err)
			}
			release()
			if res, _ := FromContext(r.Context()); res.Delayed != 0 {
				t.Errorf("Admit delayed %v", res.Delayed)
			}
			if got := testutil.ToFloat64(f.g.m.delayed.WithLabelValues("tasks")); got != 0 || f.g.QueueDepth() != 0 {
				t.Errorf("delayed_total %v, depth %d; want 0, 0", got, f.g.QueueDepth())
			}
		})
	}
}

func TestAdmitDecisionHeaderOnlyInDebug(t *testing.T) {
	tests := []struct {
		name  string
		debug bool
		want  string
	}{
		{"debug", true, DecisionDelayed},
		{"no debug", false, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.Debug = tc.debug })
			w := httptest.NewRecorder()
			var res Result
			h := f.g.Middleware(f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				res, _ = FromContext(r.Context())
			})))
			// Opt-in halves the wait to keep the test short.
			r := withHeader(withHeader(post(`{"recursion_depth":3}`), HeaderDebug, "true"), HeaderOptIn, "true")
			h.ServeHTTP(w, r)
			if got := w.Header().Get(HeaderDecision); got != tc.want {
				t.Errorf("%s = %q, want %q", HeaderDecision, got, tc.want)
			}
			if res.Decision != DecisionDelayed {
				t.Errorf("handler saw decision %q, want delayed", res.Decision)
			}
		})
	}
}

func TestToolCallAlert(t *testing.T) {
	type loop struct {
		id    string
		count int
	}
	var loops []loop
	f := newFixture(t, func(o *Options) {
		o.Mode = ModeEnforce
		o.ToolCallLoop = func(_ context.Context, id string, count int) { loops = append(loops, loop{id, count}) }
	})
	// Cancelled requests are queued and leave at once: the count, not the
	// wait, is under test.
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	queue := func(id string, n int) {
		for range n {
			r := scored(gone, 0.7, false, id)
			r.RemoteAddr = rawIP + ":5555"
			if _, err := f.g.Admit(httptest.NewRecorder(), r); !errors.Is(err, context.Canceled) {
				t.Fatalf("Admit: %v", err)
			}
		}
	}
	warns := func() []string { return f.log.lines(slog.LevelWarn) }

	queue("call_loop", 15)
	if w := warns(); len(w) != 0 {
		t.Fatalf("alert after 15 queueings: %q", w)
	}
	queue("call_loop", 1)
	w := warns()
	if len(w) != 1 {
		t.Fatalf("%d alerts after the 16th queueing, want 1", len(w))
	}
	for _, want := range []string{"visitor=" + visitorHash, "route=tasks", "count=16"} {
		if !strings.Contains(w[0], want) {
			t.Errorf("alert %q lacks %q", w[0], want)
		}
	}
	if strings.Contains(w[0], rawIP) {
		t.Errorf("alert leaks the raw IP: %q", w[0])
	}
	queue("call_loop", 30)
	queue("call_other", 15)
	if n := len(warns()); n != 1 {
		t.Fatalf("%d alerts in the same window, want still 1", n)
	}
	f.clk.Advance(10 * time.Minute)
	queue("call_loop", 15)
	if n := len(warns()); n != 1 {
		t.Fatalf("%d alerts after 15 in a new window, want 1", n)
	}
	queue("call_loop", 1)
	if n := len(warns()); n != 2 {
		t.Fatalf("%d alerts after the 16th in a new window, want 2", n)
	}
	if want := []loop{{"call_loop", 16}, {"call_loop", 16}}; !slices.Equal(loops, want) {
		t.Errorf("ToolCallLoop calls %v, want %v", loops, want)
	}
	if got := testutil.ToFloat64(f.g.m.alerts.WithLabelValues("tasks")); got != 2 {
		t.Errorf("tool_call_alerts_total = %v, want 2", got)
	}
}
