package alert

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// request is what the test receiver saw.
type request struct {
	header http.Header
	body   []byte
}

// receiver is an httptest webhook that records requests and answers with
// the statuses it is given in turn (the last one repeats).
type receiver struct {
	srv  *httptest.Server
	reqs chan request

	mu       sync.Mutex
	statuses []int
	headers  []http.Header
}

func newReceiver(t *testing.T, statuses ...int) *receiver {
	t.Helper()
	if len(statuses) == 0 {
		statuses = []int{http.StatusNoContent}
	}
	r := &receiver{reqs: make(chan request, 64), statuses: statuses}
	r.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		body, _ := io.ReadAll(req.Body)
		r.mu.Lock()
		status := r.statuses[0]
		if len(r.statuses) > 1 {
			r.statuses = r.statuses[1:]
		}
		var h http.Header
		if len(r.headers) > 0 {
			h, r.headers = r.headers[0], r.headers[1:]
		}
		r.mu.Unlock()
		for k, v := range h {
			w.Header()[k] = v
		}
		w.WriteHeader(status)
		r.reqs <- request{header: req.Header.Clone(), body: body}
	}))
	t.Cleanup(r.srv.Close)
	return r
}

// next waits for the next request.
func (r *receiver) next(t *testing.T) request {
	t.Helper()
	select {
	case q := <-r.reqs:
		return q
	case <-time.After(10 * time.Second):
		t.Fatal("no request reached the receiver")
		return request{}
	}
}

// none asserts that no further request arrives before the Notifier is
// closed (Close drains the queue, so anything pending is sent by then).
func (r *receiver) none(t *testing.T, n *Notifier) {
	t.Helper()
	n.Close()
	select {
	case q := <-r.reqs:
		t.Fatalf("unexpected request: %s", q.body)
	default:
	}
}

// logs collects log records.
type logs struct {
	mu  sync.Mutex
	rec []slog.Record
}

func (l *logs) Enabled(context.Context, slog.Level) bool { return true }
func (l *logs) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	l.rec = append(l.rec, r)
	l.mu.Unlock()
	return nil
}
func (l *logs) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logs) WithGroup(string) slog.Handler      { return l }

// messages returns the messages logged so far.
func (l *logs) messages() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, len(l.rec))
	for i, r := range l.rec {
		out[i] = r.Message
	}
	return out
}

// attr returns attribute key of the first record with message msg.
func (l *logs) attr(msg, key string) (slog.Value, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.rec {
		if r.Message != msg {
			continue
		}
		var v slog.Value
		found := false
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == key {
				v, found = a.Value, true
				return false
			}
			return true
		})
		return v, found
	}
	return slog.Value{}, false
}

// clock is a settable test clock.
type clock = clocktest.Clock

var epoch = time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)

// harness is a running Notifier with its registry, logs and clock.
type harness struct {
	n     *Notifier
	reg   *prometheus.Registry
	logs  *logs
	clock *clock
}

// start builds a Notifier from o (filling test defaults) and runs it.
func start(t *testing.T, o Options) *harness {
	t.Helper()
	h := &harness{reg: prometheus.NewRegistry(), logs: &logs{}, clock: clocktest.New(epoch)}
	o.Registerer = h.reg
	o.Logger = slog.New(h.logs)
	if o.Now == nil {
		o.Now = h.clock.Now
	}
	if o.Backoff == nil {
		o.Backoff = func(int) time.Duration { return 0 }
	}
	h.n = New(o)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { _ = h.n.Run(ctx) }()
	t.Cleanup(func() {
		h.n.Close()
		cancel()
	})
	return h
}

// outcome reads faregate_alerts_total for event and outcome.
func (h *harness) outcome(event, outcome string) float64 {
	return testutil.ToFloat64(h.n.total.WithLabelValues(event, outcome))
}

// eventually polls cond until it holds or a deadline passes; the condition
// is a real event (a worker finishing), not a timed guess.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	clocktest.Eventually(t, 10*time.Second, what, cond)
}

