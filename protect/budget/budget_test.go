package budget

import (
	"context"
	"errors"
	"fmt"
	"net"
	"reflect"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// clock is a settable clock shared by goroutines.
type clock = clocktest.Clock

func newClock(t time.Time) *clock { return clocktest.New(t) }

var start = time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)

const (
	day     = "2026-08-31"
	visA    = "v_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	visB    = "v_bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	keyA    = "k_acme"
	keyB    = "k_globex"
	taskOne = "t_one"
	taskTwo = "t_two"
	partner = "partner"
)

// testPrices: a cheap and a dear model (gpt-4o-mini and gpt-4o list
// prices), a very dear one and a free one.
var testPrices = Prices{"cheap": {InputMicroPerMTok: 150000, OutputMicroPerMTok: 600000}, "dear": {InputMicroPerMTok: 2500000, OutputMicroPerMTok: 10000000}, "gold": {InputMicroPerMTok: 50000000, OutputMicroPerMTok: 50000000}, "free": {}}

// fixture is one Budget on one backend, with its clock and registry.
type fixture struct {
	layout int
	b      *Budget
	rdb    redis.UniversalClient
	day    string // the day check reads
	clk    *clock
	reg    *prometheus.Registry
	ctx    context.Context
}

func newFixture(t *testing.T, rdb *redis.Client, l Limits) *fixture {
	t.Helper()
	if err := rdb.FlushDB(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	clk := newClock(start)
	reg := prometheus.NewRegistry()
	b := New(rdb, Options{Limits: l, Prices: testPrices, ReservationTTL: time.Minute, Now: clk.Now, Registerer: reg})
	return &fixture{b: b, rdb: rdb, day: day, clk: clk, reg: reg, ctx: context.Background()}
}

// conf is one way the conformance cases run: a backend, and the key
// layout the fixture's day is in (layout 2 reserves every call per call
// here: leases have tests of their own, lease_test.go).
type conf struct {
	rdb    *redis.Client
	layout int
}

func (c conf) name() string {
	if c.layout == layoutDay {
		return "day-layout"
	}
	return "principal-layout"
}

// fixture is newFixture on c's backend with the day in c's layout: a day
// of layout 1 is one whose site scope a faregate of that layout wrote
// first.
func (c conf) fixture(t *testing.T, l Limits) *fixture {
	t.Helper()
	f := newFixture(t, c.rdb, l)
	f.layout = c.layout
	if c.layout == layoutDay {
		f.oldLayout(t, day)
	}
	return f
}

// oldLayout makes d a day that a faregate of layout 1 began.
func (f *fixture) oldLayout(t *testing.T, d string) {
	t.Helper()
	if err := f.rdb.HSet(f.ctx, dayPrefix(d)+"site", "outstanding", 0).Err(); err != nil {
		t.Fatal(err)
	}
}

// n is the expected UsageReport.Reservations: the day's open reservations
// in layout 1, the queried principal's in layout 2.
func (f *fixture) n(day, principal int64) int64 {
	if f.layout == layoutDay {
		return day
	}
	return principal
}

// another is a second Budget (another replica) on the same Redis and clock.
func (f *fixture) another() *Budget {
	return New(f.rdb, Options{Limits: f.b.Limits(), Prices: testPrices, ReservationTTL: time.Minute, Now: f.clk.Now})
}

// tok asks for amount tokens of a free model.
func tok(principal, task string, amount int64) Request {
	return Request{Day: day, Principal: principal, Task: task, Model: "free", PromptTokens: amount}
}

func (f *fixture) reserve(t *testing.T, req Request) Reservation {
	t.Helper()
	r, err := f.b.Reserve(f.ctx, req)
	if err != nil {
		t.Fatalf("reserve %+v: %v", req, err)
	}
	return r
}

func (f *fixture) settle(t *testing.T, r Reservation, prompt, completion int64) Settlement {
	t.Helper()
	s, err := f.b.Settle(f.ctx, r, prompt, completion)
	if err != nil {
		t.Fatalf("settle %s: %v", r.ID, err)
	}
	return s
}

// su is {settled, outstanding, overage} of one scope.
type su [3]int64

// state is what check expects of the scopes of one UsageQuery.
type state struct {
	site, spend, tier, principal, task su
	n                                  int64
}

func (f *fixture) check(t *testing.T, q UsageQuery, want state) {
	t.Helper()
	q.Day = f.day
	rep, err := f.b.Usage(f.ctx, q)
	if err != nil {
		t.Fatalf("usage: %v", err)
	}
	x := func(s ScopeUsage) su { return su{s.Settled, s.Outstanding, s.Overage} }
	got := state{x(rep.Site), x(rep.Spend), x(rep.Tier), x(rep.Principal), x(rep.Task), rep.Reservations}
	if got != want {
		t.Fatalf("usage of %+v\n got %+v\nwant %+v", q, got, want)
	}
	// The invariant, in every scope: only recorded overage passes a limit.
	for name, s := range map[string]ScopeUsage{"site": rep.Site, "spend": rep.Spend, "tier": rep.Tier, "principal": rep.Principal, "task": rep.Task} {
		if s.Limit > 0 && s.Settled+s.Outstanding-s.Overage > s.Limit {
			t.Fatalf("%s scope %+v breaks settled + outstanding − overage ≤ limit", name, s)
		}
	}
}

// conformance runs every case on miniredis and on a real Redis.
func TestConformance(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, cf conf)
	}{
		{"ReserveSettleArithmetic", testReserveSettle},
		{"OverageRefusesNext", testOverageRefusesNext},
		{"Money", testMoney},
		{"RefusalNamesScope", testRefusal},
		{"TierShare", testTierShare},
		{"KeysAndTTL", testKeys},
		{"ReserveIsIdempotent", testReserveIdempotent},
		{"SettleIsIdempotent", testSettleIdempotent},
		{"AlteredReservationRefused", testAltered},
		{"ExpiryGivesBackOnce", testExpiry},
		{"ReleaseTask", testReleaseTask},
		{"ConcurrentReapersGiveBackOnce", testConcurrentReapers},
		{"CanAfford", testCanAfford},
		{"WarningOncePerScopeAndDay", testWarningOnce},
		{"WarningOnceUnderConcurrency", testWarningConcurrent},
		{"ExhaustedFirstOnce", testExhaustedFirst},
		{"WithdrawUndoesAReserve", testWithdraw},
		{"Metrics", testMetrics},
		{"Ledger", testLedger},
		{"LedgerPaging", testLedgerPaging},
	}
	for _, be := range redistest.Both(t) {
		for _, layout := range []int{layoutDay, layoutPrincipals} {
			cf := conf{rdb: be.Client, layout: layout}
			t.Run(be.Name+"/"+cf.name(), func(t *testing.T) {
				for _, c := range cases {
					t.Run(c.name, func(t *testing.T) { c.run(t, cf) })
				}
			})
		}
	}
}

