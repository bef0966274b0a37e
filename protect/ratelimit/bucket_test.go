package ratelimit

import (
	"errors"
	"strconv"
	"testing"
	"time"
)

// rate600 refills 10 tokens a second (10 milli-tokens a millisecond, so
// every figure below is exact) and holds 1200.
const rate600 = 600

// testBucketRefill: an emptied bucket holds min(cap, rate × t / 60) after t,
// and Peek says exactly when it will hold what is asked.
func testBucketRefill(t *testing.T, r *rig) {
	cases := []struct {
		name  string
		after time.Duration
		level float64
		need  int64
		ok    bool
		retry time.Duration
	}{
		{"empty", 0, 0, 100, false, 10 * time.Second},
		{"after 250ms", 250 * time.Millisecond, 2.5, 100, false, 9750 * time.Millisecond},
		{"after a second", time.Second, 10, 100, false, 9 * time.Second},
		{"after half a minute", 30 * time.Second, 300, 300, true, 0},
		{"after 119 s", 119 * time.Second, 1190, 1200, false, time.Second},
		{"full after two minutes", 2 * time.Minute, 1200, 1200, true, 0},
		{"never above capacity", 10 * time.Minute, 1200, 1200, true, 0},
		{"between milliseconds", 1500*time.Microsecond + 250*time.Nanosecond, 0.01, 1, false, 98500*time.Microsecond - 250*time.Nanosecond},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			scope := "k:refill-" + strconv.Itoa(i)
			r.at(0)
			if d := r.call(t, r.a, CallRequest{Scope: scope, PromptTokens: 1, Amount: 2 * rate600, TokensPerMinute: rate600}); !d.Taken {
				t.Fatalf("emptying a full bucket: %+v", d)
			}
			r.at(c.after)
			if got := r.level(t, scope, rate600); got != c.level {
				t.Fatalf("level %v; want %v", got, c.level)
			}
			ok, retry, err := r.b.Peek(r.ctx, scope, rate600, c.need)
			if err != nil || ok != c.ok || retry != c.retry {
				t.Fatalf("Peek(%d) = %v, %v, %v; want %v, %v", c.need, ok, retry, err, c.ok, c.retry)
			}
			if c.ok {
				return
			}
			// RetryAfter is exact: 1 ns earlier it still cannot, then it can.
			now := r.clk.Now()
			r.clk.Set(now.Add(retry - time.Nanosecond))
			if ok, _, _ := r.a.Peek(r.ctx, scope, rate600, c.need); ok {
				t.Fatal("Peek ok 1ns before its RetryAfter")
			}
			r.clk.Set(now.Add(retry))
			if ok, _, _ := r.a.Peek(r.ctx, scope, rate600, c.need); !ok {
				t.Fatal("Peek not ok at its RetryAfter")
			}
		})
	}
}

