package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"faregate/agent/gateway"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/agent/taskstore"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/policy"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
	"faregate/protect/turnstile"
)

func TestParseCreateRequest(t *testing.T) {
	cases := []struct {
		name, body string
		field      string // "" = valid
		lang       string
	}{
		{"valid", `{"turnstile_token":"t","destination":"Lisbon","days":3,"interests":["food"]}`, "", ""},
		{"unknown fields ignored", `{"destination":"Rome","days":1,"extra":{"a":[1,2]}}`, "", ""},
		{"null interests", `{"destination":"Rome","days":1,"interests":null}`, "", ""},
		{"80 code points", `{"destination":"` + strings.Repeat("ö", 80) + `","days":7}`, "", ""},
		{"81 code points", `{"destination":"` + strings.Repeat("ö", 81) + `","days":7}`, "destination", ""},
		{"control character", `{"destination":"Rome\u0007","days":1}`, "destination", ""},
		{"days float", `{"destination":"Rome","days":1.0}`, "days", ""},
		{"days exponent", `{"destination":"Rome","days":1e0}`, "days", ""},
		{"days string", `{"destination":"Rome","days":"1"}`, "days", ""},
		{"days bool", `{"destination":"Rome","days":true}`, "days", ""},
		{"interests object", `{"destination":"Rome","days":1,"interests":{"a":1}}`, "interests", ""},
		{"interest 33", `{"destination":"Rome","days":1,"interests":["` + strings.Repeat("a", 33) + `"]}`, "interests", ""},
		{"language zh-CN", `{"destination":"北京","days":1,"language":"zh-CN"}`, "", "zh-CN"},
		{"language any case", `{"destination":"北京","days":1,"language":"ZH-cn"}`, "", "zh-CN"},
		{"language en", `{"destination":"Rome","days":1,"language":"en"}`, "", "en"},
		{"language other", `{"destination":"Rome","days":1,"language":"fr"}`, "language", ""},
		{"language number", `{"destination":"Rome","days":1,"language":1}`, "language", ""},
		{"not an object", `"Rome"`, "body", ""},
		{"null", `null`, "body", ""},
		{"two objects", `{} {}`, "body", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := parseCreateRequest([]byte(tc.body))
			var ie *InvalidError
			switch {
			case tc.field == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.field != "" && (!errors.As(err, &ie) || ie.Fields[tc.field] == ""):
				t.Fatalf("want a message for %q, got %v", tc.field, err)
			case tc.field == "" && req.Language != tc.lang:
				t.Fatalf("language %q, want %q", req.Language, tc.lang)
			}
		})
	}
}

func TestLanguageFrom(t *testing.T) {
	cases := map[string]string{
		"":                               "en",
		"zh-CN,zh;q=0.9":                 "zh-CN",
		"zh-TW":                          "zh-CN",
		"en-GB,en;q=0.8,zh;q=0.5":        "en",
		"fr-FR,zh;q=0.7,en;q=0.6":        "zh-CN",
		"de":                             "en",
		"en;q=0.2, zh-Hans-CN;q=0.9, *;": "zh-CN",
	}
	for in, want := range cases {
		if got := languageFrom(in); got != want {
			t.Errorf("languageFrom(%q) = %q, want %q", in, got, want)
		}
	}
}

// budgetRefusal is a real *budget.ExhaustedError (its retry time is set by
// the budget), from a budget with nothing left.
func budgetRefusal(t *testing.T, now time.Time) error {
	t.Helper()
	b := budget.New(redistest.Mini(t).Client, budget.Options{Limits: budget.Limits{Site: 10, Principal: 10, Task: 10}, Now: func() time.Time { return now }})
	err := b.CanAfford(context.Background(), budget.AffordRequest{Day: budget.Day(now), Principal: "v_x", PrincipalLimit: 10, Tokens: 100})
	if !errors.Is(err, budget.ErrExhausted) {
		t.Fatalf("budget refusal: %v", err)
	}
	return err
}

