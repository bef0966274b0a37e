package main

import (
	"bufio"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/policy"
)

// Helpers of the keyed-lane (#9) and cost (#10) end-to-end tests.

// apiKey is a key made as `faregate keys new` makes it, with its policy line.
type apiKey struct {
	ID, Key string
}

// newAPIKey makes a fresh key for id.
func newAPIKey(id string) apiKey { return apiKey{ID: id, Key: policy.NewKey()} }

// line is the key's entry under keys: in a policy file.
func (k apiKey) line(tier string) string {
	return fmt.Sprintf("  - {id: %s, sha256: %q, tier: %s}\n", k.ID, policy.HashKey(k.Key), tier)
}

// auth is the header map that sends the key.
func (k apiKey) auth() map[string]string {
	return map[string]string{"Authorization": "Bearer " + k.Key}
}

// policyFile is a policy file in the test's temporary directory. write
// replaces it atomically (a new file renamed over the old), as editors and
// config management do, so the watcher never reads a half-written file.
type policyFile struct {
	t    testing.TB
	Path string
	n    int
}

func newPolicyFile(t testing.TB, content string) *policyFile {
	t.Helper()
	p := &policyFile{t: t, Path: filepath.Join(t.TempDir(), "policy.yaml")}
	p.write(content)
	return p
}

func (p *policyFile) write(content string) {
	p.t.Helper()
	p.n++
	tmp := filepath.Join(filepath.Dir(p.Path), fmt.Sprintf(".policy-%d.tmp", p.n))
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		p.t.Fatal(err)
	}
	if err := os.Rename(tmp, p.Path); err != nil {
		p.t.Fatal(err)
	}
}

// siteverify is a Turnstile siteverify emulator that accepts every token
// for demo.example and counts the calls it gets.
type siteverify struct {
	*httptest.Server
	calls atomic.Int64
}

func newSiteverify(t testing.TB) *siteverify {
	sv := &siteverify{}
	sv.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sv.calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, `{"success":true,"hostname":"demo.example"}`)
	}))
	t.Cleanup(sv.Close)
	return sv
}

// env is what points faregate at the emulator.
func (sv *siteverify) env() map[string]string {
	return map[string]string{"FAREGATE_TURNSTILE_SECRET_KEY": "test-secret", "FAREGATE_TURNSTILE_HOSTNAMES": "demo.example",
		"FAREGATE_TURNSTILE_VERIFY_URL": sv.URL}
}

// mergeEnv returns one map of all of ms, later ones winning.
func mergeEnv(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

// metricValue reads one series of the server's /metrics (labels as Prometheus
// writes them: sorted by name); 0 when the series is absent.
func metricValue(t testing.TB, base, series string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatalf("metrics: %v", err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				t.Fatalf("metric %s: %q", series, v)
			}
			return f
		}
	}
	return 0
}

// pollUntil polls cond until it holds or timeout passes (failing the
// test), and reports how long it took: clocktest.Eventually, the one
// polling wait of these tests.
func pollUntil(t testing.TB, timeout time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	return clocktest.Eventually(t, timeout, what, cond)
}

// letTimePass lets d of real time pass. It is no wait for an event (those
// poll, through pollUntil or clocktest.Poll): the stretch is itself the
// quantity a test needs, a measurement window, a gap a Retry-After must
// count, or a Retry-After a client honours.
func letTimePass(d time.Duration) { clocktest.Pass(d) }

// postTask posts a task for dest with the header h.
func postTask(t testing.TB, base, dest string, h map[string]string) reply {
	t.Helper()
	return do(t, "POST", base+"/api/tasks", taskBody(dest), h)
}

// rateLimitItem returns the parameters of the named item of a RateLimit or
// RateLimit-Policy field (`"rpm";r=0;t=42` → {"r": 0, "t": 42}).
func rateLimitItem(field, name string) (map[string]int64, bool) {
	for _, item := range strings.Split(field, ",") {
		parts := strings.Split(strings.TrimSpace(item), ";")
		if len(parts) == 0 || parts[0] != strconv.Quote(name) {
			continue
		}
		out := map[string]int64{}
		for _, p := range parts[1:] {
			k, v, _ := strings.Cut(p, "=")
			n, _ := strconv.ParseInt(v, 10, 64)
			out[k] = n
		}
		return out, true
	}
	return nil, false
}

// retryAfterMatches checks that a 429's Retry-After equals the t of the
// RateLimit item that names the refusing policy, and returns it.
func retryAfterMatches(t testing.TB, r reply, policyName string) int64 {
	t.Helper()
	ra, err := strconv.ParseInt(r.Header.Get("Retry-After"), 10, 64)
	if err != nil {
		t.Fatalf("Retry-After %q: %v", r.Header.Get("Retry-After"), err)
	}
	item, ok := rateLimitItem(r.Header.Get("RateLimit"), policyName)
	if !ok {
		t.Fatalf("RateLimit %q names no %q policy", r.Header.Get("RateLimit"), policyName)
	}
	if item["t"] != ra {
		t.Fatalf("Retry-After %d but RateLimit %q has t=%d", ra, policyName, item["t"])
	}
	return ra
}

