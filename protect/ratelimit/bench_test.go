package ratelimit

import (
	"context"
	"strconv"
	"testing"
	"time"

	"faregate/protect/redistest"
)

// BenchmarkGate measures one admitted Gate round trip with its allocations;
// the window holds about 60 entries, as a busy visitor's does. On miniredis
// the embedded server's Lua VM runs in this process and dominates the
// allocations; on real Redis only the client's are counted.
func BenchmarkGate(b *testing.B) {
	for _, name := range []string{"miniredis", "redis"} {
		b.Run(name, func(b *testing.B) {
			be := redistest.Mini(b)
			if name == "redis" {
				be = redistest.Real(b)
			}
			clk := newClock(start)
			l := New(be.Client, Options{Now: clk.Now})
			ctx := context.Background()
			req := GateRequest{Scope: visA, RequestsPerMinute: 120, FailedChecksPerHour: 20, CheckAnomaly: true}
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
		})
	}
}
