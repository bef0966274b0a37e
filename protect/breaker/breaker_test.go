package breaker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"faregate/protect/kit/testkit/clocktest"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The tests run on the default settings (60s window, 10 calls, ratios
// 0.2 and 0.1, 20s slow call, 30s open, 3 probes) but one: any one
// principal may open the breaker (MinPrincipals 1), unless a test says
// otherwise, and a fake clock that only moves when a test moves it. Calls
// held in flight run in a synctest bubble, whose Wait tells when they have
// parked inside fn.

var errProvider = errors.New("provider: 502")

// clock is a fake clock the tests move by hand.
type clock = clocktest.Clock

func newClock() *clock { return clocktest.New(time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)) }

// outcome is what one fake provider call does.
type outcome int

const (
	ok          outcome = iota
	fail                // returns errProvider at once
	slow                // its first event comes after 21s, past the 20s SlowCall; succeeds
	canceled            // the caller cancels it; fn returns ctx.Err()
	deadline            // the caller's deadline passes; fn returns ctx.Err()
	long                // first event at once, then streams for 21s; succeeds
	whole               // a whole answer (no first event marked) after 21s; succeeds
	refused             // the provider refuses the request (a 400): the caller's fault
	throttled           // the provider's 429 with Retry-After 10s
	timeout             // a transport timeout before any event
	longTimeout         // first event at once, a transport timeout 21s later
	statusErr           // the provider answers 503, as a Judged error says
)

// statusError is a provider answer as a Judged error.
type statusError struct {
	status int
	after  time.Duration
}

func (e *statusError) Error() string             { return fmt.Sprintf("provider: %d", e.status) }
func (e *statusError) BreakerFault() Fault       { return StatusFault(e.status) }
func (e *statusError) RetryAfter() time.Duration { return e.after }

// netTimeout is a transport's timeout, as net.Error says it.
type netTimeout struct{}

func (netTimeout) Error() string   { return "i/o timeout" }
func (netTimeout) Timeout() bool   { return true }
func (netTimeout) Temporary() bool { return true }

func repeat(o outcome, n int) []outcome {
	out := make([]outcome, n)
	for i := range out {
		out[i] = o
	}
	return out
}

func seq(parts ...[]outcome) []outcome {
	var out []outcome
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// logBuf collects log output from concurrent goroutines.
type logBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *logBuf) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	s := strings.TrimSpace(l.b.String())
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

// fixture is a breaker on a fake clock with its logs and registry.
type fixture struct {
	t    *testing.T
	b    *Breaker
	s    Settings // as given to New, before defaults
	clk  *clock
	logs *logBuf
	reg  *prometheus.Registry
}

// newFixture builds a breaker named "test" on a fake clock; edit, if not
// nil, changes the settings first.
func newFixture(t *testing.T, edit func(*Settings)) *fixture {
	t.Helper()
	f := &fixture{t: t, clk: newClock(), logs: &logBuf{}, reg: prometheus.NewRegistry()}
	f.s = Settings{Name: "test", Now: f.clk.Now, MinPrincipals: 1}
	if edit != nil {
		edit(&f.s)
	}
	f.b = New(f.s, slog.New(slog.NewTextHandler(f.logs, nil)), f.reg)
	return f
}

// ctxFor returns the context a call with outcome o runs under.
func ctxFor(o outcome) (context.Context, context.CancelFunc) {
	switch o {
	case canceled:
		return context.WithCancel(context.Background())
	case deadline:
		return context.WithDeadline(context.Background(), time.Unix(0, 0))
	}
	return context.WithCancel(context.Background())
}

// behave is the body of a fake provider call with outcome o.
func (f *fixture) behave(ctx context.Context, c *Call, o outcome) error {
	switch o {
	case fail:
		return errProvider
	case slow:
		f.clk.Advance(21 * time.Second)
		c.FirstEvent()
	case long:
		c.FirstEvent()
		f.clk.Advance(21 * time.Second)
	case whole:
		f.clk.Advance(21 * time.Second)
	case canceled, deadline:
		return ctx.Err()
	case refused:
		return fmt.Errorf("call: %w", &statusError{status: 400})
	case throttled:
		return fmt.Errorf("call: %w", &statusError{status: 429, after: 10 * time.Second})
	case statusErr:
		return fmt.Errorf("call: %w", &statusError{status: 503})
	case timeout:
		return fmt.Errorf("call: %w", netTimeout{})
	case longTimeout:
		c.FirstEvent()
		f.clk.Advance(21 * time.Second)
		return fmt.Errorf("call: %w", netTimeout{})
	}
	return nil
}

