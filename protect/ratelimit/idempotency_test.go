package ratelimit

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// testIdempotency: a command Redis applied and the client sent again (same
// op, possibly through the other replica, a moment later) counts once and
// is answered with the first result.
func testIdempotency(t *testing.T, r *rig) {
	cases := []struct {
		name string
		run  func(t *testing.T)
	}{
		{"Gate", func(t *testing.T) {
			req := GateRequest{Scope: visA, RequestsPerMinute: 10, Op: "same"}
			first, err := r.a.Gate(r.ctx, req)
			if err != nil || !first.Allowed || first.Remaining != 9 {
				t.Fatalf("first: %+v, %v", first, err)
			}
			r.clk.Advance(time.Second)
			again, err := r.b.Gate(r.ctx, req)
			if err != nil || !again.Allowed || again.Remaining != 9 {
				t.Fatalf("again: %+v, %v; want the same admission", again, err)
			}
			if d := r.gate(t, r.a, GateRequest{Scope: visA, RequestsPerMinute: 10}); d.Remaining != 8 {
				t.Fatalf("next op: remaining %d; want 8 (the repeat counted once)", d.Remaining)
			}
		}},
		{"RecordFailedCheck", func(t *testing.T) {
			for range 2 {
				if c, b, err := r.a.RecordFailedCheck(r.ctx, visA, "same", 2); err != nil || c != 1 || b != 0 {
					t.Fatalf("= %d, %v, %v; want 1 each time", c, b, err)
				}
			}
			if c, b, err := r.b.RecordFailedCheck(r.ctx, visA, "other", 2); err != nil || c != 2 || b != time.Hour {
				t.Fatalf("next op = %d, %v, %v; want 2, blocked 1h", c, b, err)
			}
		}},
		{"BeforeCall", func(t *testing.T) {
			req := CallRequest{Scope: keyAcme, PromptTokens: 100, Amount: 300, TokensPerMinute: rate600, Op: "same"}
			first, err := r.a.BeforeCall(r.ctx, req)
			if err != nil || !first.Taken {
				t.Fatalf("first: %+v, %v", first, err)
			}
			r.clk.Advance(time.Second)
			again, err := r.b.BeforeCall(r.ctx, req)
			if err != nil || again != first {
				t.Fatalf("again: %+v, %v; want %+v", again, err, first)
			}
			if got := r.level(t, keyAcme, rate600); got != 1200-300+10 {
				t.Fatalf("level %v; want 910 (taken once, refilled a second)", got)
			}
		}},
		{"BeforeCall anomaly", func(t *testing.T) {
			req := CallRequest{Scope: visB, PromptTokens: 100, Amount: 100}
			for range 5 {
				r.call(t, r.a, req)
			}
			req.PromptTokens, req.Op = 5000, "spike"
			for range 2 {
				d, err := r.b.BeforeCall(r.ctx, req)
				if err != nil || !d.Anomaly || d.AnomaliesInHour != 1 {
					t.Fatalf("= %+v, %v; want one anomaly each time", d, err)
				}
			}
		}},
		{"AfterCall", func(t *testing.T) {
			for range 2 {
				if over, err := r.a.AfterCall(r.ctx, keyAcme, rate600, 300, 100, "settle"); err != nil || over != 0 {
					t.Fatalf("= %d, %v", over, err)
				}
			}
			if got := r.level(t, keyAcme, rate600); got != 1110 {
				t.Fatalf("level %v; want 1110 (refunded once)", got)
			}
			for range 2 {
				if over, err := r.b.AfterCall(r.ctx, keyAcme, rate600, 100, 2000, "settle-over"); err != nil || over != 1900 {
					t.Fatalf("= %d, %v; want 1900", over, err)
				}
			}
			if got := r.level(t, keyAcme, rate600); got != -790 {
				t.Fatalf("level %v; want -790 (charged once)", got)
			}
		}},
		{"Pace", func(t *testing.T) {
			if _, err := r.a.Pace(r.ctx, SiteScope, rate600, 1200, time.Hour, "drain"); err != nil {
				t.Fatal(err)
			}
			first, err := r.a.Pace(r.ctx, SiteScope, rate600, 600, time.Hour, "same")
			if err != nil || first != time.Minute {
				t.Fatalf("first: %v, %v; want 1m", first, err)
			}
			r.clk.Advance(5 * time.Second)
			again, err := r.b.Pace(r.ctx, SiteScope, rate600, 600, time.Hour, "same")
			if err != nil || again != first-5*time.Second {
				t.Fatalf("again: %v, %v; want the same send time, %v from now", again, err, first-5*time.Second)
			}
			next, err := r.b.Pace(r.ctx, SiteScope, rate600, 600, time.Hour, "next")
			if err != nil || next != 2*time.Minute-5*time.Second {
				t.Fatalf("next op: %v, %v; want one reservation ahead of it", next, err)
			}
		}},
	}
	for _, c := range cases {
		t.Run(c.name, c.run)
	}
	// Replays are not counted as decisions either.
	if got := testutil.ToFloat64(r.a.m.decisions.WithLabelValues("gate", outcomeAllowed)); got != 2 {
		t.Fatalf("gate admissions counted %v; want 2", got)
	}
	if got := testutil.ToFloat64(r.a.m.decisions.WithLabelValues("pace", outcomeAllowed)); got != 3 {
		t.Fatalf("pace admissions counted %v; want 3", got)
	}
}

