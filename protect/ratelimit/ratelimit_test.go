package ratelimit

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// clock is a settable clock shared by goroutines and by both replicas.
type clock = clocktest.Clock

func newClock(t time.Time) *clock { return clocktest.New(t) }

// start lies half a minute before a UTC midnight: windows and buckets
// belong to the principal, and nothing may reset when the day turns.
var start = time.Date(2026, 8, 31, 23, 59, 30, 0, time.UTC)

var (
	visA = "v:" + strings.Repeat("a", 64)
	visB = "v:" + strings.Repeat("b", 64)
)

const keyAcme = "k:acme"

// rig is one Redis with two Limiters on two clients, as two replicas are,
// sharing one clock and one registry.
type rig struct {
	ctx  context.Context
	clk  *clock
	reg  *prometheus.Registry
	rdb  *redis.Client
	a, b *Limiter
	ops  atomic.Int64
}

func newRig(t *testing.T, be redistest.Backend) *rig {
	t.Helper()
	ctx := context.Background()
	if err := be.Client.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	opt, err := redis.ParseURL(be.URL)
	if err != nil {
		t.Fatal(err)
	}
	second := redis.NewClient(opt)
	t.Cleanup(func() { _ = second.Close() })
	r := &rig{ctx: ctx, clk: newClock(start), reg: prometheus.NewRegistry(), rdb: be.Client}
	r.a = New(be.Client, Options{Now: r.clk.Now, Registerer: r.reg})
	r.b = New(second, Options{Now: r.clk.Now, Registerer: r.reg})
	return r
}

// op is a fresh op id.
func (r *rig) op() string { return "op-" + strconv.FormatInt(r.ops.Add(1), 10) }

// at sets the clock to start + d.
func (r *rig) at(d time.Duration) { r.clk.Set(start.Add(d)) }

// gate runs one Gate with a fresh op.
func (r *rig) gate(t *testing.T, l *Limiter, req GateRequest) GateDecision {
	t.Helper()
	req.Op = r.op()
	d, err := l.Gate(r.ctx, req)
	if err != nil {
		t.Fatalf("gate: %v", err)
	}
	return d
}

// call runs one BeforeCall with a fresh op.
func (r *rig) call(t *testing.T, l *Limiter, req CallRequest) CallDecision {
	t.Helper()
	req.Op = r.op()
	d, err := l.BeforeCall(r.ctx, req)
	if err != nil {
		t.Fatalf("before call: %v", err)
	}
	return d
}

// level reads a bucket's level.
func (r *rig) level(t *testing.T, scope string, rate int64) float64 {
	t.Helper()
	v, err := r.a.Level(r.ctx, scope, rate)
	if err != nil {
		t.Fatalf("level: %v", err)
	}
	return v
}

// TestConformance runs every case on miniredis and on a real Redis.
func TestConformance(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, r *rig)
	}{
		{"GateWindowExact", testGateWindowExact},
		{"GateSliding", testGateSliding},
		{"FailedChecks", testFailedChecks},
		{"AnomalyBlock", testAnomalyBlock},
		{"Spike", testSpike},
		{"BucketRefill", testBucketRefill},
		{"BucketBurstAndShortfall", testBucketBurst},
		{"AfterCall", testAfterCall},
		{"PaceSchedule", testPaceSchedule},
		{"PaceRandomWindows", testPaceRandom},
		{"PaceBetweenMilliseconds", testPaceBetweenMilliseconds},
		{"PaceReplicas", testPaceReplicas},
		{"PaceWaitTooLong", testPaceTooLong},
		{"GatePerSecond", testGatePerSecond},
		{"InvalidRatio", testInvalidRatio},
		{"InvalidRatioBelow", testInvalidRatioBelow},
		{"HourQuota", testHourQuota},
		{"HourConcurrent", testHourConcurrent},
		{"GateSoft", testGateSoft},
		{"SlotsBounded", testSlotsBounded},
		{"Idempotency", testIdempotency},
		{"Invalid", testInvalid},
		{"KeysAndTTLs", testKeys},
		{"Metrics", testMetrics},
	}
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, newRig(t, be)) })
			}
		})
	}
}

