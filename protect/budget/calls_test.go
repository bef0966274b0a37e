package budget

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// commandCounts is INFO commandstats as name → calls, reset after reading.
func commandCounts(t *testing.T, rdb *redis.Client) map[string]int {
	t.Helper()
	ctx := context.Background()
	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for line := range strings.Lines(info) {
		name, stats, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(line), "cmdstat_"), ":")
		if !ok || name == "info" || name == "config|resetstat" {
			continue
		}
		n, _, _ := strings.Cut(strings.TrimPrefix(stats, "calls="), ",")
		out[name], _ = strconv.Atoi(n)
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// total is every command but the scripts themselves.
func total(c map[string]int) (scripts, commands int) {
	for name, n := range c {
		if strings.HasPrefix(name, "eval") {
			scripts += n
		} else {
			commands += n
		}
	}
	return scripts, commands
}

// TestCommandsPerCall counts what one model call's reserve and settle
// (with its ledger entry) cost Redis, on a real redis-server (INFO
// commandstats): inside a script a redis.call costs about as much again
// as the command, and these run on every call. On the fast path (the day
// scopes in a leased block) each is one script in the principal's slot,
// which reads only what it checks (a settle adds to fields it never
// reads), writes each scope once, and sets no expiry on a scope or a
// stream whose expiry it set within the minute: 21 commands a call (18
// before the billing feed, whose entry reads and writes the stream's
// counters and reads its length, for the export's cap), where the day
// layout's two scripts made 42 without the feed. Per call (leasing off, or
// near a limit) the day's slot adds its part, in the same script on a
// single Redis: its reaper's reads and its own record of the charge (with
// the day stream's counters) make it 46.
func TestCommandsPerCall(t *testing.T) {
	redistest.Require(t)
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	d := time.Now().UTC().Format(time.DateOnly)
	cases := []struct {
		name                     string
		lease                    LeaseOptions
		reserveMax, settleMax    int
		reserveScript, settleScr int
	}{
		{"leased", LeaseOptions{Calls: DefaultLeaseCalls}, 9, 12, 1, 1},
		{"per call", LeaseOptions{}, 20, 26, 1, 1},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b := New(rdb, Options{Limits: Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}, Lease: c.lease})
			t.Cleanup(func() { _ = b.Close(ctx) })
			req := Request{Day: d, Principal: "v_x", Task: "t_1", Model: "unpriced",
				PrincipalLimit: 1 << 40, PromptTokens: 30, MaxTokens: 200, Tier: "public", TierLimit: 1 << 40}
			e := Entry{Task: req.Task, Model: req.Model, Principal: req.Principal, Outcome: "ok"}
			call := Call{PromptTokens: 20, CompletionTokens: 10, Counted: 30, Ledger: &e}
			// The first round loads the script, decides the day's layout and
			// takes the lease.
			res, err := b.Reserve(ctx, req)
			if err == nil {
				_, err = b.SettleCall(ctx, res, call)
			}
			if err != nil {
				t.Fatal(err)
			}
			commandCounts(t, rdb)
			if res, err = b.Reserve(ctx, req); err != nil {
				t.Fatal(err)
			}
			reserve := commandCounts(t, rdb)
			if _, err := b.SettleCall(ctx, res, call); err != nil {
				t.Fatal(err)
			}
			settle := commandCounts(t, rdb)
			rs, rc := total(reserve)
			ss, sc := total(settle)
			t.Logf("reserve: %d script(s), %d commands %v", rs, rc, reserve)
			t.Logf("settle: %d script(s), %d commands %v", ss, sc, settle)
			if rs != c.reserveScript || rc > c.reserveMax || ss != c.settleScr || sc > c.settleMax {
				t.Errorf("reserve %d script(s) of %d commands, settle %d of %d; want %d of at most %d and %d of at most %d",
					rs, rc, ss, sc, c.reserveScript, c.reserveMax, c.settleScr, c.settleMax)
			}
			// Each scope is read once and expires once, when it is made; a
			// settle reads only the principal (its 80% line) and the
			// counters of each stream it writes.
			if reserve["hmget"] > 2+len(b.dayNeeds(res))*flag(c.lease.Calls == 0) || reserve["expire"] > 1+flag(c.lease.Calls == 0) ||
				settle["hmget"] > 2+(len(b.dayNeeds(res))+1)*flag(c.lease.Calls == 0) || settle["expire"] != 0 {
				t.Errorf("reserve: %d scope reads, %d expiries; settle %d, %d", reserve["hmget"], reserve["expire"], settle["hmget"], settle["expire"])
			}
		})
	}
}

// TestRefusedHoldsNoDay: a per-call reserve's two parts go in one script
// on a single Redis, and the day's part of a call its principal's part
// refused (here its task's limit) holds nothing, not even until its
// withdraw: such holds refused calls the site could afford near its limit
// (TestExactSoak's site bound 19,650 of 24,000 tokens).
func TestRefusedHoldsNoDay(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			f := newFixture(t, be.Client, Limits{Site: 10000, Principal: 1 << 30, Task: 100})
			if l, err := f.b.layoutOf(f.ctx, day); err != nil || l != layoutPrincipals {
				t.Fatalf("layout %d, %v", l, err)
			}
			r := Reservation{ID: "r_refused", Day: day, Principal: visA, Task: "t_1", Model: "free",
				PrincipalLimit: 1 << 30, Tokens: 500}
			exp := ms(f.clk.Now().Add(time.Minute))
			rop, dop := f.b.reserveOp(r, exp), f.b.directOp(r, exp)
			f.b.send(rop, dop)
			rv, rerr := rop.wait(f.ctx)
			dv, derr := dop.wait(f.ctx)
			if rerr != nil || derr != nil || rv[0] != 0 || rv[1] != 5 || dv[0] != 6 {
				t.Fatalf("reserve %v (%v), day's part %v (%v); want refused by the task, the day's part not tried", rv, rerr, dv, derr)
			}
			if rep := dayScopes(t, f.b, day, ""); rep.Site.Outstanding != 0 || rep.Reservations != 0 {
				t.Fatalf("site %+v, %d open: the refused call holds the day", rep.Site, rep.Reservations)
			}
		})
	}
}