// TestErrorTable: each error the handlers meet chooses its status, its
// code, its Retry-After and, for a 429, the RateLimit field that names the
// refusing policy with the same t, in one table.
func TestErrorTable(t *testing.T) {
	now := time.Date(2026, 12, 1, 18, 48, 0, 0, time.UTC)
	s := &server{d: Deps{Now: func() time.Time { return now }, Limits: Limits{SiteDailyTokens: 200000, FailedChecksPerHour: 20, StreamsPerPrincipal: 4,
		InvalidRatio: 0.5, InvalidMinRequests: 20}}, errors: newErrorTable(errorRows())}
	tier := principal.Tier{Name: "public", TasksPerDay: 5, TokensPerDay: 40000, TokensPerMinute: 6000, RequestsPerMinute: 120,
		RequestsPerSecond: 10, TokensPerHour: 10000, SoftAt: 0.8, SoftRequestsPerMinute: 5}
	cases := []struct {
		name   string
		err    error
		status int
		code   string
		retry  string // Retry-After; "" = none
		rl     string // RateLimit; "" = none
	}{
		{"invalid", invalid("days", "must be 1 to 7"), 400, codes.InvalidRequest, "", ""},
		{"prompt rule", &PromptRejectedError{Rule: "instruction_override"}, 400, codes.PromptRejected, "", ""},
		{"unknown key", &policy.KeyError{Fault: policy.KeyUnknown}, 401, codes.InvalidAPIKey, "", ""},
		{"usage without key", errNoKey, 401, codes.InvalidAPIKey, "", ""},
		{"turnstile", fmt.Errorf("%w: hostname", turnstile.ErrRejected), 403, codes.TurnstileFailed, "", ""},
		{"task", task.ErrNotFound, 404, codes.TaskNotFound, "", ""},
		{"route", ErrNotFound, 404, codes.NotFound, "", ""},
		{"method", ErrMethodNotAllowed, 405, codes.MethodNotAllowed, "", ""},
		{"too large", ErrTooLarge, 413, codes.RequestTooLarge, "", ""},
		{"media", ErrUnsupportedMedia, 415, codes.UnsupportedMediaType, "", ""},
		{"visitor day", &quota.LimitError{Err: quota.ErrVisitorLimit, Limit: 5, After: quota.UntilReset(now)}, 429, codes.DemoIPLimitReached, "18720", `"daily";r=0;t=18720`},
		{"site day", &quota.LimitError{Err: quota.ErrGlobalLimit, Limit: 100, After: quota.UntilReset(now)}, 429, codes.DemoGlobalLimitReached, "18720", `"daily";r=0;t=18720`},
		{"key day", &quota.LimitError{Err: quota.ErrKeyLimit, Limit: 500, After: quota.UntilReset(now)}, 429, codes.KeyDailyLimitReached, "18720", `"daily";r=0;t=18720`},
		{"budget", budgetRefusal(t, now), 429, codes.DemoBudgetExhausted, "18720", `"budget";r=10;t=18720`},
		{"streams", &retryError{ErrTooManyStreams, streamRetry}, 429, codes.TooManyStreams, "5", `"streams";r=0;t=5`},
		{"window", &ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, After: 1500 * time.Millisecond}, 429, codes.RateLimited, "2", `"rpm";r=0;t=2`},
		{"window from memory", &retryError{ratelimit.ErrRateLimited, 1500 * time.Millisecond}, 429, codes.RateLimited, "2", `"rpm";r=0;t=2`},
		{"second window", &ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, Window: ratelimit.WindowSecond, After: 400 * time.Millisecond}, 429, codes.RateLimited, "1", `"rps";r=0;t=1`},
		{"second window from memory", &retryError{&ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, Window: ratelimit.WindowSecond}, 300 * time.Millisecond}, 429, codes.RateLimited, "1", `"rps";r=0;t=1`},
		{"soft window", &ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, Window: ratelimit.WindowSoft, After: 55 * time.Second}, 429, codes.RateLimited, "55", `"soft";r=0;t=55`},
		{"invalid ratio", &ratelimit.RefusedError{Reason: ratelimit.ReasonInvalidRatio, After: 9*time.Minute + 30*time.Second}, 429, codes.InvalidRatio, "570", `"invalid";r=0;t=570`},
		{"invalid ratio from memory", &retryError{ratelimit.ErrInvalidRatio, time.Minute}, 429, codes.InvalidRatio, "60", `"invalid";r=0;t=60`},
		{"hour", &ratelimit.RefusedError{Reason: ratelimit.ReasonHourExhausted, After: 40*time.Minute + 30*time.Second}, 429, codes.DemoBudgetExhausted, "2430", `"hour";r=0;t=2430`},
		{"failed checks", &ratelimit.RefusedError{Reason: ratelimit.ReasonTooManyFailedChecks, After: 30 * time.Minute}, 429, codes.TooManyFailedChecks, "1800", `"failed";r=0;t=1800`},
		{"failed checks from memory", &retryError{ratelimit.ErrTooManyFailedChecks, 90 * time.Second}, 429, codes.TooManyFailedChecks, "90", `"failed";r=0;t=90`},
		{"anomaly", &ratelimit.RefusedError{Reason: ratelimit.ReasonAnomalyBlocked, After: 59*time.Minute + 100*time.Millisecond}, 429, codes.AnomalyBlocked, "3541", `"anomaly";r=0;t=3541`},
		{"bucket", &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: 12 * time.Second}, 429, codes.TokenRateLimited, "12", `"tpm";r=0;t=12`},
		{"pacing", &ratelimit.WaitTooLongError{Wait: 40 * time.Second, MaxWait: 30 * time.Second, After: 10 * time.Second}, 429, codes.TokenRateLimited, "10", `"tpm";r=0;t=10`},
		{"task's events", &tasklimits.LimitError{Err: tasklimits.ErrEventLimit, Kind: tasklimits.Events, Max: 200, After: 30 * time.Second}, 429, codes.EventLimit, "30", `"task";r=0;t=30`},
		{"task's fetches", &tasklimits.LimitError{Err: tasklimits.ErrToolLimit, Kind: tasklimits.Tools, Max: 12, After: 1500 * time.Millisecond}, 429, codes.ToolLimit, "2", `"task";r=0;t=2`},
		{"result taken", taskkey.ErrFinished, 409, codes.TaskFinished, "", ""},
		{"fetch refused", fmt.Errorf("%w: private address", ErrFetchRefused), 400, codes.FetchRefused, "", ""},
		{"task key refused", taskkey.ErrInvalid, 401, codes.InvalidAPIKey, "", ""},
		{"model not allowed", gateway.ErrModelNotAllowed, 400, codes.ModelNotAllowed, "", ""},
		{"unsupported parameter", &gateway.ParamError{Err: gateway.ErrUnsupportedParameter, Field: "n", Reason: "must be 1"}, 400, codes.UnsupportedParameter, "", ""},
		{"input spike", fmt.Errorf("%w: 50000 tokens", ratelimit.ErrInputSpike), 429, codes.InputSpike, "5", `"task";r=0;t=5`},
		{"step limit", tasklimits.ErrStepLimit, 429, codes.StepLimit, "5", `"task";r=0;t=5`},
		{"too many calls", tasklimits.ErrTooManyCalls, 429, codes.TooManyCalls, "5", `"task";r=0;t=5`},
		{"panic", errPanic, 500, codes.InternalError, "", ""},
		{"unknown", errors.New("something else"), 500, codes.InternalError, "", ""},
		{"redis for quota", fmt.Errorf("%w: dial", quota.ErrUnavailable), 503, codes.DemoProtectionUnavailable, "5", ""},
		{"redis for budget", budget.ErrUnavailable, 503, codes.DemoProtectionUnavailable, "5", ""},
		{"redis for limits", ratelimit.ErrUnavailable, 503, codes.DemoProtectionUnavailable, "5", ""},
		{"redis for tasks", taskstore.ErrUnavailable, 503, codes.DemoProtectionUnavailable, "5", ""},
		{"siteverify", turnstile.ErrUnavailable, 503, codes.DemoProtectionUnavailable, "5", ""},
		{"model", errModelUnavailable, 503, codes.ModelUnavailable, "5", ""},
		{"provider's answer past its reservation", fmt.Errorf("%w: 170000 tokens", gateway.ErrUpstreamAnswer), 502, codes.UpstreamInvalid, "", ""},
		{"aitf", &retryError{aitf.ErrQueueFull, 1500 * time.Millisecond}, 503, codes.AITFQueueFull, "2", ""},
		{"busy", &retryError{ErrServerBusy, 5 * time.Second}, 503, codes.ServerBusy, "5", ""},
		{"503 capped", &retryError{ErrServerBusy, 2 * time.Minute}, 503, codes.ServerBusy, "30", ""},
		{"out of time", fmt.Errorf("lane: %w", context.DeadlineExceeded), 503, codes.ServerBusy, "5", ""},
		{"joined", errors.Join(errors.New("x"), ratelimit.ErrUnavailable), 503, codes.DemoProtectionUnavailable, "5", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := &state{id: "req-1", tier: tier}
			r := httptest.NewRequest("POST", "/api/tasks", nil)
			r = r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
			w := httptest.NewRecorder()
			s.writeErr(w, r, tc.err)
			if w.Code != tc.status || st.code != tc.code {
				t.Fatalf("%d %s, want %d %s", w.Code, st.code, tc.status, tc.code)
			}
			var env map[string]map[string]any
			if err := json.Unmarshal(w.Body.Bytes(), &env); err != nil {
				t.Fatalf("body %q: %v", w.Body, err)
			}
			if env["error"]["code"] != tc.code || env["error"]["request_id"] != "req-1" || env["error"]["message"] == "" {
				t.Fatalf("envelope %s", w.Body)
			}
			if strings.Contains(w.Body.String(), "something else") || strings.Contains(w.Body.String(), "dial") {
				t.Fatalf("an internal error text reached the client: %s", w.Body)
			}
			if got := w.Header().Get("Retry-After"); got != tc.retry {
				t.Fatalf("Retry-After %q, want %q", got, tc.retry)
			}
			if got := w.Header().Get("RateLimit"); got != tc.rl {
				t.Fatalf("RateLimit %q, want %q", got, tc.rl)
			}
			if tc.status == http.StatusTooManyRequests && (tc.rl == "" || w.Header().Get("RateLimit-Policy") == "") {
				t.Fatalf("a 429 without RateLimit fields: %q / %q", w.Header().Get("RateLimit-Policy"), w.Header().Get("RateLimit"))
			}
			if tc.rl != "" && !strings.HasSuffix(tc.rl, "t="+tc.retry) {
				t.Fatalf("the case itself is wrong: t must equal Retry-After")
			}
			if ct := w.Header().Get("Content-Type"); ct != "application/json; charset=utf-8" {
				t.Fatalf("content type %q", ct)
			}
		})
	}
	// Every code of the table is met above, so no 429 escapes the check
	// that it names its policy.
	met := map[string]bool{}
	for _, tc := range cases {
		met[tc.code] = true
	}
	for code := range s.errors.byCode {
		if !met[code] {
			t.Errorf("no case answers %s", code)
		}
	}
	// The invalid envelope names its fields; the prompt refusal its rule.
	for _, c := range []struct {
		err  error
		want string
	}{
		{invalid("days", "must be 1 to 7"), `"fields":{"days":"must be 1 to 7"}`},
		{&PromptRejectedError{Rule: "instruction_override"}, `(rule: instruction_override)`},
	} {
		w := httptest.NewRecorder()
		s.writeErr(w, httptest.NewRequest("POST", "/", nil), c.err)
		if !strings.Contains(w.Body.String(), c.want) {
			t.Errorf("%s lacks %s", w.Body, c.want)
		}
	}
}