// TestUnavailable: every call on a Redis that does not answer fails with
// ErrUnavailable, never with an answer a caller could take as permission.
func TestUnavailable(t *testing.T) {
	m := miniredis.RunT(t)
	addr := m.Addr()
	m.Close()
	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = rdb.Close() })
	l := New(rdb, Options{})
	ctx := context.Background()
	calls := []struct {
		name string
		call func() error
	}{
		{"Gate", func() error {
			_, err := l.Gate(ctx, GateRequest{Scope: visA, RequestsPerMinute: 10, Op: "o"})
			return err
		}},
		{"RecordFailedCheck", func() error { _, _, err := l.RecordFailedCheck(ctx, visA, "o", 3); return err }},
		{"Peek", func() error { _, _, err := l.Peek(ctx, visA, 600, 10); return err }},
		{"Level", func() error { _, err := l.Level(ctx, visA, 600); return err }},
		{"BeforeCall", func() error {
			_, err := l.BeforeCall(ctx, CallRequest{Scope: visA, PromptTokens: 10, Amount: 10, TokensPerMinute: 600, Op: "o"})
			return err
		}},
		{"AfterCall", func() error { _, err := l.AfterCall(ctx, visA, 600, 10, 5, "o"); return err }},
		{"Settle", func() error {
			_, err := l.Settle(ctx, SettleRequest{Scope: visA, TokensPerHour: 100, HourSlot: 1, Reserved: 10, Actual: 5, Op: "o"})
			return err
		}},
		{"Record", func() error { _, _, err := l.Record(ctx, Note{Scope: visA, Invalid: 1, Op: "o"}); return err }},
		{"HourRoom", func() error { _, _, _, err := l.HourRoom(ctx, visA, 100, 1); return err }},
		{"Pace", func() error { _, err := l.Pace(ctx, SiteScope, 600, 10, time.Second, "o"); return err }},
	}
	for _, c := range calls {
		t.Run(c.name, func(t *testing.T) {
			if err := c.call(); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("err = %v; want ErrUnavailable", err)
			}
		})
	}
}

