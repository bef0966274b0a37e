package ratelimit

import (
	"errors"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"
)

// send is one paced model call: its size and when it was allowed out.
type send struct {
	amount int64
	at     time.Time
}

// checkWindows asserts the pacing property on simulated sends: in every
// window [x, y] the tokens sent stay within capacity + rate × (y − x). The
// tightest windows start and end at sends, so those are all that is checked.
func checkWindows(t *testing.T, sends []send, rate int64) {
	t.Helper()
	s := slices.Clone(sends)
	slices.SortStableFunc(s, func(a, b send) int { return a.at.Compare(b.at) })
	capacity := capacityOf(rate)
	for i := range s {
		var sum int64
		for j := i; j < len(s); j++ {
			sum += s[j].amount
			if j+1 < len(s) && s[j+1].at.Equal(s[j].at) {
				continue // the window must hold every send at its end instant
			}
			// sum ≤ capacity + rate × w / 1 min, in integer nanoseconds.
			w := int64(s[j].at.Sub(s[i].at))
			if sum*int64(time.Minute) > capacity*int64(time.Minute)+rate*w {
				t.Fatalf("%d tokens sent in the %v from %v; bound is %d + %d/min", sum, time.Duration(w), s[i].at, capacity, rate)
			}
		}
	}
}

// testPaceSchedule: calls at one instant are given send times in the order
// they asked, each the earliest the bucket can pay for after the others.
func testPaceSchedule(t *testing.T, r *rig) {
	steps := []struct {
		amount int64
		wait   time.Duration
	}{
		{500, 0},
		{500, 0},
		{500, 30 * time.Second}, // 200 left, 300 to refill at 10/s
		{300, time.Minute},
		{1200, 3 * time.Minute}, // a full capacity's worth
		{100, 3*time.Minute + 10*time.Second},
	}
	var sends []send
	for i, st := range steps {
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		wait, err := l.Pace(r.ctx, SiteScope, rate600, st.amount, time.Hour, r.op())
		if err != nil || wait != st.wait {
			t.Fatalf("call %d (%d tokens): wait %v, %v; want %v", i, st.amount, wait, err, st.wait)
		}
		sends = append(sends, send{st.amount, r.clk.Now().Add(wait)})
	}
	checkWindows(t, sends, rate600)
	// Later callers queue behind the reservations, not behind "now".
	r.at(time.Minute)
	if wait, err := r.a.Pace(r.ctx, SiteScope, rate600, 50, time.Hour, r.op()); err != nil || wait != 2*time.Minute+15*time.Second {
		t.Fatalf("a minute later: %v, %v; want 2m15s", wait, err)
	}
}

// testPaceBetweenMilliseconds: from a clock between milliseconds, a call
// the bucket has room for goes at once (no sleep to the next
// millisecond's edge, which an idle Go runtime stretches to a whole
// millisecond or more), and the next is scheduled from no earlier than
// that edge, so the bound holds from the first call's real send.
func testPaceBetweenMilliseconds(t *testing.T, r *rig) {
	r.at(time.Second + 300*time.Microsecond)
	wait, err := r.a.Pace(r.ctx, SiteScope, rate600, capacityOf(rate600), time.Hour, r.op())
	if err != nil || wait != 0 {
		t.Fatalf("a full bucket, between milliseconds: wait %v, %v; want 0", wait, err)
	}
	sends := []send{{capacityOf(rate600), r.clk.Now()}}
	// 10 tokens refill in 1 s at 600/min, counted from the next
	// millisecond's edge.
	wait, err = r.b.Pace(r.ctx, SiteScope, rate600, 10, time.Hour, r.op())
	if want := time.Second + 700*time.Microsecond; err != nil || wait != want {
		t.Fatalf("the next call: wait %v, %v; want %v", wait, err, want)
	}
	sends = append(sends, send{10, r.clk.Now().Add(wait)})
	checkWindows(t, sends, rate600)
}

// testPaceRandom: random sizes at random moments, idle spells included;
// the sends come out in request order and every window holds the bound.
func testPaceRandom(t *testing.T, r *rig) {
	const rate = 6000
	rng := rand.New(rand.NewPCG(7, 11))
	var (
		sends   []send
		maxWait time.Duration
	)
	last := r.clk.Now()
	for i := range 300 {
		switch rng.IntN(10) {
		case 0:
			r.clk.Advance(time.Duration(rng.Int64N(int64(3 * time.Minute)))) // idle: the bucket refills
		default:
			r.clk.Advance(time.Duration(rng.Int64N(int64(2 * time.Second))))
		}
		// Mostly small calls, some up to the whole capacity: on average a
		// little more than the refill between them, so a queue builds.
		amount := 1 + rng.Int64N(capacityOf(rate)/10)
		if rng.IntN(10) == 0 {
			amount = 1 + rng.Int64N(capacityOf(rate))
		}
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		wait, err := l.Pace(r.ctx, SiteScope, rate, amount, 24*time.Hour, r.op())
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		at := r.clk.Now().Add(wait)
		if at.Before(last) {
			t.Fatalf("call %d sent at %v, before call %d at %v", i, at, i-1, last)
		}
		last = at
		maxWait = max(maxWait, wait)
		sends = append(sends, send{amount, at})
	}
	if maxWait == 0 {
		t.Fatal("no call ever waited: the test exercised no queue")
	}
	checkWindows(t, sends, rate)
}

