package aitf

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The delay queue's tests run in synctest bubbles: the queue's timers and
// time.Now are the bubble's fake clock, so a wait is measured exactly and
// synctest.Wait, not a poll or a sleep, says when every goroutine has
// settled into its wait.

// scored returns a request carrying a Result, as Middleware would leave it.
func scored(ctx context.Context, score float64, optIn bool, toolID string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/api/tasks", nil)
	return r.WithContext(NewContext(ctx, Result{Score: score, OptIn: optIn, ToolCallID: toolID}))
}

// outcome is what one Admit returned.
type outcome struct {
	release func()
	err     error
	res     Result
}

// admitAsync runs Admit in a goroutine and reports its outcome on a channel.
func admitAsync(g *Guard, r *http.Request) <-chan outcome {
	ch := make(chan outcome, 1)
	go func() {
		rel, err := g.Admit(httptest.NewRecorder(), r)
		res, _ := FromContext(r.Context())
		ch <- outcome{rel, err, res}
	}()
	return ch
}

// settled waits until every goroutine of the bubble is blocked and then
// checks the queue depth.
func settled(t *testing.T, g *Guard, wantDepth int) {
	t.Helper()
	synctest.Wait()
	if d := g.QueueDepth(); d != wantDepth {
		t.Fatalf("queue depth %d, want %d", d, wantDepth)
	}
}

// pending reports whether ch already holds an outcome, without waiting.
func pending(ch <-chan outcome) bool {
	select {
	case o := <-ch:
		if o.release != nil {
			o.release()
		}
		return true
	default:
		return false
	}
}

func TestAdmitWaitsByFormula(t *testing.T) {
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
		t.Run(tc.want.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
				r := scored(context.Background(), tc.score, tc.optIn, "")
				start := time.Now()
				release, err := f.g.Admit(httptest.NewRecorder(), r)
				if err != nil {
					t.Fatalf("Admit: %v", err)
				}
				release()
				if got := time.Since(start); got != tc.want {
					t.Errorf("waited %v, want %v", got, tc.want)
				}
				if res, _ := FromContext(r.Context()); res.Decision != DecisionDelayed || res.Delayed != tc.want {
					t.Errorf("Result %+v, want delayed %v", res, tc.want)
				}
				if got := testutil.ToFloat64(f.g.m.delayed.WithLabelValues("tasks")); got != 1 || f.g.QueueDepth() != 0 {
					t.Errorf("delayed_total %v, depth %d; want 1, 0", got, f.g.QueueDepth())
				}
			})
		})
	}
}

func TestAdmitBelowThresholdPassesAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
		r := scored(context.Background(), 0.59, false, "")
		start := time.Now()
		release, err := f.g.Admit(httptest.NewRecorder(), r)
		if err != nil || time.Since(start) != 0 {
			t.Fatalf("Admit = %v after %v, want nil at once", err, time.Since(start))
		}
		release()
		if res, _ := FromContext(r.Context()); res.Decision != DecisionPass || res.Delayed != 0 {
			t.Errorf("Result %+v, want pass without delay", res)
		}
	})
}

func TestAdmitSerialisesToolCallID(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// A high threshold leaves only the tool_call_id lock.
		f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.Threshold = 0.95 })
		ctx := context.Background()

		first, err := f.g.Admit(httptest.NewRecorder(), scored(ctx, 0.7, false, "call_same"))
		if err != nil {
			t.Fatalf("first Admit: %v", err)
		}
		second := admitAsync(f.g, scored(ctx, 0.7, false, "call_same"))
		third := admitAsync(f.g, scored(ctx, 0.7, false, "call_same"))
		settled(t, f.g, 2)

		// Another id is not held up by them.
		other, err := f.g.Admit(httptest.NewRecorder(), scored(ctx, 0.7, false, "call_other"))
		if err != nil {
			t.Fatalf("other id: %v", err)
		}
		other()
		if pending(second) || pending(third) {
			t.Fatal("a request ran while the first held the id")
		}

		first()
		synctest.Wait()
		// Whichever of the two got the id, the other must still wait.
		var o outcome
		var last <-chan outcome
		select {
		case o = <-second:
			last = third
		case o = <-third:
			last = second
		default:
			t.Fatal("neither waiter ran after the release")
		}
		if o.err != nil {
			t.Fatalf("Admit after release: %v", o.err)
		}
		settled(t, f.g, 1)
		if pending(last) {
			t.Fatal("two requests with one id ran at once")
		}
		o.release()
		o.release() // a second call is harmless
		synctest.Wait()
		select {
		case o = <-last:
		default:
			t.Fatal("the last waiter did not run after the second release")
		}
		if o.err != nil {
			t.Fatalf("last Admit: %v", o.err)
		}
		o.release()
		if f.g.QueueDepth() != 0 || len(f.g.q.locks) != 0 {
			t.Errorf("after all released: depth %d, %d locks held", f.g.QueueDepth(), len(f.g.q.locks))
		}
	})
}

