package budget

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// leased is a Budget with leases on rdb (a replica), closed with the test.
func leased(t *testing.T, rdb redis.Scripter, l Limits, lo LeaseOptions, now func() time.Time) *Budget {
	t.Helper()
	if lo.Calls == 0 {
		lo.Calls = DefaultLeaseCalls
	}
	b := New(rdb, Options{Limits: l, Prices: testPrices, ReservationTTL: time.Minute, Now: now, Lease: lo})
	t.Cleanup(func() { _ = b.Close(context.Background()) })
	return b
}

// dayScopes reads the day's site, spend and tier scopes.
func dayScopes(t *testing.T, b *Budget, d, tier string) UsageReport {
	t.Helper()
	rep, err := b.Usage(context.Background(), UsageQuery{Day: d, Tier: tier})
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

// records sums what the day's stream says leases and direct reservations
// charged each day scope (tokens, or micro-units for spend): what the
// scope's settled must equal.
func records(t *testing.T, rdb redis.Cmdable, d string) map[string]int64 {
	t.Helper()
	msgs, err := rdb.XRange(context.Background(), UsageKey(d), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int64{}
	for _, m := range msgs {
		n := func(f string) int64 {
			v, _ := strconv.ParseInt(fmt.Sprint(m.Values[f]), 10, 64)
			return v
		}
		switch m.Values["kind"] {
		case "lease":
			out[fmt.Sprint(m.Values["scope"])] += n("amount")
		case "direct":
			out["site"] += n("tokens")
			out["spend"] += n("cost_micro")
			if tier := fmt.Sprint(m.Values["tier"]); tier != "" {
				out["tier:"+tier] += n("tokens")
			}
		}
	}
	return out
}

// TestLeaseFastPath: with leases, a call's day scopes come from the
// replica's block: Redis sees the block outstanding (leased), not each
// call, until the replica reports; Close reports what the calls spent and
// gives the rest back, with the day's stream recording every charge.
func TestLeaseFastPath(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			f := newFixture(t, be.Client, Limits{})
			b := leased(t, be.Client, Limits{Site: 100000, SpendMicro: 10_000_000}, LeaseOptions{}, f.clk.Now)
			var rs []Reservation
			for i := range 10 {
				r, err := b.Reserve(f.ctx, Request{Day: day, Principal: visA, Tier: partner, TierLimit: 50000,
					Task: fmt.Sprintf("t_%d", i), Model: "cheap", PromptTokens: 100, MaxTokens: 100})
				if err != nil {
					t.Fatal(err)
				}
				if r.how != heldLease {
					t.Fatalf("reservation %d held %v; want in the lease", i, r.how)
				}
				rs = append(rs, r)
			}
			rep := dayScopes(t, b, day, partner)
			// One block: 64 × the largest reservation (200), less than a
			// quarter of the headroom (25000).
			if rep.Site.Outstanding != 12800 || rep.Site.Leased != 12800 || rep.Site.Settled != 0 || rep.Leases != 1 {
				t.Fatalf("site while leased = %+v (leases %d); want a block of 12800 outstanding, all leased", rep.Site, rep.Leases)
			}
			for _, r := range rs {
				if _, err := b.Settle(f.ctx, r, 100, 50); err != nil {
					t.Fatal(err)
				}
			}
			if err := b.Close(f.ctx); err != nil {
				t.Fatal(err)
			}
			rep = dayScopes(t, b, day, partner)
			// 10 × 150 tokens at 0.15/0.6 per token: 10 × (15 + 30) micro-units.
			if rep.Site != (ScopeUsage{Settled: 1500, Limit: 100000}) || rep.Tier != (ScopeUsage{Settled: 1500}) ||
				rep.Spend != (ScopeUsage{Settled: 450, Limit: 10_000_000}) || rep.Leases != 0 {
				t.Fatalf("after close: site %+v tier %+v spend %+v leases %d", rep.Site, rep.Tier, rep.Spend, rep.Leases)
			}
			got := records(t, be.Client, day)
			if got["site"] != 1500 || got["tier:"+partner] != 1500 || got["spend"] != 450 {
				t.Fatalf("the day's records sum to %v; want the settled amounts", got)
			}
			u, err := b.Usage(f.ctx, UsageQuery{Day: day, Principal: visA, Task: "t_3"})
			if err != nil || u.Principal.Settled != 1500 || u.Task.Settled != 150 || u.PrincipalSpend.Settled != 450 || u.Reservations != 0 {
				t.Fatalf("principal %+v %+v task %+v open %d, %v", u.Principal, u.PrincipalSpend, u.Task, u.Reservations, err)
			}
		})
	}
}