func testReserveSettle(t *testing.T, cf conf) {
	cases := []struct {
		name            string
		reserve, actual int64
		overage         int64
	}{
		{"partial use returns the rest", 1000, 300, 0},
		{"nothing used", 1000, 0, 0},
		{"exact use", 1000, 1000, 0},
		{"use above the hold is charged in full", 1000, 1700, 700},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := cf.fixture(t, Limits{})
			r := f.reserve(t, tok(visA, taskOne, c.reserve))
			held := su{0, c.reserve, 0}
			q := UsageQuery{Principal: visA, Task: taskOne}
			f.check(t, q, state{site: held, principal: held, task: held, n: 1})
			got := f.settle(t, r, c.actual, 0)
			if want := (Settlement{Tokens: c.actual, OverageTokens: c.overage}); !reflect.DeepEqual(got, want) {
				t.Fatalf("settle = %+v; want %+v", got, want)
			}
			done := su{c.actual, 0, c.overage}
			f.check(t, q, state{site: done, principal: done, task: done})
			if v := testutil.ToFloat64(f.b.m.overageTokens.WithLabelValues(causeExcess)); v != float64(c.overage) {
				t.Fatalf("overage metric = %v; want %d", v, c.overage)
			}
		})
	}
}

// testOverageRefusesNext: a settle that pushes a scope past its limit is
// recorded as overage, and the scope refuses the next reservation at once.
func testOverageRefusesNext(t *testing.T, cf conf) {
	rdb := cf.rdb
	f := cf.fixture(t, Limits{Site: 1000, Principal: 5000, Task: 5000})
	r := f.reserve(t, tok(visA, taskOne, 600))
	s := f.settle(t, r, 1000, 300)
	if s.Tokens != 1300 || s.OverageTokens != 700 || s.Late {
		t.Fatalf("settle = %+v; want 1300 charged, 700 overage", s)
	}
	f.check(t, UsageQuery{Principal: visA, Task: taskOne},
		state{site: su{1300, 0, 700}, principal: su{1300, 0, 700}, task: su{1300, 0, 700}})
	// The overage lives in the scope hashes themselves, for every replica.
	if h := rdb.HGetAll(f.ctx, "faregate:budget:{"+day+"}:site").Val(); h["settled"] != "1300" || h["overage"] != "700" {
		t.Fatalf("site hash = %v", h)
	}
	_, err := f.b.Reserve(f.ctx, tok(visB, taskTwo, 1))
	var ex *ExhaustedError
	if !errors.As(err, &ex) || ex.Scope != ScopeSite || ex.Remaining != 0 {
		t.Fatalf("next reserve = %v; want the site scope exhausted with 0 left", err)
	}
	if v := testutil.ToFloat64(f.b.m.overageTokens.WithLabelValues(causeExcess)); v != 700 {
		t.Fatalf("faregate_budget_overage_tokens_total = %v; want 700", v)
	}
}

// testMoney: cost is held and settled with the tokens, to the micro-unit.
func testMoney(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 100000, Principal: 100000, Task: 100000, SpendMicro: 10000})
	dear := Request{Day: day, Principal: keyA, Task: taskOne, Model: "dear", PromptTokens: 1000, MaxTokens: 500}
	r := f.reserve(t, dear)
	// 1000 × 2.5 + 500 × 10 micro-units.
	if r.Tokens != 1500 || r.CostMicro != 7500 {
		t.Fatalf("reservation = %+v; want 1500 tokens costing 7500", r)
	}
	q := UsageQuery{Principal: keyA, Task: taskOne}
	f.check(t, q, state{site: su{0, 1500, 0}, spend: su{0, 7500, 0}, principal: su{0, 1500, 0}, task: su{0, 1500, 0}, n: 1})
	if s := f.settle(t, r, 1000, 200); s.CostMicro != 4500 || s.OverageCostMicro != 0 {
		t.Fatalf("settle = %+v; want 4500 micro-units", s)
	}
	// 4500 spent: another 7500 does not fit the 10000 cap, 5500 is left.
	_, err := f.b.Reserve(f.ctx, dear)
	var ex *ExhaustedError
	if !errors.As(err, &ex) || ex.Scope != ScopeSpend || ex.Remaining != 5500 {
		t.Fatalf("reserve over the spend cap = %v; want spend with 5500 left", err)
	}
	if !errors.Is(err, ErrExhausted) || ex.RetryAfter() != 12*time.Hour {
		t.Fatalf("spend refusal %v retry after %v; want ErrExhausted, 12h to midnight", err, ex.RetryAfter())
	}
	// Exactly up to the cap is allowed: 5500 = 2000 × 2.5 + 50 × 10.
	exact := f.reserve(t, Request{Day: day, Principal: keyA, Task: taskTwo, Model: "dear", PromptTokens: 2000, MaxTokens: 50})
	if exact.CostMicro != 5500 {
		t.Fatalf("exact reservation costs %d", exact.CostMicro)
	}
	if _, err := f.b.Reserve(f.ctx, Request{Day: day, Principal: keyA, Task: taskTwo, Model: "cheap", PromptTokens: 1}); !errors.As(err, &ex) || ex.Scope != ScopeSpend || ex.Remaining != 0 {
		t.Fatalf("one micro-unit over the cap = %v; want spend refusal", err)
	}
	// A completion far above the hold is charged in full, the excess as overage.
	s := f.settle(t, exact, 2000, 650) // 5000 + 6500 = 11500, held 5500
	if s.CostMicro != 11500 || s.OverageCostMicro != 6000 || s.OverageTokens != 600 {
		t.Fatalf("settle above the hold = %+v; want 11500 charged, 6000 and 600 over", s)
	}
	f.check(t, UsageQuery{Principal: keyA, Task: taskTwo},
		state{site: su{3850, 0, 600}, spend: su{16000, 0, 6000}, principal: su{3850, 0, 600}, task: su{2650, 0, 600}})
	if v := testutil.ToFloat64(f.b.m.overageSpend.WithLabelValues(causeExcess)); v != 6000 {
		t.Fatalf("overage spend metric = %v; want 6000", v)
	}
	// A model without a price cannot be reserved while money is capped.
	if _, err := f.b.Reserve(f.ctx, Request{Day: day, Principal: keyA, Task: taskOne, Model: "mystery", PromptTokens: 1}); !errors.Is(err, ErrUnpriced) {
		t.Fatalf("unpriced model = %v; want ErrUnpriced", err)
	}
	if c, err := f.b.Cost("cheap", 1000, 1000); c != 750 || err != nil {
		t.Fatalf("Cost = %d, %v; want 750", c, err)
	}
}

