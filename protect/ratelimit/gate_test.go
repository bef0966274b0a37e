package ratelimit

import (
	"errors"
	"strconv"
	"sync"
	"testing"
	"time"
)

// testGateWindowExact: 3N requests at one instant through two replicas admit
// exactly N; the refusals say exactly when one fits, and one does then.
func testGateWindowExact(t *testing.T, r *rig) {
	const n = 10
	req := GateRequest{Scope: visA, RequestsPerMinute: n}
	results := make([]GateDecision, 3*n)
	errs := make([]error, 3*n)
	var wg sync.WaitGroup
	for i := range 3 * n {
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		wg.Go(func() {
			q := req
			q.Op = "burst-" + strconv.Itoa(i)
			results[i], errs[i] = l.Gate(r.ctx, q)
		})
	}
	wg.Wait()
	allowed := 0
	remaining := map[int64]bool{}
	for i, d := range results {
		if errs[i] != nil {
			t.Fatalf("request %d: %v", i, errs[i])
		}
		if d.Allowed {
			allowed++
			remaining[d.Remaining] = true
			continue
		}
		if d.Reason != ReasonRateLimited || d.RetryAfter != time.Minute || d.Remaining != 0 || d.Limit != n {
			t.Fatalf("refusal %d = %+v; want rate_limited, retry 1m, remaining 0, limit %d", i, d, n)
		}
		var re *RefusedError
		if err := d.Err(); !errors.Is(err, ErrRateLimited) || !errors.As(err, &re) || re.RetryAfter() != time.Minute {
			t.Fatalf("refusal %d: Err() = %v", i, err)
		}
	}
	// Each admission saw its own place in the window: remaining n-1 … 0.
	if allowed != n || len(remaining) != n {
		t.Fatalf("admitted %d with %d distinct remaining counts; want exactly %d", allowed, len(remaining), n)
	}
	// Refusals were not counted: the window holds exactly n entries.
	if c := r.rdb.ZCard(r.ctx, key(visA, "win")).Val(); c != n {
		t.Fatalf("window holds %d entries; want %d", c, n)
	}

	steps := []struct {
		name    string
		at      time.Duration
		allowed bool
		retry   time.Duration
	}{
		{"one millisecond later", time.Millisecond, false, time.Minute - time.Millisecond},
		{"across midnight", 30*time.Second + 250*time.Millisecond, false, 29*time.Second + 750*time.Millisecond},
		{"the last millisecond", time.Minute - time.Millisecond, false, time.Millisecond},
		{"the burst has left: one fits", time.Minute, true, 0},
	}
	for i, st := range steps {
		r.at(st.at)
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		d := r.gate(t, l, req)
		if d.Allowed != st.allowed || d.RetryAfter != st.retry {
			t.Fatalf("%s: %+v; want allowed %v, retry %v", st.name, d, st.allowed, st.retry)
		}
	}
	// The whole burst left together, so the window is open to n again.
	for i := 1; i < n; i++ {
		if d := r.gate(t, r.b, req); !d.Allowed || d.Remaining != int64(n-1-i) {
			t.Fatalf("refill %d: %+v", i, d)
		}
	}
	if d := r.gate(t, r.a, req); d.Allowed || d.RetryAfter != time.Minute {
		t.Fatalf("after the second burst: %+v; want rate_limited for 1m", d)
	}
}

// testGateSliding: requests spread over the minute leave one by one, and
// RetryAfter lands exactly on the instant the next one fits, even from a
// clock that is not on a millisecond.
func testGateSliding(t *testing.T, r *rig) {
	const n = 5
	req := GateRequest{Scope: keyAcme, RequestsPerMinute: n}
	for i := range n {
		r.at(time.Duration(i) * 10 * time.Second)
		d := r.gate(t, r.a, req)
		if !d.Allowed || d.Remaining != int64(n-1-i) || d.Reset != time.Minute-time.Duration(i)*10*time.Second {
			t.Fatalf("request %d: %+v", i, d)
		}
	}
	steps := []struct {
		name      string
		at        time.Duration
		allowed   bool
		retry     time.Duration
		reset     time.Duration
		remaining int64
	}{
		{"full", 45 * time.Second, false, 15 * time.Second, 15 * time.Second, 0},
		{"one ms before the oldest leaves", time.Minute - time.Millisecond, false, time.Millisecond, time.Millisecond, 0},
		{"the oldest left: one fits", time.Minute, true, 0, 10 * time.Second, 0},
		{"full until the next leaves", time.Minute, false, 10 * time.Second, 10 * time.Second, 0},
		{"between milliseconds", 65*time.Second + 400*time.Microsecond, false, 5*time.Second - 400*time.Microsecond, 5*time.Second - 400*time.Microsecond, 0},
	}
	for _, st := range steps {
		r.at(st.at)
		d := r.gate(t, r.b, req)
		if d.Allowed != st.allowed || d.RetryAfter != st.retry || d.Reset != st.reset || d.Remaining != st.remaining {
			t.Fatalf("%s: %+v; want allowed %v retry %v reset %v remaining %d", st.name, d, st.allowed, st.retry, st.reset, st.remaining)
		}
	}
	// From that sub-millisecond instant: 1 ns before RetryAfter is still
	// refused, RetryAfter itself admits.
	now := r.clk.Now()
	r.clk.Set(now.Add(5*time.Second - 400*time.Microsecond - time.Nanosecond))
	if d := r.gate(t, r.a, req); d.Allowed {
		t.Fatalf("1ns before RetryAfter: admitted")
	}
	r.clk.Set(now.Add(5*time.Second - 400*time.Microsecond))
	if d := r.gate(t, r.a, req); !d.Allowed {
		t.Fatalf("at RetryAfter: %+v", d)
	}
}