func TestAdmitDegradesPastBacklog(t *testing.T) {
	tests := []struct {
		name         string
		score        float64
		wantDecision string
		wantWait     time.Duration
	}{
		{"above 0.7 passes degraded", 0.8, DecisionDegraded, 0},
		{"0.7 still waits", 0.7, DecisionDelayed, 760 * time.Millisecond},
		{"below threshold passes", 0.3, DecisionPass, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.DegradeBacklog = 2; o.MaxQueue = 10 })
				// Three requests holding places for far longer than the
				// formula's wait make the backlog.
				hold, cancel := context.WithCancel(context.Background())
				var waiters []<-chan outcome
				for range 3 {
					waiters = append(waiters, admitAsync(f.g, scored(hold, 1.0, false, "")))
				}
				settled(t, f.g, 3)

				start := time.Now()
				r := scored(context.Background(), tc.score, false, "")
				release, err := f.g.Admit(httptest.NewRecorder(), r)
				if err != nil {
					t.Fatalf("Admit: %v", err)
				}
				release()
				res, _ := FromContext(r.Context())
				if res.Decision != tc.wantDecision || res.Degraded != (tc.wantDecision == DecisionDegraded) ||
					time.Since(start) != tc.wantWait || res.Delayed != tc.wantWait {
					t.Errorf("Result %+v after %v; want %s after %v", res, time.Since(start), tc.wantDecision, tc.wantWait)
				}
				want := 0.0
				if tc.wantDecision == DecisionDegraded {
					want = 1
				}
				if got := testutil.ToFloat64(f.g.m.degraded.WithLabelValues("tasks")); got != want {
					t.Errorf("degraded_total = %v, want %v", got, want)
				}
				cancel()
				for _, w := range waiters {
					<-w
				}
			})
		})
	}
}

// fullQueue fills f's queue to depth with requests that wait until the
// returned stop is called.
func fullQueue(t *testing.T, f *fixture, depth int) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var waiters []<-chan outcome
	for range depth {
		waiters = append(waiters, admitAsync(f.g, scored(ctx, 1.0, false, "")))
	}
	settled(t, f.g, depth)
	return func() {
		cancel()
		for _, w := range waiters {
			<-w
		}
	}
}

