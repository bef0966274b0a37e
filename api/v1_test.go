package api

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/agent/gateway"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/agent/taskstore"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/ratelimit"
)

// v1Model is a stand-in for the model endpoint: every route of it runs
// the one function, which answers its own errors through errs or returns
// one for its route to answer (the gateway writes its refusals through
// the writer it is handed).
type v1Model func(w http.ResponseWriter, r *http.Request, errs gateway.ErrorWriter) error

// handlers are the model routes of m.
func (m v1Model) handlers(errs gateway.ErrorWriter) gateway.Handlers {
	serve := func(w http.ResponseWriter, r *http.Request) {
		if err := m(w, r, errs); err != nil {
			errs.WriteError(w, r, err)
		}
	}
	call := func(w http.ResponseWriter, r *http.Request, _ []byte) { serve(w, r) }
	// The Messages routes say they served (X-Wire), so the router's choice
	// of a models list by the client's wire shows.
	anthropic := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Wire", "anthropic")
		serve(w, r)
	}
	acall := func(w http.ResponseWriter, r *http.Request, _ []byte) { anthropic(w, r) }
	return gateway.Handlers{Chat: call, Responses: call, Embeddings: call,
		Models: http.HandlerFunc(serve), Model: http.HandlerFunc(serve),
		Messages: &gateway.MessagesHandlers{Messages: acall, CountTokens: acall,
			Models: http.HandlerFunc(anthropic), Model: http.HandlerFunc(anthropic)}}
}

