package pause

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

const ms = time.Millisecond

// TestBackoff: the run of waits doubles (or grows by Factor) up to Max,
// starts over on Reset, and bounds hold for nonsense policies.
func TestBackoff(t *testing.T) {
	cases := []struct {
		name  string
		p     Policy
		n     int
		reset bool // Reset after n waits, then one more
		want  []time.Duration
	}{
		{"doubling to the cap", Policy{First: 100 * ms, Max: 2 * time.Second}, 7, false,
			[]time.Duration{100 * ms, 200 * ms, 400 * ms, 800 * ms, 1600 * ms, 2000 * ms, 2000 * ms}},
		{"reset starts over", Policy{First: 100 * ms, Max: 2 * time.Second}, 3, true,
			[]time.Duration{100 * ms, 200 * ms, 400 * ms, 100 * ms}},
		{"factor 4", Policy{First: 100 * ms, Max: 400 * ms, Factor: 4}, 3, false,
			[]time.Duration{100 * ms, 400 * ms, 400 * ms}},
		{"factor below 1 means 2", Policy{First: time.Second, Max: time.Minute, Factor: 0.5}, 3, false,
			[]time.Duration{time.Second, 2 * time.Second, 4 * time.Second}},
		{"max below first means first", Policy{First: time.Second, Max: time.Millisecond}, 2, false,
			[]time.Duration{time.Second, time.Second}},
		{"zero first is 1ns", Policy{Max: 4}, 4, false, []time.Duration{1, 2, 4, 4}},
		{"growth past a Duration is capped", Policy{First: time.Hour, Max: 1 << 62, Factor: 1e12}, 3, false,
			[]time.Duration{time.Hour, 1 << 62, 1 << 62}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := c.p.Backoff()
			var got []time.Duration
			for range c.n {
				got = append(got, b.Next())
			}
			if c.reset {
				b.Reset()
				got = append(got, b.Next())
			}
			if !slices.Equal(got, c.want) {
				t.Fatalf("waits %v, want %v", got, c.want)
			}
			for n := range c.n {
				if w := c.p.Nth(n); w != c.want[n] {
					t.Fatalf("Nth(%d) = %v, want %v (the run's)", n, w, c.want[n])
				}
			}
		})
	}
}

// TestBackoffJitter: a jittered wait lies in [w·(1−Jitter), w] and the
// waits are not all alike (so waiters spread out); a Jitter of 1 or more
// still leaves a wait above zero.
func TestBackoffJitter(t *testing.T) {
	b := Policy{First: time.Second, Max: time.Second, Jitter: 0.2}.Backoff()
	seen := map[time.Duration]bool{}
	for range 200 {
		w := b.Next()
		if w < 800*ms || w > time.Second {
			t.Fatalf("wait %v outside [800ms, 1s]", w)
		}
		seen[w] = true
	}
	if len(seen) < 2 {
		t.Fatal("200 jittered waits all alike")
	}
	p := Policy{First: 100 * ms, Max: time.Second, Jitter: 0.5}
	for range 200 {
		if w := p.Nth(2); w < 200*ms || w > 400*ms {
			t.Fatalf("Nth(2) %v outside [200ms, 400ms]", w)
		}
	}
	b = Policy{First: time.Second, Max: time.Second, Jitter: 5}.Backoff()
	for range 200 {
		if w := b.Next(); w <= 0 {
			t.Fatalf("jitter 5 gave a wait of %v", w)
		}
	}
}

// TestRetry, on fake time: when each try is made, what it is told of the
// next wait, and what Retry returns.
func TestRetry(t *testing.T) {
	errDown, errFinal := errors.New("down"), errors.New("final")
	doubling := Policy{First: 100 * ms, Max: 2 * time.Second}
	cases := []struct {
		name    string
		p       Policy
		timeout time.Duration // 0: none
		results []error       // try's answers in turn; past the end, errDown
		want    error
		at      []time.Duration // when each try was made
		nexts   []time.Duration // the next wait each try was told of
		took    time.Duration
	}{
		{"first try succeeds", doubling, 0, []error{nil}, nil,
			[]time.Duration{0}, []time.Duration{100 * ms}, 0},
		{"two failures then success", doubling, 0, []error{errDown, errDown, nil}, nil,
			[]time.Duration{0, 100 * ms, 300 * ms}, []time.Duration{100 * ms, 200 * ms, 400 * ms}, 300 * ms},
		{"tries run out: the last error", Policy{First: 100 * ms, Max: 400 * ms, Factor: 4, Tries: 3}, 0,
			[]error{errDown, errDown, errFinal}, errFinal,
			[]time.Duration{0, 100 * ms, 500 * ms}, []time.Duration{100 * ms, 400 * ms, 400 * ms}, 500 * ms},
		{"stop: at once, unwrapped", doubling, 0, []error{errDown, Stop(errFinal), nil}, errFinal,
			[]time.Duration{0, 100 * ms}, []time.Duration{100 * ms, 200 * ms}, 100 * ms},
		{"ctx ends in a wait: try's last error", doubling, 250 * ms, []error{errDown, errFinal}, errFinal,
			[]time.Duration{0, 100 * ms}, []time.Duration{100 * ms, 200 * ms}, 250 * ms},
		{"ctx ended before: one try still made", doubling, -1, []error{errFinal}, errFinal,
			[]time.Duration{0}, []time.Duration{100 * ms}, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				ctx := context.Background()
				if c.timeout != 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, max(c.timeout, 0))
					defer cancel()
				}
				start := time.Now()
				var at, nexts []time.Duration
				err := Retry(ctx, c.p, func(next time.Duration) error {
					at, nexts = append(at, time.Since(start)), append(nexts, next)
					if i := len(at) - 1; i < len(c.results) {
						return c.results[i]
					}
					return errDown
				})
				if err != c.want {
					t.Errorf("Retry = %v, want %v", err, c.want)
				}
				if !slices.Equal(at, c.at) || !slices.Equal(nexts, c.nexts) {
					t.Errorf("tries at %v told %v; want at %v told %v", at, nexts, c.at, c.nexts)
				}
				if took := time.Since(start); took != c.took {
					t.Errorf("took %v, want %v", took, c.took)
				}
			})
		})
	}
}

// TestStop: Stop(nil) is nil (a success stays one), and a stop error
// still says and unwraps to its cause.
func TestStop(t *testing.T) {
	if Stop(nil) != nil {
		t.Fatal("Stop(nil) is not nil")
	}
	cause := fmt.Errorf("lease: %w", context.Canceled)
	if err := Stop(cause); err.Error() != cause.Error() || !errors.Is(err, context.Canceled) {
		t.Fatalf("Stop(cause) = %v", err)
	}
}