// call runs one call with outcome o through the breaker, for principal
// "p", and reports whether fn ran.
func (f *fixture) call(o outcome) (ran bool, err error) {
	return f.callFor("p", o)
}

// callFor is call for principal who.
func (f *fixture) callFor(who string, o outcome) (ran bool, err error) {
	ctx, cancel := ctxFor(o)
	defer cancel()
	if o == canceled {
		cancel()
	}
	err = f.b.Do(ctx, who, func(ctx context.Context, c *Call) error {
		ran = true
		return f.behave(ctx, c, o)
	})
	return ran, err
}

// mustRun runs calls that the breaker must admit.
func (f *fixture) mustRun(calls ...outcome) {
	f.t.Helper()
	for i, o := range calls {
		if ran, err := f.call(o); !ran {
			f.t.Fatalf("call %d refused: %v", i, err)
		}
	}
}

// mustRefuse checks that a call is refused with ErrOpen and fn not run.
func (f *fixture) mustRefuse() {
	f.t.Helper()
	ran, err := f.call(ok)
	if ran || !errors.Is(err, ErrOpen) {
		f.t.Fatalf("call ran=%v err=%v; want refused with ErrOpen", ran, err)
	}
}

func (f *fixture) wantState(want State) {
	f.t.Helper()
	if got := f.b.State(); got != want {
		f.t.Fatalf("state = %s; want %s", got, want)
	}
}

// open trips a closed breaker with failures.
func (f *fixture) open() {
	f.t.Helper()
	f.mustRun(repeat(fail, int(f.b.s.MinCalls))...)
	f.wantState(Open)
}

// halfOpen trips the breaker and lets OpenFor pass.
func (f *fixture) halfOpen() {
	f.t.Helper()
	f.open()
	f.clk.Advance(f.b.s.OpenFor)
	f.wantState(HalfOpen)
}

// held is a call parked inside fn until it is let go. Use it only inside
// a synctest bubble.
type held struct {
	o       outcome
	cancel  context.CancelFunc
	release chan struct{}
	done    chan struct{}
	ran     bool
	err     error
}

// hold starts a call with outcome o and returns once it is parked inside
// fn or refused.
func (f *fixture) hold(o outcome) *held {
	ctx, cancel := ctxFor(o)
	h := &held{o: o, cancel: cancel, release: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(h.done)
		h.err = f.b.Do(ctx, "p", func(ctx context.Context, c *Call) error {
			h.ran = true
			<-h.release
			return f.behave(ctx, c, o)
		})
	}()
	synctest.Wait()
	return h
}

// finish lets a held call end with its outcome and waits for Do to return.
func (h *held) finish() {
	if h.o == canceled {
		h.cancel()
	}
	close(h.release)
	<-h.done
	h.cancel()
}

func TestTrip(t *testing.T) {
	cases := []struct {
		name  string
		edit  func(*Settings)
		calls []outcome
		want  State
	}{
		{"2 failures in 10 open", nil, seq(repeat(ok, 8), repeat(fail, 2)), Open},
		{"1 failure in 10 stays closed", nil, seq(repeat(ok, 9), repeat(fail, 1)), Closed},
		{"9 failures are below MinCalls", nil, repeat(fail, 9), Closed},
		{"a success that makes MinCalls trips", nil, seq(repeat(fail, 2), repeat(ok, 8)), Open},
		{"1 slow success in 10 opens", nil, seq(repeat(ok, 9), repeat(slow, 1)), Open},
		{"slow first, then successes", nil, seq(repeat(slow, 1), repeat(ok, 9)), Open},
		{"1 slow in 11 stays closed", nil, seq(repeat(ok, 10), repeat(slow, 1)), Closed},
		{"a caller's deadline is a failure", nil, seq(repeat(ok, 8), repeat(deadline, 2)), Open},
		{"canceled calls are not counted", nil, seq(repeat(canceled, 10), repeat(fail, 9)), Closed},
		{"canceled calls do not dilute failures", nil, seq(repeat(canceled, 10), repeat(ok, 8), repeat(fail, 2)), Open},
		{"MinCalls 3", func(s *Settings) { s.MinCalls = 3 }, seq(repeat(ok, 2), repeat(fail, 1)), Open},
		{"failure ratio above 1 never trips", func(s *Settings) { s.FailureRatio = 1.1 }, repeat(fail, 20), Closed},
		{"slow ratio above 1 never trips", func(s *Settings) { s.SlowRatio = 1.1 }, repeat(slow, 2), Closed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, c.edit)
			f.mustRun(c.calls...)
			f.wantState(c.want)
			if c.want == Open {
				f.mustRefuse()
				if l := f.logs.lines(); len(l) != 1 || !strings.Contains(l[0], "level=INFO") || !strings.Contains(l[0], "to=open") {
					t.Fatalf("log = %q; want one INFO line for the opening", l)
				}
				return
			}
			if l := f.logs.lines(); len(l) != 0 {
				t.Fatalf("log = %q; want none", l)
			}
			f.mustRun(ok)
		})
	}
}

