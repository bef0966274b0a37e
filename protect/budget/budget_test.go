package budget

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"faregate/protect/redistest"
)

// clock is a settable clock shared by goroutines.
type clock struct{ ns atomic.Int64 }

func newClock(t time.Time) *clock {
	c := &clock{}
	c.ns.Store(t.UnixNano())
	return c
}

func (c *clock) Now() time.Time          { return time.Unix(0, c.ns.Load()).UTC() }
func (c *clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }

var start = time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)

const (
	day     = "2026-08-31"
	visA    = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	visB    = "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	taskOne = "t_one"
	taskTwo = "t_two"
)

// fixture is one Budget on one backend, with its clock and registry.
type fixture struct {
	b     *Budget
	rdb   *redis.Client
	clk   *clock
	reg   *prometheus.Registry
	ctx   context.Context
	limit Limits
}

func newFixture(t *testing.T, rdb *redis.Client, l Limits) *fixture {
	t.Helper()
	if err := rdb.FlushDB(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	clk := newClock(start)
	reg := prometheus.NewRegistry()
	b := New(rdb, Options{Limits: l, ReservationTTL: time.Minute, Now: clk.Now, Registerer: reg})
	return &fixture{b: b, rdb: rdb, clk: clk, reg: reg, ctx: context.Background(), limit: b.Limits()}
}

func (f *fixture) reserve(t *testing.T, vis, task string, amount int64) Reservation {
	t.Helper()
	r, err := f.b.Reserve(f.ctx, Request{Day: day, Visitor: vis, Task: task, Amount: amount})
	if err != nil {
		t.Fatalf("reserve %d: %v", amount, err)
	}
	return r
}

// usage asserts the three scopes of (vis, task) and the reservation count.
func (f *fixture) usage(t *testing.T, vis, task string, site, visitor, tsk ScopeUsage, n int64) {
	t.Helper()
	s, v, k, got, err := f.b.Usage(f.ctx, day, vis, task)
	if err != nil {
		t.Fatalf("usage: %v", err)
	}
	site.Limit, visitor.Limit, tsk.Limit = f.limit.Site, f.limit.Visitor, f.limit.Task
	if s != site || v != visitor || k != tsk || got != n {
		t.Fatalf("usage = site %+v visitor %+v task %+v reservations %d; want %+v %+v %+v %d", s, v, k, got, site, visitor, tsk, n)
	}
}

// conformance runs every case on miniredis and on a real Redis.
func TestConformance(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, rdb *redis.Client)
	}{
		{"ReserveSettleArithmetic", testReserveSettle},
		{"RefusalNamesScope", testRefusal},
		{"KeysAndTTL", testKeys},
		{"DoubleSettleChargesOnce", testDoubleSettle},
		{"AlteredReservationRefused", testAltered},
		{"ExpiryGivesBackOnce", testExpiry},
		{"ConcurrentReapersGiveBackOnce", testConcurrentReapers},
		{"CanAfford", testCanAfford},
		{"Metrics", testMetrics},
		{"Ledger", testLedger},
		{"LedgerPaging", testLedgerPaging},
	}
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) { c.run(t, be.Client) })
			}
		})
	}
}

func testReserveSettle(t *testing.T, rdb *redis.Client) {
	cases := []struct {
		name            string
		reserve, actual int64
		charged         int64
	}{
		{"partial use returns the rest", 1000, 300, 300},
		{"nothing used", 1000, 0, 0},
		{"exact use", 1000, 1000, 1000},
		{"overage capped at the reservation", 1000, 1700, 1000},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, rdb, Limits{})
			r := f.reserve(t, visA, taskOne, c.reserve)
			held := ScopeUsage{Outstanding: c.reserve}
			f.usage(t, visA, taskOne, held, held, held, 1)
			got, err := f.b.Settle(f.ctx, r, c.actual)
			if err != nil || got != c.charged {
				t.Fatalf("settle = %d, %v; want %d", got, err, c.charged)
			}
			done := ScopeUsage{Settled: c.charged}
			f.usage(t, visA, taskOne, done, done, done, 0)
		})
	}
}

