package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/protect/budget"
	"faregate/protect/kit/testkit/redistest"
)

// TestUsageFlags runs `faregate usage` against a ledger written on a fixed
// day: each grouping and format, and every bad flag refused with a message
// that names it.
func TestUsageFlags(t *testing.T) {
	be := redistest.Mini(t)
	day := time.Date(2026, 8, 31, 9, 0, 0, 0, time.UTC)
	l := budget.NewLedger(be.Client, func() time.Time { return day })
	for _, e := range []budget.Entry{
		{Task: "t_1", Model: "gpt-4o-mini", Principal: "k_acme", PromptTokens: 1000, CompletionTokens: 500, Reserved: 2000,
			CostMicro: 450, Outcome: budget.OutcomeOK},
		{Task: "t_2", Model: "gpt-4o", Principal: "v_ab12", PromptTokens: 100, CompletionTokens: 900, Reserved: 600,
			CostMicro: 9250, OverageTokens: 400, OverageCostMicro: 4000, Outcome: budget.OutcomeOK},
	} {
		if err := l.Append(context.Background(), e); err != nil {
			t.Fatal(err)
		}
	}
	env := envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL})
	cases := []struct {
		name string
		args []string
		env  func(string) string
		want []string // lines (or parts of the error) expected
		err  bool
	}{
		{"table by model is the default", []string{"-day", "2026-08-31"}, env, []string{
			"MODEL               CALLS  ERRORS  CUT  ESTIMATED  PROMPT  COMPLETION  TOTAL  RESERVED  COST      OVERAGE  OVERAGE_COST",
			"gpt-4o              1      0       0    0          100     900         1000   600       0.009250  400      0.004000",
			"gpt-4o-mini         1      0       0    0          1000    500         1500   2000      0.000450  0        0.000000",
			"total (2026-08-31)  2      0       0    0          1100    1400        2500   2600      0.009700  400      0.004000",
		}, false},
		{"table by principal", []string{"-day", "2026-08-31", "-by", "principal"}, env, []string{
			"PRINCIPAL", "k_acme              1", "v_ab12              1",
		}, false},
		{"csv by principal", []string{"-day", "2026-08-31", "-by", "principal", "-format", "csv"}, env, []string{
			"day,principal,calls,errors,cut_calls,estimated_calls,prompt_tokens,completion_tokens,total_tokens,reserved_tokens,cost,overage_tokens,overage_cost",
			"2026-08-31,k_acme,1,0,0,0,1000,500,1500,2000,0.000450,0,0.000000",
			"2026-08-31,v_ab12,1,0,0,0,100,900,1000,600,0.009250,400,0.004000",
		}, false},
		{"empty day", []string{"-day", "2001-01-01"}, env, []string{"no model calls recorded on 2001-01-01"}, false},
		{"bad -by", []string{"-by", "task"}, env, []string{`-by "task": want model or principal`}, true},
		{"bad -format", []string{"-format", "xml"}, env, []string{`-format "xml": want table or csv`}, true},
		{"json without a scope", []string{"-format", "json"}, env, []string{`-format "json": only with -site, -principal or -task`}, true},
		{"two scopes", []string{"-site", "-principal", "v_x"}, env, []string{"want one of them"}, true},
		{"bad -day", []string{"-day", "yesterday"}, env, []string{`-day "yesterday": want a date as YYYY-MM-DD`}, true},
		{"impossible -day", []string{"-day", "2026-02-30"}, env, []string{`-day "2026-02-30"`}, true},
		{"every bad flag at once", []string{"-day", "x", "-by", "y", "-format", "z", "extra"}, env,
			[]string{`unexpected argument "extra"`, `-day "x"`, `-by "y"`, `-format "z"`}, true},
		{"unknown flag", []string{"-model", "x"}, env, []string{"flag provided but not defined: -model"}, true},
		{"no redis", []string{"-day", "2026-08-31"}, envOf(nil), []string{"FAREGATE_REDIS_URL is not set"}, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out bytes.Buffer
			err := runUsage(context.Background(), c.args, c.env, &out)
			got := out.String()
			if c.err {
				if err == nil {
					t.Fatalf("runUsage(%v) succeeded:\n%s", c.args, got)
				}
				got = err.Error()
			} else if err != nil {
				t.Fatalf("runUsage(%v) = %v", c.args, err)
			}
			for _, w := range c.want {
				if !strings.Contains(got, w) {
					t.Errorf("output lacks %q:\n%s", w, got)
				}
			}
		})
	}
}

