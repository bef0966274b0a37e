package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"faregate/agent/offline"
	"faregate/protect/clocktest"
)

// fakeGov is a Governor that records every call: it grants MaxOutput (the
// client's ask, capped at cap), retries once on the fallback when the
// primary fails before the answer started, and keeps what each attempt
// returned.
type fakeGov struct {
	up, fallback *Upstream
	cap          int64
	model        string // sent upstream; "" = the requested one
	refuse       error

	mu       sync.Mutex
	specs    []Spec
	attempts []Attempt
	outs     []Outcome
	errs     []error
	done     chan struct{} // closed by the first Call's end, if set
	ended    int
	// settle, if set, runs where the real Governor settles the call and
	// writes its step: after the attempts, before Call returns.
	settle func()
	// settleErr, if set, is returned by a call whose attempt answered (a
	// settle that failed after the answer).
	settleErr error
}

func (g *fakeGov) Call(ctx context.Context, spec Spec, attempt func(context.Context, Attempt) (Outcome, error)) (Outcome, error) {
	g.mu.Lock()
	g.specs = append(g.specs, spec)
	g.mu.Unlock()
	defer func() {
		g.mu.Lock()
		g.ended++
		g.mu.Unlock()
		if g.done != nil {
			close(g.done)
			g.done = nil
		}
	}()
	// The slot is taken first and given back uncounted on a refusal, as
	// the real governor does.
	release := func(context.Context, bool) {}
	if spec.Hold != nil {
		rel, err := spec.Hold(ctx)
		if err != nil {
			return Outcome{}, err
		}
		release = rel
	}
	if g.refuse != nil {
		release(ctx, false)
		return Outcome{}, g.refuse
	}
	defer release(ctx, true)
	a := Attempt{Model: spec.Model, Upstream: *g.up, MaxOutput: g.cap}
	if g.model != "" {
		a.Model = g.model
	}
	if spec.Kind == KindEmbeddings {
		a.MaxOutput = 0
	} else if spec.MaxOutput > 0 && spec.MaxOutput < a.MaxOutput {
		a.MaxOutput = spec.MaxOutput
	}
	out, err := g.try(ctx, attempt, a)
	if err != nil && !out.Started && g.fallback != nil {
		a.Upstream, a.Fallback = *g.fallback, true
		out, err = g.try(ctx, attempt, a)
	}
	if g.settle != nil {
		g.settle()
	}
	if err == nil && g.settleErr != nil {
		return out, g.settleErr
	}
	return out, err
}

func (g *fakeGov) try(ctx context.Context, attempt func(context.Context, Attempt) (Outcome, error), a Attempt) (Outcome, error) {
	out, err := attempt(ctx, a)
	g.mu.Lock()
	g.attempts = append(g.attempts, a)
	g.outs = append(g.outs, out)
	g.errs = append(g.errs, err)
	g.mu.Unlock()
	return out, err
}

func (g *fakeGov) last(t *testing.T) (Spec, Attempt, Outcome, error) {
	t.Helper()
	// The answer completes after Call's settle, but the client may read
	// it before Call's deferred bookkeeping here: wait for every call
	// begun to end.
	waitFor(t, "the governed calls to end", func() bool {
		g.mu.Lock()
		defer g.mu.Unlock()
		return len(g.specs) > 0 && g.ended == len(g.specs)
	})
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.outs) == 0 {
		t.Fatal("no attempt was made")
	}
	n := len(g.outs) - 1
	return g.specs[len(g.specs)-1], g.attempts[n], g.outs[n], g.errs[n]
}

// testErrors is the integrator's table as the package doc gives it.
var testErrors = []struct {
	err    error
	status int
	code   string
	typ    string
}{
	{ErrNoTask, 401, "invalid_api_key", "authentication_error"},
	{ErrNotFound, 404, "not_found", "invalid_request_error"},
	{ErrMethodNotAllowed, 405, "method_not_allowed", "invalid_request_error"},
	{ErrInvalidRequest, 400, "invalid_request", "invalid_request_error"},
	{ErrUnsupportedMedia, 415, "unsupported_media_type", "invalid_request_error"},
	{ErrTooLarge, 413, "request_too_large", "invalid_request_error"},
	{ErrModelNotAllowed, 400, "model_not_allowed", "invalid_request_error"},
	{ErrUnsupportedParameter, 400, "unsupported_parameter", "invalid_request_error"},
	{ErrStepLimit, 429, "step_limit", "insufficient_quota"},
	{ErrTooManyCalls, 429, "too_many_calls", "rate_limit_error"},
	{ErrLimitsUnavailable, 503, "demo_protection_unavailable", "api_error"},
	{ErrCallEnded, 409, "task_finished", "invalid_request_error"},
	{ErrUpstreamInvalid, 400, "invalid_request", "invalid_request_error"},
	{ErrUpstream, 503, "model_unavailable", "api_error"},
	{errBudget, 429, "demo_budget_exhausted", "insufficient_quota"},
}

