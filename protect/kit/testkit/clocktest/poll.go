package clocktest

import (
	"testing"
	"time"
)

// Tests of what runs outside the test's own goroutines (the real binary, a
// redis-server, a kernel socket) cannot fake those clocks with
// testing/synctest: they wait for an event by polling it with a deadline.
// Poll and Eventually are that one wait, so no test sleeps its own guess.

// pollMax is the longest pause between two looks; the first looks come
// sooner (1 ms, doubling), so a condition that holds at once costs nothing.
const pollMax = 20 * time.Millisecond

// Poll calls cond until it holds or timeout has passed, and reports
// whether it held; cond is called at least once, and once more at the
// deadline.
func Poll(timeout time.Duration, cond func() bool) bool {
	return PollAt(timeout, pollMax, cond)
}

// PollAt is Poll with its longest pause between two looks at most, and
// its first at most/8: for a look that costs the polled server something
// it limits (a request that counts in a per-second window), so the poller
// leaves it room (at most/8 = 31 ms, 250 ms: seven looks in the first
// second, then four a second).
func PollAt(timeout, most time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	pause := max(most/8, time.Nanosecond)
	if most == pollMax {
		pause = time.Millisecond // Poll's own first look
	}
	for {
		if cond() {
			return true
		}
		left := time.Until(deadline)
		if left <= 0 {
			return false
		}
		// The one real-clock pause of the polling helpers: what is polled
		// happens outside any clock the test could fake.
		time.Sleep(min(pause, left))
		pause = min(2*pause, most)
	}
}

// Eventually is Poll that fails the test (naming what it waited for) when
// cond does not hold within timeout, and returns how long it took.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	if !Poll(timeout, cond) {
		t.Fatalf("%s: not within %v", what, timeout)
	}
	return time.Since(start)
}

// Pass lets d of real time pass. It is no wait for an event (those poll,
// through Poll or Eventually): the stretch is itself what a test needs, a
// measurement window, a provider's or an outage's duration, a gap a
// Retry-After must count.
func Pass(d time.Duration) { time.Sleep(d) }