func TestAdmitQueueFull(t *testing.T) {
	enforce2 := func(o *Options) { o.Mode = ModeEnforce; o.MaxQueue = 2 }
	t.Run("Admit returns QueueFullError", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, enforce2)
			defer fullQueue(t, f, 2)()
			_, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.65, false, ""))
			var full *QueueFullError
			if !errors.As(err, &full) || !errors.Is(err, ErrQueueFull) {
				t.Fatalf("err = %v, want a *QueueFullError wrapping ErrQueueFull", err)
			}
			if full.RetryAfter != queueFullRetry {
				t.Errorf("RetryAfter = %v, want %v", full.RetryAfter, queueFullRetry)
			}
			if got := testutil.ToFloat64(f.g.m.refused.WithLabelValues("tasks")); got != 1 {
				t.Errorf("refused_total = %v, want 1", got)
			}
		})
	})
	t.Run("Delay answers a bare 503 by default", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, enforce2)
			defer fullQueue(t, f, 2)()
			w := httptest.NewRecorder()
			called := false
			f.g.Middleware(f.g.Delay(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { called = true }))).ServeHTTP(w, post(toolBody))
			body, _ := io.ReadAll(w.Body)
			// The envelope is the integrator's to write (Options.Refuse).
			if called || w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "2" || len(body) != 0 {
				t.Errorf("handler called %v, status %d, Retry-After %q, body %s", called, w.Code, w.Header().Get("Retry-After"), body)
			}
		})
	})
	t.Run("Delay uses Options.Refuse", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var got time.Duration
			f := newFixture(t, func(o *Options) {
				o.Mode = ModeEnforce
				o.MaxQueue = 1
				o.Refuse = func(w http.ResponseWriter, r *http.Request, retryAfter time.Duration) {
					got = retryAfter
					w.WriteHeader(http.StatusTeapot)
				}
			})
			defer fullQueue(t, f, 1)()
			w := httptest.NewRecorder()
			f.g.Delay(http.NotFoundHandler()).ServeHTTP(w, scored(context.Background(), 0.9, false, ""))
			if w.Code != http.StatusTeapot || got != queueFullRetry {
				t.Errorf("status %d, retryAfter %v; want the custom Refuse with %v", w.Code, got, queueFullRetry)
			}
		})
	})
	t.Run("below threshold still passes", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, enforce2)
			defer fullQueue(t, f, 2)()
			start := time.Now()
			release, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.2, false, ""))
			if err != nil || time.Since(start) != 0 {
				t.Fatalf("Admit = %v after %v, want nil at once", err, time.Since(start))
			}
			release()
		})
	})
}

func TestAdmitDisconnectLeavesAtOnce(t *testing.T) {
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
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
				if tc.holdID != "" {
					release, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.3, false, tc.holdID))
					if err != nil {
						t.Fatal(err)
					}
					defer release()
				}
				ctx, cancel := context.WithCancel(context.Background())
				ch := admitAsync(f.g, scored(ctx, tc.score, false, tc.holdID))
				settled(t, f.g, 1)
				start := time.Now()
				cancel()
				o := <-ch
				if !errors.Is(o.err, context.Canceled) || time.Since(start) != 0 {
					t.Errorf("Admit = %v after %v, want context.Canceled at once", o.err, time.Since(start))
				}
				if d := f.g.QueueDepth(); d != 0 {
					t.Errorf("queue depth %d after the client left, want 0", d)
				}
				if tc.holdID == "" && len(f.g.q.locks) != 0 {
					t.Errorf("%d tool_call_id locks left", len(f.g.q.locks))
				}
			})
		})
	}
}

func TestObserveNeverDelays(t *testing.T) {
	for _, mode := range []Mode{ModeObserve, ModeOff} {
		t.Run(string(mode), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = mode; o.MaxQueue = 1 })
				h := f.g.Middleware(f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					w.WriteHeader(http.StatusAccepted)
				})))
				body := `{"tool_call_id":"call_x","recursion_depth":5,"mode":"batch"}`
				start := time.Now()
				for i := range 3 {
					w := httptest.NewRecorder()
					h.ServeHTTP(w, post(body))
					if w.Code != http.StatusAccepted {
						t.Errorf("request %d: status %d, want 202", i, w.Code)
					}
				}
				r := scored(context.Background(), 1, false, "call_x")
				release, err := f.g.Admit(httptest.NewRecorder(), r)
				if err != nil {
					t.Fatal(err)
				}
				release()
				if el := time.Since(start); el != 0 {
					t.Errorf("requests took %v, want no wait at all", el)
				}
				if res, _ := FromContext(r.Context()); res.Delayed != 0 {
					t.Errorf("Admit delayed %v", res.Delayed)
				}
				if got := testutil.ToFloat64(f.g.m.delayed.WithLabelValues("tasks")); got != 0 || f.g.QueueDepth() != 0 {
					t.Errorf("delayed_total %v, depth %d; want 0, 0", got, f.g.QueueDepth())
				}
			})
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
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.Debug = tc.debug })
				w := httptest.NewRecorder()
				var res Result
				h := f.g.Middleware(f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					res, _ = FromContext(r.Context())
				})))
				h.ServeHTTP(w, withHeader(post(`{"tool_call_id":"call_1","recursion_depth":3}`), HeaderDebug, "true"))
				if got := w.Header().Get(HeaderDecision); got != tc.want {
					t.Errorf("%s = %q, want %q", HeaderDecision, got, tc.want)
				}
				if res.Decision != DecisionDelayed {
					t.Errorf("handler saw decision %q, want delayed", res.Decision)
				}
			})
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

