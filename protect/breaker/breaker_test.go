package breaker

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// short are the test settings: small enough to keep the suite fast, with
// slow calls (60ms) well apart from fast ones (microseconds).
var short = Settings{Window: time.Second, OpenFor: 200 * time.Millisecond, SlowCall: 50 * time.Millisecond, Name: "test"}

var errProvider = errors.New("provider: 502")

// outcome is what one fake provider call does.
type outcome int

const (
	ok outcome = iota
	fail
	slow     // succeeds after 60ms
	canceled // the caller cancels it
)

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

// call runs one outcome through b and reports whether fn ran.
func call(t *testing.T, b *Breaker, o outcome) (ran bool, err error) {
	t.Helper()
	ctx := context.Background()
	if o == canceled {
		c, cancel := context.WithCancel(ctx)
		cancel()
		ctx = c
	}
	err = b.Do(ctx, func(ctx context.Context) error {
		ran = true
		switch o {
		case fail:
			return errProvider
		case slow:
			time.Sleep(60 * time.Millisecond) // the slowness under test
		case canceled:
			return ctx.Err()
		}
		return nil
	})
	return ran, err
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
	return strings.Split(strings.TrimSpace(l.b.String()), "\n")
}

func newTest(t *testing.T, s Settings) (*Breaker, *logBuf, *prometheus.Registry) {
	t.Helper()
	var lb logBuf
	reg := prometheus.NewRegistry()
	return New(s, slog.New(slog.NewTextHandler(&lb, nil)), reg), &lb, reg
}

func TestTrip(t *testing.T) {
	cases := []struct {
		name  string
		calls []outcome
		want  State
	}{
		{"2 failures in 10 open", seq(repeat(ok, 8), repeat(fail, 2)), Open},
		{"1 failure in 10 stays closed", seq(repeat(ok, 9), repeat(fail, 1)), Closed},
		{"9 failures are below MinCalls", repeat(fail, 9), Closed},
		{"a success that makes MinCalls trips", seq(repeat(fail, 2), repeat(ok, 8)), Open},
		{"1 slow success in 10 opens", seq(repeat(ok, 9), repeat(slow, 1)), Open},
		{"slow first, then successes", seq(repeat(slow, 1), repeat(ok, 9)), Open},
		{"1 slow in 11 stays closed", seq(repeat(ok, 10), repeat(slow, 1)), Closed},
		{"canceled calls are not counted", seq(repeat(canceled, 10), repeat(fail, 9)), Closed},
		{"canceled calls do not dilute failures", seq(repeat(canceled, 10), repeat(ok, 8), repeat(fail, 2)), Open},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, lb, _ := newTest(t, short)
			for i, o := range c.calls {
				ran, err := call(t, b, o)
				if !ran {
					t.Fatalf("call %d refused early: %v", i, err)
				}
			}
			if got := b.State(); got != c.want {
				t.Fatalf("state = %s; want %s", got, c.want)
			}
			ran, err := call(t, b, ok)
			if c.want == Open {
				if ran || !errors.Is(err, ErrOpen) {
					t.Fatalf("call on open breaker: ran=%v err=%v; want refused with ErrOpen", ran, err)
				}
				if l := lb.lines(); len(l) != 1 || !strings.Contains(l[0], "level=INFO") || !strings.Contains(l[0], "to=open") {
					t.Fatalf("log = %q; want one INFO line for the opening", l)
				}
			} else if !ran || err != nil {
				t.Fatalf("call on closed breaker: ran=%v err=%v", ran, err)
			}
		})
	}
}

func TestErrorsPassThrough(t *testing.T) {
	b, _, _ := newTest(t, short)
	if _, err := call(t, b, fail); !errors.Is(err, errProvider) {
		t.Fatalf("err = %v; want the provider's error", err)
	}
	if _, err := call(t, b, canceled); !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v; want context.Canceled", err)
	}
	if _, err := call(t, b, slow); err != nil {
		t.Fatalf("slow success returned %v", err)
	}
}