// v1Server is the API with only /v1 wired, on a real task key of a
// running task (miniredis), and the model endpoint given as models.
func v1Server(t *testing.T, models v1Model) (*Server, string, taskkey.Grant) {
	t.Helper()
	be := redistest.Mini(t)
	store := taskstore.New(be.Client)
	now := time.Now().UTC()
	rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusRunning, CreatedAt: now, UpdatedAt: now,
		Steps: []task.Step{}, Warnings: []string{}}, Principal: "v_abcdef0123456789", Tier: "public"}
	if err := store.Create(context.Background(), rec); err != nil {
		t.Fatal(err)
	}
	l, _, err := store.Acquire(context.Background(), taskstore.Entry{ID: "1-1", Task: rec.ID}, "me")
	if err != nil {
		t.Fatal(err)
	}
	keys := taskkey.New(be.Client, taskkey.Options{})
	key, err := keys.Mint(context.Background(), l, rec, now.Add(90*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	g, _ := keys.Authenticate(context.Background(), key)
	srv := NewServer(Deps{Visitors: clientip.NewResolver(nil, "", []byte("k")), Store: store, Registry: prometheus.NewRegistry(),
		V1: &V1{Keys: keys, Limits: tasklimits.New(be.Client, tasklimits.Options{Limits: tasklimits.Limits{Tools: 12, Events: 200}}), Gateway: models.handlers}})
	return srv, key, g
}

func v1Do(srv http.Handler, method, path, key, ct, body string) *httptest.ResponseRecorder {
	r := httptest.NewRequest(method, path, strings.NewReader(body))
	if key != "" {
		r.Header.Set("Authorization", "Bearer "+key)
	}
	if ct != "" {
		r.Header.Set("Content-Type", ct)
	}
	w := httptest.NewRecorder()
	srv.ServeHTTP(w, r)
	return w
}

func v1Code(t *testing.T, w *httptest.ResponseRecorder) (code, typ string) {
	t.Helper()
	var e struct {
		Error struct{ Code, Message, Type string }
	}
	if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Error.Message == "" {
		t.Fatalf("not an OpenAI-shaped error: %d %s", w.Code, w.Body)
	}
	return e.Error.Code, e.Error.Type
}

// TestV1Surface: the model endpoint behind the task key gets the grant in
// its context and answers errors through the one table in the OpenAI
// shape; refusals that last as long as the task say so; the key and the
// body are checked before it runs.
func TestV1Surface(t *testing.T) {
	var seen taskkey.Grant
	var fail error
	srv, key, g := v1Server(t, func(w http.ResponseWriter, r *http.Request, errs gateway.ErrorWriter) error {
		seen, _ = taskkey.FromContext(r.Context())
		if r.URL.Path == "/v1/embeddings" {
			errs.WriteError(w, r, budget.ErrExhausted) // written by the handler itself
			return nil
		}
		if fail != nil {
			return fail
		}
		w.WriteHeader(http.StatusOK)
		return nil
	})
	if w := v1Do(srv, "POST", "/v1/chat/completions", key, "application/json", `{}`); w.Code != 200 || seen.Task != g.Task || seen.Principal != g.Principal {
		t.Fatalf("model call: %d, grant %+v", w.Code, seen)
	}
	if w := v1Do(srv, "GET", "/v1/models", key, "", ""); w.Code != 200 {
		t.Fatalf("models: %d", w.Code)
	}
	if w := v1Do(srv, "GET", "/v1/models/meta-llama/Llama-3.1-8B", key, "", ""); w.Code != 200 {
		t.Fatalf("one model: %d", w.Code)
	}

	w := v1Do(srv, "POST", "/v1/embeddings", key, "application/json", `{}`)
	if code, typ := v1Code(t, w); w.Code != 429 || code != codes.DemoBudgetExhausted || typ != "insufficient_quota" {
		t.Fatalf("budget refusal: %d %s %s", w.Code, code, typ)
	}
	ra, _ := strconv.Atoi(w.Header().Get("Retry-After"))
	if w.Header().Get("X-Should-Retry") != "false" || ra < 85 || ra > 90 ||
		w.Header().Get("Ratelimit") != `"task";r=0;t=`+strconv.Itoa(ra) {
		t.Fatalf("task-scoped refusal headers %v", w.Header())
	}

	fail = &tasklimits.LimitError{Err: tasklimits.ErrEventLimit, Kind: tasklimits.Events, Deadline: time.Now().Add(30 * time.Second), Max: 200}
	w = v1Do(srv, "POST", "/v1/responses", key, "application/json", `{}`)
	if code, _ := v1Code(t, w); w.Code != 429 || code != codes.EventLimit || w.Header().Get("Ratelimit-Policy") != `"task";q=200;w=30` {
		t.Fatalf("limit error: %d %s %v", w.Code, code, w.Header())
	}
	fail = errors.New("a bug")
	w = v1Do(srv, "POST", "/v1/chat/completions", key, "application/json", `{}`)
	if code, typ := v1Code(t, w); w.Code != 500 || code != codes.InternalError || typ != "api_error" {
		t.Fatalf("unknown error: %d %s %s", w.Code, code, typ)
	}

	for _, c := range []struct {
		name, method, path, key, ct, body string
		status                            int
		code, typ                         string
	}{
		{"no key", "POST", "/v1/chat/completions", "", "application/json", `{}`, 401, codes.InvalidAPIKey, "authentication_error"},
		{"forged key", "POST", "/v1/chat/completions", key[:len(key)-2] + "AA", "application/json", `{}`, 401, codes.InvalidAPIKey, "authentication_error"},
		{"other task", "POST", "/v1/tasks/" + task.NewID() + "/events", key, "application/json", `{"name":"a","status":"ok"}`, 401, codes.InvalidAPIKey, "authentication_error"},
		{"not JSON", "POST", "/v1/chat/completions", key, "text/plain", `{}`, 415, codes.UnsupportedMediaType, "invalid_request_error"},
		{"unknown path", "POST", "/v1/nope", key, "application/json", `{}`, 404, codes.NotFound, "invalid_request_error"},
		{"bad event", "POST", "/v1/tasks/" + g.Task + "/events", key, "application/json", `{"name":"a"}`, 400, codes.InvalidRequest, "invalid_request_error"},
		{"bad result", "POST", "/v1/tasks/" + g.Task + "/result", key, "application/json", `{"result":{}}`, 400, codes.InvalidRequest, "invalid_request_error"},
		{"bad fetch", "POST", "/v1/tools/fetch", key, "application/json", `{"max_bytes":0}`, 400, codes.InvalidRequest, "invalid_request_error"},
	} {
		w := v1Do(srv, c.method, c.path, c.key, c.ct, c.body)
		if code, typ := v1Code(t, w); w.Code != c.status || code != c.code || typ != c.typ {
			t.Errorf("%s: %d %s %s, want %d %s %s", c.name, w.Code, code, typ, c.status, c.code, c.typ)
		}
	}
}

// TestV1BudgetMessages: a budget refusal of a model call says which
// budget refused: the task's own (with what it has left; it never
// refills) or the visitor's day; the site's keeps the table's message.
func TestV1BudgetMessages(t *testing.T) {
	for _, tc := range []struct {
		scope budget.Scope
		want  string
	}{
		{budget.ScopeTask, "it has 37 tokens left"},
		{budget.ScopePrincipal, "This visitor's model budget for today is used up"},
		{budget.ScopeSite, "Today's model budget is used up"},
		{budget.ScopeTier, "Today's model budget is used up"},
	} {
		var ex error = &budget.ExhaustedError{Scope: tc.scope, Remaining: 37}
		srv, key, _ := v1Server(t, func(w http.ResponseWriter, r *http.Request, _ gateway.ErrorWriter) error {
			return fmt.Errorf("governed call refused: %w", ex)
		})
		w := v1Do(srv, "POST", "/v1/chat/completions", key, "application/json", `{}`)
		var e struct {
			Error struct{ Code, Message string }
		}
		_ = json.Unmarshal(w.Body.Bytes(), &e)
		if w.Code != 429 || e.Error.Code != codes.DemoBudgetExhausted || !strings.Contains(e.Error.Message, tc.want) {
			t.Errorf("%s: %d %+v, want a message with %q", tc.scope, w.Code, e.Error, tc.want)
		}
		if tc.scope != budget.ScopeTask && strings.Contains(e.Error.Message, "37") {
			t.Errorf("%s: a day's budget shows a number: %q", tc.scope, e.Error.Message)
		}
	}
}

// TestV1RoutesGate: every /v1 route is routed once, on its method, behind
// the one body gate: a body that is not Content-Type: application/json
// (parameters allowed) is 415 on every POST route, whatever the key; a
// route's other methods are 405 with Allow; all in the OpenAI shape.
func TestV1RoutesGate(t *testing.T) {
	srv, key, g := v1Server(t, func(w http.ResponseWriter, r *http.Request, _ gateway.ErrorWriter) error {
		w.WriteHeader(http.StatusOK)
		return nil
	})
	posts := []string{"/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/tools/fetch",
		"/v1/messages", "/v1/messages/count_tokens",
		"/v1/tasks/" + g.Task + "/events", "/v1/tasks/" + g.Task + "/result"}
	gets := []string{"/v1/models", "/v1/models/gpt-4o-mini", "/v1/models/meta-llama/Llama-3.1-8B"}
	for _, path := range posts {
		for _, c := range []struct {
			ct       string
			accepted bool
		}{
			{"", false},
			{"application/json", true},
			{"application/json; charset=utf-8", true},
			{"application/vnd.x+json", false},
			{"application/json-seq", false},
			{"text/plain", false},
		} {
			w := v1Do(srv, http.MethodPost, path, key, c.ct, `{}`)
			if got := w.Code != http.StatusUnsupportedMediaType; got != c.accepted {
				t.Errorf("POST %s with Content-Type %q: %d %s", path, c.ct, w.Code, w.Body)
			}
			if !c.accepted {
				if code, typ := v1Code(t, w); code != codes.UnsupportedMediaType || typ != "invalid_request_error" {
					t.Errorf("POST %s with %q: %s %s", path, c.ct, code, typ)
				}
			}
		}
		for _, m := range []string{http.MethodGet, http.MethodPut, http.MethodDelete} {
			w := v1Do(srv, m, path, key, "application/json", `{}`)
			if code, _ := v1Code(t, w); w.Code != 405 || code != codes.MethodNotAllowed || w.Header().Get("Allow") != "POST" {
				t.Errorf("%s %s: %d %s Allow %q", m, path, w.Code, code, w.Header().Get("Allow"))
			}
		}
	}
	for _, path := range gets {
		if w := v1Do(srv, http.MethodGet, path, key, "", ""); w.Code != 200 {
			t.Errorf("GET %s: %d %s", path, w.Code, w.Body)
		}
		w := v1Do(srv, http.MethodPost, path, key, "application/json", `{}`)
		if code, _ := v1Code(t, w); w.Code != 405 || code != codes.MethodNotAllowed || w.Header().Get("Allow") != "GET" {
			t.Errorf("POST %s: %d %s Allow %q", path, w.Code, code, w.Header().Get("Allow"))
		}
	}
	// Without a key, the gate still answers first: a body is refused by
	// its headers before anything else runs.
	if w := v1Do(srv, http.MethodPost, "/v1/chat/completions", "", "text/plain", `{}`); w.Code != 415 {
		t.Errorf("no key, text/plain: %d", w.Code)
	}
	// A declared body over FAREGATE_V1_MAX_BODY is 413 from its headers.
	r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(`{}`))
	r.Header.Set("Authorization", "Bearer "+key)
	r.Header.Set("Content-Type", "application/json")
	r.ContentLength = DefaultV1MaxBody + 1
	w := httptest.NewRecorder()
	srv.ServeHTTP(w, r)
	if code, _ := v1Code(t, w); w.Code != 413 || code != codes.RequestTooLarge {
		t.Errorf("oversize: %d %s", w.Code, code)
	}
	// A body without a length is cut at the bound by the one reader.
	r = httptest.NewRequest(http.MethodPost, "/v1/responses", strings.NewReader(`{"input":"`+strings.Repeat("a", DefaultV1MaxBody)+`"}`))
	r.Header.Set("Authorization", "Bearer "+key)
	r.Header.Set("Content-Type", "application/json")
	r.ContentLength = -1
	w = httptest.NewRecorder()
	srv.ServeHTTP(w, r)
	if code, _ := v1Code(t, w); w.Code != 413 || code != codes.RequestTooLarge {
		t.Errorf("chunked oversize: %d %s", w.Code, code)
	}
}

