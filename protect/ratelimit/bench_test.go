package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// BenchmarkGate measures one admitted Gate round trip with its allocations;
// the window holds about 60 entries, as a busy visitor's does. On miniredis
// the embedded server's Lua VM runs in this process and dominates the
// allocations; on real Redis only the client's are counted. "rules" adds
// what a creation meets with every optional rule on (the second window,
// the invalid ratio, the hour and its soft share), against "plain" in the
// same run.
func BenchmarkGate(b *testing.B) {
	for _, name := range []string{"miniredis", "redis"} {
		for _, rules := range []bool{false, true} {
			sub := name + "/plain"
			if rules {
				sub = name + "/rules"
			}
			b.Run(sub, func(b *testing.B) { benchGate(b, name, rules) })
		}
	}
}

func benchGate(b *testing.B, name string, rules bool) {
	be := redistest.Mini(b)
	if name == "redis" {
		be = redistest.Real(b)
	}
	clk := newClock(start)
	l := New(be.Client, Options{Now: clk.Now})
	ctx := context.Background()
	req := GateRequest{Scope: visA, RequestsPerMinute: 120, FailedChecksPerHour: 20, CheckAnomaly: true}
	if rules {
		req.RequestsPerSecond = 10
		req.Invalid = InvalidRule{Ratio: RatioScale / 2, MinRequests: 20}
		req.Hour = HourRule{Tokens: 1 << 30, SoftTokens: 1 << 29, SoftRequestsPerMinute: 5}
		// An hour with a slot a minute, as a busy principal's is.
		for i := range 60 {
			clk.Advance(time.Minute)
			if _, err := l.BeforeCall(ctx, CallRequest{Scope: visA, PromptTokens: 1, Amount: 100,
				TokensPerHour: req.Hour.Tokens, SoftTokens: req.Hour.SoftTokens, Op: "c" + strconv.Itoa(i)}); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		clk.Advance(time.Second)
		req.Op = "op-" + strconv.Itoa(i)
		d, err := l.Gate(ctx, req)
		if err != nil || !d.Allowed {
			b.Fatalf("gate: %+v, %v", d, err)
		}
	}
}