func TestPayloadAndSignature(t *testing.T) {
	rcv := newReceiver(t)
	h := start(t, Options{URL: rcv.srv.URL, Secret: "s3cret"})
	h.n.Notify(Alert{Event: BudgetExhausted, Scope: "site", Severity: Critical,
		Text: "The daily token budget is spent.", Details: map[string]any{"used": 40000, "limit": 40000}})
	req := rcv.next(t)

	var got map[string]any
	if err := json.Unmarshal(req.body, &got); err != nil {
		t.Fatalf("body is not JSON: %v", err)
	}
	for _, k := range []string{"event", "severity", "text", "at", "details"} {
		if _, ok := got[k]; !ok {
			t.Errorf("payload lacks %q: %s", k, req.body)
		}
	}
	if got["event"] != BudgetExhausted || got["severity"] != Critical || got["text"] != "The daily token budget is spent." {
		t.Errorf("payload = %s", req.body)
	}
	at, err := time.Parse(time.RFC3339, got["at"].(string))
	if err != nil || !at.Equal(epoch) {
		t.Errorf("at = %v (%v), want %v in RFC 3339", got["at"], err, epoch)
	}
	if d := got["details"].(map[string]any); d["used"] != float64(40000) {
		t.Errorf("details = %v", d)
	}
	if ct := req.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q", ct)
	}

	mac := hmac.New(sha256.New, []byte("s3cret"))
	mac.Write(req.body)
	want := "sha256=" + hex.EncodeToString(mac.Sum(nil))
	if sig := req.header.Get("X-Faregate-Signature"); !hmac.Equal([]byte(sig), []byte(want)) {
		t.Errorf("signature %q does not verify (want %q)", sig, want)
	}
	eventually(t, "the sent count", func() bool { return h.outcome(BudgetExhausted, "sent") == 1 })
	if _, ok := h.logs.attr("alert sent", "event"); !ok {
		t.Errorf("no log line for the sent alert: %v", h.logs.messages())
	}
}

func TestNoSecretNoSignature(t *testing.T) {
	rcv := newReceiver(t)
	h := start(t, Options{URL: rcv.srv.URL})
	h.n.Notify(Alert{Event: BreakerOpen, Scope: "model:primary"})
	req := rcv.next(t)
	if _, ok := req.header["X-Faregate-Signature"]; ok {
		t.Errorf("unsigned alert carries a signature header: %q", req.header.Get("X-Faregate-Signature"))
	}
	var got payload
	_ = json.Unmarshal(req.body, &got)
	if got.Severity != Warning || got.Text != "breaker_open (model:primary)" {
		t.Errorf("defaults not filled: %+v", got)
	}
}

func TestRetriesOn500ThenSucceeds(t *testing.T) {
	rcv := newReceiver(t, 500, 502, 200)
	var mu sync.Mutex
	var backoffs []int
	h := start(t, Options{URL: rcv.srv.URL, Backoff: func(attempt int) time.Duration {
		mu.Lock()
		backoffs = append(backoffs, attempt)
		mu.Unlock()
		return 0
	}})
	h.n.Notify(Alert{Event: Overage, Scope: "principal:k_acme"})
	first := rcv.next(t)
	for range 2 {
		if again := rcv.next(t); string(again.body) != string(first.body) {
			t.Errorf("a retry changed the body:\n%s\n%s", first.body, again.body)
		}
	}
	eventually(t, "the sent count", func() bool { return h.outcome(Overage, "sent") == 1 })
	rcv.none(t, h.n)
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(backoffs) != "[1 2]" {
		t.Errorf("backoff asked for attempts %v, want [1 2]", backoffs)
	}
	if v, _ := h.logs.attr("alert sent", "attempts"); v.Int64() != 3 {
		t.Errorf("logged attempts = %v, want 3", v)
	}
}

func TestGivesUpAfterThreeRetries(t *testing.T) {
	rcv := newReceiver(t, 503)
	h := start(t, Options{URL: rcv.srv.URL})
	h.n.Notify(Alert{Event: Anomaly, Scope: "principal:k_acme"})
	for range maxAttempts {
		rcv.next(t)
	}
	eventually(t, "the failed count", func() bool { return h.outcome(Anomaly, "failed") == 1 })
	rcv.none(t, h.n)
	if v, ok := h.logs.attr("alert delivery failed", "attempts"); !ok || v.Int64() != 4 {
		t.Errorf("failure log attempts = %v (found %v), want 4", v, ok)
	}
}