// testFailedChecks: past the limit, Gate refuses with too_many_failed_checks
// until enough checks slide out of the hour, and those refusals leave the
// request window untouched.
func testFailedChecks(t *testing.T, r *rig) {
	const per = 3
	record := func(at time.Duration, l *Limiter, wantCount int64, wantBlocked time.Duration) {
		t.Helper()
		r.at(at)
		c, b, err := l.RecordFailedCheck(r.ctx, visA, r.op(), per)
		if err != nil || c != wantCount || b != wantBlocked {
			t.Fatalf("record at %v = %d, %v, %v; want %d, %v", at, c, b, err, wantCount, wantBlocked)
		}
	}
	gate := func(fails int64) GateDecision {
		t.Helper()
		return r.gate(t, r.b, GateRequest{Scope: visA, RequestsPerMinute: 100, FailedChecksPerHour: fails})
	}
	record(0, r.a, 1, 0)
	record(10*time.Minute, r.b, 2, 0)
	if d := gate(per); !d.Allowed {
		t.Fatalf("two failed checks of three: %+v", d)
	}
	record(20*time.Minute, r.a, 3, 40*time.Minute)
	if d := gate(0); !d.Allowed || d.Remaining != 99 {
		t.Fatalf("FailedChecksPerHour 0 must not check: %+v", d)
	}
	for range 3 {
		d := gate(per)
		if d.Allowed || d.Reason != ReasonTooManyFailedChecks || d.RetryAfter != 40*time.Minute {
			t.Fatalf("blocked: %+v; want too_many_failed_checks for 40m", d)
		}
		// Not counted: the window still holds the one admission above.
		if d.Remaining != 99 {
			t.Fatalf("refusal consumed the window: remaining %d; want 99", d.Remaining)
		}
		if !errors.Is(d.Err(), ErrTooManyFailedChecks) {
			t.Fatalf("Err() = %v", d.Err())
		}
	}
	if d := gate(per + 1); !d.Allowed || d.Remaining != 98 {
		t.Fatalf("three failed checks of four: %+v", d)
	}
	// A fourth keeps the count at the limit; the block now lasts until the
	// check of 10m leaves the hour, at 70m.
	record(30*time.Minute, r.b, 3, 40*time.Minute)
	steps := []struct {
		at      time.Duration
		allowed bool
		retry   time.Duration
	}{
		{30 * time.Minute, false, 40 * time.Minute},
		{69*time.Minute + 59*time.Second + 999*time.Millisecond, false, time.Millisecond},
		{70 * time.Minute, true, 0},
	}
	for _, st := range steps {
		r.at(st.at)
		if d := gate(per); d.Allowed != st.allowed || d.RetryAfter != st.retry {
			t.Fatalf("at %v: %+v; want allowed %v retry %v", st.at, d, st.allowed, st.retry)
		}
	}
	if c := r.rdb.ZCard(r.ctx, key(visA, "fail")).Val(); c != 2 {
		t.Fatalf("failed-check log holds %d entries at 70m; want 2", c)
	}
}