// taskError is the error code of a final task ("" when it succeeded).
func taskError(task map[string]any) string {
	e, _ := task["error"].(map[string]any)
	c, _ := e["code"].(string)
	return c
}

// usageOf reads a task's usage.
func usageOf(task map[string]any) (prompt, completion int64) {
	u, _ := task["usage"].(map[string]any)
	p, _ := u["prompt_tokens"].(float64)
	c, _ := u["completion_tokens"].(float64)
	return int64(p), int64(c)
}

// utcToday is the UTC day as keys and the ledger name it.
func utcToday() string { return time.Now().UTC().Format(time.DateOnly) }

// meteredReply is one answer of the metered model: what to say or call,
// and the usage to report for it.
type meteredReply struct {
	Delay     time.Duration
	Content   string
	ToolCalls []fakeCall
	// Prompt and Completion are the usage reported in the last chunk.
	Prompt, Completion int
}

// meteredLLM is the fake model with the usage of each answer chosen by
// the script (fakeLLM derives it from the request count): the provider's
// word that settle must charge in full.
type meteredLLM = fakeLLM

func newMeteredLLM(t testing.TB, script func(req chatRequest, n int) meteredReply) *meteredLLM {
	return newFakeLLM(t, func(req chatRequest, n int) fakeReply {
		rep := script(req, n)
		return fakeReply{Delay: rep.Delay, Content: rep.Content, ToolCalls: rep.ToolCalls,
			Usage: &fakeUsage{Prompt: rep.Prompt, Completion: rep.Completion}}
	})
}

// userText is the first user message of a chat request: the request in
// words, with its destination.
func userText(req chatRequest) string {
	for _, m := range req.Messages {
		if m["role"] == "user" {
			s, _ := m["content"].(string)
			return s
		}
	}
	return ""
}

// alertPost is one alert a webhook receiver got.
type alertPost struct {
	Event, Severity, Text, At string
	Details                   map[string]any
	// Signed reports a valid X-Faregate-Signature for the receiver's secret.
	Signed bool
}

// alertReceiver is a webhook that records the alerts it gets and checks
// their signatures.
type alertReceiver struct {
	*httptest.Server
	secret string
	mu     sync.Mutex
	posts  []alertPost
}

func newAlertReceiver(t testing.TB, secret string) *alertReceiver {
	ar := &alertReceiver{secret: secret}
	ar.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var p struct {
			Event, Severity, Text, At string
			Details                   map[string]any
		}
		if err := json.Unmarshal(body, &p); err != nil {
			http.Error(w, "bad json", http.StatusBadRequest)
			return
		}
		mac := hmac.New(sha256.New, []byte(ar.secret))
		mac.Write(body)
		signed := hmac.Equal([]byte(r.Header.Get("X-Faregate-Signature")), []byte("sha256="+hex.EncodeToString(mac.Sum(nil))))
		ar.mu.Lock()
		ar.posts = append(ar.posts, alertPost{Event: p.Event, Severity: p.Severity, Text: p.Text, At: p.At, Details: p.Details, Signed: signed})
		ar.mu.Unlock()
	}))
	t.Cleanup(ar.Close)
	return ar
}

// env is what points faregate at the receiver.
func (ar *alertReceiver) env() map[string]string {
	return map[string]string{"FAREGATE_ALERT_WEBHOOK_URL": ar.URL, "FAREGATE_ALERT_WEBHOOK_SECRET": ar.secret}
}

// events lists the alerts received with event name.
func (ar *alertReceiver) events(name string) []alertPost {
	ar.mu.Lock()
	defer ar.mu.Unlock()
	var out []alertPost
	for _, p := range ar.posts {
		if p.Event == name {
			out = append(out, p)
		}
	}
	return out
}

// names lists the events received, sorted, for failure messages.
func (ar *alertReceiver) names() []string {
	ar.mu.Lock()
	defer ar.mu.Unlock()
	var out []string
	for _, p := range ar.posts {
		out = append(out, p.Event)
	}
	sort.Strings(out)
	return out
}

// waitEvent waits until an alert with event name arrived and returns it.
func (ar *alertReceiver) waitEvent(t testing.TB, name string) alertPost {
	t.Helper()
	var got []alertPost
	if clocktest.Poll(15*time.Second, func() bool { got = ar.events(name); return len(got) > 0 }) {
		return got[0]
	}
	t.Fatalf("no %s alert within 15s; received %v", name, ar.names())
	return alertPost{}
}