// TestV1HourRefusal: a model call refused by its principal's hourly
// tokens is a rate limit the agent may retry: Retry-After the hour's own
// wait, policy "hour" with the principal's quota, not the task-scoped
// answer the day's budgets get.
func TestV1HourRefusal(t *testing.T) {
	refusal := &ratelimit.RefusedError{Reason: ratelimit.ReasonHourExhausted, After: 125 * time.Second, Quota: 10_000}
	srv, key, _ := v1Server(t, func(w http.ResponseWriter, r *http.Request, _ gateway.ErrorWriter) error {
		return fmt.Errorf("governed call refused: %w", refusal)
	})
	w := v1Do(srv, "POST", "/v1/chat/completions", key, "application/json", `{}`)
	var e struct {
		Error struct{ Code, Message, Type string }
	}
	_ = json.Unmarshal(w.Body.Bytes(), &e)
	if w.Code != 429 || e.Error.Code != codes.DemoBudgetExhausted || e.Error.Type != "rate_limit_error" || !strings.Contains(e.Error.Message, "last hour") {
		t.Fatalf("%d %+v", w.Code, e.Error)
	}
	if w.Header().Get("Retry-After") != "125" || w.Header().Get("X-Should-Retry") == "false" ||
		w.Header().Get("RateLimit-Policy") != `"hour";q=10000;w=3600` {
		t.Fatalf("headers %v", w.Header())
	}
}

