package budget

import (
	"context"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// TestImplausibleUsage: a provider report below zero, past the ceiling
// (MaxInt64 included, which used to wrap the site's settled tokens to
// −9.2e18) or unreadable is charged the larger of the reservation and
// faregate's own count, capped at the ceiling; the site's counters stay
// exact and non-negative, and the budget keeps refusing at its limit.
func TestImplausibleUsage(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			f := newFixture(t, be.Client, Limits{Site: 5000, Principal: 5000, Task: 5000})
			f.b = New(be.Client, Options{Limits: f.b.Limits(), Prices: testPrices, ReservationTTL: time.Minute,
				Now: f.clk.Now, MaxCallTokens: 1000})
			req := Request{Day: day, Principal: visA, Task: taskOne, Model: "cheap", PromptTokens: 100, MaxTokens: 100}
			cases := []struct {
				name        string
				call        Call
				prompt, out int64
				implausible bool
			}{
				{"max int64 prompt", Call{PromptTokens: math.MaxInt64, CompletionTokens: 1}, 100, 100, true},
				{"sum past int64", Call{PromptTokens: math.MaxInt64 / 2, CompletionTokens: math.MaxInt64/2 + 10}, 100, 100, true},
				{"negative", Call{PromptTokens: -50000, CompletionTokens: -50000}, 100, 100, true},
				{"unreadable, counted more", Call{Unreadable: true, Counted: 700, Raw: `{"prompt_tokens":1e999}`}, 100, 600, true},
				{"counted past the ceiling", Call{PromptTokens: -1, Counted: 1 << 40}, 100, 900, true},
				{"just past the ceiling", Call{PromptTokens: 1000, CompletionTokens: 1}, 100, 100, true},
				{"at the ceiling", Call{PromptTokens: 999, CompletionTokens: 1}, 999, 1, false},
			}
			var settled, cost int64
			for _, c := range cases {
				r := f.reserve(t, req)
				p, o, imp := f.b.Charged(r, c.call)
				if p != c.prompt || o != c.out || imp != c.implausible {
					t.Fatalf("%s: Charged = %d+%d implausible %v; want %d+%d %v", c.name, p, o, imp, c.prompt, c.out, c.implausible)
				}
				s, err := f.b.SettleCall(f.ctx, r, c.call)
				if err != nil {
					t.Fatalf("%s: settle: %v", c.name, err)
				}
				if s.Tokens != c.prompt+c.out || s.CostMicro != testPrices["cheap"].Cost(c.prompt, c.out) {
					t.Fatalf("%s: settlement %+v; want %d tokens", c.name, s, c.prompt+c.out)
				}
				settled += s.Tokens
				cost += s.CostMicro
			}
			rep, err := f.b.Usage(f.ctx, UsageQuery{Day: day, Principal: visA, Task: taskOne})
			if err != nil {
				t.Fatal(err)
			}
			if rep.Site.Settled != settled || rep.Site.Outstanding != 0 || rep.Spend.Settled != cost || rep.Principal.Settled != settled {
				t.Fatalf("after the hostile reports: site %+v spend %+v principal %+v; want %d tokens, %d micro-units settled",
					rep.Site, rep.Spend, rep.Principal, settled, cost)
			}
			// The site still counts: what is left is exact, and the next
			// reservation past it is refused.
			left := 5000 - settled
			if _, err := f.b.Reserve(f.ctx, Request{Day: day, Principal: visB, Task: taskTwo, Model: "cheap", PromptTokens: left + 1}); err == nil {
				t.Fatalf("a reservation of %d with %d left was granted", left+1, left)
			}
			f.reserve(t, Request{Day: day, Principal: visB, Task: taskTwo, Model: "cheap", PromptTokens: left})
			t.Logf("7 hostile reports charged %d tokens in all; site settled %d of 5000, %d left and enforced", settled, rep.Site.Settled, left)
		})
	}
}