// TestWindowSlides: failures leave the window one bucket (Window/10) at a
// time; once they have all left, successes start it afresh.
func TestWindowSlides(t *testing.T) {
	cases := []struct {
		name  string
		after time.Duration // between 9 failures and 10 successes
		want  State
	}{
		{"failures a window ago are forgotten", time.Minute, Closed},
		{"failures in the oldest bucket still count", time.Minute - 6*time.Second, Open},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, nil)
			f.mustRun(repeat(fail, 9)...)
			f.clk.Advance(c.after)
			for range 10 {
				f.call(ok)
			}
			f.wantState(c.want)
		})
	}
}

func TestErrorsPassThrough(t *testing.T) {
	f := newFixture(t, nil)
	cases := []struct {
		o    outcome
		want error
	}{
		{fail, errProvider},
		{canceled, context.Canceled},
		{deadline, context.DeadlineExceeded},
		{slow, nil},
		{ok, nil},
	}
	for _, c := range cases {
		if _, err := f.call(c.o); !errors.Is(err, c.want) {
			t.Errorf("outcome %d: err = %v; want %v", c.o, err, c.want)
		}
	}
}

// TestOpen: an open breaker refuses without calling fn, naming itself,
// until OpenFor has passed; then it reports half-open.
func TestOpen(t *testing.T) {
	f := newFixture(t, nil)
	f.open()
	_, err := f.call(ok)
	if err == nil || err.Error() != "breaker: open: test" {
		t.Fatalf("err = %v; want breaker: open: test", err)
	}
	f.clk.Advance(30*time.Second - time.Nanosecond)
	f.mustRefuse()
	f.wantState(Open)
	f.clk.Advance(time.Nanosecond)
	f.wantState(HalfOpen)
	f.mustRun(ok)
}

func TestHalfOpen(t *testing.T) {
	cases := []struct {
		name   string
		probes []outcome // the HalfOpenProbes probes, ending in this order
		after  []State   // the state after each probe ends
	}{
		{"all probes succeed: closes", repeat(ok, 3), []State{HalfOpen, HalfOpen, Closed}},
		{"the last probe fails: reopens", seq(repeat(ok, 2), repeat(fail, 1)), []State{HalfOpen, HalfOpen, Open}},
		{"the last probe is slow: reopens", seq(repeat(ok, 2), repeat(slow, 1)), []State{HalfOpen, HalfOpen, Open}},
		{"a probe's deadline passes: reopens", seq(repeat(ok, 1), repeat(deadline, 1), repeat(ok, 1)), []State{HalfOpen, Open, Open}},
		{"the first probe fails: later results are dropped", seq(repeat(fail, 1), repeat(ok, 2)), []State{Open, Open, Open}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := newFixture(t, nil)
				f.halfOpen()
				probes := make([]*held, len(c.probes))
				for i, o := range c.probes {
					probes[i] = f.hold(o)
					if !probes[i].ran {
						t.Fatalf("probe %d refused: %v", i, probes[i].err)
					}
				}
				// Every probe slot is taken: the next call is refused unrun.
				f.mustRefuse()
				for i, p := range probes {
					p.finish()
					f.wantState(c.after[i])
				}
				want := c.after[len(c.after)-1]
				if l := f.logs.lines(); len(l) != 3 || !strings.Contains(l[2], "to="+string(want)) {
					t.Errorf("log = %q; want 3 changes, the last to %s", l, want)
				}
			})
		})
	}
}