func TestNoRetryOn400(t *testing.T) {
	rcv := newReceiver(t, 400)
	h := start(t, Options{URL: rcv.srv.URL})
	h.n.Notify(Alert{Event: ToolCallLoop, Scope: "principal:k_acme"})
	rcv.next(t)
	eventually(t, "the failed count", func() bool { return h.outcome(ToolCallLoop, "failed") == 1 })
	rcv.none(t, h.n)
}

func TestNetworkErrorIsRetried(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL
	dead.Close() // nothing listens there now
	var mu sync.Mutex
	calls := 0
	h := start(t, Options{URL: url, Backoff: func(int) time.Duration {
		mu.Lock()
		calls++
		mu.Unlock()
		return 0
	}})
	h.n.Notify(Alert{Event: PolicyReloadFailed, Scope: "site"})
	eventually(t, "the failed count", func() bool { return h.outcome(PolicyReloadFailed, "failed") == 1 })
	mu.Lock()
	defer mu.Unlock()
	if calls != maxAttempts-1 {
		t.Errorf("%d retries after network errors, want %d", calls, maxAttempts-1)
	}
}

func TestRetryAfterIsHonouredUpToCap(t *testing.T) {
	rcv := newReceiver(t, 429, 503, 200)
	rcv.headers = []http.Header{{"Retry-After": {"120"}}, {"Retry-After": {"1"}}}
	reg := prometheus.NewRegistry()
	n := New(Options{URL: rcv.srv.URL, MaxRetryAfter: 2 * time.Second, Registerer: reg,
		Logger: slog.New(&logs{}), Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	var mu sync.Mutex
	var waits []time.Duration
	n.wait = func(_ context.Context, d time.Duration) error {
		mu.Lock()
		waits = append(waits, d)
		mu.Unlock()
		return nil
	}
	go func() { _ = n.Run(context.Background()) }()
	n.Notify(Alert{Event: BudgetWarning, Scope: "site/2026-08-31"})
	for range 3 {
		rcv.next(t)
	}
	n.Close()
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(waits) != "[2s 1s]" {
		t.Errorf("waits = %v, want [2s 1s] (120 s capped at 2 s, then 1 s)", waits)
	}
}

func TestParseRetryAfter(t *testing.T) {
	now := epoch
	tests := map[string]time.Duration{
		"":                              0,
		"7":                             7 * time.Second,
		"-3":                            0,
		"soon":                          0,
		"Mon, 31 Aug 2026 12:00:30 GMT": 30 * time.Second,
		"Mon, 31 Aug 2026 11:00:00 GMT": 0,
	}
	for in, want := range tests {
		if got := parseRetryAfter(in, now); got != want {
			t.Errorf("parseRetryAfter(%q) = %v, want %v", in, got, want)
		}
	}
}

func TestDeduplication(t *testing.T) {
	rcv := newReceiver(t)
	h := start(t, Options{URL: rcv.srv.URL, Window: 10 * time.Minute})
	a := Alert{Event: BudgetExhausted, Scope: "site"}

	h.n.Notify(a)
	h.n.Notify(a) // same event and scope within the window
	rcv.next(t)
	if got := h.outcome(BudgetExhausted, "deduplicated"); got != 1 {
		t.Errorf("deduplicated = %v, want 1", got)
	}

	h.n.Notify(Alert{Event: BudgetExhausted, Scope: "principal:k_acme"}) // another scope
	rcv.next(t)

	h.clock.Advance(10*time.Minute + time.Second) // the window has passed
	h.n.Notify(a)
	rcv.next(t)

	h.n.Notify(Alert{Event: BudgetWarning, Scope: "site/2026-08-31", Window: 24 * time.Hour})
	rcv.next(t)
	h.clock.Advance(time.Hour)
	h.n.Notify(Alert{Event: BudgetWarning, Scope: "site/2026-08-31", Window: 24 * time.Hour})
	rcv.none(t, h.n)
	if got := h.outcome(BudgetWarning, "deduplicated"); got != 1 {
		t.Errorf("a per-alert window of 24h did not hold: deduplicated = %v", got)
	}
}

func TestRedisDeduperSharedByReplicas(t *testing.T) {
	b := redistest.Mini(t)
	rcv := newReceiver(t)
	one := start(t, Options{URL: rcv.srv.URL, Dedupe: RedisDeduper(b.Client)})
	two := start(t, Options{URL: rcv.srv.URL, Dedupe: RedisDeduper(b.Client)})
	a := Alert{Event: BreakerOpen, Scope: "model:primary"}
	one.n.Notify(a)
	two.n.Notify(a)
	rcv.next(t)
	eventually(t, "both replicas to decide", func() bool {
		return one.outcome(BreakerOpen, "sent")+two.outcome(BreakerOpen, "sent") == 1 &&
			one.outcome(BreakerOpen, "deduplicated")+two.outcome(BreakerOpen, "deduplicated") == 1
	})
	if ttl := b.Mini.TTL("faregate:alert:{breaker_open}:model:primary"); ttl != 10*time.Minute {
		t.Errorf("dedupe key TTL = %v, want 10m", ttl)
	}

	// After the window (on Redis's clock and each replica's) it is sent again.
	b.Mini.FastForward(10*time.Minute + time.Second)
	one.clock.Advance(10*time.Minute + time.Second)
	two.clock.Advance(10*time.Minute + time.Second)
	two.n.Notify(a)
	rcv.next(t)
	one.n.Close()
	rcv.none(t, two.n)
}

func TestRedisDownFallsBackToMemory(t *testing.T) {
	b := redistest.Mini(t)
	b.Mini.Close() // Redis is gone
	rcv := newReceiver(t)
	h := start(t, Options{URL: rcv.srv.URL, Dedupe: RedisDeduper(b.Client)})
	h.n.Notify(Alert{Event: BudgetExhausted, Scope: "site"})
	rcv.next(t) // sent although the shared deduper failed
	h.n.Notify(Alert{Event: BudgetExhausted, Scope: "site"})
	if got := h.outcome(BudgetExhausted, "deduplicated"); got != 1 {
		t.Errorf("local memory did not deduplicate: %v", got)
	}
	rcv.none(t, h.n)
}

func TestRedisDeduperErrors(t *testing.T) {
	b := redistest.Mini(t)
	b.Mini.Close()
	_, err := RedisDeduper(b.Client).First(context.Background(), Overage, "site", time.Minute)
	if err == nil || !strings.Contains(err.Error(), ErrUnavailable.Error()) {
		t.Errorf("err = %v, want ErrUnavailable", err)
	}
	var _ redis.Cmdable = b.Client // RedisDeduper takes the narrow interface
}

func TestQueueFullDropsAndCounts(t *testing.T) {
	rcv := newReceiver(t)
	reg := prometheus.NewRegistry()
	n := New(Options{URL: rcv.srv.URL, QueueSize: 2, Registerer: reg, Logger: slog.New(&logs{}),
		Backoff: func(int) time.Duration { return 0 }})
	// The worker is not running yet, so nothing leaves the queue.
	for i := range 5 {
		n.Notify(Alert{Event: Anomaly, Scope: fmt.Sprintf("principal:k_%d", i)})
	}
	if got := testutil.ToFloat64(n.total.WithLabelValues(Anomaly, "dropped")); got != 3 {
		t.Errorf("dropped = %v, want 3", got)
	}
	go func() { _ = n.Run(context.Background()) }()
	rcv.next(t)
	rcv.next(t)
	// A dropped alert was not marked as seen: it can still be sent.
	n.Notify(Alert{Event: Anomaly, Scope: "principal:k_4"})
	if q := rcv.next(t); !strings.Contains(string(q.body), `"anomaly"`) {
		t.Errorf("unexpected body %s", q.body)
	}
	n.Close()
	n.Notify(Alert{Event: Anomaly, Scope: "principal:k_9"})
	if got := testutil.ToFloat64(n.total.WithLabelValues(Anomaly, "dropped")); got != 4 {
		t.Errorf("an alert after Close must be dropped: dropped = %v, want 4", got)
	}
}

// TestHangingReceiverNeverBlocksNotify proves the design point: while the
// receiver holds the worker's request open, Notify still returns at once,
// a thousand times, dropping what the queue cannot hold.
func TestHangingReceiverNeverBlocksNotify(t *testing.T) {
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(srv.Close)
	h := start(t, Options{URL: srv.URL, QueueSize: 8, Timeout: time.Minute, DrainTimeout: time.Millisecond})
	defer close(release) // before start's cleanup closes the Notifier

	h.n.Notify(Alert{Event: Overage, Scope: "principal:first"})
	<-entered // the worker is now stuck in the receiver

	done := make(chan struct{})
	go func() {
		for i := range 1000 {
			h.n.Notify(Alert{Event: Overage, Scope: fmt.Sprintf("principal:k_%d", i)})
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Notify blocked while the receiver hung")
	}
	if got := h.outcome(Overage, "dropped"); got != 1000-8 {
		t.Errorf("dropped = %v, want %d (queue of 8)", got, 1000-8)
	}
}

func BenchmarkNotifyHangingReceiver(b *testing.B) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(release)
	n := New(Options{URL: srv.URL, QueueSize: 256, Logger: slog.New(&logs{}), DrainTimeout: time.Millisecond})
	go func() { _ = n.Run(context.Background()) }()
	defer n.Close()
	a := Alert{Event: Overage, Scope: "principal:k_acme", Details: map[string]any{"tokens": 120}}
	i := 0
	for b.Loop() {
		a.Scope = "principal:k_" + fmt.Sprint(i%4096)
		n.Notify(a)
		i++
	}
}

func TestNoURLLogsOnly(t *testing.T) {
	h := start(t, Options{})
	h.n.Notify(Alert{Event: BreakerClosed, Scope: "model:primary", Severity: Info, Text: "The model answers again."})
	eventually(t, "the logged count", func() bool { return h.outcome(BreakerClosed, "logged") == 1 })
	if v, ok := h.logs.attr("alert", "text"); !ok || v.String() != "The model answers again." {
		t.Errorf("log line = %v (found %v); logs: %v", v, ok, h.logs.messages())
	}
	if got := h.outcome(BreakerClosed, "sent"); got != 0 {
		t.Errorf("sent = %v without a URL", got)
	}
}

func TestCloseDrainsQueue(t *testing.T) {
	rcv := newReceiver(t)
	reg := prometheus.NewRegistry()
	n := New(Options{URL: rcv.srv.URL, Registerer: reg, Logger: slog.New(&logs{})})
	for i := range 3 {
		n.Notify(Alert{Event: Anomaly, Scope: fmt.Sprintf("principal:k_%d", i)})
	}
	ran := make(chan error, 1)
	go func() { ran <- n.Run(context.Background()) }()
	rcv.next(t) // Run is delivering; two alerts are still queued
	n.Close()
	if got := testutil.ToFloat64(n.total.WithLabelValues(Anomaly, "sent")); got != 3 {
		t.Errorf("sent before Close returned = %v, want 3", got)
	}
	if err := <-ran; err != nil {
		t.Errorf("Run after Close = %v, want nil", err)
	}
	if err := n.Run(context.Background()); err == nil {
		t.Error("a second Run must fail")
	}
}

func TestCloseIsBoundedByDrainTimeout(t *testing.T) {
	entered := make(chan struct{}, 8)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body) // so the server notices the client leaving
		entered <- struct{}{}
		<-r.Context().Done() // hang until the client gives up
	}))
	t.Cleanup(srv.Close)
	reg := prometheus.NewRegistry()
	n := New(Options{URL: srv.URL, Registerer: reg, Logger: slog.New(&logs{}), Timeout: time.Hour,
		DrainTimeout: 20 * time.Millisecond, Backoff: func(int) time.Duration { return 0 }})
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan error, 1)
	go func() { ran <- n.Run(ctx) }()
	n.Notify(Alert{Event: Overage, Scope: "principal:a"})
	<-entered
	n.Notify(Alert{Event: Overage, Scope: "principal:b"})
	cancel() // shutting down: the hanging request is abandoned, the drain is bounded
	select {
	case err := <-ran:
		if err != context.Canceled {
			t.Errorf("Run = %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within its drain bound")
	}
	n.Close()
	failed := testutil.ToFloat64(n.total.WithLabelValues(Overage, "failed"))
	dropped := testutil.ToFloat64(n.total.WithLabelValues(Overage, "dropped"))
	if failed+dropped != 2 {
		t.Errorf("failed %v + dropped %v, want 2 alerts accounted for", failed, dropped)
	}
}

