package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/alert"
	"faregate/protect/budget"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// billingDay is the day the ledger tests write and export.
const billingDay = "2026-08-31"

// billingWriter is a ledger writing to billingDay that keeps 1,000
// entries once exported (the cap the tests give a day).
func billingWriter(t *testing.T, rdb redis.Cmdable) *budget.Ledger {
	t.Helper()
	at := time.Date(2026, 8, 31, 9, 0, 0, 0, time.UTC)
	l := budget.OpenLedger(rdb, budget.LedgerOptions{Now: func() time.Time { return at }, Keep: 1000})
	// The export groups registered so far (a running server reads them
	// every 30 s).
	if err := l.Refresh(context.Background()); err != nil {
		t.Fatal(err)
	}
	return l
}

// appendBilling appends n entries (request ids req-<from>…) to l's day.
func appendBilling(t *testing.T, l *budget.Ledger, from, n int) {
	t.Helper()
	for i := from; i < from+n; i++ {
		e := budget.Entry{Task: "t_1", Model: "gpt-4o-mini", Principal: fmt.Sprintf("v_%d", i%7), Tier: "public",
			RequestID: fmt.Sprintf("req-%d", i), PromptTokens: 100, CompletionTokens: 20, Reserved: 300, CostMicro: 27,
			Outcome: budget.OutcomeOK, Status: 200}
		if err := l.Append(context.Background(), e); err != nil {
			t.Fatal(err)
		}
	}
}

// exportLines parses JSON Lines output.
func exportLines(t *testing.T, out []byte) []budget.Line {
	t.Helper()
	var lines []budget.Line
	for raw := range bytes.Lines(out) {
		var l budget.Line
		if err := json.Unmarshal(raw, &l); err != nil {
			t.Fatalf("line %q: %v", raw, err)
		}
		lines = append(lines, l)
	}
	return lines
}

// runExport runs `faregate ledger export args…` in process.
func runExport(t *testing.T, env func(string) string, args ...string) []budget.Line {
	t.Helper()
	var out bytes.Buffer
	if err := run(context.Background(), append([]string{"faregate", "ledger", "export"}, args...), env, &out); err != nil {
		t.Fatalf("ledger export %v: %v\n%s", args, err, out.String())
	}
	return exportLines(t, out.Bytes())
}

// groupState is the export group's pending count and whether it has read
// the stream to its end.
func groupState(t *testing.T, rdb *redis.Client) (pending int64, caughtUp bool) {
	t.Helper()
	ctx := context.Background()
	key := budget.UsageKey(billingDay)
	gs, err := rdb.XInfoGroups(ctx, key).Result()
	if err != nil || len(gs) != 1 {
		t.Fatalf("export groups %+v, %v", gs, err)
	}
	last, err := rdb.XRevRangeN(ctx, key, "+", "-", 1).Result()
	if err != nil || len(last) != 1 {
		t.Fatalf("last entry: %v", err)
	}
	return gs[0].Pending, gs[0].LastDeliveredID == last[0].ID
}

// TestLedgerExportCommand (#30 item 5): with an export group, 1,500
// entries of a day that keeps 1,000 are not trimmed before the export;
// `faregate ledger export` writes all 1,500 once, acknowledges them, and
// trimming resumes; a second export writes nothing.
func TestLedgerExportCommand(t *testing.T) {
	be := redistest.Mini(t)
	env := envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL})
	// The first export registers the group "billing": a new day's stream
	// has it from its first entry on.
	if lines := runExport(t, env, "-day", billingDay); len(lines) != 0 {
		t.Fatalf("an empty day exported %d lines", len(lines))
	}
	appendBilling(t, billingWriter(t, be.Client), 0, 1500)
	ctx := context.Background()
	key := budget.UsageKey(billingDay)
	if n := be.Client.XLen(ctx, key).Val(); n != 1500 {
		t.Fatalf("before the export the day holds %d entries; want all 1500", n)
	}
	lines := runExport(t, env, "-day", billingDay)
	seen := map[string]bool{}
	for i, l := range lines {
		if seen[l.LedgerID] || l.RequestID != fmt.Sprintf("req-%d", i) {
			t.Fatalf("line %d: %+v (repeated: %v)", i, l, seen[l.LedgerID])
		}
		seen[l.LedgerID] = true
	}
	if len(lines) != 1500 {
		t.Fatalf("%d lines, want 1500", len(lines))
	}
	l := lines[0]
	if !strings.HasPrefix(l.LedgerID, billingDay+"/") || l.Day != billingDay || l.Principal != "v_0" || l.Tier != "public" ||
		l.Model != "gpt-4o-mini" || l.InputTokens != 100 || l.OutputTokens != 20 || l.CostMicro != 27 || l.Outcome != "ok" ||
		l.Status != 200 || l.Time.IsZero() {
		t.Fatalf("first line %+v", l)
	}
	if pending, caughtUp := groupState(t, be.Client); pending != 0 || !caughtUp {
		t.Fatalf("after the export: %d pending, read to the end %v; want everything acknowledged", pending, caughtUp)
	}
	if n := be.Client.XLen(ctx, key).Val(); n > 1000 {
		t.Fatalf("after the export the day holds %d entries; trimming to 1000 did not resume", n)
	}
	if again := runExport(t, env, "-day", billingDay); len(again) != 0 {
		t.Fatalf("a second export wrote %d lines", len(again))
	}
}