// TestReportBelowCount: a report is judged against faregate's own count
// of what passed. Counted with the model's tokenizer, the larger of the
// two is charged; with the conservative bound only, the report stands
// unless it is under half the count and more than 1,000 under it. Either
// way such a report is implausible (raw kept, alerted), and the charge
// never passes the ceiling.
func TestReportBelowCount(t *testing.T) {
	b := New(nil, Options{MaxCallTokens: 100_000})
	r := Reservation{Tokens: 3000, PromptTokens: 1000}
	cases := []struct {
		name        string
		call        Call
		prompt, out int64
		implausible bool
	}{
		{"exact: a stream of 2,000 reported as 0", Call{PromptTokens: 20, CompletionTokens: 0, CountedPrompt: 20, CountedOutput: 2000, Exact: true}, 20, 2000, true},
		{"exact: a prompt reported as 0", Call{PromptTokens: 0, CompletionTokens: 5, CountedPrompt: 1500, CountedOutput: 5, Exact: true}, 1500, 5, true},
		{"exact: a little below is raised, not doubted", Call{PromptTokens: 90, CompletionTokens: 95, CountedPrompt: 100, CountedOutput: 100, Exact: true}, 100, 100, false},
		{"exact: above the count is believed", Call{PromptTokens: 120, CompletionTokens: 900, CountedPrompt: 100, CountedOutput: 40, Exact: true}, 120, 900, false},
		{"exact: under half but within 1,000 is raised quietly", Call{PromptTokens: 10, CompletionTokens: 100, CountedPrompt: 10, CountedOutput: 900, Exact: true}, 10, 900, false},
		{"bound: a cached prompt reported low is believed", Call{PromptTokens: 0, CompletionTokens: 30, CountedPrompt: 800, CountedOutput: 40}, 0, 30, false},
		{"bound: within half is believed", Call{PromptTokens: 600, CompletionTokens: 1100, CountedPrompt: 1000, CountedOutput: 2000}, 600, 1100, false},
		{"bound: under half and 1,000 under is the bound", Call{PromptTokens: 5, CompletionTokens: 0, CountedPrompt: 40, CountedOutput: 2500}, 5, 2500, true},
		{"exact: capped at the ceiling", Call{PromptTokens: 0, CompletionTokens: 0, CountedPrompt: 60_000, CountedOutput: 60_000, Exact: true}, 60_000, 40_000, true},
		{"nothing counted: the report", Call{PromptTokens: 12, CompletionTokens: 3}, 12, 3, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			p, o, imp := b.Charged(r, c.call)
			if p != c.prompt || o != c.out || imp != c.implausible {
				t.Fatalf("Charged = %d+%d implausible %v; want %d+%d %v", p, o, imp, c.prompt, c.out, c.implausible)
			}
		})
	}
}

// TestScriptsRefuseInexactAmounts: the scripts themselves refuse an
// amount a double cannot hold exactly (past 2^53) or below zero, before
// anything moves, in case a caller ever skips Go's bounds.
func TestScriptsRefuseInexactAmounts(t *testing.T) {
	be := redistest.Real(t)
	f := newFixture(t, be.Client, Limits{})
	r := f.reserve(t, tok(visA, taskOne, 10))
	k := keysFor(day, visA, "", taskOne)
	for _, n := range []string{"9007199254740993", "-5", "1e300", "x"} {
		err := settleScript.Run(f.ctx, be.Client, append(k.scopeKeys(), UsageKey(day)),
			ms(start), r.ID, n, 0, info(r), dayKeyTTL, 1, 0, 0, 1, 0, 0).Err()
		if err == nil || !strings.Contains(err.Error(), "out of range") {
			t.Fatalf("settle of %s tokens: %v; want out of range", n, err)
		}
		err = reserveScript.Run(f.ctx, be.Client, k.scopeKeys(), ms(start), ms(start.Add(time.Minute)), "rz", n, 0,
			1, 0, 0, 1, 1, dayKeyTTL, "1|0|"+visA+"||"+taskOne+"|free", 0).Err()
		if err == nil || !strings.Contains(err.Error(), "out of range") {
			t.Fatalf("reserve of %s tokens: %v; want out of range", n, err)
		}
	}
	f.check(t, UsageQuery{Principal: visA, Task: taskOne}, state{site: su{0, 10, 0}, principal: su{0, 10, 0}, task: su{0, 10, 0}, n: 1})
}