func TestScopeAndDetailsAreScrubbed(t *testing.T) {
	hash := strings.Repeat("ab12", 16)
	tests := map[string]string{
		"v:" + hash:                      "v:ab12ab12ab12",
		"principal:" + hash:              "principal:ab12ab12ab12",
		"ip:203.0.113.7":                 "ip:ip-redacted",
		"2001:db8::1":                    "ip-redacted",
		"visitor 198.51.100.4 blocked":   "visitor ip-redacted blocked",
		"net:2001:db8::/64":              "net:ip-redacted",
		"model:primary":                  "model:primary",
		"site/2026-08-31":                "site/2026-08-31",
		"spike 12.5x over EMA (3.2 avg)": "spike 12.5x over EMA (3.2 avg)",
	}
	for in, want := range tests {
		if got := scrub(in); got != want {
			t.Errorf("scrub(%q) = %q, want %q", in, got, want)
		}
	}
	a := clean(Alert{Event: Anomaly, Scope: "v:" + hash, Text: "input spike from 203.0.113.7",
		Details: map[string]any{"visitor": hash, "ip": "203.0.113.7", "tokens": 9000}})
	if a.Scope != "v:ab12ab12ab12" || a.Text != "input spike from ip-redacted" ||
		a.Details["visitor"] != "ab12ab12ab12" || a.Details["ip"] != "ip-redacted" || a.Details["tokens"] != 9000 {
		t.Errorf("clean = %+v", a)
	}
}