// testPaceReplicas: concurrent callers on two replicas share one schedule.
func testPaceReplicas(t *testing.T, r *rig) {
	const rate = 1200
	var (
		mu    sync.Mutex
		sends []send
		wg    sync.WaitGroup
	)
	now := r.clk.Now()
	for i := range 40 {
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		amount := int64(50 + 25*(i%7))
		wg.Go(func() {
			wait, err := l.Pace(r.ctx, SiteScope, rate, amount, time.Hour, "p-"+strconv.Itoa(i))
			if err != nil {
				t.Errorf("call %d: %v", i, err)
				return
			}
			mu.Lock()
			sends = append(sends, send{amount, now.Add(wait)})
			mu.Unlock()
		})
	}
	wg.Wait()
	if len(sends) != 40 {
		t.Fatalf("%d of 40 calls scheduled", len(sends))
	}
	checkWindows(t, sends, rate)
	// The schedule is tight: the last send is exactly when the bucket
	// (full at the start) has paid for everything.
	var total int64
	latest := now
	for _, s := range sends {
		total += s.amount
		if s.at.After(latest) {
			latest = s.at
		}
	}
	want := now.Add(time.Duration((total-capacityOf(rate))*60000/rate) * time.Millisecond)
	if !latest.Equal(want) {
		t.Fatalf("last send at %v; want %v", latest.Sub(now), want.Sub(now))
	}
}

// testPaceTooLong: a call whose turn is beyond maxWait reserves nothing and
// is told exactly when it would fit.
func testPaceTooLong(t *testing.T, r *rig) {
	pace := func(amount int64, maxWait time.Duration) (time.Duration, error) {
		return r.a.Pace(r.ctx, SiteScope, rate600, amount, maxWait, r.op())
	}
	if wait, err := pace(1200, 0); err != nil || wait != 0 {
		t.Fatalf("a full bucket with no wait allowed: %v, %v", wait, err)
	}
	tooLong := func(amount int64, maxWait, wait, retry time.Duration) {
		t.Helper()
		_, err := pace(amount, maxWait)
		var wl *WaitTooLongError
		if !errors.Is(err, ErrTokenRateLimited) || !errors.As(err, &wl) {
			t.Fatalf("err = %v; want *WaitTooLongError", err)
		}
		if wl.Wait != wait || wl.MaxWait != maxWait || wl.RetryAfter() != retry {
			t.Fatalf("%+v; want wait %v, retry %v", wl, wait, retry)
		}
	}
	tooLong(600, 30*time.Second, time.Minute, 30*time.Second)
	tooLong(600, 30*time.Second, time.Minute, 30*time.Second) // nothing was reserved
	r.at(30*time.Second - time.Millisecond)
	tooLong(600, 30*time.Second, 30*time.Second+time.Millisecond, time.Millisecond)
	r.at(30 * time.Second)
	if wait, err := pace(600, 30*time.Second); err != nil || wait != 30*time.Second {
		t.Fatalf("at RetryAfter: %v, %v; want a wait of exactly 30s", wait, err)
	}
	tooLong(600, 0, 90*time.Second, 90*time.Second)
	// A bound between milliseconds: never a longer wait than asked.
	tooLong(600, 90*time.Second-time.Microsecond, 90*time.Second, time.Microsecond)
	// From a clock between milliseconds, the wait ends exactly on the
	// booked millisecond and stays within the bound.
	r.at(30*time.Second + 300*time.Microsecond)
	tooLong(600, 90*time.Second-300*time.Microsecond-time.Nanosecond, 90*time.Second-300*time.Microsecond, time.Nanosecond)
	if _, err := pace(2*rate600+1, time.Hour); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("over capacity: %v; want ErrTooLarge", err)
	}
	if wait, err := pace(600, 90*time.Second); err != nil || wait != 90*time.Second-300*time.Microsecond {
		t.Fatalf("after the refusals: %v, %v; want 90s (they reserved nothing)", wait, err)
	}
}