// TestSettleWritesOneLedgerLine: SettleCall writes the call's ledger entry
// in its own script, with the settlement's numbers and, beside an
// implausible report's charge, the raw report; settling again (a re-send)
// writes nothing more.
func TestSettleWritesOneLedgerLine(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			f := newFixture(t, be.Client, Limits{})
			r := f.reserve(t, Request{Day: day, Principal: keyA, Task: taskOne, Model: "dear", PromptTokens: 100, MaxTokens: 100})
			e := &Entry{Task: taskOne, Model: "dear", Principal: keyA, RequestID: "req-1", LatencyMS: 42, Outcome: OutcomeOK}
			call := Call{PromptTokens: -50000, CompletionTokens: -50000, Raw: `{"prompt_tokens":-50000,"completion_tokens":-50000}`, Ledger: e}
			first, err := f.b.SettleCall(f.ctx, r, call)
			if err != nil {
				t.Fatal(err)
			}
			again, err := f.b.SettleCall(f.ctx, r, call)
			if err != nil || again.Tokens != first.Tokens || again.CostMicro != first.CostMicro {
				t.Fatalf("repeat settle = %+v, %v; want the first %+v", again, err, first)
			}
			msgs, err := be.Client.XRange(f.ctx, StreamOf(day, keyA), "-", "+").Result()
			if err != nil || len(msgs) != 1 {
				t.Fatalf("ledger: %d entries (%v); want 1", len(msgs), err)
			}
			got := msgs[0].Values
			want := map[string]string{"task": taskOne, "model": "dear", "principal": keyA, "request_id": "req-1",
				"prompt_tokens": "100", "completion_tokens": "100", "reserved": "200", "latency_ms": "42", "outcome": "ok",
				"cost_micro": "1250", "overage_tokens": "0", "implausible": "1", "usage_raw": call.Raw, "reservation": r.ID}
			for k, v := range want {
				if got[k] != v {
					t.Fatalf("ledger field %s = %v; want %s (entry %v)", k, got[k], v, got)
				}
			}
			totals, err := NewLedger(be.Client, f.clk.Now).Totals(f.ctx, day, ByPrincipal)
			if err != nil || len(totals) != 1 || totals[0].PromptTokens != 100 || totals[0].CompletionTokens != 100 || totals[0].Calls != 1 {
				t.Fatalf("totals %+v, %v", totals, err)
			}
		})
	}
}

// TestLegacyNegativeEntriesTotalZero: entries an older faregate wrote with
// a provider's negative numbers never make a total negative.
func TestLegacyNegativeEntriesTotalZero(t *testing.T) {
	be := redistest.Real(t)
	ctx := context.Background()
	be.Client.FlushDB(ctx)
	l := NewLedger(be.Client, func() time.Time { return start })
	for _, n := range []int64{-50000, 150} {
		if err := l.Append(ctx, Entry{Task: taskOne, Model: "m", Principal: keyA, PromptTokens: n, CompletionTokens: n, Outcome: OutcomeOK}); err != nil {
			t.Fatal(err)
		}
	}
	totals, err := l.Totals(ctx, day, ByModel)
	if err != nil || len(totals) != 1 || totals[0].PromptTokens != 150 || totals[0].CompletionTokens != 150 {
		t.Fatalf("totals %+v, %v; want the negatives counted as 0", totals, err)
	}
}

// TestSettleResendsItself: with the client's own retries off, a settle
// whose reply is lost is sent again by SettleCall (idempotently), so the
// hold comes back at once instead of when the reservation expires, and
// the call has one ledger line.
func TestSettleResendsItself(t *testing.T) {
	be := redistest.Real(t)
	faults := redistest.NewFaults()
	opt, err := redis.ParseURL(be.URL)
	if err != nil {
		t.Fatal(err)
	}
	opt.Dialer, opt.ReadTimeout, opt.MaxRetries = faults.Dialer(nil), 250*time.Millisecond, -1
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	f := newFixture(t, be.Client, Limits{})
	reg := prometheus.NewRegistry()
	b := New(c, Options{Prices: testPrices, ReservationTTL: time.Minute, Now: f.clk.Now, Registerer: reg})
	if err := batchScript.Load(f.ctx, be.Client).Err(); err != nil {
		t.Fatal(err)
	}
	r := f.reserve(t, Request{Day: day, Principal: keyA, Task: taskOne, Model: "cheap", PromptTokens: 100, MaxTokens: 100})
	faults.LoseNextReply("evalsha")
	s, err := b.SettleCall(f.ctx, r, Call{PromptTokens: 50, CompletionTokens: 20, Ledger: &Entry{Task: taskOne, Model: "cheap", Principal: keyA, Outcome: OutcomeOK}})
	if err != nil {
		t.Fatalf("settle after a lost reply: %v", err)
	}
	if faults.Lost() != 1 || s.Tokens != 70 {
		t.Fatalf("lost %d replies, settlement %+v; want 1 lost, 70 tokens", faults.Lost(), s)
	}
	f.check(t, UsageQuery{Principal: keyA, Task: taskOne}, state{site: su{70, 0, 0}, spend: su{20, 0, 0}, principal: su{70, 0, 0}, task: su{70, 0, 0}})
	if n := be.Client.XLen(f.ctx, StreamOf(day, keyA)).Val(); n != 1 {
		t.Fatalf("ledger has %d lines; want 1", n)
	}
}