// TestAdmitBoundsOneToolCallID: one id held and twenty more of it arriving
// queue at most perIDMax in all (the rest refused at once), so another
// agent's suspicious request still finds room in a queue of ten.
func TestAdmitBoundsOneToolCallID(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce; o.MaxQueue = 10 })
		ctx := context.Background()
		hold, err := f.g.Admit(httptest.NewRecorder(), scored(ctx, 0.3, false, "call_Z"))
		if err != nil {
			t.Fatal(err)
		}
		var waiters []<-chan outcome
		refused := 0
		for range 20 {
			ch := admitAsync(f.g, scored(ctx, 0.3, false, "call_Z"))
			synctest.Wait()
			select {
			case o := <-ch:
				if !errors.Is(o.err, ErrQueueFull) || o.res.Decision != DecisionRefused {
					t.Fatalf("a call_Z past the bound: %v (%s), want ErrQueueFull", o.err, o.res.Decision)
				}
				refused++
			default:
				waiters = append(waiters, ch)
			}
		}
		if len(waiters) != perIDMax-1 || refused != 20-(perIDMax-1) {
			t.Fatalf("%d call_Z waiting and %d refused, want %d and %d", len(waiters), refused, perIDMax-1, 20-(perIDMax-1))
		}
		settled(t, f.g, perIDMax-1)

		other := admitAsync(f.g, scored(ctx, 0.9, false, "call_Y"))
		synctest.Wait()
		if pending(other) {
			t.Fatal("another agent's request was answered before its delay")
		}
		time.Sleep(time.Second) // the bubble's clock: its 200 ms + 0.9 × 800 ms
		synctest.Wait()
		select {
		case o := <-other:
			if o.err != nil || o.res.Decision != DecisionDelayed {
				t.Fatalf("another agent's request: %v (%s), want delayed and admitted", o.err, o.res.Decision)
			}
			o.release()
		default:
			t.Fatal("another agent's request is still waiting")
		}

		// Released, the waiters run one at a time.
		hold()
		for range waiters {
			synctest.Wait()
			o, ok := firstReady(waiters)
			if !ok || o.err != nil {
				t.Fatalf("a call_Z waiter after the release: ran %v, %v", ok, o.err)
			}
			if _, again := firstReady(waiters); again {
				t.Fatal("two call_Z requests ran at once")
			}
			o.release()
		}
		synctest.Wait()
		if f.g.QueueDepth() != 0 || len(f.g.q.locks) != 0 {
			t.Errorf("after all released: depth %d, %d locks held", f.g.QueueDepth(), len(f.g.q.locks))
		}
		if got := testutil.ToFloat64(f.g.m.refused.WithLabelValues("tasks")); got != float64(refused) {
			t.Errorf("refused_total = %v, want %d", got, refused)
		}
	})
}