func testInvalid(t *testing.T, r *rig) {
	l, ctx := r.a, r.ctx
	gate := func(g GateRequest) error { _, err := l.Gate(ctx, g); return err }
	ok := GateRequest{Scope: visA, RequestsPerMinute: 10, Op: "o"}
	with := func(f func(*GateRequest)) GateRequest { g := ok; f(&g); return g }
	callOK := CallRequest{Scope: visA, PromptTokens: 10, Amount: 20, TokensPerMinute: 600, Op: "o"}
	callWith := func(f func(*CallRequest)) error {
		c := callOK
		f(&c)
		_, err := l.BeforeCall(ctx, c)
		return err
	}
	cases := []struct {
		name string
		err  error
	}{
		{"empty scope", gate(with(func(g *GateRequest) { g.Scope = "" }))},
		{"brace in scope", gate(with(func(g *GateRequest) { g.Scope = "v:{x" }))},
		{"closing brace in scope", gate(with(func(g *GateRequest) { g.Scope = "v:x}" }))},
		{"space in scope", gate(with(func(g *GateRequest) { g.Scope = "v: x" }))},
		{"tab in scope", gate(with(func(g *GateRequest) { g.Scope = "v:\tx" }))},
		{"newline in scope", gate(with(func(g *GateRequest) { g.Scope = "v:x\n" }))},
		{"scope of 141 characters", gate(with(func(g *GateRequest) { g.Scope = strings.Repeat("é", 141) }))},
		{"scope not UTF-8", gate(with(func(g *GateRequest) { g.Scope = "v:\xff" }))},
		{"empty op", gate(with(func(g *GateRequest) { g.Op = "" }))},
		{"op with a space", gate(with(func(g *GateRequest) { g.Op = "a b" }))},
		{"op with a brace", gate(with(func(g *GateRequest) { g.Op = "{a}" }))},
		{"op of 129 characters", gate(with(func(g *GateRequest) { g.Op = strings.Repeat("o", 129) }))},
		{"zero requests per minute", gate(with(func(g *GateRequest) { g.RequestsPerMinute = 0 }))},
		{"negative failed checks per hour", gate(with(func(g *GateRequest) { g.FailedChecksPerHour = -1 }))},
		{"negative requests per second", gate(with(func(g *GateRequest) { g.RequestsPerSecond = -1 }))},
		{"invalid ratio over one", gate(with(func(g *GateRequest) { g.Invalid = InvalidRule{Ratio: RatioScale + 1, MinRequests: 1} }))},
		{"invalid ratio without a minimum", gate(with(func(g *GateRequest) { g.Invalid = InvalidRule{Ratio: 1} }))},
		{"hour without a soft share", gate(with(func(g *GateRequest) { g.Hour = HourRule{Tokens: 10, SoftRequestsPerMinute: 1} }))},
		{"soft share over the hour", gate(with(func(g *GateRequest) { g.Hour = HourRule{Tokens: 10, SoftTokens: 11, SoftRequestsPerMinute: 1} }))},
		{"hour without soft requests", gate(with(func(g *GateRequest) { g.Hour = HourRule{Tokens: 10, SoftTokens: 8} }))},
		{"record: negative requests", func() error { _, _, err := l.Record(ctx, Note{Scope: visA, Requests: -1, Op: "o"}); return err }()},
		{"record: invalid past the bound", func() error { _, _, err := l.Record(ctx, Note{Scope: visA, Invalid: maxNote + 1, Op: "o"}); return err }()},
		{"record: no op", func() error { _, _, err := l.Record(ctx, Note{Scope: visA, Invalid: 1}); return err }()},
		{"call: hour without a soft share", callWith(func(c *CallRequest) { c.TokensPerHour = 10 })},
		{"call: soft share over the hour", callWith(func(c *CallRequest) { c.TokensPerHour, c.SoftTokens = 10, 11 })},
		{"settle: negative hour slot", func() error {
			_, err := l.Settle(ctx, SettleRequest{Scope: visA, TokensPerHour: 10, HourSlot: -1, Op: "o"})
			return err
		}()},
		{"hour room: zero quota", func() error { _, _, _, err := l.HourRoom(ctx, visA, 0, 1); return err }()},
		{"record: zero per hour", func() error { _, _, err := l.RecordFailedCheck(ctx, visA, "o", 0); return err }()},
		{"record: bad scope", func() error { _, _, err := l.RecordFailedCheck(ctx, "a b", "o", 3); return err }()},
		{"peek: zero rate", func() error { _, _, err := l.Peek(ctx, visA, 0, 10); return err }()},
		{"peek: rate over the maximum", func() error { _, _, err := l.Peek(ctx, visA, maxRate+1, 10); return err }()},
		{"peek: zero need", func() error { _, _, err := l.Peek(ctx, visA, 600, 0); return err }()},
		{"level: zero rate", func() error { _, err := l.Level(ctx, visA, 0); return err }()},
		{"call: zero prompt", callWith(func(c *CallRequest) { c.PromptTokens = 0 })},
		{"call: zero amount", callWith(func(c *CallRequest) { c.Amount = 0 })},
		{"call: amount over the maximum", callWith(func(c *CallRequest) { c.Amount = maxTokens + 1 })},
		{"call: negative rate", callWith(func(c *CallRequest) { c.TokensPerMinute = -1 })},
		{"call: bad op", callWith(func(c *CallRequest) { c.Op = "a\nb" })},
		{"after: negative actual", func() error { _, err := l.AfterCall(ctx, visA, 600, 10, -1, "o"); return err }()},
		{"after: negative reserved", func() error { _, err := l.AfterCall(ctx, visA, 600, -1, 1, "o"); return err }()},
		{"after: negative rate", func() error { _, err := l.AfterCall(ctx, visA, -1, 1, 1, "o"); return err }()},
		{"after: bad scope", func() error { _, err := l.AfterCall(ctx, "", 0, 1, 1, "o"); return err }()},
		{"pace: negative max wait", func() error { _, err := l.Pace(ctx, SiteScope, 600, 10, -time.Nanosecond, "o"); return err }()},
		{"pace: max wait over a day", func() error { _, err := l.Pace(ctx, SiteScope, 600, 10, MaxPaceWait+1, "o"); return err }()},
		{"pace: zero rate", func() error { _, err := l.Pace(ctx, SiteScope, 0, 10, time.Second, "o"); return err }()},
		{"pace: zero amount", func() error { _, err := l.Pace(ctx, SiteScope, 600, 0, time.Second, "o"); return err }()},
		{"pace: empty op", func() error { _, err := l.Pace(ctx, SiteScope, 600, 10, time.Second, ""); return err }()},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if !errors.Is(c.err, ErrInvalid) {
				t.Fatalf("err = %v; want ErrInvalid", c.err)
			}
		})
	}
	// Nothing invalid reached Redis.
	if n, err := r.rdb.DBSize(ctx).Result(); err != nil || n != 0 {
		t.Fatalf("DBSIZE = %d, %v; want 0", n, err)
	}
	// The limits themselves are admitted: 140 characters, any UTF-8.
	long := GateRequest{Scope: strings.Repeat("é", 140), RequestsPerMinute: 1, Op: strings.Repeat("o", 128)}
	if _, err := l.Gate(ctx, long); err != nil {
		t.Fatalf("140-character scope, 128-character op: %v", err)
	}
}