func testRefusal(t *testing.T, rdb *redis.Client) {
	l := Limits{Site: 1000, Visitor: 600, Task: 400}
	cases := []struct {
		name      string
		before    []Request // granted first
		req       Request
		scope     Scope
		remaining int64
	}{
		{"task", []Request{{day, visA, taskOne, 300}}, Request{day, visA, taskOne, 101}, ScopeTask, 100},
		{"visitor across tasks", []Request{{day, visA, taskOne, 400}}, Request{day, visA, taskTwo, 201}, ScopeVisitor, 200},
		{"site across visitors", []Request{{day, visA, taskOne, 400}, {day, visA, taskTwo, 200}, {day, visB, "t_three", 350}},
			Request{day, visB, "t_four", 51}, ScopeSite, 50},
		{"narrowest scope named when all are short", []Request{{day, visA, taskOne, 400}, {day, visA, taskTwo, 200}, {day, visB, "t_three", 400}},
			Request{day, visA, taskOne, 1}, ScopeTask, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, rdb, l)
			for _, r := range c.before {
				f.reserve(t, r.Visitor, r.Task, r.Amount)
			}
			site0, vis0, task0, n0, _ := f.b.Usage(f.ctx, day, c.req.Visitor, c.req.Task)
			_, err := f.b.Reserve(f.ctx, c.req)
			var ex *ExhaustedError
			if !errors.Is(err, ErrExhausted) || !errors.As(err, &ex) {
				t.Fatalf("reserve = %v; want *ExhaustedError", err)
			}
			if ex.Scope != c.scope || ex.Remaining != c.remaining {
				t.Fatalf("refused by %s with %d left; want %s with %d", ex.Scope, ex.Remaining, c.scope, c.remaining)
			}
			// A refusal charges nothing in any scope.
			site1, vis1, task1, n1, _ := f.b.Usage(f.ctx, day, c.req.Visitor, c.req.Task)
			if site0 != site1 || vis0 != vis1 || task0 != task1 || n0 != n1 {
				t.Fatalf("refusal changed usage: %+v %+v %+v %d -> %+v %+v %+v %d", site0, vis0, task0, n0, site1, vis1, task1, n1)
			}
			if got := testutil.ToFloat64(f.b.m.refusals.WithLabelValues(string(c.scope))); got != 1 {
				t.Fatalf("refusals{scope=%s} = %v; want 1", c.scope, got)
			}
		})
	}
}

func testKeys(t *testing.T, rdb *redis.Client) {
	f := newFixture(t, rdb, Limits{})
	r := f.reserve(t, visA, taskOne, 250)
	p := "faregate:budget:{2026-08-31}:"
	want := []string{p + "ip:" + visA, p + "res", p + "resinfo", p + "site", p + "task:" + taskOne}
	got, err := rdb.Keys(f.ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(got)
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("keys = %v; want %v", got, want)
	}
	for _, k := range want {
		ttl, err := rdb.TTL(f.ctx, k).Result()
		if err != nil || ttl <= 172790*time.Second || ttl > 172800*time.Second {
			t.Errorf("TTL %s = %v, %v; want 172800s", k, ttl, err)
		}
	}
	for _, k := range []string{p + "site", p + "ip:" + visA, p + "task:" + taskOne} {
		h, _ := rdb.HGetAll(f.ctx, k).Result()
		if h["outstanding"] != "250" || len(h) != 1 {
			t.Errorf("%s = %v; want outstanding 250 only", k, h)
		}
	}
	score, _ := rdb.ZScore(f.ctx, p+"res", r.ID).Result()
	if int64(score) != start.Add(time.Minute).UnixMilli() {
		t.Errorf("expiry score = %v; want now + TTL = %d", int64(score), start.Add(time.Minute).UnixMilli())
	}
	if v, _ := rdb.HGet(f.ctx, p+"resinfo", r.ID).Result(); v != "250|"+visA+"|"+taskOne {
		t.Errorf("resinfo = %q", v)
	}
	if _, err := f.b.Settle(f.ctx, r, 100); err != nil {
		t.Fatal(err)
	}
	if n, _ := rdb.Exists(f.ctx, p+"res", p+"resinfo").Result(); n != 0 {
		t.Errorf("settled reservation left %d bookkeeping keys", n)
	}
}