// TestDelayReleasesWhenTheAnswerStarts: behind Delay, a stream holding a
// tool_call_id lets the next request of that id run as soon as it has sent
// its headers (or flushed), not when it ends.
func TestDelayReleasesWhenTheAnswerStarts(t *testing.T) {
	starts := map[string]func(w http.ResponseWriter){
		"WriteHeader": func(w http.ResponseWriter) { w.WriteHeader(http.StatusOK) },
		"Write":       func(w http.ResponseWriter) { _, _ = io.WriteString(w, "retry: 1000\n\n") },
		"Flush": func(w http.ResponseWriter) {
			if err := http.NewResponseController(w).Flush(); err != nil {
				t.Errorf("Flush through the wrapper: %v", err)
			}
		},
	}
	for name, begin := range starts {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
				end := make(chan struct{})
				began := make(chan struct{}, 2)
				stream := f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					begin(w)
					began <- struct{}{}
					<-end // the stream stays open
				}))
				first := httptest.NewRecorder()
				go stream.ServeHTTP(first, scored(context.Background(), 0.3, false, "call_Z"))
				<-began
				second := httptest.NewRecorder()
				done := make(chan struct{})
				go func() {
					stream.ServeHTTP(second, scored(context.Background(), 0.3, false, "call_Z"))
					close(done)
				}()
				synctest.Wait()
				select {
				case <-began:
				default:
					t.Fatal("the second request of the id waits for the first stream to end")
				}
				close(end)
				<-done
				if !first.Flushed && name == "Flush" {
					t.Error("the flush did not reach the writer")
				}
			})
		})
	}
}

// TestDelayAnswersWhenOutOfTime: a request whose own deadline passes while
// it waits in the queue (on the timer or on a tool_call_id) is refused
// through Options.Refuse (503 with Retry-After), never a 200 with no body.
func TestDelayAnswersWhenOutOfTime(t *testing.T) {
	tests := []struct {
		name   string
		holdID string
		score  float64
	}{
		{"waiting on the timer", "", 1.0},
		{"waiting on the tool_call_id", "call_held", 0.3},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, func(o *Options) { o.Mode = ModeEnforce })
				if tc.holdID != "" {
					release, err := f.g.Admit(httptest.NewRecorder(), scored(context.Background(), 0.3, false, tc.holdID))
					if err != nil {
						t.Fatal(err)
					}
					defer release()
				}
				ran := false
				h := f.g.Delay(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { ran = true }))
				ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
				defer cancel()
				w := httptest.NewRecorder()
				h.ServeHTTP(w, scored(ctx, tc.score, false, tc.holdID))
				if ran || w.Code != http.StatusServiceUnavailable || w.Header().Get("Retry-After") != "2" {
					t.Fatalf("out of time in the queue: ran %v, %d %q Retry-After %q", ran, w.Code, w.Body, w.Header().Get("Retry-After"))
				}
				if d := f.g.QueueDepth(); d != 0 {
					t.Errorf("queue depth %d after the deadline, want 0", d)
				}
			})
		})
	}
}

// TestToolCallAlertsBoundedOverall: a client that changes its tool_call_id
// every 16 requests raises the metric for each id but at most
// alertsPerWindow log lines and callbacks per window.
func TestToolCallAlertsBoundedOverall(t *testing.T) {
	calls := 0
	f := newFixture(t, func(o *Options) {
		o.Mode = ModeEnforce
		o.ToolCallLoop = func(context.Context, string, int) { calls++ }
	})
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	flood := func(ids int, prefix string) {
		for i := range ids {
			for range alertAfter + 1 {
				if _, err := f.g.Admit(httptest.NewRecorder(), scored(gone, 0.7, false, fmt.Sprintf("%s_%d", prefix, i))); !errors.Is(err, context.Canceled) {
					t.Fatalf("Admit: %v", err)
				}
			}
		}
	}
	flood(40, "call")
	if n := len(f.log.lines(slog.LevelWarn)); n != alertsPerWindow || calls != alertsPerWindow {
		t.Fatalf("40 looping ids: %d WARN lines and %d callbacks, want %d each", n, calls, alertsPerWindow)
	}
	if got := testutil.ToFloat64(f.g.m.alerts.WithLabelValues("tasks")); got != 40 {
		t.Errorf("tool_call_alerts_total = %v, want 40 (the metric counts them all)", got)
	}
	f.clk.Advance(alertWindow)
	flood(1, "next")
	if calls != alertsPerWindow+1 {
		t.Errorf("the next window's first looping id: %d callbacks, want %d", calls, alertsPerWindow+1)
	}
}

// firstReady takes the outcome of the first of chs that has one.
func firstReady(chs []<-chan outcome) (outcome, bool) {
	for _, c := range chs {
		select {
		case o := <-c:
			return o, true
		default:
		}
	}
	return outcome{}, false
}