var errBudget = errors.New("test: budget exhausted")

func writeTestError(w http.ResponseWriter, r *http.Request, err error) {
	status, code, typ := 500, "internal_error", "api_error"
	for _, e := range testErrors {
		if errors.Is(err, e.err) {
			status, code, typ = e.status, e.code, e.typ
			break
		}
	}
	var param any
	var pe *ParamError
	if errors.As(err, &pe) {
		param = pe.Param()
	}
	if d, ok := retryAfterOf(err); ok {
		w.Header().Set("Retry-After", itoa(int64((d+time.Second-1)/time.Second)))
	}
	if typ == "insufficient_quota" {
		w.Header().Set("X-Should-Retry", "false")
	}
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"code": code, "message": err.Error(), "type": typ, "param": param}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// env is a gateway in front of an upstream, and an official client for it.
type env struct {
	gov    *fakeGov
	srv    *httptest.Server
	client openai.Client
	task   Task
}

const testModel = "gpt-4o-mini"

func newEnv(t *testing.T, up Upstream, mod func(*Options)) *env {
	t.Helper()
	e := &env{gov: &fakeGov{up: &up, cap: 1000}}
	e.task = Task{ID: "t_test", Principal: "p1", Tier: "public", Deadline: time.Now().Add(time.Hour),
		Models: []string{testModel, offline.ModelName}}
	o := Options{Governor: e.gov, Task: func(*http.Request) (Task, bool) { return e.task, true },
		WriteError: writeTestError, EmbeddingModel: "text-embedding-3-small"}
	if mod != nil {
		mod(&o)
	}
	e.srv = httptest.NewServer(New(o))
	t.Cleanup(e.srv.Close)
	e.client = openai.NewClient(option.WithBaseURL(e.srv.URL+"/v1/"), option.WithAPIKey("fgt_test"), option.WithMaxRetries(0))
	return e
}

func offlineUpstream() Upstream {
	return Upstream{BaseURL: offline.BaseURL, Client: offline.Client()}
}

// scripted is an httptest provider whose answer a test writes; it keeps
// the bodies it was sent.
type scripted struct {
	srv    *httptest.Server
	mu     sync.Mutex
	bodies [][]byte
	serve  func(w http.ResponseWriter, r *http.Request, body map[string]any)
	gone   chan struct{} // closed when a request's context ends
}

func newScripted(t *testing.T, serve func(w http.ResponseWriter, r *http.Request, body map[string]any)) *scripted {
	t.Helper()
	s := &scripted{serve: serve, gone: make(chan struct{}, 16)}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		s.mu.Lock()
		s.bodies = append(s.bodies, b)
		s.mu.Unlock()
		var m map[string]any
		_ = json.Unmarshal(b, &m)
		context.AfterFunc(r.Context(), func() { s.gone <- struct{}{} })
		s.serve(w, r, m)
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *scripted) upstream() Upstream {
	return Upstream{BaseURL: s.srv.URL + "/v1", APIKey: "sk-upstream", Client: s.srv.Client()}
}

func (s *scripted) lastBody(t *testing.T) map[string]any {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.bodies) == 0 {
		t.Fatal("the upstream got no request")
	}
	var m map[string]any
	if err := json.Unmarshal(s.bodies[len(s.bodies)-1], &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// sse writes events and flushes each.
func sse(w http.ResponseWriter, events ...string) {
	w.Header().Set("Content-Type", "text/event-stream")
	for _, ev := range events {
		_, _ = io.WriteString(w, ev+"\n\n")
		w.(http.Flusher).Flush()
	}
}

func chunkJSON(content string) string {
	b, _ := json.Marshal(map[string]any{"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": testModel,
		"choices": []any{map[string]any{"index": 0, "delta": map[string]any{"content": content}, "finish_reason": nil}}})
	return "data: " + string(b)
}

// post sends a raw request to the gateway.
func (e *env) post(t *testing.T, path, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	clocktest.Eventually(t, 10*time.Second, what, cond)
}

func asAPIError(err error, target **openai.Error) bool { return errors.As(err, target) }

// retryAfterOf is the Retry-After an error carries, as the api writer reads it.
func retryAfterOf(err error) (time.Duration, bool) {
	var re interface{ RetryAfter() time.Duration }
	if errors.As(err, &re) {
		return re.RetryAfter(), true
	}
	return 0, false
}