func testRefusal(t *testing.T, cf conf) {
	l := Limits{Site: 1000, Principal: 600, Task: 400}
	tier := func(r Request, limit int64) Request { r.Tier, r.TierLimit = partner, limit; return r }
	own := func(r Request, limit int64) Request { r.PrincipalLimit = limit; return r }
	cases := []struct {
		name      string
		before    []Request // granted first
		req       Request
		scope     Scope
		remaining int64
		retry     time.Duration
	}{
		{"task", []Request{tok(visA, taskOne, 300)}, tok(visA, taskOne, 101), ScopeTask, 100, 0},
		{"principal across tasks", []Request{tok(visA, taskOne, 400)}, tok(visA, taskTwo, 201), ScopePrincipal, 200, 12 * time.Hour},
		{"principal's own limit", []Request{own(tok(keyA, taskOne, 200), 250)}, own(tok(keyA, taskTwo, 51), 250), ScopePrincipal, 50, 12 * time.Hour},
		{"tier across principals", []Request{tier(tok(keyA, taskOne, 300), 500), tier(tok(keyB, taskTwo, 200), 500)},
			tier(tok(keyB, "t_three", 1), 500), ScopeTier, 0, 12 * time.Hour},
		{"site across principals", []Request{tok(visA, taskOne, 400), tok(visA, taskTwo, 200), tok(visB, "t_three", 350)},
			tok(visB, "t_four", 51), ScopeSite, 50, 12 * time.Hour},
		{"narrowest scope named when all are short", []Request{tok(visA, taskOne, 400), tok(visA, taskTwo, 200), tok(visB, "t_three", 400)},
			tok(visA, taskOne, 1), ScopeTask, 0, 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := cf.fixture(t, l)
			for _, r := range c.before {
				f.reserve(t, r)
			}
			q := UsageQuery{Day: day, Principal: c.req.Principal, Tier: c.req.Tier, Task: c.req.Task}
			before, _ := f.b.Usage(f.ctx, q)
			_, err := f.b.Reserve(f.ctx, c.req)
			var ex *ExhaustedError
			if !errors.Is(err, ErrExhausted) || !errors.As(err, &ex) {
				t.Fatalf("reserve = %v; want *ExhaustedError", err)
			}
			if ex.Scope != c.scope || ex.Remaining != c.remaining || ex.RetryAfter() != c.retry {
				t.Fatalf("refused by %s with %d left, retry %v; want %s with %d, %v", ex.Scope, ex.Remaining, ex.RetryAfter(), c.scope, c.remaining, c.retry)
			}
			// A refusal charges nothing in any scope.
			if after, _ := f.b.Usage(f.ctx, q); after != before {
				t.Fatalf("refusal changed usage: %+v -> %+v", before, after)
			}
			if got := testutil.ToFloat64(f.b.m.refusals.WithLabelValues(string(c.scope))); got != 1 {
				t.Fatalf("refusals{scope=%s} = %v; want 1", c.scope, got)
			}
		})
	}
}

// testTierShare: two principals of one tier together cannot pass the
// tier's share, while a public principal still can reserve.
func testTierShare(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 10000, Principal: 5000, Task: 5000})
	share := int64(3000) // max_site_share 0.3
	partnerReq := func(p, task string, n int64) Request {
		return Request{Day: day, Principal: p, PrincipalLimit: 5000, Tier: partner, TierLimit: share, Task: task, PromptTokens: n}
	}
	f.reserve(t, partnerReq(keyA, "t_a1", 2000))
	r := f.reserve(t, partnerReq(keyB, "t_b1", 1000))
	var ex *ExhaustedError
	for _, p := range []string{keyA, keyB} {
		if _, err := f.b.Reserve(f.ctx, partnerReq(p, "t_"+p, 1)); !errors.As(err, &ex) || ex.Scope != ScopeTier || ex.Remaining != 0 {
			t.Fatalf("%s past the tier share = %v; want tier exhausted", p, err)
		}
		err := f.b.CanAfford(f.ctx, AffordRequest{Day: day, Principal: p, PrincipalLimit: 5000, Tier: partner, TierLimit: share, Tokens: 1})
		if !errors.As(err, &ex) || ex.Scope != ScopeTier {
			t.Fatalf("CanAfford of %s = %v; want tier exhausted", p, err)
		}
	}
	// Each partner key is far from its own limit; the public lane is untouched.
	if err := f.b.CanAfford(f.ctx, AffordRequest{Day: day, Principal: visA, Tier: "public", Tokens: 5000}); err != nil {
		t.Fatalf("public CanAfford = %v", err)
	}
	f.reserve(t, Request{Day: day, Principal: visA, Tier: "public", Task: "t_pub", PromptTokens: 5000})
	f.check(t, UsageQuery{Principal: keyB, Tier: partner, Task: "t_b1"},
		state{site: su{0, 8000, 0}, tier: su{0, 3000, 0}, principal: su{0, 1000, 0}, task: su{0, 1000, 0}, n: f.n(3, 1)})
	// Settling gives the unused share back to the tier.
	f.settle(t, r, 400, 0)
	f.reserve(t, partnerReq(keyA, "t_a2", 600))
}

func testKeys(t *testing.T, cf conf) {
	if cf.layout == layoutPrincipals {
		testPrincipalKeys(t, cf)
		return
	}
	rdb := cf.rdb
	f := cf.fixture(t, Limits{})
	r := f.reserve(t, Request{Day: day, Principal: keyA, Tier: partner, TierLimit: 100000, Task: taskOne, Model: "cheap", PromptTokens: 200, MaxTokens: 50})
	p := "faregate:budget:{2026-08-31}:"
	keysNow := func() []string {
		got, err := rdb.Keys(f.ctx, "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		sort.Strings(got)
		return got
	}
	want := []string{p + "p:" + keyA, p + "res", p + "resinfo", p + "site", p + "spend", p + "task:" + taskOne, p + "taskres:" + taskOne, p + "tier:" + partner}
	if got := keysNow(); !reflect.DeepEqual(got, want) {
		t.Fatalf("keys = %v; want %v", got, want)
	}
	for _, k := range want {
		ttl, err := rdb.TTL(f.ctx, k).Result()
		if err != nil || ttl <= 172790*time.Second || ttl > 172800*time.Second {
			t.Errorf("TTL %s = %v, %v; want 172800s", k, ttl, err)
		}
	}
	// 200 × 0.15 + 50 × 0.6 = 60 micro-units.
	for k, v := range map[string]string{p + "site": "250", p + "spend": "60", p + "p:" + keyA: "250", p + "tier:" + partner: "250", p + "task:" + taskOne: "250"} {
		h := rdb.HGetAll(f.ctx, k).Val()
		if k == p+"site" && h["layout"] == "1" {
			delete(h, "layout") // the day's layout, decided once
		}
		if h["outstanding"] != v || len(h) != 1 {
			t.Errorf("%s = %v; want outstanding %s only", k, h, v)
		}
	}
	score, _ := rdb.ZScore(f.ctx, p+"res", r.ID).Result()
	if int64(score) != start.Add(time.Minute).UnixMilli() {
		t.Errorf("expiry score = %v; want now + TTL = %d", int64(score), start.Add(time.Minute).UnixMilli())
	}
	if v := rdb.HGet(f.ctx, p+"resinfo", r.ID).Val(); v != "250|60|"+keyA+"|partner|"+taskOne+"|cheap" {
		t.Errorf("resinfo = %q", v)
	}
	if m := rdb.SMembers(f.ctx, p+"taskres:"+taskOne).Val(); len(m) != 1 || m[0] != r.ID {
		t.Errorf("taskres = %v", m)
	}
	f.settle(t, r, 100, 20)
	// The open-reservation bookkeeping is gone; the settled id is remembered.
	want = []string{p + "done", p + "p:" + keyA, p + "site", p + "spend", p + "task:" + taskOne, p + "tier:" + partner}
	if got := keysNow(); !reflect.DeepEqual(got, want) {
		t.Fatalf("keys after settle = %v; want %v", got, want)
	}
	if v := rdb.HGet(f.ctx, p+"done", r.ID).Val(); v != "S|120|27|0|0|0|250|60|"+keyA+"|partner|"+taskOne+"|cheap" {
		t.Errorf("done = %q", v)
	}
	if ttl := rdb.TTL(f.ctx, p+"done").Val(); ttl <= 172790*time.Second {
		t.Errorf("TTL done = %v", ttl)
	}
	// The settle of an open reservation sets no expiry of its own on the
	// scopes the reserve held an amount in (the reserve's stands): every
	// key still expires.
	for _, k := range want {
		if ttl := rdb.TTL(f.ctx, k).Val(); ttl <= 172790*time.Second || ttl > 172800*time.Second {
			t.Errorf("TTL %s after settle = %v; want 172800s", k, ttl)
		}
	}
	// A scope the reserve held nothing in (a free model's spend) and the
	// settle charges (priced meanwhile by a reload) gets its expiry there.
	g := cf.fixture(t, Limits{})
	fr := g.reserve(t, Request{Day: day, Principal: keyA, Task: taskOne, Model: "free", PromptTokens: 200, MaxTokens: 50})
	if n := rdb.Exists(g.ctx, p+"spend").Val(); n != 0 {
		t.Fatalf("a free reserve made the spend scope")
	}
	g.b.SetPrices(Prices{"free": {InputMicroPerMTok: 1_000_000, OutputMicroPerMTok: 1_000_000}})
	g.settle(t, fr, 100, 20)
	if ttl := rdb.TTL(g.ctx, p+"spend").Val(); ttl <= 172790*time.Second || ttl > 172800*time.Second {
		t.Errorf("TTL spend made by a settle = %v; want 172800s", ttl)
	}
}

// testReserveIdempotent: the same reservation id sent twice holds once.
func testReserveIdempotent(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{})
	req := Request{ID: "r_fixed", Day: day, Principal: keyA, Task: taskOne, Model: "dear", PromptTokens: 100, MaxTokens: 100}
	first := f.reserve(t, req)
	again := f.reserve(t, req)
	if first.ID != "r_fixed" || !reflect.DeepEqual(first, again) {
		t.Fatalf("re-sent reserve = %+v; first %+v", again, first)
	}
	held := su{0, 200, 0}
	f.check(t, UsageQuery{Principal: keyA, Task: taskOne}, state{site: held, spend: su{0, 1250, 0}, principal: held, task: held, n: 1})
	// The same id for a different reservation is a caller's bug, not a repeat.
	other := req
	other.MaxTokens = 101
	if _, err := f.b.Reserve(f.ctx, other); !errors.Is(err, ErrInvalid) {
		t.Fatalf("id reused for another amount = %v; want ErrInvalid", err)
	}
	f.settle(t, first, 100, 50)
	if _, err := f.b.Reserve(f.ctx, req); !errors.Is(err, ErrInvalid) {
		t.Fatalf("reserve of a settled id = %v; want ErrInvalid", err)
	}
	f.check(t, UsageQuery{Principal: keyA, Task: taskOne}, state{site: su{150, 0, 0}, spend: su{750, 0, 0}, principal: su{150, 0, 0}, task: su{150, 0, 0}})
	// Generated ids are 128 random bits (r and 32 hex digits) and distinct.
	a, b := f.reserve(t, tok(keyA, taskTwo, 1)), f.reserve(t, tok(keyA, taskTwo, 1))
	if a.ID == b.ID || len(a.ID) != 33 {
		t.Fatalf("generated ids %q %q", a.ID, b.ID)
	}
}