// TestUsageTrimmedWithoutGroup (#30 item 5): without an export group the
// day is trimmed as before, and `faregate usage` says how many entries
// were trimmed and reports the counters' totals, by model and by
// principal.
func TestUsageTrimmedWithoutGroup(t *testing.T) {
	be := redistest.Mini(t)
	appendBilling(t, billingWriter(t, be.Client), 0, 1500)
	kept := be.Client.XLen(context.Background(), budget.UsageKey(billingDay)).Val()
	if kept >= 1500 {
		t.Fatalf("nothing was trimmed (%d entries)", kept)
	}
	env := envOf(map[string]string{"FAREGATE_REDIS_URL": be.URL})
	for _, by := range []string{"model", "principal"} {
		var out bytes.Buffer
		if err := runUsage(context.Background(), []string{"-day", billingDay, "-by", by}, env, &out); err != nil {
			t.Fatal(err)
		}
		got := out.String()
		note := fmt.Sprintf("%d entries trimmed; totals from the counters", 1500-kept)
		total := "total (2026-08-31)  1500   0       0    0          150000  30000       180000  450000    0.040500"
		if !strings.HasPrefix(got, note) || !strings.Contains(got, total) {
			t.Errorf("by %s:\n%s\nwant the line %q and the total %q", by, got, note, total)
		}
		if by == "principal" && !strings.Contains(got, "\n"+budget.RestKey+" ") {
			t.Errorf("by principal: no %s row:\n%s", budget.RestKey, got)
		}
	}
}

// childEnv is the environment of a faregate child: the test's process
// without any FAREGATE_ variable, then env.
func childEnv(env map[string]string) []string {
	var out []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FAREGATE_") {
			out = append(out, kv)
		}
	}
	for k, v := range env {
		out = append(out, k+"="+v)
	}
	return out
}