func TestValidStreamID(t *testing.T) {
	for s, want := range map[string]bool{"1700000000000-0": true, "1-2": true, "0": true, "": false, "-1": false, "1-": false, "1-2-3": false, "abc": false, "1-x": false} {
		if validStreamID(s) != want {
			t.Errorf("validStreamID(%q) = %v", s, !want)
		}
	}
}

func TestRequestID(t *testing.T) {
	if !validRequestID("abc-123_x.y:z") || validRequestID(`a"b`) || validRequestID(strings.Repeat("a", 129)) || validRequestID("") {
		t.Fatal("validRequestID")
	}
	seen := map[string]bool{}
	for i := 0; i < 1000; i++ {
		id := newRequestID()
		if len(id) != 24 || !validRequestID(id) || seen[id] {
			t.Fatalf("request id %q", id)
		}
		seen[id] = true
	}
}

func TestSummary(t *testing.T) {
	var buf strings.Builder
	lg := slog.New(slog.NewTextHandler(&buf, nil))
	s := newSummary()
	for i := 0; i < 1000; i++ {
		s.add(codes.DemoIPLimitReached, []byte(fmt.Sprintf("v:%012d", i%100)))
	}
	for i := 0; i < 30; i++ {
		s.add(codes.TurnstileFailed, []byte("v:000000000007"))
	}
	s.note("aitf_observed")
	s.flush(lg, 10*time.Second)
	line := buf.String()
	for _, want := range []string{"total=1030", "demo_ip_limit_reached=1000 turnstile_failed=30", "top=\"v:000000000007=40 ", `noted="aitf_observed=1"`} {
		if !strings.Contains(line, want) {
			t.Errorf("summary %q lacks %q", line, want)
		}
	}
	if strings.Count(line, "\n") != 1 {
		t.Fatalf("summary wrote %d lines", strings.Count(line, "\n"))
	}
	buf.Reset()
	s.flush(lg, 10*time.Second)
	if buf.Len() != 0 {
		t.Fatalf("an empty interval wrote %q", buf.String())
	}
}

