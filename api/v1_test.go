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

	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/taskstore"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/codes"
	"faregate/protect/redistest"
)

// v1Server is the API with only /v1 wired, on a real task key of a
// running task (miniredis), and the model endpoint given as models.
func v1Server(t *testing.T, models V1Handler) (*Server, string, taskkey.Grant) {
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
		V1: &V1{Keys: keys, Models: models}})
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
	srv, key, g := v1Server(t, func(w http.ResponseWriter, r *http.Request) error {
		seen, _ = taskkey.FromContext(r.Context())
		if r.URL.Path == "/v1/embeddings" {
			WriteV1Error(w, r, budget.ErrExhausted) // written by the handler itself
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

	fail = &taskkey.LimitError{Err: taskkey.ErrEventLimit, Deadline: time.Now().Add(30 * time.Second), Max: 200}
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
		srv, key, _ := v1Server(t, func(w http.ResponseWriter, r *http.Request) error {
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