// TestV1AgentBodiesReadExactly: the events, fetch and result routes read
// member names as the model routes do: a name given twice, or one a
// case-insensitive decoder reads as another, is refused naming it (Go's
// decoder took the last "name" and read "URL" as url); max_bytes is a
// JSON number, never a string holding one.
func TestV1AgentBodiesReadExactly(t *testing.T) {
	srv, key, g := v1Server(t, func(http.ResponseWriter, *http.Request, gateway.ErrorWriter) error { return nil })
	events, result := "/v1/tasks/"+g.Task+"/events", "/v1/tasks/"+g.Task+"/result"
	for _, c := range []struct {
		name, path, body, field string
	}{
		{"event name twice", events, `{"name":"a","status":"ok","name":"b"}`, "name"},
		{"event Name beside name", events, `{"name":"a","Name":"b","status":"ok"}`, "Name"},
		{"event STATUS", events, `{"name":"a","STATUS":"ok"}`, "STATUS"},
		{"event detaiſ", events, `{"name":"a","status":"ok","detaiſ":"x"}`, "detaiſ"},
		{"fetch URL", "/v1/tools/fetch", `{"URL":"https://example.com/"}`, "URL"},
		{"fetch url twice", "/v1/tools/fetch", `{"url":"https://example.com/","url":"http://10.0.0.1/"}`, "url"},
		{"fetch max_bytes as a string", "/v1/tools/fetch", `{"url":"https://example.com/","max_bytes":"100"}`, "max_bytes"},
		{"fetch max_bytes as a fraction", "/v1/tools/fetch", `{"url":"https://example.com/","max_bytes":100.5}`, "max_bytes"},
		{"result text twice", result, `{"result":{"text":"a","text":"b"}}`, "text"},
		{"result Text", result, `{"result":{"Text":"a"}}`, "Text"},
		{"result and RESULT", result, `{"result":{"text":"a"},"RESULT":{"text":"b"}}`, "RESULT"},
	} {
		w := v1Do(srv, "POST", c.path, key, "application/json", c.body)
		var e struct {
			Error struct {
				Code   string
				Fields map[string]string
			}
		}
		_ = json.Unmarshal(w.Body.Bytes(), &e)
		if w.Code != 400 || e.Error.Code != codes.InvalidRequest || e.Error.Fields[c.field] == "" {
			t.Errorf("%s: %d %s, want 400 invalid_request naming %q", c.name, w.Code, w.Body, c.field)
		}
	}
	if w := v1Do(srv, "POST", events, key, "application/json", `{"name":"Search","status":"ok","detail":"{\"Name\":1}"}`); w.Code != 204 {
		t.Fatalf("a well-formed event: %d %s", w.Code, w.Body)
	}
}