// testSettleIdempotent: a settle sent twice charges once and answers the
// first settlement again, whatever the second one says.
func testSettleIdempotent(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 10000})
	r := f.reserve(t, Request{Day: day, Principal: visA, Task: taskOne, Model: "cheap", PromptTokens: 400, MaxTokens: 100})
	first := f.settle(t, r, 300, 400) // 300 over the 500 held
	for _, actual := range [][2]int64{{300, 400}, {0, 0}, {9000, 9000}} {
		again := f.settle(t, r, actual[0], actual[1])
		if !reflect.DeepEqual(again, first) {
			t.Fatalf("repeat settle %v = %+v; want the first %+v", actual, again, first)
		}
	}
	done := su{700, 0, 200}
	f.check(t, UsageQuery{Principal: visA, Task: taskOne}, state{site: done, spend: su{285, 0, 165}, principal: done, task: done})
	// An id never reserved charges nothing.
	ghost := r
	ghost.ID = "r_ghost"
	if _, err := f.b.Settle(f.ctx, ghost, 10, 10); !errors.Is(err, ErrUnknownReservation) {
		t.Fatalf("settle of an unknown id = %v; want ErrUnknownReservation", err)
	}
	f.check(t, UsageQuery{Principal: visA, Task: taskOne}, state{site: done, spend: su{285, 0, 165}, principal: done, task: done})
}

func testAltered(t *testing.T, cf conf) {
	cases := []struct {
		name  string
		alter func(*Reservation)
	}{
		{"larger amount", func(r *Reservation) { r.Tokens = 5000 }},
		{"lower cost", func(r *Reservation) { r.CostMicro = 1 }},
		{"cheaper model", func(r *Reservation) { r.Model = "cheap" }},
		{"other task", func(r *Reservation) { r.Task = taskTwo }},
		{"other principal", func(r *Reservation) { r.Principal = visB }},
		{"other tier", func(r *Reservation) { r.Tier = "other" }},
		{"no tier", func(r *Reservation) { r.Tier = "" }},
		{"unknown id", func(r *Reservation) { r.ID = "rnope" }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := cf.fixture(t, Limits{})
			r := f.reserve(t, Request{Day: day, Principal: visA, Tier: partner, Task: taskOne, Model: "dear", PromptTokens: 400, MaxTokens: 100})
			bad := r
			c.alter(&bad)
			if _, err := f.b.Settle(f.ctx, bad, 100, 0); !errors.Is(err, ErrUnknownReservation) {
				t.Fatalf("settle altered = %v; want ErrUnknownReservation", err)
			}
			held := su{0, 500, 0}
			f.check(t, UsageQuery{Principal: visA, Tier: partner, Task: taskOne},
				state{site: held, spend: su{0, 2000, 0}, tier: held, principal: held, task: held, n: 1})
		})
	}
}

// testExpiry: an expired reservation comes back once; its late settle is
// charged in full as overage.
func testExpiry(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 1000, Principal: 1000, Task: 1000})
	r := f.reserve(t, tok(visA, taskOne, 1000))
	if _, err := f.b.Reserve(f.ctx, tok(visA, taskOne, 1)); !errors.Is(err, ErrExhausted) {
		t.Fatalf("reserve over a full budget = %v", err)
	}
	q := UsageQuery{Principal: visA, Task: taskOne}
	// Exactly at the expiry instant the reservation is due.
	f.clk.Advance(time.Minute - time.Millisecond)
	held := su{0, 1000, 0}
	f.check(t, q, state{site: held, principal: held, task: held, n: 1})
	f.clk.Advance(time.Millisecond)
	f.check(t, q, state{})
	s := f.settle(t, r, 10, 0)
	if !s.Late || s.Tokens != 10 || s.OverageTokens != 10 {
		t.Fatalf("settle after expiry = %+v; want 10 charged late, all overage", s)
	}
	if again := f.settle(t, r, 10, 0); !reflect.DeepEqual(again, s) {
		t.Fatalf("repeat of the late settle = %+v; want %+v", again, s)
	}
	late := su{10, 0, 10}
	f.check(t, q, state{site: late, principal: late, task: late})
	// The capacity came back once: all but the late 10 can be reserved again.
	f.reserve(t, tok(visA, taskTwo, 990))
	if _, err := f.b.Reserve(f.ctx, tok(visB, "t_x", 1)); !errors.Is(err, ErrExhausted) {
		t.Fatalf("reserve past the limit after expiry = %v", err)
	}
	if v := testutil.ToFloat64(f.b.m.overageTokens.WithLabelValues(causeLate)); v != 20 {
		t.Fatalf("late overage metric = %v; want 20 (two answers counted)", v)
	}
}