func testDoubleSettle(t *testing.T, rdb *redis.Client) {
	f := newFixture(t, rdb, Limits{})
	r := f.reserve(t, visA, taskOne, 500)
	if got, err := f.b.Settle(f.ctx, r, 200); got != 200 || err != nil {
		t.Fatalf("first settle = %d, %v", got, err)
	}
	got, err := f.b.Settle(f.ctx, r, 200)
	if !errors.Is(err, ErrUnknownReservation) || got != 0 {
		t.Fatalf("second settle = %d, %v; want 0, ErrUnknownReservation", got, err)
	}
	done := ScopeUsage{Settled: 200}
	f.usage(t, visA, taskOne, done, done, done, 0)
}

func testAltered(t *testing.T, rdb *redis.Client) {
	cases := []struct {
		name  string
		alter func(*Reservation)
	}{
		{"larger amount", func(r *Reservation) { r.Amount = 5000 }},
		{"other task", func(r *Reservation) { r.Task = taskTwo }},
		{"other visitor", func(r *Reservation) { r.Visitor = visB }},
		{"unknown id", func(r *Reservation) { r.ID = "rnope" }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, rdb, Limits{})
			r := f.reserve(t, visA, taskOne, 500)
			bad := r
			c.alter(&bad)
			if _, err := f.b.Settle(f.ctx, bad, 100); !errors.Is(err, ErrUnknownReservation) {
				t.Fatalf("settle altered = %v; want ErrUnknownReservation", err)
			}
			held := ScopeUsage{Outstanding: 500}
			f.usage(t, visA, taskOne, held, held, held, 1)
		})
	}
}

func testExpiry(t *testing.T, rdb *redis.Client) {
	f := newFixture(t, rdb, Limits{Site: 1000, Visitor: 1000, Task: 1000})
	r := f.reserve(t, visA, taskOne, 1000)
	if _, err := f.b.Reserve(f.ctx, Request{day, visA, taskOne, 1}); !errors.Is(err, ErrExhausted) {
		t.Fatalf("reserve over a full budget = %v", err)
	}
	// Exactly at the expiry instant the reservation is due.
	f.clk.Advance(time.Minute - time.Millisecond)
	held := ScopeUsage{Outstanding: 1000}
	f.usage(t, visA, taskOne, held, held, held, 1)
	f.clk.Advance(time.Millisecond)
	f.usage(t, visA, taskOne, ScopeUsage{}, ScopeUsage{}, ScopeUsage{}, 0)
	if _, err := f.b.Settle(f.ctx, r, 10); !errors.Is(err, ErrUnknownReservation) {
		t.Fatalf("settle after expiry = %v; want ErrUnknownReservation", err)
	}
	// The capacity is back, once: the whole budget can be reserved again.
	f.reserve(t, visA, taskOne, 1000)
	f.usage(t, visA, taskOne, held, held, held, 1)
}

