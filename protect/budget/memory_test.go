package budget

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// TestLedgerMemory measures what a day's ledger costs in Redis, for the
// manual: entries written by real settles (a visitor's 64-hex principal, a
// task and request id as faregate makes them) on a real redis-server, the
// stream's and its counters' MEMORY USAGE divided by the entries. It runs
// only when asked, as it takes a while:
//
//	FAREGATE_LEDGER_MEMORY=1 go test -run TestLedgerMemory -v ./protect/budget
func TestLedgerMemory(t *testing.T) {
	if os.Getenv("FAREGATE_LEDGER_MEMORY") == "" {
		t.Skip("set FAREGATE_LEDGER_MEMORY=1 to measure")
	}
	rdb := redistest.Private(t).Client
	ctx := context.Background()
	clk := newClock(start)
	l := OpenLedger(rdb, LedgerOptions{Now: clk.Now})
	b := New(rdb, Options{Now: clk.Now, Ledger: l, Limits: Limits{Site: 1 << 50, Principal: 1 << 50, Task: 1 << 50}})
	hexID := func(n int) string {
		p := make([]byte, n)
		_, _ = rand.Read(p)
		return hex.EncodeToString(p)
	}
	const n = 20000
	for _, grouped := range []bool{false, true} {
		if err := rdb.FlushDB(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if grouped {
			if _, err := l.Exporter(ctx, ExportOptions{Consumer: "m"}); err != nil {
				t.Fatal(err)
			}
		}
		principals := make([]string, 50)
		for i := range principals {
			principals[i] = "v_" + hexID(32)
		}
		for i := range n {
			task := "t_" + hexID(16)
			r, err := b.Reserve(ctx, Request{Day: day, Principal: principals[i%len(principals)], Task: task, Model: "gpt-4o-mini",
				PromptTokens: 1200, MaxTokens: 1024})
			if err != nil {
				t.Fatal(err)
			}
			e := Entry{Task: task, Model: "gpt-4o-mini", Principal: r.Principal, Tier: "public", RequestID: hexID(12),
				LatencyMS: 1500 + int64(i%900), Outcome: OutcomeOK, Status: 200}
			if _, err := b.SettleCall(ctx, r, Call{PromptTokens: 1100 + int64(i%100), CompletionTokens: 300 + int64(i%500), Ledger: &e}); err != nil {
				t.Fatal(err)
			}
		}
		// The calls' entries are in their principals' buckets' streams;
		// the day's own holds a record of each direct reservation's charge
		// (leasing is off here).
		streams, err := l.Streams(ctx, day)
		if err != nil {
			t.Fatal(err)
		}
		var calls, records, sums int64
		for _, s := range streams {
			m, _ := rdb.MemoryUsage(ctx, s, 0).Result()
			c, _ := rdb.MemoryUsage(ctx, sumsKey(s), 0).Result()
			sums += c
			if s == UsageKey(day) {
				records += m
			} else {
				calls += m
			}
		}
		t.Logf("export group %v: %d entries in %d streams: %d bytes (%.0f per entry), the day's %d records %d bytes (%.0f each), counters %d bytes; 1,000,000 entries ≈ %.0f MB",
			grouped, n, len(streams)-1, calls, float64(calls)/n, n, records, float64(records)/n, sums, float64(calls)/n)
	}
}

// BenchmarkSettleLedger is one reserve and settle on a real redis-server
// without a ledger entry (the baseline), with one, and with one for an
// export group: what the ledger adds to a model call's scripts. Beside
// the wall time (noisy on a shared machine) it reports redis-µs/op, the
// server's own time in the scripts (INFO commandstats).
//
//	go test -run '^$' -bench SettleLedger -benchtime 2000x ./protect/budget
func BenchmarkSettleLedger(b *testing.B) {
	rdb := redistest.Private(b).Client
	ctx := context.Background()
	for _, mode := range []string{"no-entry", "entry", "entry+group"} {
		b.Run(mode, func(b *testing.B) {
			if err := rdb.FlushDB(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			clk := newClock(start)
			l := OpenLedger(rdb, LedgerOptions{Now: clk.Now})
			if mode == "entry+group" {
				if _, err := l.Exporter(ctx, ExportOptions{Consumer: "bench"}); err != nil {
					b.Fatal(err)
				}
			}
			bud := New(rdb, Options{Now: clk.Now, Ledger: l, Limits: Limits{Site: 1 << 50, Principal: 1 << 50, Task: 1 << 50}})
			if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				r, err := bud.Reserve(ctx, Request{Day: day, Principal: "v_bench", Task: "t_bench", Model: "m", PromptTokens: 100, MaxTokens: 100})
				if err != nil {
					b.Fatal(err)
				}
				call := Call{PromptTokens: 90, CompletionTokens: 50}
				if mode != "no-entry" {
					call.Ledger = &Entry{Task: "t_bench", Model: "m", Principal: "v_bench", Tier: "public", RequestID: "req", Outcome: OutcomeOK, Status: 200}
				}
				if _, err := bud.SettleCall(ctx, r, call); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(scriptMicros(b, rdb)/float64(b.N), "redis-µs/op")
		})
	}
}

// scriptMicros is the time redis-server spent in scripts since the last
// CONFIG RESETSTAT, in microseconds.
func scriptMicros(b *testing.B, rdb *redis.Client) float64 {
	b.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		name, stats, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok || (name != "cmdstat_evalsha" && name != "cmdstat_eval") {
			continue
		}
		for _, kv := range strings.Split(stats, ",") {
			if v, ok := strings.CutPrefix(kv, "usec="); ok {
				n, _ := strconv.ParseFloat(v, 64)
				total += n
			}
		}
	}
	return total
}