func TestUnknownEventIsLabelledOther(t *testing.T) {
	h := start(t, Options{})
	h.n.Notify(Alert{Event: "made_up"})
	eventually(t, "the logged count", func() bool { return h.outcome("other", "logged") == 1 })
}

func TestMemorySweepsExpiredEntries(t *testing.T) {
	c := clocktest.New(epoch)
	m := newMemory(c.Now)
	for i := range memSweep {
		m.first(Anomaly, fmt.Sprint(i), time.Minute)
	}
	c.Advance(2 * time.Minute)
	m.first(Anomaly, "new", time.Minute)
	m.mu.Lock()
	n := len(m.until)
	m.mu.Unlock()
	if n != 1 {
		t.Errorf("memory holds %d entries after the sweep, want 1", n)
	}
}

// TestEventLimitBoundsAFlood: a flood of one event with a new scope each
// time (a tool_call_id that changes every request) sends EventLimit alerts
// per window, counts the rest as limited, marks no more scopes than it sent,
// and the first alert of the next window says how many were held back.
func TestEventLimitBoundsAFlood(t *testing.T) {
	rcv := newReceiver(t)
	h := start(t, Options{URL: rcv.srv.URL, EventLimit: 5})
	for i := range 40 {
		h.n.Notify(Alert{Event: ToolCallLoop, Scope: fmt.Sprintf("tool_call:call_%d", i)})
	}
	for range 5 {
		rcv.next(t)
	}
	eventually(t, "five sent", func() bool { return h.outcome(ToolCallLoop, "sent") == 5 })
	if got := h.outcome(ToolCallLoop, "limited"); got != 35 {
		t.Errorf("limited = %v, want 35", got)
	}
	h.n.local.mu.Lock()
	marks := len(h.n.local.until)
	h.n.local.mu.Unlock()
	if marks != 5 {
		t.Errorf("the deduplication memory holds %d scopes, want the 5 sent", marks)
	}
	var warned int
	for _, m := range h.logs.messages() {
		if strings.HasPrefix(m, "alert: rate limit reached") {
			warned++
		}
	}
	if warned != 1 {
		t.Errorf("%d rate-limit log lines, want 1 per event and window", warned)
	}

	h.clock.Advance(10*time.Minute + time.Second)
	h.n.Notify(Alert{Event: ToolCallLoop, Scope: "tool_call:call_next"})
	var got payload
	if err := json.Unmarshal(rcv.next(t).body, &got); err != nil {
		t.Fatal(err)
	}
	if got.Details["suppressed"] != float64(35) {
		t.Errorf("the next window's first alert has details %v, want suppressed 35", got.Details)
	}
	// Another event has its own bound.
	h.n.Notify(Alert{Event: Anomaly, Scope: "principal:v:abc"})
	rcv.next(t)
	rcv.none(t, h.n)
}