// testReleaseTask: the reaper of a lapsed lease gives back a task's open
// reservations at once in every scope; a settle that arrives later is
// charged in full as overage, once.
func testReleaseTask(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{SpendMicro: 1000000})
	lost := func(n int64) Request {
		return Request{Day: day, Principal: keyA, Tier: partner, TierLimit: 100000, Task: taskOne, Model: "dear", PromptTokens: n, MaxTokens: 100}
	}
	r1 := f.reserve(t, lost(100))
	r2 := f.reserve(t, lost(300))
	kept := f.reserve(t, Request{Day: day, Principal: keyA, Tier: partner, TierLimit: 100000, Task: taskTwo, Model: "cheap", PromptTokens: 50})
	q := UsageQuery{Principal: keyA, Tier: partner, Task: taskOne}
	// 200 + 400 tokens costing 1250 + 1750 micro-units, and the kept 50 (8).
	f.check(t, q, state{site: su{0, 650, 0}, spend: su{0, 3008, 0}, tier: su{0, 650, 0}, principal: su{0, 650, 0}, task: su{0, 600, 0}, n: 3})

	n, err := f.b.ReleaseTask(f.ctx, day, keyA, taskOne)
	if err != nil || n != 2 {
		t.Fatalf("ReleaseTask = %d, %v; want 2", n, err)
	}
	f.check(t, q, state{site: su{0, 50, 0}, spend: su{0, 8, 0}, tier: su{0, 50, 0}, principal: su{0, 50, 0}, n: 1})
	if n, err := f.b.ReleaseTask(f.ctx, day, keyA, taskOne); n != 0 || err != nil {
		t.Fatalf("second ReleaseTask = %d, %v; want 0", n, err)
	}

	// The dead replica's settle arrives after all: everything is overage.
	s := f.settle(t, r1, 100, 40) // 250 + 400 micro-units
	want := Settlement{Tokens: 140, CostMicro: 650, OverageTokens: 140, OverageCostMicro: 650, Late: true}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("late settle = %+v; want %+v", s, want)
	}
	if again := f.settle(t, r1, 100, 40); !reflect.DeepEqual(again, want) {
		t.Fatalf("repeat of the late settle = %+v", again)
	}
	late := su{140, 0, 140}
	f.check(t, q, state{site: su{140, 50, 140}, spend: su{650, 8, 650}, tier: su{140, 50, 140}, principal: su{140, 50, 140}, task: late, n: 1})
	// A re-sent reserve of a released reservation answers its first success
	// and holds nothing again.
	if again, err := f.b.Reserve(f.ctx, Request{ID: r2.ID, Day: day, Principal: keyA, Tier: partner, TierLimit: 100000,
		Task: taskOne, Model: "dear", PromptTokens: 300, MaxTokens: 100}); err != nil || again.ID != r2.ID {
		t.Fatalf("re-sent reserve of a released id = %+v, %v", again, err)
	}
	f.check(t, q, state{site: su{140, 50, 140}, spend: su{650, 8, 650}, tier: su{140, 50, 140}, principal: su{140, 50, 140}, task: late, n: 1})
	// The other task's reservation settles normally.
	if s := f.settle(t, kept, 50, 0); s.Late || s.OverageTokens != 0 {
		t.Fatalf("settle of the kept reservation = %+v", s)
	}
}