// unspent is what replica b's lease of day holds unspent in scope.
func unspent(b *Budget, d, scope string) int64 {
	m := b.leases
	m.mu.Lock()
	defer m.mu.Unlock()
	if dl := m.days[d]; dl != nil {
		for _, s := range dl.scopes {
			if s.name == scope {
				return max(s.avail(), 0)
			}
		}
	}
	return 0
}

// TestNearExhaustion: a site budget of exactly 10 reservations, served by
// two replicas with leases, admits exactly 10, whichever replica holds
// blocks and however the calls alternate: a replica short of its block
// near the limit gives its unspent part back in the script that reserves
// its call per call. Asked of one replica alone, it is refused while the
// other holds unspent blocks, never more than their size, and the other
// replica admits what they hold.
func TestNearExhaustion(t *testing.T) {
	be := redistest.Real(t)
	const hold, fit = 100, 10
	cases := []struct {
		name  string
		order string // which replica each call goes to, repeated; "A+" asks A alone once B warmed up
		warm  int    // calls on B first, so B holds blocks
	}{
		{"alternate, A first", "AB", 0},
		{"alternate, B warmed", "AB", 3},
		{"B twice for each A", "BBA", 1},
		{"A alone, B holding a block", "A", 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t, be.Client, Limits{})
			l := Limits{Site: fit * hold, Principal: 1 << 40, Task: 1 << 40}
			a := leased(t, be.Client, l, LeaseOptions{}, f.clk.Now)
			b := leased(t, be.Client, l, LeaseOptions{}, f.clk.Now)
			replica := map[byte]*Budget{'A': a, 'B': b}
			n := 0
			call := func(r *Budget) bool {
				_, err := r.Reserve(f.ctx, tok(visA, fmt.Sprintf("t_%d", n), hold))
				var ex *ExhaustedError
				switch {
				case err == nil:
					n++
					return true
				case errors.As(err, &ex) && ex.Scope == ScopeSite:
					return false
				}
				t.Fatal(err)
				return false
			}
			for range c.warm {
				if !call(b) {
					t.Fatal("warming up B was refused")
				}
			}
			for refusals, i := 0, 0; refusals < 2*len(c.order); i++ {
				if call(replica[c.order[i%len(c.order)]]) {
					refusals = 0
				} else {
					refusals++
				}
				if i > 100 {
					t.Fatal("no end")
				}
			}
			rep := dayScopes(t, a, day, "")
			if rep.Site.Settled+rep.Site.Outstanding > fit*hold {
				t.Fatalf("site %+v past its limit", rep.Site)
			}
			if c.order != "A" {
				if n != fit {
					t.Fatalf("admitted %d; want exactly %d (site %+v)", n, fit, rep.Site)
				}
				return
			}
			// A alone: A was refused while B held unspent blocks (the
			// slack, never more than what B leased), and B admits the rest.
			slack := unspent(b, day, "site")
			if n >= fit || slack == 0 || slack > rep.Site.Leased || int64(n)*hold+slack+(fit*hold-rep.Site.Settled-rep.Site.Outstanding) != fit*hold {
				t.Fatalf("A alone admitted %d with B holding %d unspent (site %+v)", n, slack, rep.Site)
			}
			for call(b) {
			}
			if n != fit {
				t.Fatalf("admitted %d after B was asked; want %d", n, fit)
			}
		})
	}
}