// TestReopen: a reopened breaker waits OpenFor again from the reopening,
// then probes afresh with all its slots.
func TestReopen(t *testing.T) {
	f := newFixture(t, nil)
	f.halfOpen()
	f.clk.Advance(10 * time.Second)
	f.mustRun(fail)
	f.wantState(Open)
	f.clk.Advance(30*time.Second - time.Nanosecond)
	f.mustRefuse()
	f.clk.Advance(time.Nanosecond)
	f.mustRun(ok, ok, ok)
	f.wantState(Closed)
}

// TestCloseForgetsWindow: a breaker that closes judges only calls made
// since, not the failures that opened it (still inside Window).
func TestCloseForgetsWindow(t *testing.T) {
	f := newFixture(t, nil)
	f.halfOpen()
	f.mustRun(ok, ok, ok)
	f.wantState(Closed)
	f.mustRun(repeat(fail, 9)...)
	f.wantState(Closed)
	f.mustRun(fail)
	f.wantState(Open)
}

// TestCanceledProbe: a probe the caller cancels neither reopens nor closes
// the breaker, and frees its slot for another probe.
func TestCanceledProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, func(s *Settings) { s.HalfOpenProbes = 1 })
		f.halfOpen()
		p := f.hold(canceled)
		f.mustRefuse()
		p.finish()
		if !errors.Is(p.err, context.Canceled) {
			t.Fatalf("probe err = %v; want context.Canceled", p.err)
		}
		f.wantState(HalfOpen)
		f.mustRun(ok)
		f.wantState(Closed)
	})
}

// TestPanicIsFailure: a panicking call counts as a failure (and frees a
// probe slot) while the panic goes on with its own value.
func TestPanicIsFailure(t *testing.T) {
	cases := []struct {
		name    string
		prepare func(*fixture)
	}{
		{"closed", func(*fixture) {}},
		{"half-open probe", (*fixture).halfOpen},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, func(s *Settings) { s.MinCalls = 1 })
			c.prepare(f)
			func() {
				defer func() {
					if p := recover(); p != "boom" {
						t.Fatalf("recovered %v; want the panic boom", p)
					}
				}()
				_ = f.b.Do(context.Background(), "p", func(context.Context, *Call) error { panic("boom") })
			}()
			f.wantState(Open)
		})
	}
}

// TestStaleGeneration: a call begun before a state change says nothing
// about the state that followed; its result is dropped.
func TestStaleGeneration(t *testing.T) {
	// A single failure opens these breakers and a single probe decides.
	one := func(s *Settings) { s.MinCalls, s.HalfOpenProbes = 1, 1 }
	t.Run("a failure begun before a reopening does not reopen the closed breaker", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, one)
			stale := f.hold(fail)
			f.halfOpen()
			f.mustRun(ok)
			f.wantState(Closed)
			stale.finish()
			f.wantState(Closed)
		})
	})
	t.Run("a success begun while closed is not a probe", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, one)
			stale := f.hold(ok)
			f.halfOpen()
			stale.finish()
			f.wantState(HalfOpen)
			f.mustRun(ok) // the probe slot is still free
			f.wantState(Closed)
		})
	})
	t.Run("a cancel begun while closed frees no probe slot", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			f := newFixture(t, one)
			stale := f.hold(canceled)
			f.halfOpen()
			probe := f.hold(ok)
			stale.finish()
			f.mustRefuse()
			probe.finish()
			f.wantState(Closed)
		})
	})
}

// stateChange is one OnStateChange call.
type stateChange struct{ from, to State }