func testConcurrentReapers(t *testing.T, rdb *redis.Client) {
	f := newFixture(t, rdb, Limits{Site: 100000, Visitor: 100000, Task: 100000})
	// 40 reservations over 4 visitors and 8 tasks that will expire together.
	vis := []string{visA, visB, "cc", "dd"}
	var want int64
	for i := range 40 {
		f.reserve(t, vis[i%4], fmt.Sprintf("t_%d", i%8), int64(100+i))
		want += int64(100 + i)
	}
	f.clk.Advance(30 * time.Second)
	// A later reservation that must survive the reaping, and a settled one
	// whose charge the reapers must leave alone.
	f.reserve(t, visA, "t_kept", 777)
	r := f.reserve(t, visA, "t_settled", 500)
	if _, err := f.b.Settle(f.ctx, r, 200); err != nil {
		t.Fatal(err)
	}
	f.usage(t, "", "", ScopeUsage{Settled: 200, Outstanding: want + 777}, ScopeUsage{}, ScopeUsage{}, 41)
	f.clk.Advance(31 * time.Second) // past the 40, not past "t_kept"
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 64 {
		wg.Go(func() {
			var err error
			switch i % 3 {
			case 0:
				_, _, _, _, err = f.b.Usage(f.ctx, day, vis[i%4], "t_x")
			case 1:
				err = f.b.CanAfford(f.ctx, day, vis[i%4], 1)
			default:
				_, err = f.b.Settle(f.ctx, Reservation{ID: "rnone", Day: day, Visitor: visA, Task: taskOne, Amount: 1}, 1)
				if errors.Is(err, ErrUnknownReservation) {
					err = nil
				}
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// Each expired amount came back exactly once: no scope went negative.
	f.usage(t, visA, "t_kept", ScopeUsage{Settled: 200, Outstanding: 777},
		ScopeUsage{Settled: 200, Outstanding: 777}, ScopeUsage{Outstanding: 777}, 1)
	for _, v := range vis[1:] {
		f.usage(t, v, "t_1", ScopeUsage{Settled: 200, Outstanding: 777}, ScopeUsage{}, ScopeUsage{}, 1)
	}
	for i := range 8 {
		f.usage(t, visB, fmt.Sprintf("t_%d", i), ScopeUsage{Settled: 200, Outstanding: 777}, ScopeUsage{}, ScopeUsage{}, 1)
	}
}

func testCanAfford(t *testing.T, rdb *redis.Client) {
	l := Limits{Site: 1000, Visitor: 500, Task: 100}
	// fill spends n×100 tokens of a visitor, one task per 100 (task ids
	// are unique across visitors, as the real ones are).
	fill := func(vis string, n int) []Request {
		var out []Request
		for i := range n {
			out = append(out, Request{day, vis, fmt.Sprintf("t_%s_%d", vis, i), 100})
		}
		return out
	}
	cases := []struct {
		name      string
		before    []Request
		vis       string
		amount    int64
		scope     Scope // "" means affordable
		remaining int64
	}{
		{"empty day", nil, visA, 500, "", 0},
		{"task limit does not matter", fill(visA, 1), visA, 400, "", 0},
		{"visitor short", fill(visA, 1), visA, 401, ScopeVisitor, 400},
		{"site short", append(append(fill(visA, 2), fill(visB, 2)...), fill("cc", 2)...), "dd", 401, ScopeSite, 400},
		{"visitor named first", append(fill(visA, 5), fill(visB, 5)...), visA, 1, ScopeVisitor, 0},
		{"site short, visitor fine", append(fill(visA, 5), fill(visB, 5)...), "cc", 1, ScopeSite, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, rdb, l)
			for _, r := range c.before {
				f.reserve(t, r.Visitor, r.Task, r.Amount)
			}
			s0, v0, _, n0, _ := f.b.Usage(f.ctx, day, c.vis, "")
			err := f.b.CanAfford(f.ctx, day, c.vis, c.amount)
			if c.scope == "" {
				if err != nil {
					t.Fatalf("can afford = %v; want nil", err)
				}
			} else {
				var ex *ExhaustedError
				if !errors.As(err, &ex) || ex.Scope != c.scope || ex.Remaining != c.remaining {
					t.Fatalf("can afford = %v; want %s with %d left", err, c.scope, c.remaining)
				}
			}
			s1, v1, _, n1, _ := f.b.Usage(f.ctx, day, c.vis, "")
			if s0 != s1 || v0 != v1 || n0 != n1 {
				t.Fatal("CanAfford changed usage")
			}
		})
	}
}

func testMetrics(t *testing.T, rdb *redis.Client) {
	f := newFixture(t, rdb, Limits{Site: 10000})
	r := f.reserve(t, visA, taskOne, 3000)
	f.reserve(t, visB, taskTwo, 1000)
	if got := testutil.ToFloat64(f.b.m.siteRemaining); got != 6000 {
		t.Errorf("site remaining = %v; want 6000", got)
	}
	if got := testutil.ToFloat64(f.b.m.outstanding); got != 2 {
		t.Errorf("outstanding reservations = %v; want 2", got)
	}
	if _, err := f.b.Settle(f.ctx, r, 1000); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(f.b.m.siteRemaining); got != 8000 {
		t.Errorf("site remaining after settle = %v; want 8000", got)
	}
	// A second Budget on the same registry shares the series instead of panicking.
	b2 := New(rdb, Options{Limits: Limits{Site: 10000}, Now: f.clk.Now, Registerer: f.reg})
	if _, err := b2.Reserve(f.ctx, Request{day, visA, "t_b2", 500}); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(f.b.m.siteRemaining); got != 7500 {
		t.Errorf("shared site remaining = %v; want 7500", got)
	}
	n, err := testutil.GatherAndCount(f.reg, "faregate_budget_site_remaining_tokens",
		"faregate_budget_outstanding_reservations", "faregate_budget_refusals_total")
	if err != nil || n != 5 {
		t.Errorf("gathered %d series, %v; want 5 (2 gauges + 3 refusal scopes)", n, err)
	}
}

// TestUnavailable: every operation fails closed, with ErrUnavailable,
// when Redis cannot be reached.
func TestUnavailable(t *testing.T) {
	b := New(deadClient(t), Options{})
	ctx := context.Background()
	r := Reservation{ID: "rx", Day: day, Visitor: visA, Task: taskOne, Amount: 10}
	cases := []struct {
		name string
		call func() error
	}{
		{"reserve", func() error {
			got, err := b.Reserve(ctx, Request{day, visA, taskOne, 10})
			if got != (Reservation{}) {
				return fmt.Errorf("reserve handed out %+v", got)
			}
			return err
		}},
		{"settle", func() error { _, err := b.Settle(ctx, r, 5); return err }},
		{"can afford", func() error { return b.CanAfford(ctx, day, visA, 10) }},
		{"usage", func() error { _, _, _, _, err := b.Usage(ctx, day, visA, taskOne); return err }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.call(); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("err = %v; want ErrUnavailable", err)
			}
		})
	}
}