// TestUsageScopes: `faregate usage -site`, `-principal P` and `-task T`
// read a scope's settled, outstanding, leased and overage tokens and money
// from its counters, in each format, without the operator knowing where
// the keys live: here a leased day (the site's part of the calls held in a
// replica's block, reported by its Close) with an open reservation.
func TestUsageScopes(t *testing.T) {
	be := redistest.Mini(t)
	ctx := context.Background()
	now := time.Now().UTC()
	day := now.Format(time.DateOnly)
	rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
		Steps: []task.Step{}, Warnings: []string{}}, Principal: "v_usage", Tier: "public", Day: day}
	if err := taskstore.New(be.Client).Create(ctx, rec); err != nil {
		t.Fatal(err)
	}
	b := budget.New(be.Client, budget.Options{Prices: budget.Prices{"m": {InputMicroPerMTok: 1_000_000, OutputMicroPerMTok: 2_000_000}},
		Lease: budget.LeaseOptions{Calls: 64}})
	req := budget.Request{Day: day, Principal: rec.Principal, Task: rec.ID, Model: "m", PromptTokens: 100, MaxTokens: 100}
	for _, used := range []int64{150, 250} { // the second past its hold of 200
		r, err := b.Reserve(ctx, req)
		if err == nil {
			_, err = b.Settle(ctx, r, 100, used-100)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.Reserve(ctx, req); err != nil { // open: 200 tokens, 300 micro-units held
		t.Fatal(err)
	}
	env := envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL})
	run := func(args ...string) string {
		t.Helper()
		var out bytes.Buffer
		if err := runUsage(ctx, args, env, &out); err != nil {
			t.Fatalf("usage %v: %v", args, err)
		}
		return out.String()
	}
	// 400 tokens settled (50 over), 200 held; money 100×1 + 50×2 = 200 and
	// 100 + 150×2 = 400 micro-units settled (100 over), 300 held.
	want := `{"scope":"task","name":"` + rec.ID + `","day":"` + day + `","tokens":{"settled":400,"outstanding":200,"leased":0,"overage":50},` +
		`"money_micro":{"settled":600,"outstanding":300,"leased":0,"overage":100},"open_reservations":0,"live_leases":0,"layout":2}`
	if got := strings.TrimSpace(run("-task", rec.ID, "-format", "json")); got != want {
		t.Fatalf("-task json:\n%s\nwant\n%s", got, want)
	}
	p := run("-principal", rec.Principal)
	for _, w := range []string{"principal " + rec.Principal + " " + day + "\nUNIT    SETTLED   OUTSTANDING  LEASED    OVERAGE\n",
		"tokens  400       200          0         50", "money   0.000600  0.000300     0.000000  0.000100", "open reservations 1"} {
		if !strings.Contains(p, w) {
			t.Errorf("-principal table lacks %q:\n%s", w, p)
		}
	}
	// The site's part is in the replica's block: outstanding, all of it
	// leased, nothing settled until the replica reports. (The site's money
	// has no cap here: it is counted, never held.)
	s := run("-site", "-format", "csv")
	if !strings.HasPrefix(s, "day,scope,name,unit,settled,outstanding,leased,overage\n"+day+",site,,tokens,0,12800,12800,0\n") ||
		strings.Count(s, "\n") != 3 {
		t.Fatalf("-site csv:\n%s", s)
	}
	if err := b.Close(ctx); err != nil {
		t.Fatal(err)
	}
	j := run("-site", "-format", "json")
	if !strings.Contains(j, `"tokens":{"settled":400,"outstanding":200,"leased":200,"overage":0}`) ||
		!strings.Contains(j, `"money_micro":{"settled":600,"outstanding":0,"leased":0,"overage":0}`) || !strings.Contains(j, `"live_leases":1`) {
		t.Fatalf("-site json after the replica reported:\n%s", j)
	}
}