// kill stops replica b as a crash would: nothing is given back, nothing
// more is reported; its leases stay in Redis until they expire.
func kill(b *Budget) {
	m := b.leases
	m.mu.Lock()
	m.closed = true
	stop, done := m.stop, m.loopDone
	m.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
}

// TestDeadReplicaLease: a replica killed while it holds leases. Its blocks
// stay outstanding until the lease expires by Redis's clock, never
// earlier; meanwhile nothing is admitted past the cap (the live replica
// falls back to per-call reservations around the stranded blocks). At
// expiry what the dead lease still held is charged, with a record in the
// day's stream, outstanding returns to what the live replica holds, and
// every scope's settled equals what the day's records and the calls'
// ledger entries say. On miniredis, whose clock (Redis's TIME) the test
// moves.
func TestDeadReplicaLease(t *testing.T) {
	m := redistest.Mini(t)
	f := newFixture(t, m.Client, Limits{})
	t0 := time.Now().Truncate(time.Second)
	m.Mini.SetTime(t0)
	const hold = 100
	l := Limits{Site: 40 * hold, Principal: 1 << 40, Task: 1 << 40}
	lo := LeaseOptions{TTL: 10 * time.Second, Idle: time.Hour}
	dead := leased(t, m.Client, l, lo, f.clk.Now)
	live := leased(t, m.Client, l, lo, f.clk.Now)
	// The dead replica admits 6 calls in its block and settles 4 of them,
	// reporting none: the lease holds their charge, and the 2 open holds.
	var open []Reservation
	for i := range 6 {
		r, err := dead.Reserve(f.ctx, Request{Day: day, Principal: visA, Task: fmt.Sprintf("t_dead_%d", i), Model: "free", PromptTokens: hold,
			Tier: partner, TierLimit: 1 << 40})
		if err != nil || r.how != heldLease {
			t.Fatalf("dead replica's call %d: %v (held %v)", i, err, r.how)
		}
		if i < 4 {
			if _, err := dead.SettleCall(f.ctx, r, Call{PromptTokens: 60, CompletionTokens: 10,
				Ledger: &Entry{Task: r.Task, Model: "free", Principal: visA, Outcome: OutcomeOK}}); err != nil {
				t.Fatal(err)
			}
		} else {
			open = append(open, r)
		}
	}
	block := dayScopes(t, live, day, partner).Site.Leased
	kill(dead)
	_ = open

	// Just before the expiry, the dead lease still holds its block: the
	// live replica admits around it, per call near the cap, never past it.
	m.Mini.SetTime(t0.Add(lo.TTL - time.Millisecond))
	admitted := 0
	for i := range 100 {
		r, err := live.Reserve(f.ctx, Request{Day: day, Principal: visB, Task: fmt.Sprintf("t_live_%d", i), Model: "free", PromptTokens: hold,
			Tier: partner, TierLimit: 1 << 40})
		var ex *ExhaustedError
		if errors.As(err, &ex) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		admitted++
		if _, err := live.SettleCall(f.ctx, r, Call{PromptTokens: hold, Ledger: &Entry{Task: r.Task, Model: "free", Principal: visB, Outcome: OutcomeOK}}); err != nil {
			t.Fatal(err)
		}
	}
	rep := dayScopes(t, live, day, partner)
	if rep.Site.Settled+rep.Site.Outstanding > l.Site || rep.Site.Leased < block {
		t.Fatalf("site before expiry %+v; want the dead block (%d) still leased, nothing past the cap", rep.Site, block)
	}
	if want := int((l.Site - block) / hold); admitted > want || admitted < want-2 {
		t.Fatalf("live replica admitted %d beside a stranded block of %d; want about %d and never more", admitted, block, want)
	}

	// At the expiry, by Redis's clock, the dead lease is charged what it
	// held, once; the live replica gives its own back.
	m.Mini.SetTime(t0.Add(lo.TTL))
	if err := live.Close(f.ctx); err != nil {
		t.Fatal(err)
	}
	rep = dayScopes(t, live, day, partner)
	if rep.Site.Outstanding != 0 || rep.Site.Leased != 0 || rep.Tier.Outstanding != 0 || rep.Leases != 0 {
		t.Fatalf("after the dead lease expired: site %+v tier %+v, %d leases; want nothing outstanding", rep.Site, rep.Tier, rep.Leases)
	}
	// Site: the live calls (reported) and the whole dead block (charged at
	// expiry: its 4 settled calls, its 2 open holds and its unspent part).
	if want := int64(admitted)*hold + block; rep.Site.Settled != want {
		t.Fatalf("site settled %d; want %d (live calls + the dead block)", rep.Site.Settled, want)
	}
	got := records(t, m.Client, day)
	if got["site"] != rep.Site.Settled || got["tier:"+partner] != rep.Tier.Settled {
		t.Fatalf("the day's records %v; want the scopes' settled (site %d, tier %d)", got, rep.Site.Settled, rep.Tier.Settled)
	}
	msgs, err := m.Client.XRange(f.ctx, UsageKey(day), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	var expired int
	for _, msg := range msgs {
		if msg.Values["kind"] == "lease" && msg.Values["expired"] == "1" && msg.Values["scope"] == "site" {
			expired++
			if msg.Values["amount"] != strconv.FormatInt(block, 10) {
				t.Fatalf("the expired lease's record %v; want its block %d charged", msg.Values, block)
			}
		}
	}
	if expired != 1 {
		t.Fatalf("%d records of the expired lease's site charge; want 1", expired)
	}
	deadLeaseExport(t, m.Client, 4+admitted, block, 4*70+int64(admitted)*hold, rep.Site.Settled)
	// The calls' own ledger: every settled call has its entry, and the
	// principals' settled equal their entries' sums.
	for _, p := range []struct {
		id    string
		calls int
		each  int64
	}{{visA, 4, 70}, {visB, admitted, hold}} {
		entries, err := m.Client.XRange(f.ctx, StreamOf(day, p.id), "-", "+").Result()
		if err != nil || len(entries) != p.calls {
			t.Fatalf("%s: %d entries, %v; want %d", p.id, len(entries), err, p.calls)
		}
		u, err := live.Usage(f.ctx, UsageQuery{Day: day, Principal: p.id})
		if err != nil || u.Principal.Settled != int64(p.calls)*p.each {
			t.Fatalf("%s settled %+v, %v; want %d", p.id, u.Principal, err, int64(p.calls)*p.each)
		}
	}
}

// deadLeaseExport: the billing feed of a day with a dead replica's lease
// has every call's line and the lease's expiry as lines of their own
// (KindLeaseExpired, site charged block), and no line for the records of
// live leases' reports or direct settles, which restate calls. The site's
// settled is then bounded by the feed: at least the calls' tokens (less
// the lines of calls the expiry charged, which may be all of them), at
// most the calls' tokens and the expiries' charges.
func deadLeaseExport(t *testing.T, rdb redis.Cmdable, calls int, block, callTokens, siteSettled int64) {
	t.Helper()
	x, err := NewLedger(rdb, nil).Exporter(context.Background(), ExportOptions{Consumer: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	var n int
	var tokens, siteExpiry int64
	for _, l := range exportAll(t, x) {
		switch l.Kind {
		case "":
			n++
			tokens += l.InputTokens + l.OutputTokens
		case KindLeaseExpired:
			if l.Scope == "site" {
				siteExpiry += l.Amount
			}
		default:
			t.Fatalf("line of kind %q: %+v", l.Kind, l)
		}
	}
	if n != calls || tokens != callTokens || siteExpiry != block {
		t.Fatalf("feed: %d call lines of %d tokens, site expiry %d; want %d, %d, %d", n, tokens, siteExpiry, calls, callTokens, block)
	}
	if siteSettled > tokens+siteExpiry {
		t.Fatalf("site settled %d past the feed's calls (%d) and expiries (%d)", siteSettled, tokens, siteExpiry)
	}
}
