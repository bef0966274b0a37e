package budget

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// exportCase is one case of the export suite, on a fresh database.
type exportCase struct {
	name string
	run  func(t *testing.T, be redistest.Backend)
}

// TestExport runs the export suite on miniredis and on a real Redis.
func TestExport(t *testing.T) {
	cases := []exportCase{
		{"NothingUnexportedIsTrimmed", testExportKeepsUntilAcknowledged},
		{"WithoutAGroupTrimmingAndCounters", testExportNoGroup},
		{"PastTheCapOldestAreLost", testExportCap},
		{"AStoppedReaderResumes", testExportResume},
		{"AnotherReaderTakesOverIdleEntries", testExportClaim},
		{"SettleWritesForTheGroup", testExportSettle},
	}
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			for _, c := range cases {
				t.Run(c.name, func(t *testing.T) {
					if err := be.Client.FlushDB(context.Background()).Err(); err != nil {
						t.Fatal(err)
					}
					c.run(t, be)
				})
			}
		})
	}
}

// appendN appends n entries (principal p<i%3>, model m<i%2>, one in five
// cut) to the ledger's day.
func appendN(t *testing.T, l *Ledger, n int) {
	t.Helper()
	ctx := context.Background()
	for i := range n {
		e := Entry{Task: "t_1", Model: fmt.Sprintf("m%d", i%2), Principal: fmt.Sprintf("p%d", i%3), Tier: "public",
			RequestID: fmt.Sprintf("req-%d", i), PromptTokens: 10, CompletionTokens: 5, ReasoningTokens: 2, Reserved: 20,
			CostMicro: 3, Outcome: OutcomeOK, Status: 200}
		if i%5 == 0 {
			e.Outcome = codes.OutputTruncated
		}
		if err := l.Append(ctx, e); err != nil {
			t.Fatal(err)
		}
	}
}

// exportAll exports day with x and returns the lines written.
func exportAll(t *testing.T, x *Exporter) []Line {
	t.Helper()
	var got []Line
	n, err := x.Export(context.Background(), day, func(ls []Line) error {
		got = append(got, ls...)
		return nil
	})
	if err != nil || n != len(got) {
		t.Fatalf("export: %d, %v (%d lines written)", n, err, len(got))
	}
	return got
}

// streamState is a day's stream length, TTL and counters.
func streamState(t *testing.T, rdb *redis.Client) (length int64, ttl time.Duration, c DayCounters) {
	t.Helper()
	ctx := context.Background()
	length, err := rdb.XLen(ctx, UsageKey(day)).Result()
	if err != nil {
		t.Fatal(err)
	}
	ttl = rdb.TTL(ctx, UsageKey(day)).Val()
	c, err = NewLedger(rdb, nil).Counters(ctx, day)
	if err != nil {
		t.Fatal(err)
	}
	return length, ttl, c
}

// newExportLedger is a ledger keeping 1,000 entries (the cap as given),
// at the suite's fixed day.
func newExportLedger(rdb *redis.Client, maxEntries int64, watch func(LedgerEvent)) *Ledger {
	return OpenLedger(rdb, LedgerOptions{Now: newClock(start).Now, Keep: 1000, MaxEntries: maxEntries, Watch: watch})
}

// distinct checks that lines are n entries, each once, in the order they
// were appended (request ids req-<from>…).
func distinct(t *testing.T, lines []Line, n, from int) {
	t.Helper()
	seen := map[string]bool{}
	for i, l := range lines {
		if seen[l.LedgerID] {
			t.Fatalf("line %d repeats %s", i, l.LedgerID)
		}
		seen[l.LedgerID] = true
		if want := fmt.Sprintf("req-%d", from+i); l.RequestID != want {
			t.Fatalf("line %d is %s, want %s", i, l.RequestID, want)
		}
	}
	if len(lines) != n {
		t.Fatalf("%d lines, want %d", len(lines), n)
	}
}