// testAnomalyBlock: three input spikes in an hour block the principal on
// every replica until the oldest of them is an hour old.
func testAnomalyBlock(t *testing.T, r *rig) {
	call := func(l *Limiter, prompt int64) CallDecision {
		t.Helper()
		return r.call(t, l, CallRequest{Scope: visB, PromptTokens: prompt, Amount: prompt + 100})
	}
	for i := range 5 {
		if d := call(r.a, 200); !d.Taken || d.EMA != 200 || d.Samples != int64(i+1) {
			t.Fatalf("normal call %d: %+v", i, d)
		}
	}
	gate := func(l *Limiter, anomaly bool, fails int64) GateDecision {
		t.Helper()
		return r.gate(t, l, GateRequest{Scope: visB, RequestsPerMinute: 100, CheckAnomaly: anomaly, FailedChecksPerHour: fails})
	}
	spikes := []struct {
		at      time.Duration
		count   int64
		blocked time.Duration
	}{
		{0, 1, 0},
		{10 * time.Minute, 2, 0},
		{20 * time.Minute, 3, 40 * time.Minute},
	}
	for i, s := range spikes {
		if d := gate(r.b, true, 0); !d.Allowed {
			t.Fatalf("before spike %d: %+v", i, d)
		}
		r.at(s.at)
		l := r.a
		if i%2 == 1 {
			l = r.b
		}
		d := call(l, 2400)
		if !d.Anomaly || d.Taken || d.AnomaliesInHour != s.count || d.BlockedFor != s.blocked || d.EMA != 200 || d.Samples != 5 {
			t.Fatalf("spike %d: %+v; want anomaly %d, blocked %v, EMA untouched", i, d, s.count, s.blocked)
		}
		if !errors.Is(d.Err(), ErrInputSpike) {
			t.Fatalf("spike %d: Err() = %v", i, d.Err())
		}
	}
	// The window's earlier entries are over a minute old: it is empty, and
	// the refusals do not fill it.
	for range 2 {
		d := gate(r.b, true, 0)
		if d.Allowed || d.Reason != ReasonAnomalyBlocked || d.RetryAfter != 40*time.Minute || d.Remaining != 100 {
			t.Fatalf("after three spikes: %+v; want anomaly_blocked for 40m, window untouched", d)
		}
	}
	if d := gate(r.a, false, 0); !d.Allowed || d.Remaining != 99 {
		t.Fatalf("CheckAnomaly false must not check: %+v", d)
	}
	// The anomaly block comes before the failed-check block.
	for range 3 {
		if _, _, err := r.a.RecordFailedCheck(r.ctx, visB, r.op(), 3); err != nil {
			t.Fatal(err)
		}
	}
	if d := gate(r.a, true, 3); d.Reason != ReasonAnomalyBlocked {
		t.Fatalf("both blocks: %+v; want anomaly_blocked first", d)
	}
	r.at(time.Hour - time.Millisecond)
	if d := gate(r.a, true, 0); d.Allowed || d.RetryAfter != time.Millisecond {
		t.Fatalf("last millisecond: %+v", d)
	}
	r.at(time.Hour)
	if d := gate(r.b, true, 0); !d.Allowed {
		t.Fatalf("an hour after the first spike: %+v", d)
	}
}

// testSpike: the EMA's arithmetic, when it becomes active, where the spike
// line lies, and that a spike takes no tokens and teaches the EMA nothing.
func testSpike(t *testing.T, r *rig) {
	const rate = 6000
	five := []int64{200, 200, 200, 200, 200}
	cases := []struct {
		name    string
		history []int64
		prompt  int64
		anomaly bool
		ema     float64
		samples int64
	}{
		{"first sample is the EMA", nil, 321, false, 321, 1},
		{"alpha 0.3", []int64{100}, 200, false, 130, 2},
		{"rounded half up to milli-tokens", []int64{1, 2, 1, 1}, 1, false, 1.103, 5},
		{"inactive before five samples", five[:4], 2400, false, 860, 5},
		{"exactly ten times is no spike", five, 2000, false, 740, 6},
		{"just over ten times is", five, 2001, true, 200, 5},
		{"twelve times", five, 2400, true, 200, 5},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			scope := "k:spike-" + strconv.Itoa(i)
			req := CallRequest{Scope: scope, TokensPerMinute: rate}
			for _, p := range c.history {
				req.PromptTokens, req.Amount = p, p+100
				if d := r.call(t, r.a, req); !d.Taken {
					t.Fatalf("history call: %+v", d)
				}
			}
			before := r.level(t, scope, rate)
			req.PromptTokens, req.Amount = c.prompt, c.prompt+100
			d := r.call(t, r.b, req)
			if d.Anomaly != c.anomaly || d.Taken == c.anomaly || d.EMA != c.ema || d.Samples != c.samples {
				t.Fatalf("%+v; want anomaly %v, EMA %v, samples %d", d, c.anomaly, c.ema, c.samples)
			}
			want := before
			if !c.anomaly {
				want -= float64(req.Amount)
			}
			if got := r.level(t, scope, rate); got != want {
				t.Fatalf("bucket %v after the call; want %v", got, want)
			}
		})
	}
}