func TestStreamCaps(t *testing.T) {
	c := newStreamCaps(2, 3)
	r1, err := c.acquire("v:a")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.acquire("v:a"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.acquire("v:a"); !errors.Is(err, ErrTooManyStreams) {
		t.Fatalf("third stream of one principal: %v", err)
	}
	if _, err := c.acquire("v:b"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.acquire("v:c"); !errors.Is(err, ErrServerBusy) {
		t.Fatalf("stream past the process cap: %v", err)
	}
	r1()
	r1() // releasing twice frees one slot only
	if _, err := c.acquire("v:c"); err != nil {
		t.Fatalf("after a release: %v", err)
	}
	if c.open() != 3 {
		t.Fatalf("open %d, want 3", c.open())
	}
}

func TestMemo(t *testing.T) {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	m := newDenials(2, func() time.Time { return now })
	m.remember(principal.Principal{Kind: principal.KindVisitor, ID: "a"}, ratelimit.ErrTooManyFailedChecks, time.Minute)
	err := m.refusal(principal.Principal{Kind: principal.KindVisitor, ID: "a"})
	var ra interface{ RetryAfter() time.Duration }
	if !errors.Is(err, ratelimit.ErrTooManyFailedChecks) || !errors.As(err, &ra) || ra.RetryAfter() != time.Minute {
		t.Fatalf("refusal %v", err)
	}
	now = now.Add(59 * time.Second)
	if err := m.refusal(principal.Principal{Kind: principal.KindVisitor, ID: "a"}); err == nil {
		t.Fatal("forgotten too early")
	}
	now = now.Add(time.Second)
	if err := m.refusal(principal.Principal{Kind: principal.KindVisitor, ID: "a"}); err != nil {
		t.Fatalf("still refused at its end: %v", err)
	}
	// Full: the least recently used refusal is forgotten (asked of Redis
	// again), the newest kept; a shorter refusal never shortens a longer.
	b, c, d := principal.Principal{Kind: principal.KindVisitor, ID: "b"}, principal.Principal{Kind: principal.KindVisitor, ID: "c"}, principal.Principal{Kind: principal.KindVisitor, ID: "d"}
	m.remember(b, ratelimit.ErrAnomalyBlocked, time.Hour)
	m.remember(c, ratelimit.ErrAnomalyBlocked, time.Hour)
	m.remember(d, ratelimit.ErrAnomalyBlocked, time.Hour)
	if m.refusal(b) != nil || m.refusal(c) == nil || m.refusal(d) == nil {
		t.Fatal("capacity not respected")
	}
	m.remember(d, ratelimit.ErrTooManyFailedChecks, time.Minute)
	if err := m.refusal(d); !errors.Is(err, ratelimit.ErrAnomalyBlocked) || !errors.As(err, &ra) || ra.RetryAfter() != time.Hour {
		t.Fatalf("a shorter refusal replaced a longer one: %v", err)
	}
	if err := m.refusal(principal.Principal{Kind: principal.KindKey, ID: "d"}); err != nil {
		t.Fatalf("a key is not the visitor of the same id: %v", err)
	}
}

func TestSetRateLimit(t *testing.T) {
	h := http.Header{}
	setRateLimit(h, rlItem{name: "daily", q: 5, w: 86400, r: 4, t: 3600}, rlItem{name: "rpm", q: 120, w: 60, r: -1, t: 60})
	if got := h.Get("RateLimit-Policy"); got != `"daily";q=5;w=86400, "rpm";q=120;w=60` {
		t.Fatalf("policy %q", got)
	}
	if got := h.Get("RateLimit"); got != `"daily";r=4;t=3600, "rpm";r=0;t=60` {
		t.Fatalf("ratelimit %q", got)
	}
}

// TestInflight: one principal holds at most max places; the next waits (not
// refused) until one is released, or leaves with its context; another
// principal is never held up.
func TestInflight(t *testing.T) {
	f := newInflight(2)
	a := principal.Principal{Kind: principal.KindVisitor, ID: "a"}
	r1, err := f.acquire(context.Background(), a)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.acquire(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	if rb, err := f.acquire(context.Background(), principal.Principal{Kind: principal.KindKey, ID: "a"}); err != nil {
		t.Fatalf("another principal waited: %v", err)
	} else {
		rb()
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := f.acquire(ctx, a); !errors.Is(err, context.Canceled) {
		t.Fatalf("a third place with a cancelled context: %v", err)
	}
	got := make(chan func(), 1)
	go func() {
		r, err := f.acquire(context.Background(), a)
		if err == nil {
			got <- r
		}
	}()
	r1()
	(<-got)() // the waiter got the released place
	f.mu.Lock()
	defer f.mu.Unlock()
	if l := f.m[keyOf(a)]; l == nil || l.refs != 1 {
		t.Fatalf("lane refs %+v, want the one place still held", l)
	}
}

// hungLimiter's window check waits until its context ends, as a check
// queued for a Redis connection under overload does.
type hungLimiter struct{ Limiter }

func (hungLimiter) Gate(ctx context.Context, _ ratelimit.GateRequest) (ratelimit.GateDecision, error) {
	<-ctx.Done()
	return ratelimit.GateDecision{}, fmt.Errorf("%w: gate: %w", ratelimit.ErrUnavailable, ctx.Err())
}

// TestDeadline: a request out of RequestTimeout inside the server is
// answered, not dropped: 503 server_busy while waiting in its principal's
// lane, or the failing check's own 503 while a check waits for Redis. A
// client that leaves while waiting gets nothing (nobody is there).
func TestDeadline(t *testing.T) {
	const timeout = 50 * time.Millisecond
	s := &server{d: Deps{Now: time.Now, Limits: Limits{RequestTimeout: timeout}, Limiter: hungLimiter{}},
		errors: newErrorTable(errorRows()), limited: newDenials(100, time.Now), inflight: newInflight(1)}
	h := s.deadline(s.window(false)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran after a window check that never answered")
	})))
	p := principal.Principal{Kind: principal.KindVisitor, ID: "v"}
	serve := func(ctx context.Context) (*httptest.ResponseRecorder, *state) {
		st := &state{id: "req-1", principal: p}
		r := httptest.NewRequest("GET", "/api/config", nil)
		r = r.WithContext(context.WithValue(ctx, stateKey{}, st))
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w, st
	}

	// The window check itself hangs: its own 503, in time.
	if w, st := serve(context.Background()); w.Code != 503 || st.code != codes.DemoProtectionUnavailable || w.Header().Get("Retry-After") == "" {
		t.Fatalf("hung check: %d %s %q", w.Code, st.code, w.Header().Get("Retry-After"))
	}

	// The lane is full (one place, held): server_busy when time is up.
	release, err := s.inflight.acquire(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	if w, st := serve(context.Background()); w.Code != 503 || st.code != codes.ServerBusy || w.Header().Get("Retry-After") != "5" {
		t.Fatalf("full lane: %d %s %q", w.Code, st.code, w.Header().Get("Retry-After"))
	}

	// A client gone while waiting: no answer is written.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if w, st := serve(ctx); st.code != "" || w.Body.Len() != 0 {
		t.Fatalf("answered a client that left: %d %s %q", w.Code, st.code, w.Body)
	}
}

// TestSeedPolicies: the refusals of the second window, the soft window,
// the invalid ratio and the hour name their policy with its quota and
// window, and the hour's refusal says it is the hour's (not the day's).
func TestSeedPolicies(t *testing.T) {
	s := &server{d: Deps{Now: time.Now, Limits: Limits{InvalidRatio: 0.5, InvalidMinRequests: 20}}, errors: newErrorTable(errorRows())}
	tier := principal.Tier{Name: "public", RequestsPerMinute: 120, RequestsPerSecond: 10, TokensPerHour: 10000, SoftAt: 0.8, SoftRequestsPerMinute: 5}
	for _, tc := range []struct {
		name, policy, message string
		err                   error
	}{
		{"second", `"rps";q=10;w=1`, "in the last second", &ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, Window: ratelimit.WindowSecond, After: time.Second}},
		{"soft", `"soft";q=5;w=60`, "a few requests a minute", &ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, Window: ratelimit.WindowSoft, After: time.Second}},
		{"minute", `"rpm";q=120;w=60`, "in the last minute", &ratelimit.RefusedError{Reason: ratelimit.ReasonRateLimited, After: time.Second}},
		{"invalid", `"invalid";q=50;w=600`, "were invalid", &ratelimit.RefusedError{Reason: ratelimit.ReasonInvalidRatio, After: time.Second}},
		{"hour", `"hour";q=10000;w=3600`, "for the last hour", &ratelimit.RefusedError{Reason: ratelimit.ReasonHourExhausted, After: time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &state{id: "req-1", tier: tier}
			r := httptest.NewRequest("POST", "/api/tasks", nil)
			r = r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
			w := httptest.NewRecorder()
			s.writeErr(w, r, tc.err)
			if got := w.Header().Get("RateLimit-Policy"); got != tc.policy {
				t.Errorf("RateLimit-Policy %q, want %q", got, tc.policy)
			}
			if !strings.Contains(w.Body.String(), tc.message) {
				t.Errorf("body %s, want %q", w.Body, tc.message)
			}
		})
	}
}