func testConcurrentReapers(t *testing.T, cf conf) {
	rdb := cf.rdb
	f := cf.fixture(t, Limits{Site: 100000, Principal: 100000, Task: 100000})
	// 40 reservations over 4 principals and 8 tasks that will expire together.
	ps := []string{visA, visB, keyA, keyB}
	var want int64
	for i := range 40 {
		f.reserve(t, Request{Day: day, Principal: ps[i%4], Tier: []string{"", partner}[i%2], Task: fmt.Sprintf("t_%d", i%8), PromptTokens: int64(100 + i)})
		want += int64(100 + i)
	}
	f.clk.Advance(30 * time.Second)
	// A later reservation that must survive the reaping, and a settled one
	// whose charge the reapers must leave alone.
	f.reserve(t, tok(visA, "t_kept", 777))
	r := f.reserve(t, tok(visA, "t_settled", 500))
	f.settle(t, r, 200, 0)
	f.check(t, UsageQuery{}, state{site: su{200, want + 777, 0}, n: 41})
	f.clk.Advance(31 * time.Second) // past the 40, not past "t_kept"
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	b2 := f.another()
	for i := range 64 {
		wg.Go(func() {
			b := []*Budget{f.b, b2}[i%2]
			var err error
			switch i % 4 {
			case 0:
				_, err = b.Usage(f.ctx, UsageQuery{Day: day, Principal: ps[i%4], Task: "t_x"})
			case 1:
				err = b.CanAfford(f.ctx, AffordRequest{Day: day, Principal: ps[i%4], Tokens: 1})
			case 2:
				_, err = b.ReleaseTask(f.ctx, day, visA, "t_none")
			default:
				_, err = b.Settle(f.ctx, Reservation{ID: "rnone", Day: day, Principal: visA, Task: taskOne, Tokens: 1}, 1, 0)
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
	f.check(t, UsageQuery{Principal: visA, Task: "t_kept"},
		state{site: su{200, 777, 0}, principal: su{200, 777, 0}, task: su{0, 777, 0}, n: 1})
	for _, p := range ps[1:] {
		f.check(t, UsageQuery{Principal: p, Tier: partner, Task: "t_1"}, state{site: su{200, 777, 0}, n: f.n(1, 0)})
	}
	for i := range 8 {
		f.check(t, UsageQuery{Principal: visB, Task: fmt.Sprintf("t_%d", i)}, state{site: su{200, 777, 0}, n: f.n(1, 0)})
		if n := rdb.SCard(f.ctx, "faregate:budget:{"+day+"}:taskres:"+fmt.Sprintf("t_%d", i)).Val(); n != 0 {
			t.Fatalf("taskres of t_%d still holds %d ids", i, n)
		}
	}
	// Every reservation ended once: 40 given back, 1 settled (in layout 2
	// once in its principal's slot and once in the day's).
	dones := []string{"faregate:budget:{" + day + "}:done"}
	if f.layout == layoutPrincipals {
		dones = rdb.Keys(f.ctx, "faregate:budget:{"+day+":b*}:done").Val()
		dones = append(dones, dayPrefix(day)+"ddone")
	}
	var ended int
	for _, k := range dones {
		for _, id := range rdb.HKeys(f.ctx, k).Val() {
			if !strings.HasPrefix(id, "op:") { // ReleaseTask's own records
				ended++
			}
		}
	}
	if want := f.n(41, 82); ended != int(want) {
		t.Fatalf("done records %d reservations; want %d (40 given back + 1 settled)", ended, want)
	}
}

func testCanAfford(t *testing.T, cf conf) {
	l := Limits{Site: 1000, Principal: 500, Task: 100, SpendMicro: 5000}
	// fill spends n×100 tokens of a principal, one task per 100 (task ids
	// are unique across principals, as the real ones are).
	fill := func(p string, n int) []Request {
		var out []Request
		for i := range n {
			out = append(out, tok(p, fmt.Sprintf("t_%s_%d", p, i), 100))
		}
		return out
	}
	spent := Request{Day: day, Principal: keyB, Task: "t_money", Model: "gold", PromptTokens: 100} // 5000 micro
	cases := []struct {
		name      string
		before    []Request
		ask       AffordRequest
		scope     Scope // "" means affordable
		remaining int64
	}{
		{"empty day", nil, AffordRequest{Principal: visA, Tokens: 500, CostMicro: 5000}, "", 0},
		{"task limit does not matter", fill(visA, 1), AffordRequest{Principal: visA, Tokens: 400}, "", 0},
		{"principal short", fill(visA, 1), AffordRequest{Principal: visA, Tokens: 401}, ScopePrincipal, 400},
		{"principal's own limit", fill(keyA, 1), AffordRequest{Principal: keyA, PrincipalLimit: 150, Tokens: 51}, ScopePrincipal, 50},
		{"tier short", fill(keyA, 1), AffordRequest{Principal: keyB, Tier: partner, TierLimit: 50, Tokens: 51}, ScopeTier, 50},
		{"site short", append(append(fill(visA, 2), fill(visB, 2)...), fill(keyA, 2)...), AffordRequest{Principal: keyB, Tokens: 401}, ScopeSite, 400},
		{"principal named first", append(fill(visA, 5), fill(visB, 5)...), AffordRequest{Principal: visA, Tokens: 1}, ScopePrincipal, 0},
		{"site short, principal fine", append(fill(visA, 5), fill(visB, 5)...), AffordRequest{Principal: keyA, Tokens: 1}, ScopeSite, 0},
		{"spend short", []Request{spent}, AffordRequest{Principal: visA, Tokens: 1, CostMicro: 1}, ScopeSpend, 0},
		{"spend not asked for", []Request{spent}, AffordRequest{Principal: visA, Tokens: 1}, "", 0},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := cf.fixture(t, l)
			for _, r := range c.before {
				f.reserve(t, r)
			}
			c.ask.Day = day
			q := UsageQuery{Day: day, Principal: c.ask.Principal, Tier: c.ask.Tier}
			before, _ := f.b.Usage(f.ctx, q)
			err := f.b.CanAfford(f.ctx, c.ask)
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
			if after, _ := f.b.Usage(f.ctx, q); after != before {
				t.Fatal("CanAfford changed usage")
			}
		})
	}
}

// testWarningOnce: the 80% crossing of each daily scope is reported once,
// to whichever replica's operation made it, and never again that day.
func testWarningOnce(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 10000, Principal: 5000, Task: 10000, SpendMicro: 10000})
	b1, b2 := f.b, f.another()
	warned := func(ws []ScopeEvent) string {
		var s []string
		for _, w := range ws {
			s = append(s, fmt.Sprintf("%s/%s %d/%d", w.Scope, w.Name, w.Used, w.Limit))
		}
		return fmt.Sprint(s)
	}
	steps := []struct {
		b    *Budget
		req  Request
		want string
	}{
		{b1, tok(keyA, "t_1", 3000), "[]"},
		// Site 8000 of 10000 and keyB 5000 of 5000: both cross here.
		{b2, tok(keyB, "t_2", 5000), "[site/ 8000/10000 principal/" + keyB + " 5000/5000]"},
		// keyA reaches 4000 of 5000 = 80%: its own crossing; the site's is spent.
		{b1, tok(keyA, "t_3", 1000), "[principal/" + keyA + " 4000/5000]"},
	}
	for i, s := range steps {
		r, err := s.b.Reserve(f.ctx, s.req)
		if err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if w := warned(r.Warnings); w != s.want {
			t.Fatalf("step %d warnings = %s; want %s", i, w, s.want)
		}
	}
	// A settle that crosses by overage reports it too: spend 7250 held of
	// 10000 (72.5%: 100 × 2.5 + 700 × 10), settled at 8250.
	big := Request{Day: day, Principal: visA, Task: "t_4", Model: "dear", PromptTokens: 100, MaxTokens: 700}
	r, err := b2.Reserve(f.ctx, big)
	if err != nil || warned(r.Warnings) != "[]" {
		t.Fatalf("spend to 72.5%%: %v %s", err, warned(r.Warnings))
	}
	s, err := b1.Settle(f.ctx, r, 100, 800) // 250 + 8000
	if err != nil || warned(s.Warnings) != "[spend/ 8250/10000]" || s.OverageCostMicro != 1000 {
		t.Fatalf("settle past 80%% of spend = %+v, %v", s, err)
	}
	// Nothing crosses again, whichever replica asks.
	for _, b := range []*Budget{b1, b2} {
		r, err := b.Reserve(f.ctx, Request{Day: day, Principal: visB, Task: "t_6", Model: "cheap", PromptTokens: 1})
		if err != nil || len(r.Warnings) != 0 {
			t.Fatalf("later reserve: %+v, %v", r.Warnings, err)
		}
	}
	// The next UTC day starts afresh.
	r, err = b1.Reserve(f.ctx, Request{Day: "2026-09-01", Principal: keyB, Task: "t_7", Model: "free", PromptTokens: 4500})
	if err != nil || warned(r.Warnings) != "[principal/"+keyB+" 4500/5000]" {
		t.Fatalf("next day: %+v, %v", r.Warnings, err)
	}
}

// testWarningConcurrent: many reservations from two replicas race past
// 80%; exactly one of them reports the site's crossing.
func testWarningConcurrent(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 10000, Principal: 10000, Task: 10000})
	bs := []*Budget{f.b, f.another()}
	var warnings, granted atomic.Int64
	var wg sync.WaitGroup
	for w := range 20 {
		wg.Go(func() {
			for i := range 10 {
				r, err := bs[w%2].Reserve(f.ctx, tok(fmt.Sprintf("v_%d", w), fmt.Sprintf("t_%d_%d", w, i), 50))
				if err != nil {
					t.Error(err)
					return
				}
				granted.Add(1)
				for _, e := range r.Warnings {
					if e.Scope == ScopeSite {
						warnings.Add(1)
					}
				}
			}
		})
	}
	wg.Wait()
	if granted.Load() != 200 || warnings.Load() != 1 {
		t.Fatalf("%d granted, %d site warnings; want 200 and exactly 1", granted.Load(), warnings.Load())
	}
}

// testExhaustedFirst: the first refusal of a daily scope is marked once
// across replicas; the task scope never is.
func testExhaustedFirst(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 100, Principal: 100, Task: 50})
	f.reserve(t, tok(visA, taskOne, 50))
	f.reserve(t, tok(visB, taskTwo, 50))
	var ex *ExhaustedError
	firsts := []bool{}
	for _, b := range []*Budget{f.b, f.another(), f.b} {
		_, err := b.Reserve(f.ctx, tok(keyA, "t_new", 1))
		if !errors.As(err, &ex) || ex.Scope != ScopeSite {
			t.Fatalf("reserve = %v; want site exhausted", err)
		}
		firsts = append(firsts, ex.First)
	}
	err := f.another().CanAfford(f.ctx, AffordRequest{Day: day, Principal: keyB, Tokens: 1})
	if !errors.As(err, &ex) || ex.First {
		t.Fatalf("CanAfford after the first refusal = %v, first %v", err, ex.First)
	}
	if fmt.Sprint(firsts) != "[true false false]" {
		t.Fatalf("First over three refusals = %v; want only the first", firsts)
	}
	for range 2 {
		if _, err := f.b.Reserve(f.ctx, tok(visA, taskOne, 1)); !errors.As(err, &ex) || ex.Scope != ScopeTask || ex.First || ex.RetryAfter() != 0 {
			t.Fatalf("task refusal = %v (first %v, retry %v); want task, not first, no retry", err, ex.First, ex.RetryAfter())
		}
	}
}