// TestTrafficFloodNeverDelaysOperatorAlert: with a receiver that hangs on
// every tool_call_loop alert, and a queue full of them, a
// policy_reload_failed still goes out at once, and is not dropped.
func TestTrafficFloodNeverDelaysOperatorAlert(t *testing.T) {
	release := make(chan struct{})
	got := make(chan string, 64)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var p payload
		_ = json.Unmarshal(body, &p)
		if p.Event == ToolCallLoop {
			select {
			case <-release:
			case <-r.Context().Done():
			}
			return
		}
		got <- p.Event
	}))
	t.Cleanup(srv.Close)
	h := start(t, Options{URL: srv.URL, QueueSize: 4, EventLimit: 100, Timeout: time.Minute, DrainTimeout: time.Millisecond})
	defer close(release) // before start's cleanup closes the Notifier

	for i := range 50 {
		h.n.Notify(Alert{Event: ToolCallLoop, Scope: fmt.Sprintf("tool_call:call_%d", i)})
	}
	eventually(t, "the traffic queue to fill", func() bool { return h.outcome(ToolCallLoop, "dropped") > 0 })
	h.n.Notify(Alert{Event: PolicyReloadFailed, Scope: "policy"})
	h.n.Notify(Alert{Event: BudgetExhausted, Scope: "site"})
	for _, want := range []string{PolicyReloadFailed, BudgetExhausted} {
		select {
		case ev := <-got:
			if ev != want {
				t.Errorf("received %s, want %s", ev, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%s waited behind the hanging tool_call_loop alerts", want)
		}
	}
	if d := h.outcome(PolicyReloadFailed, "dropped") + h.outcome(BudgetExhausted, "dropped"); d != 0 {
		t.Errorf("%v operator alerts dropped", d)
	}
}

func TestLanes(t *testing.T) {
	tests := []struct {
		a    Alert
		want lane
	}{
		{Alert{Event: PolicyReloadFailed, Scope: "policy"}, laneOperator},
		{Alert{Event: BreakerOpen, Scope: "model:primary"}, laneOperator},
		{Alert{Event: BreakerClosed, Scope: "model:primary"}, laneOperator},
		{Alert{Event: LedgerBacklog, Scope: "ledger/2026-08-31"}, laneOperator},
		{Alert{Event: LedgerLost, Scope: "ledger/2026-08-31"}, laneOperator},
		{Alert{Event: BudgetExhausted, Scope: "site"}, laneOperator},
		{Alert{Event: BudgetExhausted, Scope: "spend"}, laneOperator},
		{Alert{Event: BudgetWarning, Scope: "tier:partner/2026-08-31"}, laneOperator},
		{Alert{Event: BudgetWarning, Scope: "principal:v:ab12ab12ab12/2026-08-31"}, laneTraffic},
		{Alert{Event: BudgetExhausted, Scope: "task:t_1"}, laneTraffic},
		{Alert{Event: ToolCallLoop, Scope: "tool_call:call_1"}, laneTraffic},
		{Alert{Event: Anomaly, Scope: "principal:k:acme"}, laneTraffic},
		{Alert{Event: Overage, Scope: "task:t_1"}, laneTraffic},
		{Alert{Event: "made_up", Scope: "site"}, laneTraffic},
	}
	for _, tc := range tests {
		if got := laneOf(clean(tc.a)); got != tc.want {
			t.Errorf("%s %s: lane %s, want %s", tc.a.Event, tc.a.Scope, laneNames[got], laneNames[tc.want])
		}
	}
}

// TestDefaultBackoff: the waits before retries 1–3 are drawn below 0.5 s,
// 1 s and 2 s, never nothing, and spread out.
func TestDefaultBackoff(t *testing.T) {
	for attempt, ceiling := range map[int]time.Duration{1: 500 * time.Millisecond, 2: time.Second, 3: 2 * time.Second} {
		seen := map[time.Duration]bool{}
		for range 100 {
			d := defaultBackoff(attempt)
			if d <= 0 || d > ceiling {
				t.Fatalf("retry %d waits %v, want in (0, %v]", attempt, d, ceiling)
			}
			seen[d] = true
		}
		if len(seen) < 2 {
			t.Fatalf("retry %d: 100 waits all alike", attempt)
		}
	}
}