// TestLedgerExportKilled (#30 item 5): an export killed with SIGKILL half
// way (a real child process) resumes under its name without losing an
// entry. What it wrote and had not acknowledged when it died (the one
// batch in flight, at most 200 entries) is written again with the same
// ledger_id and the same content, which is how a consumer drops it: the
// export is at least once; a pipe cannot tell the exporter what its
// reader got.
func TestLedgerExportKilled(t *testing.T) {
	redistest.Require(t)
	bin := buildFaregate(t, t.TempDir())
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	env := map[string]string{"FAREGATE_REDIS_URL": rs.URL()}
	runExport(t, envOf(env), "-day", billingDay)
	appendBilling(t, billingWriter(t, rdb), 0, 1500)

	cmd := exec.Command(bin, "ledger", "export", "-day", billingDay)
	cmd.Env = childEnv(env)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	rd := bufio.NewReader(stdout)
	var first bytes.Buffer
	n := 0
	for ; n < 750; n++ {
		line, err := rd.ReadBytes('\n')
		if err != nil {
			t.Fatalf("the export wrote %d lines before it ended: %v %s", n, err, stderr.String())
		}
		first.Write(line)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	// What it wrote before it died is still in the pipe: the reader gets
	// it, up to the last whole line (a write cut by the kill may leave a
	// part of one, which a reader of JSON Lines drops).
	rest, _ := io.ReadAll(rd)
	first.Write(rest[:bytes.LastIndexByte(rest, '\n')+1])
	_ = cmd.Wait()

	again := exec.Command(bin, "ledger", "export", "-day", billingDay)
	again.Env = childEnv(env)
	second, err := again.Output()
	if err != nil {
		t.Fatalf("the second export: %v", err)
	}
	a, b := exportLines(t, first.Bytes()), exportLines(t, second)
	byID := map[string]budget.Line{}
	repeats := 0
	for _, l := range append(a, b...) {
		if prev, ok := byID[l.LedgerID]; ok {
			if prev != l {
				t.Fatalf("%s exported twice with different content: %+v and %+v", l.LedgerID, prev, l)
			}
			repeats++
		}
		byID[l.LedgerID] = l
	}
	if len(byID) != 1500 {
		t.Fatalf("%d distinct entries exported (%d before the kill, %d after); want all 1500", len(byID), len(a), len(b))
	}
	if repeats > budget.DefaultExportBatch {
		t.Fatalf("%d entries exported twice; want at most the one batch in flight (%d)", repeats, budget.DefaultExportBatch)
	}
	if pending, caughtUp := groupState(t, rdb); pending != 0 || !caughtUp {
		t.Fatalf("after the second export: %d pending, read to the end %v", pending, caughtUp)
	}
	t.Logf("killed after %d lines read; %d written before the kill, %d after, %d written twice (same ledger_id and content)",
		n, len(a), len(b), repeats)
}

// billingReceiver is a billing webhook that answers 500 to its first
// failures POSTs, then 200, keeping what it accepted.
type billingReceiver struct {
	*httptest.Server
	secret string

	mu       sync.Mutex
	posts    int
	failures int
	accepted []budget.Line
	unsigned int
}

func newBillingReceiver(t *testing.T, secret string, failures int) *billingReceiver {
	br := &billingReceiver{secret: secret, failures: failures}
	br.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mac := hmac.New(sha256.New, []byte(secret))
		mac.Write(body)
		br.mu.Lock()
		defer br.mu.Unlock()
		br.posts++
		if !hmac.Equal([]byte(r.Header.Get("X-Faregate-Signature")), []byte("sha256="+hex.EncodeToString(mac.Sum(nil)))) {
			br.unsigned++
		}
		if br.posts <= br.failures {
			http.Error(w, "down", http.StatusInternalServerError)
			return
		}
		var b struct{ Entries []budget.Line }
		if json.Unmarshal(body, &b) != nil || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "bad batch", http.StatusBadRequest)
			return
		}
		br.accepted = append(br.accepted, b.Entries...)
	}))
	t.Cleanup(br.Close)
	return br
}

func (br *billingReceiver) seen() (posts int, accepted []budget.Line, unsigned int) {
	br.mu.Lock()
	defer br.mu.Unlock()
	return br.posts, append([]budget.Line(nil), br.accepted...), br.unsigned
}

// TestBillingWebhook (#30 item 5): with FAREGATE_BILLING_URL the server
// exports the ledger in the background: the receiver fails twice, the
// batch is posted again (signed with FAREGATE_BILLING_SECRET) and
// acknowledged once it is accepted; every model call of the tasks arrives
// once.
func TestBillingWebhook(t *testing.T) {
	be := redistest.Mini(t)
	const secret = "billing-secret-0123456789"
	rcv := newBillingReceiver(t, secret, 2)
	s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_BILLING_URL": rcv.URL, "FAREGATE_BILLING_SECRET": secret}))
	for _, dest := range []string{"Lisbon", "Porto"} {
		r := do(t, "POST", s.URL+"/api/tasks", taskBody(dest), nil)
		if r.Status != 202 {
			t.Fatalf("create: %d %s", r.Status, r.Raw)
		}
		if got, ok := pollTask(t, s.URL, r.Body["id"].(string), 30*time.Second, statusIs("succeeded")); !ok {
			t.Fatalf("task: %v", got)
		}
	}
	ctx := context.Background()
	// The calls' entries, in whichever of the day's streams they are
	// (those of the principals' buckets); the records of what direct
	// reservations charged the day's scopes are no lines of the feed.
	streams, err := budget.NewLedger(be.Client, nil).Streams(ctx, utcToday())
	if err != nil {
		t.Fatal(err)
	}
	// entries are the calls' ledger ids, and their request ids.
	var entries [][2]string
	for _, key := range streams {
		msgs, err := be.Client.XRange(ctx, key, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			if _, record := m.Values["kind"]; !record {
				entries = append(entries, [2]string{budget.LedgerID(key, m.ID), fmt.Sprint(m.Values["request_id"])})
			}
		}
	}
	if len(entries) < 2 {
		t.Fatalf("ledger: %d entries", len(entries))
	}
	clocktest.Eventually(t, 20*time.Second, "every entry accepted by the receiver", func() bool {
		_, accepted, _ := rcv.seen()
		return len(accepted) >= len(entries)
	})
	posts, accepted, unsigned := rcv.seen()
	ids := map[string]bool{}
	for _, l := range accepted {
		ids[l.LedgerID] = true
	}
	for _, e := range entries {
		if !ids[e[0]] {
			t.Errorf("entry %s (%s) never accepted", e[0], e[1])
		}
	}
	if len(accepted) != len(entries) || posts < 3 || unsigned != 0 {
		t.Fatalf("%d entries accepted of %d, in %d posts, %d unsigned; want each once, after two failures, all signed",
			len(accepted), len(entries), posts, unsigned)
	}
	clocktest.Eventually(t, 10*time.Second, "the accepted batches acknowledged", func() bool {
		for _, key := range streams {
			gs, err := be.Client.XInfoGroups(ctx, key).Result()
			if err != nil || len(gs) != 1 || gs[0].Pending != 0 {
				return false
			}
		}
		return true
	})
}