// testWithdraw: a withdrawn reserve leaves nothing behind: the hold goes
// back in every scope, and the warning or exhaustion it was first to see
// is reported by the next reserve that crosses, still once. A settled
// reservation is not withdrawn; a second withdraw finds nothing.
func testWithdraw(t *testing.T, cf conf) {
	f := cf.fixture(t, Limits{Site: 10000, Principal: 5000, Task: 10000})
	q := UsageQuery{Principal: keyA, Task: taskOne}
	f.reserve(t, tok(keyA, taskOne, 3000))
	// keyA to 4000 of 5000: the principal's crossing, then withdrawn.
	req := tok(keyA, taskOne, 1000)
	req.ID = "rwithdrawn1"
	r := f.reserve(t, req)
	if len(r.Warnings) != 1 || r.Warnings[0].Scope != ScopePrincipal {
		t.Fatalf("warnings %+v; want the principal's", r.Warnings)
	}
	for i, want := range []bool{true, false} {
		back, err := f.b.Withdraw(f.ctx, req)
		if err != nil || back != want {
			t.Fatalf("withdraw %d = %v, %v; want %v", i, back, err, want)
		}
	}
	f.check(t, q, state{site: su{0, 3000, 0}, principal: su{0, 3000, 0}, task: su{0, 3000, 0}, n: 1})
	// The crossing is reported by the next reserve past 80%, once.
	next := f.reserve(t, tok(keyA, "t_other", 1000))
	if len(next.Warnings) != 1 || next.Warnings[0].Scope != ScopePrincipal {
		t.Fatalf("next crossing warnings %+v; want the principal's", next.Warnings)
	}
	if r := f.reserve(t, tok(keyA, "t_other", 1)); len(r.Warnings) != 0 {
		t.Fatalf("warned twice: %+v", r.Warnings)
	}
	// A settle of the withdrawn one is late: all overage, never a refund.
	if s := f.settle(t, r, 1000, 0); !s.Late || s.OverageTokens != 1000 {
		t.Fatalf("settle after withdraw = %+v; want late, all overage", s)
	}
	f.check(t, q, state{site: su{1000, 4001, 1000}, principal: su{1000, 4001, 1000}, task: su{1000, 3000, 1000}, n: 3})
	// A refused reserve that was the scope's first: withdrawn, the next
	// refusal is the first.
	ref := tok(keyA, "t_big", 4000)
	ref.ID = "rwithdrawn2"
	var ex *ExhaustedError
	if _, err := f.b.Reserve(f.ctx, ref); !errors.As(err, &ex) || ex.Scope != ScopePrincipal || !ex.First {
		t.Fatalf("reserve = %v; want the principal's first refusal", err)
	}
	if back, err := f.b.Withdraw(f.ctx, ref); err != nil || back {
		t.Fatalf("withdraw of a refusal = %v, %v; want nothing given back", back, err)
	}
	for i, want := range []bool{true, false} {
		if _, err := f.b.Reserve(f.ctx, tok(keyA, "t_big", 4000)); !errors.As(err, &ex) || ex.First != want {
			t.Fatalf("refusal %d = %v, first %v; want %v", i, err, ex.First, want)
		}
	}
	// A settled reservation stays settled.
	done := tok(visB, taskTwo, 10)
	done.ID = "rsettled1"
	r = f.reserve(t, done)
	f.settle(t, r, 10, 0)
	if back, err := f.b.Withdraw(f.ctx, done); err != nil || back {
		t.Fatalf("withdraw after settle = %v, %v", back, err)
	}
	f.check(t, UsageQuery{Principal: visB, Task: taskTwo}, state{site: su{1010, 4001, 1000}, principal: su{10, 0, 0}, task: su{10, 0, 0}, n: f.n(3, 0)})
	if _, err := f.b.Withdraw(f.ctx, Request{Day: day, Principal: keyA, Task: taskOne, ID: "bad id"}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("withdraw with a bad id = %v", err)
	}
}

func testMetrics(t *testing.T, cf conf) {
	rdb := cf.rdb
	f := cf.fixture(t, Limits{Site: 10000, SpendMicro: 100000})
	r := f.reserve(t, Request{Day: day, Principal: visA, Task: taskOne, Model: "dear", PromptTokens: 2000, MaxTokens: 1000}) // 15000 micro
	f.reserve(t, tok(visB, taskTwo, 1000))
	if got := testutil.ToFloat64(f.b.m.siteRemaining); got != 6000 {
		t.Errorf("site remaining = %v; want 6000", got)
	}
	if got := testutil.ToFloat64(f.b.m.spendRemaining); got != 85000 {
		t.Errorf("spend remaining = %v; want 85000", got)
	}
	if got := testutil.ToFloat64(f.b.m.outstanding); got != 2 {
		t.Errorf("outstanding reservations = %v; want 2", got)
	}
	f.settle(t, r, 2000, 1500) // 5000 + 15000: 500 tokens and 5000 micro over
	if got := testutil.ToFloat64(f.b.m.siteRemaining); got != 5500 {
		t.Errorf("site remaining after settle = %v; want 5500", got)
	}
	if got := testutil.ToFloat64(f.b.m.spendRemaining); got != 80000 {
		t.Errorf("spend remaining after settle = %v; want 80000", got)
	}
	if a, b := testutil.ToFloat64(f.b.m.overageTokens.WithLabelValues(causeExcess)), testutil.ToFloat64(f.b.m.overageSpend.WithLabelValues(causeExcess)); a != 500 || b != 5000 {
		t.Errorf("overage = %v tokens, %v micro; want 500, 5000", a, b)
	}
	// A second Budget on the same registry shares the series instead of panicking.
	b2 := New(rdb, Options{Limits: Limits{Site: 10000, SpendMicro: 100000}, Prices: testPrices, Now: f.clk.Now, Registerer: f.reg})
	if _, err := b2.Reserve(f.ctx, tok(visA, "t_b2", 500)); err != nil {
		t.Fatal(err)
	}
	if got := testutil.ToFloat64(f.b.m.siteRemaining); got != 5000 {
		t.Errorf("shared site remaining = %v; want 5000", got)
	}
	n, err := testutil.GatherAndCount(f.reg, "faregate_budget_site_remaining_tokens", "faregate_budget_spend_remaining_micro",
		"faregate_budget_outstanding_reservations", "faregate_budget_refusals_total",
		"faregate_budget_overage_tokens_total", "faregate_budget_overage_spend_micro_total")
	if err != nil || n != 12 {
		t.Errorf("gathered %d series, %v; want 12 (3 gauges + 5 refusal scopes + 2×2 overage causes)", n, err)
	}
	// Without a spend limit there is no spend gauge.
	reg := prometheus.NewRegistry()
	New(rdb, Options{Registerer: reg})
	if n, _ := testutil.GatherAndCount(reg, "faregate_budget_spend_remaining_micro"); n != 0 {
		t.Errorf("spend gauge registered without a spend limit")
	}
}

