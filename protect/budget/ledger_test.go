package budget

import (
	"bytes"
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
)

// ledgerEntries are three calls of two principals on two models.
var ledgerEntries = []Entry{
	{Task: "t_1", Model: "gpt-x", Principal: keyA, RequestID: "req-1", PromptTokens: 100, CompletionTokens: 50, Reserved: 400,
		CostMicro: 1234567, LatencyMS: 900, Outcome: OutcomeOK},
	{Task: "t_1", Model: "gpt-x", Principal: keyA, RequestID: "req-1", PromptTokens: 200, CompletionTokens: 300, Reserved: 250,
		CostMicro: 2000000, OverageTokens: 250, OverageCostMicro: 1000000, LatencyMS: 30000, Outcome: "timeout", Estimated: true},
	{Task: "t_2", Model: "alpha", Principal: visA, RequestID: "req-2", PromptTokens: 10, CompletionTokens: 5, Reserved: 100,
		CostMicro: 1, LatencyMS: 40, Outcome: OutcomeOK},
}

func testLedger(t *testing.T, cf conf) {
	rdb := cf.rdb
	ctx := context.Background()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	clk := newClock(start)
	l := NewLedger(rdb, clk.Now)
	for _, e := range ledgerEntries {
		if err := l.Append(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
	// An entry after midnight belongs to the next day's stream.
	clk.Advance(12 * time.Hour)
	if err := l.Append(ctx, Entry{Task: "t_3", Model: "gpt-x", PromptTokens: 7, Outcome: OutcomeOK}); err != nil {
		t.Fatal(err)
	}

	key := UsageKey(day)
	if ttl := rdb.TTL(ctx, key).Val(); ttl <= 8*24*time.Hour-10*time.Second || ttl > 8*24*time.Hour {
		t.Errorf("TTL %s = %v; want 8 days", key, ttl)
	}
	msgs, _ := rdb.XRange(ctx, key, "-", "+").Result()
	if len(msgs) != 3 {
		t.Fatalf("stream = %v", msgs)
	}
	want := map[string]any{"task": "t_1", "model": "gpt-x", "principal": keyA, "tier": "", "request_id": "req-1", "prompt_tokens": "200",
		"completion_tokens": "300", "reasoning_tokens": "0", "cache_creation_input_tokens": "0", "cache_read_input_tokens": "0",
		"reserved": "250", "cost_micro": "2000000", "overage_tokens": "250",
		"overage_cost_micro": "1000000", "latency_ms": "30000", "outcome": "timeout", "status": "0", "estimated": "1",
		"usage_raw": "", "implausible": "0", "reservation": "", "seq": "2"}
	if !reflect.DeepEqual(msgs[1].Values, want) {
		t.Fatalf("entry = %v\nwant %v", msgs[1].Values, want)
	}

	byModel, err := l.Totals(ctx, day, ByModel)
	if err != nil {
		t.Fatal(err)
	}
	wantModel := []Total{
		{Key: "alpha", Calls: 1, PromptTokens: 10, CompletionTokens: 5, Reserved: 100, CostMicro: 1},
		{Key: "gpt-x", Calls: 2, Errors: 1, Estimated: 1, PromptTokens: 300, CompletionTokens: 350, Reserved: 650,
			CostMicro: 3234567, OverageTokens: 250, OverageCostMicro: 1000000},
	}
	if !reflect.DeepEqual(byModel, wantModel) {
		t.Fatalf("totals by model = %+v\nwant %+v", byModel, wantModel)
	}
	byPrincipal, err := l.Totals(ctx, day, ByPrincipal)
	if err != nil {
		t.Fatal(err)
	}
	wantPrincipal := []Total{
		{Key: keyA, Calls: 2, Errors: 1, Estimated: 1, PromptTokens: 300, CompletionTokens: 350, Reserved: 650,
			CostMicro: 3234567, OverageTokens: 250, OverageCostMicro: 1000000},
		{Key: visA, Calls: 1, PromptTokens: 10, CompletionTokens: 5, Reserved: 100, CostMicro: 1},
	}
	if !reflect.DeepEqual(byPrincipal, wantPrincipal) {
		t.Fatalf("totals by principal = %+v\nwant %+v", byPrincipal, wantPrincipal)
	}
	if _, err := l.Totals(ctx, day, "task"); !errors.Is(err, ErrInvalid) {
		t.Fatalf("totals by task = %v; want ErrInvalid", err)
	}

	var buf bytes.Buffer
	if err := WriteTable(&buf, day, ByModel, byModel); err != nil {
		t.Fatal(err)
	}
	wantTable := strings.Join([]string{
		"MODEL               CALLS  ERRORS  CUT  ESTIMATED  PROMPT  COMPLETION  TOTAL  RESERVED  COST      OVERAGE  OVERAGE_COST",
		"alpha               1      0       0    0          10      5           15     100       0.000001  0        0.000000",
		"gpt-x               2      1       0    1          300     350         650    650       3.234567  250      1.000000",
		"total (2026-08-31)  3      1       0    1          310     355         665    750       3.234568  250      1.000000",
		"",
	}, "\n")
	if buf.String() != wantTable {
		t.Fatalf("table:\n%s\nwant:\n%s", buf.String(), wantTable)
	}
	buf.Reset()
	if err := WriteCSV(&buf, day, ByPrincipal, byPrincipal); err != nil {
		t.Fatal(err)
	}
	wantCSV := strings.Join([]string{
		"day,principal,calls,errors,cut_calls,estimated_calls,prompt_tokens,completion_tokens,total_tokens,reserved_tokens,cost,overage_tokens,overage_cost",
		"2026-08-31,k_acme,2,1,0,1,300,350,650,650,3.234567,250,1.000000",
		"2026-08-31," + visA + ",1,0,0,0,10,5,15,100,0.000001,0,0.000000",
		"",
	}, "\n")
	if buf.String() != wantCSV {
		t.Fatalf("csv:\n%s\nwant:\n%s", buf.String(), wantCSV)
	}

	// Provider-reported tokens are kept apart from estimates.
	for _, c := range []struct {
		model, kind, source string
		want                float64
	}{
		{"gpt-x", "prompt", "provider", 107}, {"gpt-x", "prompt", "estimate", 200},
		{"gpt-x", "completion", "estimate", 300}, {"alpha", "completion", "provider", 5},
	} {
		if v := testutil.ToFloat64(l.tokens.WithLabelValues(c.model, c.kind, c.source)); v != c.want {
			t.Errorf("tokens{%s,%s,%s} = %v; want %v", c.model, c.kind, c.source, v, c.want)
		}
	}

	empty, err := l.Totals(ctx, "2026-01-01", ByModel)
	if err != nil || len(empty) != 0 {
		t.Fatalf("totals of an empty day = %v, %v", empty, err)
	}
	buf.Reset()
	if err := WriteTable(&buf, "2026-01-01", ByModel, empty); err != nil || buf.String() != "no model calls recorded on 2026-01-01\n" {
		t.Fatalf("empty table = %q, %v", buf.String(), err)
	}

	// An entry of the first ledger version (no principal, cost or
	// overage) still sums; its principal shows as "-".
	old := UsageKey("2026-01-03")
	rdb.XAdd(ctx, &redis.XAddArgs{Stream: old, Values: []any{"task", "t", "model", "m", "prompt_tokens", 2,
		"completion_tokens", 1, "reserved", 3, "latency_ms", 1, "outcome", OutcomeOK}})
	got, err := l.Totals(ctx, "2026-01-03", ByPrincipal)
	if err != nil || !reflect.DeepEqual(got, []Total{{Key: "", Calls: 1, PromptTokens: 2, CompletionTokens: 1, Reserved: 3}}) {
		t.Fatalf("totals of an old entry = %+v, %v", got, err)
	}
	buf.Reset()
	if err := WriteTable(&buf, "2026-01-03", ByPrincipal, got); err != nil || !strings.Contains(buf.String(), "\n-  ") {
		t.Fatalf("old entry table = %q, %v", buf.String(), err)
	}

	// A foreign entry is reported, not silently counted as zero.
	for _, vals := range [][]any{
		{"model", "m", "prompt_tokens", "many"},
		{"model", "m", "prompt_tokens", 1, "completion_tokens", 1, "reserved", 1, "cost_micro", "1.5"},
	} {
		bad := UsageKey("2026-01-02")
		rdb.Del(ctx, bad)
		rdb.XAdd(ctx, &redis.XAddArgs{Stream: bad, Values: vals})
		if _, err := l.Totals(ctx, "2026-01-02", ByModel); !errors.Is(err, ErrCorruptLedger) {
			t.Fatalf("totals of %v = %v; want ErrCorruptLedger", vals, err)
		}
	}
}

// testLedgerPaging sums more entries than one XRANGE page holds.
func testLedgerPaging(t *testing.T, cf conf) {
	rdb := cf.rdb
	ctx := context.Background()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	l := NewLedger(rdb, newClock(start).Now)
	const n = 2*ledgerPage + 1
	// Fill through one pipeline (same fields Append writes) to keep it fast.
	_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for range n {
			p.XAdd(ctx, &redis.XAddArgs{Stream: UsageKey(day), Values: []any{
				"task", "t", "model", "m", "principal", keyA, "request_id", "q", "prompt_tokens", 2, "completion_tokens", 1,
				"reserved", 3, "cost_micro", 5, "overage_tokens", 0, "overage_cost_micro", 0, "latency_ms", 1,
				"outcome", OutcomeOK, "estimated", 0}})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Append(ctx, Entry{Task: "t", Model: "m", Principal: keyA, PromptTokens: 2, CompletionTokens: 1, Reserved: 3, CostMicro: 5, Outcome: OutcomeOK}); err != nil {
		t.Fatal(err)
	}
	got, err := l.Totals(ctx, day, ByPrincipal)
	if err != nil {
		t.Fatal(err)
	}
	want := Total{Key: keyA, Calls: n + 1, PromptTokens: 2 * (n + 1), CompletionTokens: n + 1, Reserved: 3 * (n + 1), CostMicro: 5 * (n + 1)}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("totals = %+v; want %+v", got, want)
	}
}

// TestLedgerCutCalls: a call cut at its budget or as a loop answered
// what passed and is charged for it: it counts under CUT, not under
// ERRORS (both read 2 errors before).
func TestLedgerCutCalls(t *testing.T) {
	ctx := context.Background()
	l := NewLedger(redistest.Mini(t).Client, newClock(start).Now)
	for _, outcome := range []string{OutcomeOK, codes.OutputTruncated, codes.OutputLoop, "error", "timeout"} {
		if err := l.Append(ctx, Entry{Task: "t_1", Model: "m", Principal: keyA, PromptTokens: 1, Outcome: outcome}); err != nil {
			t.Fatal(err)
		}
	}
	got, err := l.Totals(ctx, day, ByModel)
	if err != nil {
		t.Fatal(err)
	}
	if want := []Total{{Key: "m", Calls: 5, Errors: 2, Cut: 2, PromptTokens: 5}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("totals = %+v\nwant %+v", got, want)
	}
	var buf bytes.Buffer
	if err := WriteTable(&buf, day, ByModel, got); err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(buf.String(), "\n"); !strings.HasPrefix(lines[1], "m                   5      2       2    0  ") {
		t.Fatalf("table:\n%s", buf.String())
	}
	buf.Reset()
	if err := WriteCSV(&buf, day, ByModel, got); err != nil || !strings.Contains(buf.String(), "\n"+day+",m,5,2,2,0,5,") {
		t.Fatalf("csv:\n%s (%v)", buf.String(), err)
	}
}

func TestLedgerUnavailable(t *testing.T) {
	l := NewLedger(deadClient(t), nil)
	if err := l.Append(context.Background(), Entry{Model: "m", PromptTokens: 3, Outcome: OutcomeOK}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append = %v; want ErrUnavailable", err)
	}
	// The tokens were spent even though the ledger could not record them.
	if v := testutil.ToFloat64(l.tokens.WithLabelValues("m", "prompt", "provider")); v != 3 {
		t.Fatalf("prompt tokens = %v; want 3", v)
	}
	if _, err := l.Totals(context.Background(), day, ByModel); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("totals = %v; want ErrUnavailable", err)
	}
}