// TestV1AnthropicClients: the Messages routes are mounted (a query string
// such as Claude Code's ?beta=true ignored), the task key is read from
// x-api-key as well as a Bearer token on every route, two different keys
// are refused, the models list answers in the client's wire, and the
// Messages routes' refusals are in Anthropic's error shape.
func TestV1AnthropicClients(t *testing.T) {
	srv, key, _ := v1Server(t, func(w http.ResponseWriter, r *http.Request, _ gateway.ErrorWriter) error {
		w.WriteHeader(http.StatusOK)
		return nil
	})
	do := func(method, path string, hdr map[string]string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(method, path, strings.NewReader(`{}`))
		if method == http.MethodPost {
			r.Header.Set("Content-Type", "application/json")
		}
		for k, v := range hdr {
			r.Header.Set(k, v)
		}
		w := httptest.NewRecorder()
		srv.ServeHTTP(w, r)
		return w
	}
	xkey := map[string]string{"X-Api-Key": key, "Anthropic-Version": "2023-06-01"}
	bearer := map[string]string{"Authorization": "Bearer " + key}
	for _, c := range []struct {
		method, path string
		hdr          map[string]string
		status       int
		wire         string
	}{
		{"POST", "/v1/messages", xkey, 200, "anthropic"},
		{"POST", "/v1/messages?beta=true", bearer, 200, "anthropic"},
		{"POST", "/v1/messages/count_tokens?beta=true", xkey, 200, "anthropic"},
		{"POST", "/v1/chat/completions", xkey, 200, ""},
		{"GET", "/v1/models", xkey, 200, "anthropic"},
		{"GET", "/v1/models/claude-x", xkey, 200, "anthropic"},
		{"GET", "/v1/models", bearer, 200, ""},
		{"GET", "/v1/models/gpt-4o-mini", bearer, 200, ""},
		{"POST", "/v1/messages", map[string]string{"X-Api-Key": key, "Authorization": "Bearer " + key}, 200, "anthropic"},
		{"POST", "/v1/messages", map[string]string{"X-Api-Key": key, "Authorization": "Bearer fg_other"}, 401, ""},
		{"POST", "/v1/messages", map[string]string{"X-Api-Key": "fg_other"}, 401, ""},
		{"POST", "/v1/messages", nil, 401, ""},
	} {
		w := do(c.method, c.path, c.hdr)
		if w.Code != c.status || w.Header().Get("X-Wire") != c.wire {
			t.Errorf("%s %s %v: %d wire %q, want %d %q: %s", c.method, c.path, c.hdr, w.Code, w.Header().Get("X-Wire"), c.status, c.wire, w.Body)
		}
		if c.status == 401 {
			var e struct {
				Type  string
				Error struct{ Type, Code, Message string }
			}
			if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || e.Type != "error" ||
				e.Error.Type != "authentication_error" || e.Error.Code != codes.InvalidAPIKey || e.Error.Message == "" {
				t.Errorf("%s %s: not Anthropic's error shape: %s", c.method, c.path, w.Body)
			}
		}
	}
}

// TestV1WithoutAnAgent: a deployment of the built-in planner mounts no
// /v1 routes; a request there, of any method, is a JSON 404 not_found in
// the model endpoint's shape (Anthropic's on the Messages paths), not the
// page's own text answer.
func TestV1WithoutAnAgent(t *testing.T) {
	page := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
	})
	srv := NewServer(Deps{Visitors: clientip.NewResolver(nil, "", []byte("k")), Registry: prometheus.NewRegistry(), Web: page})
	for _, c := range []struct{ method, path, typ string }{
		{http.MethodPost, "/v1/chat/completions", "invalid_request_error"},
		{http.MethodGet, "/v1/models", "invalid_request_error"},
		{http.MethodPost, "/v1/messages?beta=true", "not_found_error"},
	} {
		w := v1Do(srv, c.method, c.path, "", "application/json", `{}`)
		var e struct {
			Error struct{ Code, Type, Message string }
		}
		if err := json.Unmarshal(w.Body.Bytes(), &e); err != nil || w.Code != 404 || e.Error.Code != codes.NotFound || e.Error.Message == "" || e.Error.Type != c.typ {
			t.Errorf("%s %s: %d %s", c.method, c.path, w.Code, w.Body)
		}
	}
}