// deadClient talks to a loopback port nobody listens on, and gives up at
// the first refused dial instead of retrying with backoff.
func deadClient(t *testing.T) *redis.Client {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// TestInvalid: malformed input is refused before Redis is asked.
func TestInvalid(t *testing.T) {
	b := New(redistest.Mini(t).Client, Options{})
	ctx := context.Background()
	good := Reservation{ID: "rx", Day: day, Visitor: visA, Task: taskOne, Amount: 10}
	cases := []struct {
		name string
		call func() error
	}{
		{"zero amount", func() error { _, err := b.Reserve(ctx, Request{day, visA, taskOne, 0}); return err }},
		{"negative amount", func() error { _, err := b.Reserve(ctx, Request{day, visA, taskOne, -5}); return err }},
		{"empty day", func() error { _, err := b.Reserve(ctx, Request{"", visA, taskOne, 5}); return err }},
		{"bad day", func() error { _, err := b.Reserve(ctx, Request{"2026-02-30", visA, taskOne, 5}); return err }},
		{"empty visitor", func() error { _, err := b.Reserve(ctx, Request{day, "", taskOne, 5}); return err }},
		{"separator in task", func() error { _, err := b.Reserve(ctx, Request{day, visA, "t|x", 5}); return err }},
		// Dots and colons are refused, so a raw IPv4 or IPv6 address can
		// never become part of a key by mistake.
		{"raw IPv4 as visitor", func() error { _, err := b.Reserve(ctx, Request{day, "203.0.113.7", taskOne, 5}); return err }},
		{"raw IPv6 as visitor", func() error { return b.CanAfford(ctx, day, "2001:db8::1", 5) }},
		{"colon in visitor", func() error { _, err := b.Reserve(ctx, Request{day, "a:site", taskOne, 5}); return err }},
		{"negative actual", func() error { _, err := b.Settle(ctx, good, -1); return err }},
		{"can afford zero", func() error { return b.CanAfford(ctx, day, visA, 0) }},
		{"usage bad task", func() error { _, _, _, _, err := b.Usage(ctx, day, visA, "a b"); return err }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.call(); !errors.Is(err, ErrInvalid) {
				t.Fatalf("err = %v; want ErrInvalid", err)
			}
		})
	}
}

func TestDay(t *testing.T) {
	cases := []struct {
		in   time.Time
		want string
	}{
		{time.Date(2026, 8, 31, 23, 59, 59, 0, time.UTC), "2026-08-31"},
		{time.Date(2026, 9, 1, 1, 0, 0, 0, time.FixedZone("CEST", 2*3600)), "2026-08-31"},
		{time.Date(2026, 8, 31, 22, 0, 0, 0, time.FixedZone("PDT", -7*3600)), "2026-09-01"},
	}
	for _, c := range cases {
		t.Run(c.in.String(), func(t *testing.T) {
			if got := Day(c.in); got != c.want {
				t.Fatalf("Day = %s; want %s", got, c.want)
			}
		})
	}
}