// TestLedgerFollowAcrossMidnight: a following export goes on past
// midnight: the new day's entries are exported, and so are entries that
// settle to the day before after it (a task admitted before midnight).
func TestLedgerFollowAcrossMidnight(t *testing.T) {
	be := redistest.Mini(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	now := time.Date(2026, 8, 31, 23, 59, 0, 0, time.UTC)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	x, err := budget.NewLedger(be.Client, nil).Exporter(ctx, budget.ExportOptions{Consumer: "follow"})
	if err != nil {
		t.Fatal(err)
	}
	var got []budget.Line
	write := func(ls []budget.Line) error {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, ls...)
		return nil
	}
	count := func() int { mu.Lock(); defer mu.Unlock(); return len(got) }
	done := make(chan error, 1)
	go func() {
		done <- followLedger(ctx, x, billingDay, 5*time.Millisecond, clock, write, func(error) bool { return true })
	}()
	writer := budget.OpenLedger(be.Client, budget.LedgerOptions{Now: clock})
	late := budget.OpenLedger(be.Client, budget.LedgerOptions{Now: func() time.Time { return time.Date(2026, 8, 31, 23, 0, 0, 0, time.UTC) }})
	for _, l := range []*budget.Ledger{writer, late} {
		if err := l.Refresh(ctx); err != nil {
			t.Fatal(err)
		}
	}
	appendBilling(t, writer, 0, 3)
	clocktest.Eventually(t, 10*time.Second, "the day's entries exported", func() bool { return count() == 3 })
	mu.Lock()
	now = time.Date(2026, 9, 1, 0, 0, 1, 0, time.UTC)
	mu.Unlock()
	appendBilling(t, writer, 3, 2)
	appendBilling(t, late, 5, 1)
	clocktest.Eventually(t, 10*time.Second, "the next day's and the late entry exported", func() bool { return count() == 6 })
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("follow ended with %v", err)
	}
	days := map[string]int{}
	for _, l := range got {
		days[l.Day]++
	}
	if days["2026-08-31"] != 4 || days["2026-09-01"] != 2 {
		t.Fatalf("lines by day %v; want 4 on the 31st (one late) and 2 on the 1st", days)
	}
}

// TestLedgerAlerts: the ledger's events become the operator's alerts:
// ledger_backlog once a day at 80%, ledger_lost with what was dropped.
func TestLedgerAlerts(t *testing.T) {
	var got []alert.Alert
	watch := ledgerAlerts(func(a alert.Alert) { got = append(got, a) })
	watch(budget.LedgerEvent{Day: billingDay, Unexported: 800, MaxEntries: 1000, Backlog: true})
	watch(budget.LedgerEvent{Day: billingDay, Unexported: 1000, MaxEntries: 1000, Lost: 3})
	if len(got) != 2 || got[0].Event != alert.LedgerBacklog || got[0].Window != 24*time.Hour || got[0].Scope != "ledger/"+billingDay ||
		got[1].Event != alert.LedgerLost || got[1].Severity != alert.Critical || got[1].Details["lost"] != int64(3) {
		t.Fatalf("alerts %+v", got)
	}
}