// TestUnavailable: every operation fails closed, with ErrUnavailable,
// when Redis cannot be reached.
func TestUnavailable(t *testing.T) {
	b := New(deadClient(t), Options{})
	ctx := context.Background()
	r := Reservation{ID: "rx", Day: day, Principal: visA, Task: taskOne, Tokens: 10}
	cases := []struct {
		name string
		call func() error
	}{
		{"reserve", func() error {
			got, err := b.Reserve(ctx, tok(visA, taskOne, 10))
			if got.ID != "" {
				return fmt.Errorf("reserve handed out %+v", got)
			}
			return err
		}},
		{"settle", func() error { _, err := b.Settle(ctx, r, 5, 0); return err }},
		{"release", func() error { _, err := b.ReleaseTask(ctx, day, keyA, taskOne); return err }},
		{"can afford", func() error { return b.CanAfford(ctx, AffordRequest{Day: day, Principal: visA, Tokens: 10}) }},
		{"usage", func() error { _, err := b.Usage(ctx, UsageQuery{Day: day, Principal: visA, Task: taskOne}); return err }},
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
	good := Reservation{ID: "rx", Day: day, Principal: visA, Task: taskOne, Tokens: 10}
	reserve := func(mod func(*Request)) func() error {
		return func() error {
			r := tok(visA, taskOne, 5)
			mod(&r)
			_, err := b.Reserve(ctx, r)
			return err
		}
	}
	cases := []struct {
		name string
		call func() error
	}{
		{"zero amount", reserve(func(r *Request) { r.PromptTokens = 0 })},
		{"negative prompt", reserve(func(r *Request) { r.PromptTokens, r.MaxTokens = -5, 10 })},
		{"negative max", reserve(func(r *Request) { r.MaxTokens = -1 })},
		{"empty day", reserve(func(r *Request) { r.Day = "" })},
		{"bad day", reserve(func(r *Request) { r.Day = "2026-02-30" })},
		{"empty principal", reserve(func(r *Request) { r.Principal = "" })},
		{"separator in task", reserve(func(r *Request) { r.Task = "t|x" })},
		{"colon in tier", reserve(func(r *Request) { r.Tier = "a:b" })},
		{"bad reservation id", reserve(func(r *Request) { r.ID = "r|1" })},
		{"huge model name", reserve(func(r *Request) { r.Model = string(make([]byte, 257)) })},
		// Dots and colons are refused, so a raw IPv4 or IPv6 address can
		// never become part of a key by mistake.
		{"raw IPv4 as principal", reserve(func(r *Request) { r.Principal = "203.0.113.7" })},
		{"raw IPv6 as principal", func() error {
			return b.CanAfford(ctx, AffordRequest{Day: day, Principal: "2001:db8::1", Tokens: 5})
		}},
		{"colon in principal", reserve(func(r *Request) { r.Principal = "a:site" })},
		{"settle without id", func() error { g := good; g.ID = ""; _, err := b.Settle(ctx, g, 1, 0); return err }},
		{"can afford zero", func() error { return b.CanAfford(ctx, AffordRequest{Day: day, Principal: visA}) }},
		{"release bad task", func() error { _, err := b.ReleaseTask(ctx, day, keyA, "t x"); return err }},
		{"usage bad task", func() error { _, err := b.Usage(ctx, UsageQuery{Day: day, Principal: visA, Task: "a b"}); return err }},
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
		in    time.Time
		want  string
		until time.Duration
	}{
		{time.Date(2026, 8, 31, 23, 59, 59, 0, time.UTC), "2026-08-31", time.Second},
		{time.Date(2026, 9, 1, 1, 0, 0, 0, time.FixedZone("CEST", 2*3600)), "2026-08-31", time.Hour},
		{time.Date(2026, 8, 31, 22, 0, 0, 0, time.FixedZone("PDT", -7*3600)), "2026-09-01", 19 * time.Hour},
		{time.Date(2026, 12, 31, 0, 0, 0, 0, time.UTC), "2026-12-31", 24 * time.Hour},
	}
	for _, c := range cases {
		t.Run(c.in.String(), func(t *testing.T) {
			if got := Day(c.in); got != c.want {
				t.Fatalf("Day = %s; want %s", got, c.want)
			}
			if got := untilMidnight(c.in); got != c.until {
				t.Fatalf("untilMidnight = %v; want %v", got, c.until)
			}
		})
	}
}

// testPrincipalKeys: layout 2 keeps a principal's and its task's scopes
// and their reservation in the principal's bucket slot, and the day's
// scopes (here held per call, leasing off) in the day's, every key
// expiring with the day's two days.
func testPrincipalKeys(t *testing.T, cf conf) {
	rdb := cf.rdb
	f := cf.fixture(t, Limits{})
	r := f.reserve(t, Request{Day: day, Principal: keyA, Tier: partner, TierLimit: 100000, Task: taskOne, Model: "cheap", PromptTokens: 200, MaxTokens: 50})
	b, d := bucketPrefix(day, keyA), dayPrefix(day)
	if b != "faregate:budget:{2026-08-31:b"+bucketHex(bucketOf(keyA))+"}:" {
		t.Fatalf("bucket prefix %q", b)
	}
	exp := strconv.FormatInt(start.Add(time.Minute).UnixMilli(), 10)
	hashes := func(want map[string]map[string]string) {
		t.Helper()
		got, err := rdb.Keys(f.ctx, "*").Result()
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for k := range want {
			names = append(names, k)
		}
		sort.Strings(got)
		sort.Strings(names)
		if !reflect.DeepEqual(got, names) {
			t.Fatalf("keys = %v\nwant %v", got, names)
		}
		for k, w := range want {
			if w == nil {
				continue
			}
			if ttl := rdb.TTL(f.ctx, k).Val(); ttl <= 172790*time.Second || ttl > 172800*time.Second {
				t.Errorf("TTL %s = %v; want 172800s", k, ttl)
			}
			if h := rdb.HGetAll(f.ctx, k).Val(); !reflect.DeepEqual(h, w) {
				t.Errorf("%s = %v\nwant %v", k, h, w)
			}
		}
	}
	// 200 × 0.15 + 50 × 0.6 = 60 micro-units, held in money by the
	// principal and the task too.
	held := map[string]string{"outstanding": "250", "moutstanding": "60"}
	hashes(map[string]map[string]string{
		b + "p:" + keyA:       held,
		b + "task:" + taskOne: held,
		b + "res":             {r.ID: exp + "|250|60|" + keyA + "|partner|" + taskOne + "|cheap", "~next": exp},
		d + "site":            {"layout": "2", "outstanding": "250"},
		d + "spend":           {"outstanding": "60"},
		d + "tier:" + partner: {"outstanding": "250"},
		d + "dres":            {r.ID: exp + "|250|60|partner|" + keyA + "|" + taskOne + "|cheap", "~next": exp},
	})
	f.settle(t, r, 100, 20) // 120 tokens, 27 micro-units
	done := map[string]string{"settled": "120", "outstanding": "0", "msettled": "27", "moutstanding": "0"}
	hashes(map[string]map[string]string{
		b + "p:" + keyA:        done,
		b + "task:" + taskOne:  done,
		b + "res":              {"~next": exp}, // its earliest expiry, stale until the next reap
		b + "done":             {r.ID: "S|120|27|0|0|0|250|60|" + keyA + "|partner|" + taskOne + "|cheap"},
		d + "site":             {"layout": "2", "settled": "120", "outstanding": "0"},
		d + "spend":            {"settled": "27", "outstanding": "0"},
		d + "tier:" + partner:  {"settled": "120", "outstanding": "0"},
		d + "dres":             {"~next": exp},
		d + "ddone":            {r.ID: "S|120|27|0|0|0|250|60|partner|" + keyA + "|" + taskOne + "|cheap"},
		UsageKey(day):          nil, // the direct charge's record (ledger_test.go)
		sumsKey(UsageKey(day)): nil, // its counters (luaLedger)
	})
	if ttl := rdb.TTL(f.ctx, UsageKey(day)).Val(); ttl < 8*24*time.Hour-time.Minute {
		t.Errorf("TTL of the day's stream = %v; want 8 days", ttl)
	}
}
