package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"faregate/protect/budget"
	"faregate/protect/redistest"
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
			"MODEL               CALLS  ERRORS  ESTIMATED  PROMPT  COMPLETION  TOTAL  RESERVED  COST      OVERAGE  OVERAGE_COST",
			"gpt-4o              1      0       0          100     900         1000   600       0.009250  400      0.004000",
			"gpt-4o-mini         1      0       0          1000    500         1500   2000      0.000450  0        0.000000",
			"total (2026-08-31)  2      0       0          1100    1400        2500   2600      0.009700  400      0.004000",
		}, false},
		{"table by principal", []string{"-day", "2026-08-31", "-by", "principal"}, env, []string{
			"PRINCIPAL", "k_acme              1", "v_ab12              1",
		}, false},
		{"csv by principal", []string{"-day", "2026-08-31", "-by", "principal", "-format", "csv"}, env, []string{
			"day,principal,calls,errors,estimated_calls,prompt_tokens,completion_tokens,total_tokens,reserved_tokens,cost,overage_tokens,overage_cost",
			"2026-08-31,k_acme,1,0,0,1000,500,1500,2000,0.000450,0,0.000000",
			"2026-08-31,v_ab12,1,0,0,100,900,1000,600,0.009250,400,0.004000",
		}, false},
		{"empty day", []string{"-day", "2001-01-01"}, env, []string{"no model calls recorded on 2001-01-01"}, false},
		{"bad -by", []string{"-by", "task"}, env, []string{`-by "task": want model or principal`}, true},
		{"bad -format", []string{"-format", "json"}, env, []string{`-format "json": want table or csv`}, true},
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