// testKeys: every key of a principal sits under its hash tag (one cluster
// slot), and every key expires.
func testKeys(t *testing.T, r *rig) {
	ops := []func() error{
		func() error {
			_, err := r.a.Gate(r.ctx, GateRequest{Scope: visA, RequestsPerMinute: 5, FailedChecksPerHour: 3, CheckAnomaly: true, Op: "g"})
			return err
		},
		func() error { _, _, err := r.a.RecordFailedCheck(r.ctx, visA, "f", 3); return err },
		func() error {
			_, err := r.a.BeforeCall(r.ctx, CallRequest{Scope: visA, PromptTokens: 10, Amount: 20, TokensPerMinute: 600, Op: "c"})
			return err
		},
		func() error { _, err := r.a.AfterCall(r.ctx, visA, 600, 20, 5, "s"); return err },
		func() error { _, err := r.a.Pace(r.ctx, SiteScope, 600, 20, time.Hour, "p"); return err },
	}
	for _, op := range ops {
		if err := op(); err != nil {
			t.Fatal(err)
		}
	}
	r.clk.Advance(time.Second)
	// Five normal calls and a spike make the anomaly log.
	for range 5 {
		r.call(t, r.a, CallRequest{Scope: visA, PromptTokens: 10, Amount: 10})
	}
	if d := r.call(t, r.a, CallRequest{Scope: visA, PromptTokens: 1000, Amount: 1000}); !d.Anomaly {
		t.Fatalf("spike: %+v", d)
	}
	got, err := r.rdb.Keys(r.ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	a := "faregate:rl:{" + visA + "}:"
	want := []string{a + "anom", a + "ema", a + "fail", a + "op:call:c", a + "op:settle:s", a + "tpm", a + "win",
		"faregate:rl:{site}:op:pace:p", "faregate:rl:{site}:tpm"}
	// Op keys of the later fresh-op calls are named by the rig's counter.
	var ops2 []string
	for _, k := range got {
		if strings.HasPrefix(k, a+"op:call:op-") {
			ops2 = append(ops2, k)
		}
	}
	if len(ops2) != 6 {
		t.Fatalf("op keys of the six later calls: %v", ops2)
	}
	got = slices.DeleteFunc(got, func(k string) bool { return slices.Contains(ops2, k) })
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("keys = %v\nwant %v", got, want)
	}
	bounds := map[string]time.Duration{
		a + "win": RequestWindow + expiryGrace, a + "fail": CheckWindow + expiryGrace, a + "anom": CheckWindow + expiryGrace,
		a + "ema": emaTTL, a + "tpm": 2*time.Minute + expiryGrace, "faregate:rl:{site}:tpm": 2*time.Minute + expiryGrace,
	}
	for _, k := range append(want, ops2...) {
		ttl, err := r.rdb.PTTL(r.ctx, k).Result()
		limit, ok := bounds[k]
		if !ok {
			limit = OpTTL
		}
		if err != nil || ttl <= 0 || ttl > limit {
			t.Errorf("PTTL %s = %v, %v; want in (0, %v]", k, ttl, err, limit)
		}
	}
}

// testMetrics: decisions are counted by kind and outcome, and the pacing
// wait is observed; no label carries a scope.
func testMetrics(t *testing.T, r *rig) {
	g := GateRequest{Scope: visA, RequestsPerMinute: 1}
	r.gate(t, r.a, g)
	r.gate(t, r.b, g)
	r.call(t, r.a, CallRequest{Scope: visA, PromptTokens: 1, Amount: 1200, TokensPerMinute: rate600})
	r.call(t, r.a, CallRequest{Scope: visA, PromptTokens: 1, Amount: 1, TokensPerMinute: rate600})
	for _, w := range []int64{1200, 600} {
		if _, err := r.a.Pace(r.ctx, SiteScope, rate600, w, time.Hour, r.op()); err != nil {
			t.Fatal(err)
		}
	}
	_, _ = r.b.Pace(r.ctx, SiteScope, rate600, 600, time.Second, r.op())
	want := map[[2]string]float64{
		{"gate", outcomeAllowed}:                    1,
		{"gate", string(ReasonRateLimited)}:         1,
		{"gate", string(ReasonAnomalyBlocked)}:      0,
		{"call", outcomeAllowed}:                    1,
		{"call", outcomeTokenRateLimited}:           1,
		{"pace", outcomeAllowed}:                    2,
		{"pace", outcomeTokenRateLimited}:           1,
		{"pace", outcomeTooLarge}:                   0,
		{"gate", string(ReasonTooManyFailedChecks)}: 0,
	}
	for k, v := range want {
		if got := testutil.ToFloat64(r.a.m.decisions.WithLabelValues(k[0], k[1])); got != v {
			t.Errorf("decisions{kind=%s,outcome=%s} = %v; want %v", k[0], k[1], got, v)
		}
	}
	// Both replicas share one family in one registry.
	if r.a.m.decisions != r.b.m.decisions {
		t.Fatal("two Limiters on one registry must share their counters")
	}
	// The waits 0 and 60 s were observed.
	if n := testutil.CollectAndCount(r.reg, "faregate_site_pacing_wait_seconds"); n != 1 {
		t.Fatalf("pacing histogram series: %d", n)
	}
	mfs, err := r.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if strings.Contains(lp.GetValue(), ":") {
					t.Errorf("%s has label %s=%q, which looks like a scope", mf.GetName(), lp.GetName(), lp.GetValue())
				}
			}
		}
		if mf.GetName() == "faregate_site_pacing_wait_seconds" {
			h := mf.GetMetric()[0].GetHistogram()
			if h.GetSampleCount() != 2 || h.GetSampleSum() != 60 {
				t.Errorf("pacing waits: %d observed, sum %v; want 2, 60", h.GetSampleCount(), h.GetSampleSum())
			}
		}
	}
}