// testBucketBurst: the capacity is twice the rate, a larger amount is
// refused for good, and a short bucket says when it will hold the amount
// without taking anything or teaching the EMA.
func testBucketBurst(t *testing.T, r *rig) {
	if ok, _, err := r.a.Peek(r.ctx, visA, rate600, 2*rate600); !ok || err != nil {
		t.Fatalf("a fresh bucket holds 2x the rate: %v, %v", ok, err)
	}
	for _, peek := range []bool{true, false} {
		var err error
		if peek {
			_, _, err = r.a.Peek(r.ctx, visA, rate600, 2*rate600+1)
		} else {
			_, err = r.a.BeforeCall(r.ctx, CallRequest{Scope: visA, PromptTokens: 1, Amount: 2*rate600 + 1, TokensPerMinute: rate600, Op: r.op()})
		}
		if !errors.Is(err, ErrTooLarge) {
			t.Fatalf("over capacity (peek %v): %v; want ErrTooLarge", peek, err)
		}
	}
	req := CallRequest{Scope: visA, PromptTokens: 50, Amount: 2 * rate600, TokensPerMinute: rate600}
	if d := r.call(t, r.a, req); !d.Taken || d.Samples != 1 {
		t.Fatalf("the whole burst: %+v", d)
	}
	req.Amount = 100
	d := r.call(t, r.b, req)
	if d.Taken || d.Anomaly || d.RetryAfter != 10*time.Second || d.Samples != 1 {
		t.Fatalf("empty bucket: %+v; want short for 10s, EMA not taught", d)
	}
	var re *RefusedError
	if err := d.Err(); !errors.Is(err, ErrTokenRateLimited) || !errors.As(err, &re) || re.RetryAfter() != 10*time.Second {
		t.Fatalf("Err() = %v", err)
	}
	if got := r.level(t, visA, rate600); got != 0 {
		t.Fatalf("a short call took tokens: level %v", got)
	}
	// One millisecond short, it holds 99.99 tokens: still not enough.
	r.at(10*time.Second - time.Millisecond)
	if d := r.call(t, r.a, req); d.Taken || d.RetryAfter != time.Millisecond {
		t.Fatalf("99.99 tokens for 100: %+v; want short for 1ms", d)
	}
	r.at(10 * time.Second)
	if d := r.call(t, r.b, req); !d.Taken || d.Samples != 2 {
		t.Fatalf("after RetryAfter: %+v", d)
	}
	// No bucket: always taken, and the EMA still learns.
	if d := r.call(t, r.a, CallRequest{Scope: visA, PromptTokens: 50, Amount: 1 << 30}); !d.Taken || d.Samples != 3 {
		t.Fatalf("without a bucket: %+v", d)
	}
}

// testAfterCall: unused tokens come back (up to capacity); usage over the
// reservation drives the bucket below zero, and refills pay it back.
func testAfterCall(t *testing.T, r *rig) {
	cases := []struct {
		name             string
		reserved, actual int64
		settleAfter      time.Duration
		overage          int64
		level            float64
	}{
		{"unused tokens come back", 1000, 300, 0, 0, 900},
		{"exact use", 1000, 1000, 0, 0, 200},
		{"refund capped at capacity", 1000, 0, 2 * time.Minute, 0, 1200},
		{"overage drives it below zero", 1000, 1500, 0, 500, -300},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			scope := "k:settle-" + strconv.Itoa(i)
			r.at(0)
			if d := r.call(t, r.a, CallRequest{Scope: scope, PromptTokens: 10, Amount: c.reserved, TokensPerMinute: rate600}); !d.Taken {
				t.Fatalf("reserve: %+v", d)
			}
			r.at(c.settleAfter)
			over, err := r.b.AfterCall(r.ctx, scope, rate600, c.reserved, c.actual, r.op())
			if err != nil || over != c.overage {
				t.Fatalf("AfterCall = %d, %v; want %d", over, err, c.overage)
			}
			if got := r.level(t, scope, rate600); got != c.level {
				t.Fatalf("level %v; want %v", got, c.level)
			}
		})
	}
	// The overdrawn bucket (-300) pays back at the refill rate.
	scope := "k:settle-3"
	if d := r.call(t, r.a, CallRequest{Scope: scope, PromptTokens: 10, Amount: 100, TokensPerMinute: rate600}); d.Taken || d.RetryAfter != 40*time.Second {
		t.Fatalf("overdrawn bucket: %+v; want short for 40s", d)
	}
	for _, st := range []struct {
		at    time.Duration
		level float64
	}{{30 * time.Second, 0}, {time.Minute, 300}, {3 * time.Minute, 1200}} {
		r.at(st.at)
		if got := r.level(t, scope, rate600); got != st.level {
			t.Fatalf("at %v: level %v; want %v", st.at, got, st.level)
		}
	}
	// Without a bucket only the overage is computed.
	if over, err := r.a.AfterCall(r.ctx, scope, 0, 100, 130, r.op()); err != nil || over != 30 {
		t.Fatalf("no bucket: %d, %v; want 30", over, err)
	}
}