// TestOnStateChange: every change is passed on once, in order, outside
// the lock (the callback reads the state), never re-entrantly.
func TestOnStateChange(t *testing.T) {
	cases := []struct {
		name string
		// react runs inside OnStateChange after it recorded the change.
		react func(f *fixture, to State)
		steps func(f *fixture)
		want  []stateChange
	}{
		{
			name: "a full cycle and a failed probe",
			react: func(f *fixture, to State) {
				if st := f.b.State(); st != to {
					f.t.Errorf("State() inside OnStateChange(_, %s) = %s", to, st)
				}
			},
			steps: func(f *fixture) {
				f.halfOpen()
				f.mustRun(ok, ok, ok)
				f.halfOpen()
				f.mustRun(fail)
			},
			want: []stateChange{
				{Closed, Open}, {Open, HalfOpen}, {HalfOpen, Closed},
				{Closed, Open}, {Open, HalfOpen}, {HalfOpen, Open},
			},
		},
		{
			name: "a change caused inside the callback comes after it",
			react: func(f *fixture, to State) {
				if to == Open {
					f.clk.Advance(f.b.s.OpenFor)
					if st := f.b.State(); st != HalfOpen {
						f.t.Errorf("State() after OpenFor = %s; want half-open", st)
					}
				}
			},
			steps: func(f *fixture) { f.mustRun(repeat(fail, 10)...) },
			want:  []stateChange{{Closed, Open}, {Open, HalfOpen}},
		},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var got []stateChange
			inside := false
			var f *fixture
			f = newFixture(t, func(s *Settings) {
				s.OnStateChange = func(from, to State) {
					if inside {
						t.Errorf("OnStateChange(%s, %s) called inside another", from, to)
					}
					inside = true
					defer func() { inside = false }()
					got = append(got, stateChange{from, to})
					c.react(f, to)
				}
			})
			c.steps(f)
			if !slices.Equal(got, c.want) {
				t.Fatalf("changes = %v; want %v", got, c.want)
			}
			lines := f.logs.lines()
			if len(lines) != len(c.want) {
				t.Fatalf("log = %q; want %d lines", lines, len(c.want))
			}
			for i, w := range c.want {
				if !strings.Contains(lines[i], "from="+string(w.from)+" to="+string(w.to)) {
					t.Errorf("log line %d = %q; want %s -> %s", i, lines[i], w.from, w.to)
				}
			}
		})
	}
}

// TestDefaultClock: without Settings.Now the breaker measures with
// time.Now, here the bubble's fake clock, which the slow provider moves.
func TestDefaultClock(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{}, nil, nil)
		for i := range 10 {
			_ = b.Do(context.Background(), fmt.Sprint("p", i%2), func(_ context.Context, c *Call) error {
				if i >= 8 {
					time.Sleep(21 * time.Second) // the provider's wait for the first token
				}
				c.FirstEvent()
				return nil
			})
		}
		if got := b.State(); got != Open {
			t.Fatalf("state = %s; want open after 2 slow calls in 10 from 2 principals", got)
		}
	})
}

func TestDefaults(t *testing.T) {
	s := Settings{}.withDefaults()
	if s.Window != time.Minute || s.MinCalls != 10 || s.FailureRatio != 0.2 || s.SlowRatio != 0.1 ||
		s.SlowCall != 20*time.Second || s.OpenFor != 30*time.Second || s.HalfOpenProbes != 3 ||
		s.MinPrincipals != 2 || s.Name != "model" || s.Now == nil {
		t.Fatalf("defaults = %+v", s)
	}
}

// TestConcurrentFailures: under concurrent load the breaker opens once and
// refuses everything after, without data races (run with -race).
func TestConcurrentFailures(t *testing.T) {
	f := newFixture(t, nil)
	const workers, each = 50, 10
	var ran atomic.Int64
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for range each {
				_ = f.b.Do(context.Background(), "p", func(context.Context, *Call) error {
					ran.Add(1)
					return errProvider
				})
			}
		})
	}
	wg.Wait()
	f.wantState(Open)
	// The 10th recorded failure opens it; at most one call per other
	// worker can be in flight then, and nothing is admitted after.
	if n := ran.Load(); n < 10 || n > 10+workers {
		t.Fatalf("%d of %d calls ran; want between MinCalls and MinCalls+%d", n, workers*each, workers)
	}
	if l := f.logs.lines(); len(l) != 1 {
		t.Fatalf("log lines = %q; want exactly one change", l)
	}
}

// TestConcurrentProbes: of many concurrent calls in half-open exactly
// HalfOpenProbes run; the rest are refused.
func TestConcurrentProbes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFixture(t, nil)
		f.halfOpen()
		calls := make([]*held, 20)
		for i := range calls {
			calls[i] = f.hold(ok)
		}
		var ran, refused int
		for _, c := range calls {
			c.finish()
			switch {
			case c.ran && c.err == nil:
				ran++
			case !c.ran && errors.Is(c.err, ErrOpen):
				refused++
			default:
				t.Errorf("call ran=%v err=%v", c.ran, c.err)
			}
		}
		if ran != 3 || refused != 17 {
			t.Fatalf("ran %d, refused %d; want 3 and 17", ran, refused)
		}
		f.wantState(Closed)
	})
}