// With an export group, 1,500 entries on a day that keeps 1,000: nothing
// is trimmed and nothing expires before the export; the export hands on
// all 1,500 once and acknowledges them; then trimming resumes and the
// stream expires again.
func testExportKeepsUntilAcknowledged(t *testing.T, be redistest.Backend) {
	ctx := context.Background()
	l := newExportLedger(be.Client, 0, nil)
	x, err := l.Exporter(ctx, ExportOptions{Consumer: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	appendN(t, l, 1500)
	if n, ttl, c := streamState(t, be.Client); n != 1500 || c.Trimmed != 0 || ttl != -1 {
		t.Fatalf("before the export: %d entries, %d trimmed, TTL %v; want 1500, 0, none", n, c.Trimmed, ttl)
	}
	firstID := mustFirstID(t, be.Client)
	lines := exportAll(t, x)
	distinct(t, lines, 1500, 0)
	first := lines[0]
	if first.LedgerID != "2026-08-31/"+firstID || first.Day != day || first.Principal != "p0" || first.Tier != "public" ||
		first.Model != "m0" || first.InputTokens != 10 || first.OutputTokens != 5 || first.ReasoningTokens != 2 || first.CostMicro != 3 ||
		first.Outcome != codes.OutputTruncated || first.Status != 200 || first.Time.IsZero() || first.Task != "t_1" {
		t.Fatalf("first line %+v", first)
	}
	n, ttl, c := streamState(t, be.Client)
	if n < 1000 || n >= 1500 || c.Trimmed != 1500-n || ttl <= 0 {
		t.Fatalf("after the export: %d entries, %d trimmed, TTL %v; want about 1000 kept, the rest trimmed, an expiry", n, c.Trimmed, ttl)
	}
	if again := exportAll(t, x); len(again) != 0 {
		t.Fatalf("a second export handed on %d lines", len(again))
	}
	appendN(t, l, 1)
	if next := exportAll(t, x); len(next) != 1 {
		t.Fatalf("the next entry: %d lines", len(next))
	}
	if c.Appended != 1500 || c.Lost != 0 {
		t.Fatalf("counters %+v", c)
	}
}

func mustFirstID(t *testing.T, rdb *redis.Client) string {
	t.Helper()
	ms, err := rdb.XRangeN(context.Background(), UsageKey(day), "-", "+", 1).Result()
	if err != nil || len(ms) == 0 {
		t.Fatalf("first entry: %v", err)
	}
	return ms[0].ID
}

// Without an export group, trimming stays as it was, and the counters
// keep the day's totals: usage by model reads them, usage by principal
// adds a row for what is no longer in the ledger, and says how many
// entries were trimmed.
func testExportNoGroup(t *testing.T, be redistest.Backend) {
	ctx := context.Background()
	l := newExportLedger(be.Client, 0, nil)
	appendN(t, l, 1500)
	n, ttl, c := streamState(t, be.Client)
	if n < 1000 || n >= 1500 || c.Trimmed != 1500-n || ttl <= 0 {
		t.Fatalf("%d entries, %d trimmed, TTL %v; want about 1000, the rest trimmed, an expiry", n, c.Trimmed, ttl)
	}
	want := Total{Calls: 1500, Errors: 0, Cut: 300, PromptTokens: 15000, CompletionTokens: 7500, Reserved: 30000, CostMicro: 4500}
	for _, by := range []string{ByModel, ByPrincipal} {
		u, err := l.Usage(ctx, day, by)
		if err != nil {
			t.Fatal(err)
		}
		if got := sum(u.Rows); got != want || u.Trimmed != 1500-n {
			t.Fatalf("by %s: rows sum to %+v, %d trimmed; want %+v, %d", by, got, u.Trimmed, want, 1500-n)
		}
		if by == ByModel && (len(u.Rows) != 2 || u.Rows[0].Calls != 750) {
			t.Fatalf("by model: %+v", u.Rows)
		}
		if by == ByPrincipal && (len(u.Rows) != 4 || u.Rows[3].Key != RestKey || u.Rows[3].Calls != 1500-n) {
			t.Fatalf("by principal: %+v", u.Rows)
		}
	}
	// What the stream still holds sums as before.
	kept, err := l.Totals(ctx, day, ByModel)
	if err != nil || sum(kept).Calls != n {
		t.Fatalf("totals of the kept entries: %+v, %v", kept, err)
	}
}

// Past the cap, with the group not reading: the oldest unexported entries
// are dropped (never the write refused), counted lost, and said so once
// per write; the backlog is said once, at 80%.
func testExportCap(t *testing.T, be redistest.Backend) {
	ctx := context.Background()
	var mu sync.Mutex
	var events []LedgerEvent
	l := newExportLedger(be.Client, 1000, func(e LedgerEvent) {
		mu.Lock()
		events = append(events, e)
		mu.Unlock()
	})
	l.o.Keep = 100
	x, err := l.Exporter(ctx, ExportOptions{Consumer: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	appendN(t, l, 1500)
	n, _, c := streamState(t, be.Client)
	if n != 1000 || c.Lost != 500 || c.Trimmed != 0 {
		t.Fatalf("%d entries, %d lost, %d trimmed; want 1000, 500, 0", n, c.Lost, c.Trimmed)
	}
	var backlog, lost int64
	for _, e := range events {
		if e.Backlog {
			backlog++
			if e.Unexported < 800 || e.Unexported > 816 || e.Day != day || e.MaxEntries != 1000 {
				t.Errorf("backlog event %+v", e)
			}
		}
		lost += e.Lost
	}
	if backlog != 1 || lost != 500 {
		t.Fatalf("%d backlog events, %d lost in events; want 1 and 500", backlog, lost)
	}
	distinct(t, exportAll(t, x), 1000, 500)
	if n, _, _ := streamState(t, be.Client); n > 200 {
		t.Fatalf("%d entries kept after the export; want about 100", n)
	}
	u, err := l.Usage(ctx, day, ByModel)
	if err != nil || sum(u.Rows).Calls != 1500 || u.Lost != 500 {
		t.Fatalf("usage after loss: %+v, %v", u, err)
	}
}

// errStop is a writer that gives up (stdout closed, the receiver down).
var errStop = errors.New("writer stopped")

// A reader whose write failed in the middle resumes under its name
// without losing or repeating an entry: the batch it could not write is
// handed on again, the ones it wrote are not.
func testExportResume(t *testing.T, be redistest.Backend) {
	ctx := context.Background()
	l := newExportLedger(be.Client, 0, nil)
	x, err := l.Exporter(ctx, ExportOptions{Consumer: "c1", Batch: 100})
	if err != nil {
		t.Fatal(err)
	}
	appendN(t, l, 450)
	var got []Line
	batches := 0
	n, err := x.Export(ctx, day, func(ls []Line) error {
		if batches++; batches == 3 {
			return errStop
		}
		got = append(got, ls...)
		return nil
	})
	if !errors.Is(err, errStop) || n != 200 {
		t.Fatalf("first export: %d, %v; want 200 and the writer's error", n, err)
	}
	again, err := l.Exporter(ctx, ExportOptions{Consumer: "c1", Batch: 100})
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, exportAll(t, again)...)
	distinct(t, got, 450, 0)
}

// A reader that took entries and died leaves them to another after the
// idle time; the other hands them on once.
func testExportClaim(t *testing.T, be redistest.Backend) {
	ctx := context.Background()
	l := newExportLedger(be.Client, 0, nil)
	dead, err := l.Exporter(ctx, ExportOptions{Consumer: "dead", Batch: 100})
	if err != nil {
		t.Fatal(err)
	}
	appendN(t, l, 250)
	if _, err := dead.Export(ctx, day, func([]Line) error { return errStop }); !errors.Is(err, errStop) {
		t.Fatalf("dead reader: %v", err)
	}
	// Redis's own clock decides idleness: miniredis's is held still and
	// then moved past the idle time; a real server's is waited for, the
	// idle time long enough that a loaded machine's first read comes
	// before it (50 ms did not, under -race beside a busy loop).
	idle := 2 * time.Second
	if be.Mini != nil {
		be.Mini.SetTime(time.Now())
		idle = time.Minute
	}
	alive, err := l.Exporter(ctx, ExportOptions{Consumer: "alive", Batch: 100, ClaimIdle: idle})
	if err != nil {
		t.Fatal(err)
	}
	// Before the idle time the dead reader's batch stays its own.
	if got := exportAll(t, alive); len(got) != 150 {
		t.Fatalf("before the idle time: %d lines, want the 150 nobody had read", len(got))
	}
	if be.Mini != nil {
		be.Mini.SetTime(time.Now().Add(2 * idle))
	}
	var got []Line
	clocktest.Eventually(t, 15*time.Second, "the dead reader's batch taken over", func() bool {
		got = append(got, exportAll(t, alive)...)
		return len(got) >= 100
	})
	ids := make([]string, len(got))
	for i, l := range got {
		ids[i] = l.RequestID
	}
	if len(got) != 100 || !slices.Contains(ids, "req-0") || !slices.Contains(ids, "req-99") {
		t.Fatalf("after the idle time: %v", ids)
	}
}

// A settle writes its entry for the registered group: the stream is
// created with the group on it, so the entry is kept until exported.
func testExportSettle(t *testing.T, be redistest.Backend) {
	ctx := context.Background()
	clk := newClock(start)
	l := OpenLedger(be.Client, LedgerOptions{Now: clk.Now})
	if _, err := l.Exporter(ctx, ExportOptions{Consumer: "c1"}); err != nil {
		t.Fatal(err)
	}
	b := New(be.Client, Options{Now: clk.Now, Ledger: l, Limits: Limits{Site: 1 << 30, Principal: 1 << 30, Task: 1 << 30}})
	r, err := b.Reserve(ctx, Request{Day: day, Principal: "p_1", Task: "t_1", Model: "m", PromptTokens: 10, MaxTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	e := Entry{Task: "t_1", Model: "m", Principal: "p_1", Tier: "gold", RequestID: "req-s", Outcome: OutcomeOK, Status: 200,
		ReasoningTokens: 4, CacheReadTokens: 6}
	if _, err := b.SettleCall(ctx, r, Call{PromptTokens: 10, CompletionTokens: 8, Ledger: &e}); err != nil {
		t.Fatal(err)
	}
	// The entry went to the principal's stream, the direct charge's
	// record to the day's: both with the group.
	for _, s := range []string{StreamOf(day, "p_1"), UsageKey(day)} {
		groups, err := be.Client.XInfoGroups(ctx, s).Result()
		if err != nil || len(groups) != 1 || groups[0].Name != DefaultExportGroup {
			t.Fatalf("groups of %s: %+v, %v", s, groups, err)
		}
	}
	x, _ := l.Exporter(ctx, ExportOptions{Consumer: "c1"})
	got := exportAll(t, x)
	if len(got) != 1 || got[0].Tier != "gold" || got[0].ReasoningTokens != 4 || got[0].CacheReadInputTokens != 6 ||
		got[0].InputTokens != 10 || got[0].OutputTokens != 8 || got[0].Status != 200 {
		t.Fatalf("lines %+v", got)
	}
}
