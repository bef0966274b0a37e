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

	"faregate/agent/govern"
	"faregate/agent/offline"
	"faregate/agent/task"
	"faregate/agent/tasklimits"
	"faregate/protect/kit/testkit/clocktest"
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
	specs    []govern.Spec
	attempts []govern.Attempt
	outs     []govern.Outcome
	errs     []error
	done     chan struct{} // closed by the first Call's end, if set
	ended    int
	// settle, if set, runs where the real Governor settles the call and
	// writes its step: after the attempts, before Call returns.
	settle func()
	// settleErr, if set, is returned by a call whose attempt answered (a
	// settle that failed after the answer).
	settleErr error
	// firstEvent, if set, is every attempt's FirstEvent.
	firstEvent func()
}

func (g *fakeGov) Call(ctx context.Context, spec govern.Spec, attempt func(context.Context, govern.Attempt) (govern.Outcome, error)) (govern.Result, error) {
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
	// The slot is taken first and its end told how the call ended, as
	// the real governor does.
	var end govern.HoldEnd
	if spec.Hold != nil {
		e, err := spec.Hold(ctx)
		if err != nil {
			return govern.Result{}, err
		}
		end = e
	}
	if g.refuse != nil {
		if end != nil {
			end(ctx, govern.Result{}, g.refuse)
		}
		return govern.Result{}, g.refuse
	}
	a := govern.Attempt{Model: modelOf(spec.Model, *g.up), MaxOutput: g.cap, FirstEvent: g.firstEvent}
	if g.model != "" {
		a.Model.Name = g.model
	}
	if spec.Kind == KindEmbeddings {
		a.MaxOutput = 0
	} else if spec.MaxOutput > 0 && spec.MaxOutput < a.MaxOutput {
		a.MaxOutput = spec.MaxOutput
	}
	out, err := g.try(ctx, attempt, a)
	if err != nil && !out.Started && g.fallback != nil {
		a.Model, a.Fallback = modelOf(a.Model.Name, *g.fallback), true
		out, err = g.try(ctx, attempt, a)
	}
	res := govern.Result{Outcome: out, Model: a.Model, FellBack: a.Fallback, Charged: out.Usage}
	if g.settle != nil {
		g.settle()
	}
	if end != nil {
		end(ctx, res, err)
	}
	if spec.After != nil {
		spec.After(ctx, res, err)
	}
	if err == nil && g.settleErr != nil {
		return res, g.settleErr
	}
	return res, err
}

// modelOf is a model of the governor's named name on up.
func modelOf(name string, up Upstream) govern.Model {
	return govern.Model{Name: name, BaseURL: up.BaseURL, APIKey: up.APIKey, HTTPClient: up.Client}
}

// testRecords is every task's record as the tests' tasks have it: the
// principal p1, today's day.
func testRecords(_ context.Context, id string) (task.Record, error) {
	return task.Record{Task: task.Task{ID: id}, Principal: "p1", Day: time.Now().UTC().Format(time.DateOnly)}, nil
}

func (g *fakeGov) try(ctx context.Context, attempt func(context.Context, govern.Attempt) (govern.Outcome, error), a govern.Attempt) (govern.Outcome, error) {
	out, err := attempt(ctx, a)
	g.mu.Lock()
	g.attempts = append(g.attempts, a)
	g.outs = append(g.outs, out)
	g.errs = append(g.errs, err)
	g.mu.Unlock()
	return out, err
}

func (g *fakeGov) last(t *testing.T) (govern.Spec, govern.Attempt, govern.Outcome, error) {
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
	{ErrInvalidRequest, 400, "invalid_request", "invalid_request_error"},
	{ErrModelNotAllowed, 400, "model_not_allowed", "invalid_request_error"},
	{ErrUnsupportedParameter, 400, "unsupported_parameter", "invalid_request_error"},
	{tasklimits.ErrStepLimit, 429, "step_limit", "insufficient_quota"},
	{tasklimits.ErrTooManyCalls, 429, "too_many_calls", "rate_limit_error"},
	{tasklimits.ErrUnavailable, 503, "demo_protection_unavailable", "api_error"},
	{ErrCallEnded, 409, "task_finished", "invalid_request_error"},
	{ErrUpstreamInvalid, 400, "invalid_request", "invalid_request_error"},
	{ErrUpstream, 503, "model_unavailable", "api_error"},
	{ErrUpstreamAnswer, 502, "upstream_invalid", "api_error"},
	{errBudget, 429, "demo_budget_exhausted", "insufficient_quota"},
}

var errBudget = errors.New("test: budget exhausted")

// testErrors is the tests' /v1 error writer: the shape of the api's, with
// the codes of testErrors (the api's own table is tested in package api).
type testErrorWriter struct{}

func (testErrorWriter) WriteError(w http.ResponseWriter, r *http.Request, err error) {
	writeTestError(w, r, err)
}

func (testErrorWriter) ErrorEvent(r *http.Request, err error) []byte {
	rec := httptest.NewRecorder()
	writeTestError(rec, r, err)
	return rec.Body.Bytes()
}

// testMux routes the model endpoint's handlers as the api's router does,
// reading a POST body whole (the router's gate is tested in package api).
func testMux(h Handlers) http.Handler {
	calls := map[string]Call{"/v1/chat/completions": h.Chat, "/v1/responses": h.Responses, "/v1/embeddings": h.Embeddings}
	return routeTest(calls, h.Models, h.Model, writeTestError)
}

// routeTest is the router testMux and msgMux share: POST calls by path,
// the two model lookups, and writeErr for a body that cannot be read and
// for any other route.
func routeTest(calls map[string]Call, models, model http.Handler, writeErr func(http.ResponseWriter, *http.Request, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if c, ok := calls[r.URL.Path]; ok && r.Method == http.MethodPost {
			body, err := io.ReadAll(r.Body)
			if err != nil {
				writeErr(w, r, invalid("body", "could not be read"))
				return
			}
			c(w, r, body)
			return
		}
		switch {
		case r.Method == http.MethodGet && r.URL.Path == "/v1/models":
			models.ServeHTTP(w, r)
		case r.Method == http.MethodGet && strings.HasPrefix(r.URL.Path, "/v1/models/"):
			model.ServeHTTP(w, r)
		default:
			writeErr(w, r, ErrNotFound)
		}
	})
}

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
	o := Options{Governor: e.gov, Records: testRecords, Task: func(*http.Request) (Task, bool) { return e.task, true },
		Errors: testErrorWriter{}, EmbeddingModel: "text-embedding-3-small"}
	if mod != nil {
		mod(&o)
	}
	e.srv = httptest.NewServer(testMux(New(o)))
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