// waitState polls until the breaker reports want: OpenFor is real time
// that must pass inside gobreaker, which has no clock to inject.
func waitState(t *testing.T, b *Breaker, want State) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for b.State() != want {
		if time.Now().After(deadline) {
			t.Fatalf("state %s; never became %s", b.State(), want)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestHalfOpen(t *testing.T) {
	cases := []struct {
		name   string
		probes []outcome // results of the HalfOpenProbes probes, in order
		want   State
	}{
		{"probes succeed: closes", repeat(ok, 3), Closed},
		{"a probe fails: reopens", seq(repeat(ok, 2), repeat(fail, 1)), Open},
		{"a probe is slow: reopens", seq(repeat(ok, 2), repeat(slow, 1)), Open},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, lb, reg := newTest(t, short)
			for range 10 {
				call(t, b, fail)
			}
			if b.State() != Open {
				t.Fatalf("state = %s; want open", b.State())
			}
			waitState(t, b, HalfOpen)

			// Start the probes and hold them inside fn.
			release := make([]chan struct{}, len(c.probes))
			entered := make(chan struct{}, len(c.probes))
			var wg sync.WaitGroup
			for i, o := range c.probes {
				release[i] = make(chan struct{})
				wg.Go(func() {
					_ = b.Do(context.Background(), func(context.Context) error {
						entered <- struct{}{}
						<-release[i]
						switch o {
						case fail:
							return errProvider
						case slow:
							time.Sleep(60 * time.Millisecond) // the slowness under test
						}
						return nil
					})
				})
			}
			for range c.probes {
				<-entered
			}
			// Every probe slot is taken: the next call is refused unrun.
			if ran, err := call(t, b, ok); ran || !errors.Is(err, ErrOpen) {
				t.Fatalf("extra call in half-open: ran=%v err=%v", ran, err)
			}
			// In whatever order they finish, one bad probe reopens: either
			// it comes first, or it meets a breaker still half-open since
			// closing needs all HalfOpenProbes successes.
			for _, r := range release {
				close(r)
			}
			wg.Wait()
			if got := b.State(); got != c.want {
				t.Fatalf("state after probes = %s; want %s", got, c.want)
			}
			want := map[string]float64{"open": 1, "half-open": 1, "closed": 0}
			want[string(c.want)]++
			for to, n := range want {
				if got := testutil.ToFloat64(b.transitions.WithLabelValues(to)); got != n {
					t.Errorf("transitions{to=%s} = %v; want %v", to, got, n)
				}
			}
			if got := testutil.ToFloat64(b.state); got != stateValue[c.want] {
				t.Errorf("state gauge = %v; want %v", got, stateValue[c.want])
			}
			if n, err := testutil.GatherAndCount(reg, "faregate_breaker_state"); n != 1 || err != nil {
				t.Errorf("state series = %d, %v", n, err)
			}
			if l := lb.lines(); len(l) != 3 {
				t.Errorf("log lines = %d (%q); want 3 transitions", len(l), l)
			}
		})
	}
}

// TestCanceledProbe: a probe the caller cancels neither reopens nor closes
// the breaker, and frees its slot for another probe.
func TestCanceledProbe(t *testing.T) {
	s := short
	s.HalfOpenProbes = 1
	b, _, _ := newTest(t, s)
	for range 10 {
		call(t, b, fail)
	}
	waitState(t, b, HalfOpen)
	if ran, _ := call(t, b, canceled); !ran {
		t.Fatal("probe refused")
	}
	if got := b.State(); got != HalfOpen {
		t.Fatalf("state after a canceled probe = %s; want half-open", got)
	}
	if ran, err := call(t, b, ok); !ran || err != nil {
		t.Fatalf("second probe: ran=%v err=%v", ran, err)
	}
	if got := b.State(); got != Closed {
		t.Fatalf("state = %s; want closed", got)
	}
}

// TestPanicIsFailure: a panicking call is reported before the panic goes on.
func TestPanicIsFailure(t *testing.T) {
	s := short
	s.MinCalls = 1
	b, _, _ := newTest(t, s)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("panic swallowed")
			}
		}()
		_ = b.Do(context.Background(), func(context.Context) error { panic("boom") })
	}()
	if got := b.State(); got != Open {
		t.Fatalf("state = %s; want open", got)
	}
}

// TestConcurrentCalls: under concurrent load the breaker opens once and
// refuses everything after, without data races (run with -race).
func TestConcurrentCalls(t *testing.T) {
	b, lb, _ := newTest(t, short)
	var ran atomic.Int64
	var wg sync.WaitGroup
	for range 50 {
		wg.Go(func() {
			for range 10 {
				_ = b.Do(context.Background(), func(context.Context) error {
					ran.Add(1)
					return errProvider
				})
			}
		})
	}
	wg.Wait()
	if b.State() != Open {
		t.Fatalf("state = %s; want open", b.State())
	}
	if n := ran.Load(); n >= 500 || n < 10 {
		t.Fatalf("%d of 500 calls ran; want at least MinCalls and far fewer than all", n)
	}
	if l := lb.lines(); len(l) != 1 {
		t.Fatalf("log lines = %q; want exactly one transition", l)
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
	if err != nil || n != 2+6 {
		t.Fatalf("series = %d, %v; want 2 states + 2x3 transitions", n, err)
	}
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
			w := newWindow(time.Second, t0)
			for _, ms := range c.adds {
				w.add(at(ms), true, true)
			}
			got := w.sum(at(c.at))
			if got != (counts{c.want, c.want, c.want}) {
				t.Fatalf("sum = %+v; want %d of each", got, c.want)
			}
		})
	}
}
