package clocktest

import (
	"sync"
	"testing"
	"time"
)

func TestClock(t *testing.T) {
	start := time.Date(2026, 8, 31, 23, 59, 0, 0, time.FixedZone("CEST", 2*3600))
	c := New(start)
	if got := c.Now(); !got.Equal(start) || got.Location() != time.UTC {
		t.Fatalf("Now = %v, want %v in UTC", got, start)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				c.Advance(time.Second)
			}
		}()
	}
	wg.Wait()
	if got, want := c.Now(), start.Add(800*time.Second); !got.Equal(want) {
		t.Fatalf("after 800 advances of 1s: %v, want %v", got, want)
	}
	c.Set(start)
	if !c.Now().Equal(start) {
		t.Fatalf("Set: %v", c.Now())
	}
}

func TestPoll(t *testing.T) {
	n := 0
	if !Poll(time.Minute, func() bool { n++; return n == 3 }) || n != 3 {
		t.Fatalf("Poll stopped after %d looks, want 3 and true", n)
	}
	// A condition that never holds: false after the timeout, with a last look at the deadline.
	start, looks := time.Now(), 0
	if Poll(30*time.Millisecond, func() bool { looks++; return false }) {
		t.Fatal("Poll reported a condition that never held")
	}
	if el := time.Since(start); el < 30*time.Millisecond || looks < 2 {
		t.Fatalf("Poll gave up after %v and %d looks, want at least the timeout and two", el, looks)
	}
	if d := Eventually(t, time.Minute, "at once", func() bool { return true }); d > time.Minute {
		t.Fatalf("Eventually took %v", d)
	}
}

// TestPollAt: a poller bounded at most looks no more often than its
// bound allows: at most/8 first, doubling to most.
func TestPollAt(t *testing.T) {
	var looks []time.Time
	start := time.Now()
	PollAt(time.Second, 250*time.Millisecond, func() bool { looks = append(looks, time.Now()); return false })
	if len(looks) > 8 {
		t.Fatalf("%d looks in a second, want at most 8", len(looks))
	}
	if d := looks[1].Sub(looks[0]); d < 31*time.Millisecond {
		t.Fatalf("second look %v after the first, want at least 31ms", d)
	}
	if time.Since(start) < time.Second {
		t.Fatal("gave up before its timeout")
	}
}