// TestMetrics: the state gauge has one series per state, 1 for the
// current state; transitions count the states entered.
func TestMetrics(t *testing.T) {
	cases := []struct {
		name  string
		steps func(*fixture)
		state State
		to    [3]int // transitions to closed, half-open, open
	}{
		{"new", func(*fixture) {}, Closed, [3]int{0, 0, 0}},
		{"open", (*fixture).open, Open, [3]int{0, 0, 1}},
		{"half-open", (*fixture).halfOpen, HalfOpen, [3]int{0, 1, 1}},
		{"closed again", func(f *fixture) { f.halfOpen(); f.mustRun(ok, ok, ok) }, Closed, [3]int{1, 1, 1}},
		{"reopened", func(f *fixture) { f.halfOpen(); f.mustRun(slow) }, Open, [3]int{0, 1, 2}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, nil)
			c.steps(f)
			var want strings.Builder
			want.WriteString(`# HELP faregate_breaker_state Circuit breaker state: 1 for the current state, 0 for the others.
# TYPE faregate_breaker_state gauge
`)
			for _, st := range states {
				v := 0
				if st == c.state {
					v = 1
				}
				fmt.Fprintf(&want, "faregate_breaker_state{name=\"test\",state=%q} %d\n", st, v)
			}
			want.WriteString(`# HELP faregate_breaker_transitions_total Circuit breaker state changes, by the state entered.
# TYPE faregate_breaker_transitions_total counter
`)
			for i, st := range states {
				fmt.Fprintf(&want, "faregate_breaker_transitions_total{name=\"test\",to=%q} %d\n", st, c.to[i])
			}
			err := testutil.GatherAndCompare(f.reg, strings.NewReader(want.String()),
				"faregate_breaker_state", "faregate_breaker_transitions_total")
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestSharedRegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := New(Settings{Name: "primary"}, nil, reg)
	b := New(Settings{Name: "fallback"}, nil, reg)
	if a.State() != Closed || b.State() != Closed {
		t.Fatal("new breakers are not closed")
	}
	n, err := testutil.GatherAndCount(reg, "faregate_breaker_state", "faregate_breaker_transitions_total")
	if err != nil || n != 2*3+2*3 {
		t.Fatalf("series = %d, %v; want 2x3 states + 2x3 transitions", n, err)
	}
}

// BenchmarkDo measures the breaker's own cost per admitted call in the
// closed state, with callers on every CPU contending for its lock.
func BenchmarkDo(b *testing.B) {
	br := New(Settings{}, nil, nil)
	fn := func(context.Context, *Call) error { return nil }
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		ctx := context.Background()
		for pb.Next() {
			if err := br.Do(ctx, "p", fn); err != nil {
				b.Fatal(err)
			}
		}
	})
}

func TestWindow(t *testing.T) {
	t0 := time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	cases := []struct {
		name string
		adds []int // ms after t0 of a failed, slow call each
		at   int
		want uint32
	}{
		{"inside the window", []int{0, 500, 999}, 999, 3},
		{"oldest bucket forgotten", []int{0, 50, 150, 999}, 1000, 2},
		{"all forgotten", []int{0, 500}, 1600, 0},
		{"slots reused after wrap", []int{0, 1000, 1050}, 1050, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			w := newWindow(time.Second, 1, t0)
			for _, ms := range c.adds {
				w.add(at(ms), true, true, "p")
			}
			got := w.sum(at(c.at))
			if got != (counts{c.want, c.want, c.want, min(c.want, 1)}) {
				t.Fatalf("sum = %+v; want %d of each", got, c.want)
			}
		})
	}
}

