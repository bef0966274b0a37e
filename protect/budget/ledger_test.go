package budget

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
)

func testLedger(t *testing.T, rdb *redis.Client) {
	ctx := context.Background()
	if err := rdb.FlushDB(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	clk := newClock(start)
	l := NewLedger(rdb, clk.Now)
	entries := []Entry{
		{Task: "t_1", Model: "gpt-x", PromptTokens: 100, CompletionTokens: 50, Reserved: 400, LatencyMS: 900, Outcome: OutcomeOK},
		{Task: "t_1", Model: "gpt-x", PromptTokens: 200, CompletionTokens: 0, Reserved: 500, LatencyMS: 30000, Outcome: "timeout"},
		{Task: "t_2", Model: "alpha", PromptTokens: 10, CompletionTokens: 5, Reserved: 100, LatencyMS: 40, Outcome: OutcomeOK},
	}
	for _, e := range entries {
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
	if len(msgs) != 3 || msgs[1].Values["outcome"] != "timeout" || msgs[1].Values["latency_ms"] != "30000" || msgs[0].Values["task"] != "t_1" {
		t.Fatalf("stream = %v", msgs)
	}

	got, err := l.Totals(ctx, day)
	if err != nil {
		t.Fatal(err)
	}
	want := []ModelTotal{
		{Model: "alpha", Calls: 1, PromptTokens: 10, CompletionTokens: 5, Reserved: 100},
		{Model: "gpt-x", Calls: 2, PromptTokens: 300, CompletionTokens: 50, Reserved: 900, Errors: 1},
	}
	if len(got) != len(want) || got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("totals = %+v; want %+v", got, want)
	}

	var buf bytes.Buffer
	if err := WriteTable(&buf, day, got); err != nil {
		t.Fatal(err)
	}
	wantTable := strings.Join([]string{
		"MODEL               CALLS  ERRORS  PROMPT  COMPLETION  TOTAL  RESERVED",
		"alpha               1      0       10      5           15     100",
		"gpt-x               2      1       300     50          350    900",
		"total (2026-08-31)  3      1       310     55          365    1000",
		"",
	}, "\n")
	if buf.String() != wantTable {
		t.Fatalf("table:\n%s\nwant:\n%s", buf.String(), wantTable)
	}

	// Tokens by model and kind, counted as they are appended.
	if v := testutil.ToFloat64(l.tokens.WithLabelValues("gpt-x", "prompt")); v != 307 {
		t.Errorf("prompt tokens gpt-x = %v; want 307", v)
	}
	if v := testutil.ToFloat64(l.tokens.WithLabelValues("alpha", "completion")); v != 5 {
		t.Errorf("completion tokens alpha = %v; want 5", v)
	}

	empty, err := l.Totals(ctx, "2026-01-01")
	if err != nil || len(empty) != 0 {
		t.Fatalf("totals of an empty day = %v, %v", empty, err)
	}
	buf.Reset()
	if err := WriteTable(&buf, "2026-01-01", empty); err != nil || buf.String() != "no model calls recorded on 2026-01-01\n" {
		t.Fatalf("empty table = %q, %v", buf.String(), err)
	}

	// A foreign entry is reported, not silently counted as zero.
	rdb.XAdd(ctx, &redis.XAddArgs{Stream: UsageKey("2026-01-02"), Values: []any{"model", "m", "prompt_tokens", "many"}})
	if _, err := l.Totals(ctx, "2026-01-02"); !errors.Is(err, ErrCorruptLedger) {
		t.Fatalf("totals of a corrupt stream = %v; want ErrCorruptLedger", err)
	}
}

// testLedgerPaging sums more entries than one XRANGE page holds.
func testLedgerPaging(t *testing.T, rdb *redis.Client) {
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
				"task", "t", "model", "m", "prompt_tokens", 2, "completion_tokens", 1,
				"reserved", 3, "latency_ms", 1, "outcome", OutcomeOK}})
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Append(ctx, Entry{Task: "t", Model: "m", PromptTokens: 2, CompletionTokens: 1, Reserved: 3, Outcome: OutcomeOK}); err != nil {
		t.Fatal(err)
	}
	got, err := l.Totals(ctx, day)
	if err != nil {
		t.Fatal(err)
	}
	want := ModelTotal{Model: "m", Calls: n + 1, PromptTokens: 2 * (n + 1), CompletionTokens: n + 1, Reserved: 3 * (n + 1)}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("totals = %+v; want %+v", got, want)
	}
}

func TestLedgerUnavailable(t *testing.T) {
	l := NewLedger(deadClient(t), nil)
	if err := l.Append(context.Background(), Entry{Model: "m", PromptTokens: 3, Outcome: OutcomeOK}); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("append = %v; want ErrUnavailable", err)
	}
	// The tokens were spent even though the ledger could not record them.
	if v := testutil.ToFloat64(l.tokens.WithLabelValues("m", "prompt")); v != 3 {
		t.Fatalf("prompt tokens = %v; want 3", v)
	}
	if _, err := l.Totals(context.Background(), day); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("totals = %v; want ErrUnavailable", err)
	}
}