// TestJudge: the breaker judges the provider, not the caller. Each case
// would open the breaker if every error and every long call counted.
func TestJudge(t *testing.T) {
	cases := []struct {
		name  string
		calls []outcome
		want  State
	}{
		{"2 requests in 10 the provider refuses do not open", seq(repeat(ok, 8), repeat(refused, 2)), Closed},
		{"refused requests do not dilute failures", seq(repeat(refused, 10), repeat(ok, 8), repeat(fail, 2)), Open},
		{"refused requests are not calls", seq(repeat(refused, 20), repeat(ok, 5)), Closed},
		{"a provider's 503 is a failure", seq(repeat(ok, 8), repeat(statusErr, 2)), Open},
		{"a throttled burst counts once", seq(repeat(ok, 9), repeat(throttled, 5)), Closed},
		{"a long stream is not slow", seq(repeat(ok, 9), repeat(long, 1)), Closed},
		{"a whole answer that took long is not slow", seq(repeat(ok, 9), repeat(whole, 1)), Closed},
		{"a late first event is slow", seq(repeat(ok, 9), repeat(slow, 1)), Open},
		{"a timeout before any event is a failure", seq(repeat(ok, 8), repeat(timeout, 2)), Open},
		{"a timeout before any event is slow", seq(repeat(ok, 9), repeat(timeout, 1)), Open},
		{"a timeout mid-answer is the answer's length", seq(repeat(ok, 8), repeat(longTimeout, 2)), Closed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, nil)
			f.mustRun(c.calls...)
			f.wantState(c.want)
		})
	}
}

// TestThrottleQuiet: a 429 counts as a failure at most once per its
// Retry-After; one after it has passed counts again.
func TestThrottleQuiet(t *testing.T) {
	f := newFixture(t, func(s *Settings) { s.MinCalls, s.FailureRatio = 2, 1 })
	f.mustRun(throttled)
	f.clk.Advance(9 * time.Second)
	f.mustRun(throttled, throttled)
	f.wantState(Closed) // one counted call: below MinCalls
	f.clk.Advance(time.Second)
	f.mustRun(throttled)
	f.wantState(Open)
}

// TestOnePrincipal: one principal alone never opens the breaker, however
// many of its calls fail or are slow; the bad calls of a second open it.
func TestOnePrincipal(t *testing.T) {
	cases := []struct {
		name string
		bad  outcome
	}{
		{"failures", fail},
		{"slow calls", slow},
		{"timeouts", timeout},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// MinPrincipals is the default, 2; a slow call moves the clock
			// 21s, so only a few stay in the window: MinCalls 5.
			f := newFixture(t, func(s *Settings) { s.MinPrincipals, s.MinCalls = 0, 5 })
			for i := range 30 {
				if ran, err := f.callFor("agent", c.bad); !ran {
					t.Fatalf("call %d refused: %v", i, err)
				}
			}
			for range 5 {
				f.callFor("visitor", ok)
			}
			f.wantState(Closed)
			f.callFor("visitor", c.bad)
			f.wantState(Open)
			if l := f.logs.lines(); len(l) != 1 || !strings.Contains(l[0], "window_principals=2") {
				t.Fatalf("log = %q; want the opening, naming 2 principals", l)
			}
		})
	}
}

// TestPrincipalsLeaveWithTheirBucket: a principal counts only while its
// bad calls are inside the window.
func TestPrincipalsLeaveWithTheirBucket(t *testing.T) {
	f := newFixture(t, func(s *Settings) { s.MinPrincipals = 2 })
	f.callFor("a", fail)
	f.clk.Advance(time.Minute)
	for range 9 {
		f.callFor("b", fail)
	}
	f.wantState(Closed)
	f.callFor("c", fail)
	f.wantState(Open)
}

// TestRefusedProbe: a probe the provider refuses for what it asked frees
// its slot, as a canceled one does.
func TestRefusedProbe(t *testing.T) {
	f := newFixture(t, func(s *Settings) { s.HalfOpenProbes = 1 })
	f.halfOpen()
	f.mustRun(refused)
	f.wantState(HalfOpen)
	f.mustRun(ok)
	f.wantState(Closed)
}

func TestStatusFault(t *testing.T) {
	cases := []struct {
		status int
		want   Fault
	}{
		{400, CallerFault}, {404, CallerFault}, {409, CallerFault}, {413, CallerFault}, {422, CallerFault},
		{401, ProviderFault}, {403, ProviderFault}, {408, ProviderFault}, {500, ProviderFault},
		{502, ProviderFault}, {503, ProviderFault}, {504, ProviderFault}, {402, ProviderFault},
		{429, RateLimitFault},
	}
	for _, c := range cases {
		if got := StatusFault(c.status); got != c.want {
			t.Errorf("StatusFault(%d) = %d; want %d", c.status, got, c.want)
		}
	}
}
