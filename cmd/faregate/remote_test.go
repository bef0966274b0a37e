package main

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/agent/task"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// The external agent (issue #21) end to end: two replicas through run on
// one redis-server, an httptest agent, and the visitor's view (GET and
// the event stream) on the replica that did not deliver.

const agentSecret = "agent-secret-0123456789"

// delivery is a delivery as the fake agent received it.
type delivery struct {
	Raw       []byte
	Signature string
	Body      struct {
		Task struct {
			ID       string          `json:"id"`
			Request  json.RawMessage `json:"request"`
			Deadline time.Time       `json:"deadline"`
			SentAt   time.Time       `json:"sent_at"`
		} `json:"task"`
		OpenAI struct {
			BaseURL        string `json:"base_url"`
			APIKey         string `json:"api_key"`
			Model          string `json:"model"`
			EmbeddingModel string `json:"embedding_model"`
		} `json:"openai"`
		Anthropic struct {
			BaseURL string `json:"base_url"`
			APIKey  string `json:"api_key"`
			Model   string `json:"model"`
		} `json:"anthropic"`
		Tools struct {
			FetchURL string `json:"fetch_url"`
		} `json:"tools"`
		EventsURL string `json:"events_url"`
		ResultURL string `json:"result_url"`
	}
	destination string
}

// fakeAgent answers deliveries by the trip's destination, which names
// what to do: "ok" (events to the other replica, then 200), "accept"
// (202, then the result POSTed to the other replica), "status500",
// "invalid", "hang", "silent" (202 and nothing), "reset" (the connection
// closed before any byte of an answer).
type fakeAgent struct {
	t        *testing.T
	srv      *httptest.Server
	replicas []string

	mu         sync.Mutex
	deliveries map[string][]delivery // by destination
	posts      map[string][]int      // statuses of what the agent posted, by destination
	done       chan string           // destinations whose follow-up posts are done
	// limitAnswers are the answers of "limits", in order (one task).
	limitAnswers []limitAnswer
}

func newFakeAgent(t *testing.T) *fakeAgent {
	a := &fakeAgent{t: t, deliveries: map[string][]delivery{}, posts: map[string][]int{}, done: make(chan string, 16)}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

// other is the replica that did not deliver d.
func (a *fakeAgent) other(d delivery) string {
	for _, r := range a.replicas {
		if !strings.HasPrefix(d.Body.EventsURL, r+"/") {
			return r
		}
	}
	a.t.Errorf("delivery from no known replica: %s", d.Body.EventsURL)
	return a.replicas[0]
}

// post sends body to url (rebased on base) with the delivery's key.
func (a *fakeAgent) post(base, url, key, body string) (int, []byte) {
	path := url[strings.Index(url, "/v1/"):]
	req, _ := http.NewRequest("POST", base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		a.t.Errorf("post %s: %v", path, err)
		return 0, nil
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, raw
}

func (a *fakeAgent) record(dest string, status int) {
	a.mu.Lock()
	a.posts[dest] = append(a.posts[dest], status)
	a.mu.Unlock()
}

func (a *fakeAgent) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	d := delivery{Raw: raw, Signature: r.Header.Get("X-Faregate-Signature")}
	if err := json.Unmarshal(raw, &d.Body); err != nil {
		a.t.Errorf("delivery body: %v %s", err, raw)
		return
	}
	var req struct{ Destination string }
	_ = json.Unmarshal(d.Body.Task.Request, &req)
	d.destination = req.Destination
	a.mu.Lock()
	a.deliveries[d.destination] = append(a.deliveries[d.destination], d)
	a.mu.Unlock()
	key := d.Body.OpenAI.APIKey
	switch d.destination {
	case "ok":
		other := a.other(d)
		for _, ev := range []string{
			`{"name":"search","status":"started"}`,
			`{"name":"search","status":"ok","detail":"3 pages"}`,
			`{"name":"write","status":"started"}`,
			`{"name":"write","status":"ok"}`,
		} {
			st, _ := a.post(other, d.Body.EventsURL, key, ev)
			a.record(d.destination, st)
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"result":{"text":"# Lisbon\n\nEat *pastéis*.","title":"Three days in Lisbon"}}`)
	case "accept":
		w.WriteHeader(http.StatusAccepted)
		go func() {
			other := a.other(d)
			// The live key on another task's path: refused.
			st, _ := a.post(other, "/v1/tasks/"+task.NewID()+"/events", key, `{"name":"x","status":"started"}`)
			a.record(d.destination, st)
			st, _ = a.post(other, d.Body.EventsURL, key, `{"name":"think","status":"started"}`)
			a.record(d.destination, st)
			st, _ = a.post(other, d.Body.ResultURL, key, `{"result":{"text":"Posted later."}}`)
			a.record(d.destination, st)
			st, _ = a.post(other, d.Body.ResultURL, key, `{"result":{"text":"Again."}}`)
			a.record(d.destination, st)
			a.done <- d.destination
		}()
	case "limits":
		// Tools and events up to their limits, then 200. The fetches name
		// a host that resolves to loopback: refused when dialled, and
		// counted (a loopback literal is refused before it counts).
		other := a.other(d)
		for i := 0; i < 13; i++ {
			st, raw := a.postFull(other, d.Body.Tools.FetchURL, key, `{"url":"http://localhost:1/"}`)
			a.limitAnswers = append(a.limitAnswers, limitAnswer{"fetch", st, raw})
		}
		for i := 0; i < 201; i++ {
			st, raw := a.postFull(other, d.Body.EventsURL, key, fmt.Sprintf(`{"name":"e%d","status":"ok"}`, i))
			if i >= 199 {
				a.limitAnswers = append(a.limitAnswers, limitAnswer{"event", st, raw})
			}
		}
		for _, bad := range []string{"{\"name\":\"a\u200bb\",\"status\":\"ok\"}", `{"name":"x","status":"done"}`, `[1]`, `{"name":"` + strings.Repeat("n", 65) + `","status":"ok"}`} {
			st, raw := a.postFull(other, d.Body.EventsURL, key, bad)
			a.limitAnswers = append(a.limitAnswers, limitAnswer{"bad", st, raw})
		}
		_, _ = io.WriteString(w, `{"result":{"text":"done"}}`)
	case "status500":
		http.Error(w, "boom", http.StatusInternalServerError)
	case "invalid":
		_, _ = io.WriteString(w, `{"result":{"text":""}}`)
	case "hang":
		select {
		case <-r.Context().Done():
		case <-time.After(time.Minute):
		}
	case "silent":
		w.WriteHeader(http.StatusAccepted)
	case "reset":
		c, _, err := w.(http.Hijacker).Hijack()
		if err == nil {
			_ = c.Close()
		}
	default:
		a.t.Errorf("unknown destination %q", d.destination)
	}
}

// delivered returns the deliveries for dest.
func (a *fakeAgent) delivered(dest string) []delivery {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]delivery(nil), a.deliveries[dest]...)
}

func (a *fakeAgent) posted(dest string) []int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]int(nil), a.posts[dest]...)
}

// limitAnswer is one answer the agent met in "limits".
type limitAnswer struct {
	what   string
	status int
	resp   *http.Response
}

// postFull is post keeping the answer's headers.
func (a *fakeAgent) postFull(base, url, key, body string) (int, *http.Response) {
	path := url[strings.Index(url, "/v1/"):]
	req, _ := http.NewRequest("POST", base+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		a.t.Errorf("post %s: %v", path, err)
		return 0, nil
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(raw))
	return resp.StatusCode, resp
}

// agentEnv is two replicas' environment for the fake agent.
func agentEnv(redisURL, agentURL string, extra map[string]string) map[string]string {
	env := realRedisEnv(redisURL, map[string]string{
		"FAREGATE_AGENT_URL": agentURL, "FAREGATE_AGENT_SECRET": agentSecret,
		"FAREGATE_AGENT_TIMEOUT": "4s", "FAREGATE_IP_DAILY_LIMIT": "100", "FAREGATE_STREAMS_PER_VISITOR": "50",
		// The fake agent reads what to do from the trip's destination.
		"FAREGATE_TASK_INPUT": "trip",
	})
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// keyRefused checks that key is refused as no key at all (401, OpenAI
// shape) on every base for task id's events.
func keyRefused(t *testing.T, key, id string, bases ...string) {
	t.Helper()
	keyAnswered(t, key, id, 401, "invalid_api_key", "authentication_error", bases...)
}

// keyEnded checks that key is answered as the key of a task that has ended
// (409 task_finished, OpenAI shape) on every base, for every /v1 request
// it may make: an event, a fetch, a model call, the model list, a result.
func keyEnded(t *testing.T, key, id string, bases ...string) {
	t.Helper()
	keyAnswered(t, key, id, 409, "task_finished", "invalid_request_error", bases...)
}

func keyAnswered(t *testing.T, key, id string, status int, code, typ string, bases ...string) {
	t.Helper()
	reqs := []struct{ method, path, body string }{
		{"POST", "/v1/tasks/" + id + "/events", `{"name":"late","status":"started"}`},
		{"POST", "/v1/tasks/" + id + "/result", `{"result":{"text":"late"}}`},
		{"POST", "/v1/tools/fetch", `{"url":"https://example.org/"}`},
		{"POST", "/v1/chat/completions", `{"model":"gpt-3.5-turbo","messages":[{"role":"user","content":"hi"}]}`},
		{"GET", "/v1/models", ""},
	}
	// The task has ended when this is called: a replica may still answer
	// from its memory of the key for at most a second.
	deadline := time.Now().Add(time.Second)
	for _, b := range bases {
		for _, q := range reqs {
			var r reply
			var e map[string]any
			answered := func() bool {
				r = do(t, q.method, b+q.path, q.body, map[string]string{"Authorization": "Bearer " + key})
				e, _ = r.Body["error"].(map[string]any)
				return r.Status == status && e["code"] == code && e["type"] == typ
			}
			if !clocktest.Poll(time.Until(deadline), answered) {
				t.Fatalf("key after the task on %s %s: %d %s, want %d %s %s", b, q.path, r.Status, r.Raw, status, code, typ)
			}
		}
	}
}

// createTrip admits a trip task with destination dest on base.
func createTrip(t *testing.T, base, dest string) string {
	t.Helper()
	r := do(t, "POST", base+"/api/tasks", taskBody(dest), nil)
	if r.Status != 202 {
		t.Fatalf("create %s: %d %s", dest, r.Status, r.Raw)
	}
	return r.Body["id"].(string)
}

// TestExternalAgent: deliveries are signed and shaped as the manual
// says; a result comes back as a 200 or as a 202 and a POST to the other
// replica; the agent's progress reaches a follower on the other replica
// in order; each way an agent can fail ends the task with its code and
// the final events; the key is refused after its task, on another task's
// path, on /api, and forged, on both replicas.
func TestExternalAgent(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	agent := newFakeAgent(t)
	// Five tasks created and followed at once, on two replicas sharing the
	// one address's windows.
	env := agentEnv(rs.URL(), agent.srv.URL, map[string]string{"FAREGATE_REQUESTS_PER_SECOND": "0"})
	a := startServer(t, env)
	b := startServer(t, env)
	agent.replicas = []string{a.URL, b.URL}
	if !strings.Contains(a.Out.String(), "the plan cache is off") {
		t.Errorf("no start-up line says the plan cache is off:\n%s", a.Out.String())
	}

	t.Run("200", func(t *testing.T) {
		id := createTrip(t, a.URL, "ok")
		f := follow(t, b.URL+"/api/tasks/"+id+"/events")
		got, ok := pollTask(t, b.URL, id, 20*time.Second, func(m map[string]any) bool { return m["status"] == "succeeded" || m["status"] == "failed" })
		if !ok || got["status"] != "succeeded" {
			t.Fatalf("task: %v", got)
		}
		ds := agent.delivered("ok")
		if len(ds) != 1 {
			t.Fatalf("%d deliveries, want 1", len(ds))
		}
		d := ds[0]
		checkDelivery(t, d, id, agent.replicas)
		if st := agent.posted("ok"); !slices.Equal(st, []int{204, 204, 204, 204}) {
			t.Fatalf("event posts answered %v, want four 204", st)
		}
		res, _ := got["result"].(map[string]any)
		if res["text"] != "# Lisbon\n\nEat *pastéis*." || res["title"] != "Three days in Lisbon" || res["language"] != "en" ||
			res["model"] != d.Body.OpenAI.Model || res["warnings"] == nil {
			t.Fatalf("result %v", res)
		}
		if _, has := res["days"]; has {
			t.Fatalf("a text result carries plan fields: %v", res)
		}
		evs := f.waitEnded(t, 10*time.Second)
		assertFinalEvents(t, evs, "succeeded", "")
		var steps []string
		for _, e := range evs {
			if e.Type != "step" {
				continue
			}
			var s task.Step
			_ = json.Unmarshal([]byte(e.Data), &s)
			if s.Kind != task.KindAgent {
				t.Fatalf("step of kind %q: %s", s.Kind, e.Data)
			}
			steps = append(steps, fmt.Sprintf("%d:%s:%s", s.Seq, s.Name, s.Status))
		}
		if want := []string{"1:search:started", "1:search:ok", "2:write:started", "2:write:ok"}; !slices.Equal(steps, want) {
			t.Fatalf("steps on the follower's stream %v, want %v", steps, want)
		}
		stored, _ := got["steps"].([]any)
		if len(stored) != 2 {
			t.Fatalf("task steps %v, want the two agent steps", stored)
		}
		keyEnded(t, d.Body.OpenAI.APIKey, id, a.URL, b.URL)
		// The key never creates tasks.
		for _, base := range []string{a.URL, b.URL} {
			r := do(t, "POST", base+"/api/tasks", taskBody("ok"), map[string]string{"Authorization": "Bearer " + d.Body.OpenAI.APIKey})
			if r.Status != 401 || r.code() != "invalid_api_key" {
				t.Fatalf("task key on /api/tasks: %d %s", r.Status, r.Raw)
			}
		}
	})

	t.Run("202 and result_url", func(t *testing.T) {
		id := createTrip(t, a.URL, "accept")
		got, ok := pollTask(t, b.URL, id, 20*time.Second, func(m map[string]any) bool { return m["status"] == "succeeded" || m["status"] == "failed" })
		if !ok || got["status"] != "succeeded" {
			t.Fatalf("task: %v", got)
		}
		select {
		case <-agent.done:
		case <-time.After(20 * time.Second):
			t.Fatal("the agent's posts did not finish")
		}
		st := agent.posted("accept")
		// another task's path, an event, the result, the result again.
		if len(st) != 4 || st[0] != 401 || st[1] != 204 || st[2] != 204 || (st[3] != 409 && st[3] != 401) {
			t.Fatalf("posts answered %v, want 401 (other task), 204, 204 (stored), then 409 or 401", st)
		}
		res, _ := got["result"].(map[string]any)
		if res["text"] != "Posted later." {
			t.Fatalf("result %v", res)
		}
		d := agent.delivered("accept")[0]
		keyEnded(t, d.Body.OpenAI.APIKey, id, a.URL, b.URL)
	})

	t.Run("tool and event limits", func(t *testing.T) {
		id := createTrip(t, a.URL, "limits")
		if got, ok := pollTask(t, b.URL, id, 20*time.Second, statusIs("succeeded")); !ok {
			t.Fatalf("task: %v", got)
		}
		ans := agent.limitAnswers
		if len(ans) != 13+2+4 {
			t.Fatalf("%d answers", len(ans))
		}
		v1err := func(la limitAnswer) (code, typ string) {
			var e struct{ Error struct{ Code, Type string } }
			raw, _ := io.ReadAll(la.resp.Body)
			_ = json.Unmarshal(raw, &e)
			return e.Error.Code, e.Error.Type
		}
		for i, la := range ans[:12] {
			if code, typ := v1err(la); la.status != 400 || code != "fetch_refused" || typ != "invalid_request_error" {
				t.Fatalf("fetch %d of a loopback address: %d %s %s", i, la.status, code, typ)
			}
		}
		for _, la := range []limitAnswer{ans[12], ans[14]} {
			code, typ := v1err(la)
			h := la.resp.Header
			ra, _ := strconv.Atoi(h.Get("Retry-After"))
			if la.status != 429 || typ != "insufficient_quota" || h.Get("X-Should-Retry") != "false" || ra < 1 || ra > 4 ||
				!strings.HasPrefix(h.Get("RateLimit-Policy"), `"task";`) || !strings.Contains(h.Get("RateLimit"), fmt.Sprintf(`"task";r=0;t=%d`, ra)) {
				t.Fatalf("%s past its limit: %d %s %s %v", la.what, la.status, code, typ, h)
			}
			if want := map[string]string{"fetch": "tool_limit", "event": "event_limit"}[la.what]; code != want {
				t.Fatalf("%s past its limit: code %s, want %s", la.what, code, want)
			}
		}
		if ans[13].status != 204 {
			t.Fatalf("the 200th event: %d", ans[13].status)
		}
		for _, la := range ans[15:] {
			if code, _ := v1err(la); la.status != 400 || code != "invalid_request" {
				t.Fatalf("bad event: %d %s", la.status, code)
			}
		}
	})

	t.Run("failures", func(t *testing.T) {
		cases := []struct{ dest, code string }{
			{"status500", codes.AgentFailed},
			{"invalid", codes.AgentFailed},
			{"hang", codes.AgentUnreachable},
			{"silent", codes.AgentTimeout},
			{"reset", codes.AgentUnreachable},
		}
		ids := map[string]string{}
		followers := map[string]*follower{}
		for _, c := range cases {
			ids[c.dest] = createTrip(t, a.URL, c.dest)
			followers[c.dest] = follow(t, b.URL+"/api/tasks/"+ids[c.dest]+"/events")
		}
		for _, c := range cases {
			id := ids[c.dest]
			waitFailedWith(t, b.URL, id, c.dest, c.code, followers[c.dest])
			ds := agent.delivered(c.dest)
			// Each was written whole, the reset one too (the agent may be
			// running it): a task is never delivered twice.
			if len(ds) != 1 {
				t.Fatalf("%s: %d deliveries, want 1", c.dest, len(ds))
			}
			keyEnded(t, ds[0].Body.OpenAI.APIKey, id, a.URL, b.URL)
		}
	})

	t.Run("forged and malformed keys", func(t *testing.T) {
		id := task.NewID()
		forged := "fgt_" + strings.TrimPrefix(id, "t_") + "_" + strings.Repeat("A", 26)
		keyRefused(t, forged, id, a.URL, b.URL)
		for _, base := range []string{a.URL, b.URL} {
			for _, h := range []map[string]string{nil, {"Authorization": "Bearer nope"}} {
				r := do(t, "POST", base+"/v1/tools/fetch", `{"url":"https://example.org"}`, h)
				if r.Status != 401 {
					t.Fatalf("fetch with %v: %d %s", h, r.Status, r.Raw)
				}
			}
			r := do(t, "POST", base+"/v1/tasks/"+id+"/events", strings.Repeat(" ", 2097153),
				map[string]string{"Authorization": "Bearer " + forged})
			if r.Status != 413 || r.code() != "request_too_large" {
				t.Fatalf("body over FAREGATE_V1_MAX_BODY: %d %s", r.Status, r.Raw)
			}
		}
	})
}

// checkDelivery checks one delivery against the manual: signed with the
// secret, exactly the documented fields, the trip request, URLs on the
// delivering replica, a task key, a deadline FAREGATE_AGENT_TIMEOUT after
// it was sent.
func checkDelivery(t *testing.T, d delivery, id string, replicas []string) {
	t.Helper()
	m := hmac.New(sha256.New, []byte(agentSecret))
	m.Write(d.Raw)
	if want := "sha256=" + hex.EncodeToString(m.Sum(nil)); d.Signature != want {
		t.Fatalf("signature %q, want %q", d.Signature, want)
	}
	var top map[string]json.RawMessage
	_ = json.Unmarshal(d.Raw, &top)
	keys := slices.Sorted(func(yield func(string) bool) {
		for k := range top {
			if !yield(k) {
				return
			}
		}
	})
	if !slices.Equal(keys, []string{"anthropic", "events_url", "openai", "result_url", "task", "tools"}) {
		t.Fatalf("delivery fields %v", keys)
	}
	b := d.Body
	if b.Task.ID != id {
		t.Fatalf("task id %q, want %q", b.Task.ID, id)
	}
	var req map[string]any
	_ = json.Unmarshal(b.Task.Request, &req)
	if req["destination"] != "ok" || req["days"] != float64(3) || req["language"] != "en" {
		t.Fatalf("request %s", b.Task.Request)
	}
	if life := b.Task.Deadline.Sub(b.Task.SentAt); life < 3*time.Second || life > 5*time.Second {
		t.Fatalf("deadline %v after sent_at, want FAREGATE_AGENT_TIMEOUT (4s)", life)
	}
	var base string
	for _, r := range replicas {
		if b.OpenAI.BaseURL == r+"/v1" {
			base = r
		}
	}
	if base == "" || b.Tools.FetchURL != base+"/v1/tools/fetch" || b.EventsURL != base+"/v1/tasks/"+id+"/events" ||
		b.ResultURL != base+"/v1/tasks/"+id+"/result" || b.Anthropic.BaseURL != base || b.Anthropic.APIKey != b.OpenAI.APIKey ||
		b.Anthropic.Model != b.OpenAI.Model {
		t.Fatalf("URLs %+v", b)
	}
	if !strings.HasPrefix(b.OpenAI.APIKey, "fgt_") || len(b.OpenAI.APIKey) < 4+32 || b.OpenAI.Model == "" {
		t.Fatalf("openai %+v", b.OpenAI)
	}
}

// TestExternalAgentUnreachable: an agent whose address refuses
// connections: the delivery is tried three times, then agent_unreachable.
func TestExternalAgentUnreachable(t *testing.T) {
	s := startServer(t, map[string]string{"FAREGATE_AGENT_URL": deadURL(t), "FAREGATE_AGENT_SECRET": agentSecret,
		"FAREGATE_AGENT_TIMEOUT": "10s"}) // the prompt form: the default with an external agent
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","prompt":"Plan a day in Lisbon"}`, nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	got, ok := pollTask(t, s.URL, id, 15*time.Second, statusIs("failed"))
	if !ok {
		t.Fatalf("task %v", got)
	}
	if e, _ := got["error"].(map[string]any); e["code"] != codes.AgentUnreachable {
		t.Fatalf("error %v, want agent_unreachable", got["error"])
	}
	waitLog(t, s.Out, 5*time.Second, "agent unreachable", `"attempts":3`)
}

// TestExternalAgentKilledReplica: the replica that delivered a task is
// killed (-9) while its agent works (lease 3 s). The task ends
// worker_lost, seen on the other replica, within 4/3 of the lease plus
// 5 s; a result the agent posts to the other replica meanwhile is refused
// (409 or 401) and never stored; the key is refused from then on.
func TestExternalAgentKilledReplica(t *testing.T) {
	redistest.Require(t)
	bin := buildFaregate(t, t.TempDir())
	rs := redistest.Start(t)
	agent := newFakeAgent(t)
	env := agentEnv(rs.URL(), agent.srv.URL, map[string]string{
		"FAREGATE_TASK_LEASE": processLease.String(), "FAREGATE_AGENT_TIMEOUT": "60s"})
	a := startChild(t, bin, env)
	id := createTrip(t, a.URL, "silent")
	clocktest.Eventually(t, 20*time.Second, "a delivery from the child", func() bool { return len(agent.delivered("silent")) > 0 })
	d := agent.delivered("silent")[0]
	// Started after the delivery: the task is the child's.
	b := startServer(t, env)
	agent.replicas = []string{a.URL, b.URL}
	if st, raw := agent.post(b.URL, d.Body.EventsURL, d.Body.OpenAI.APIKey, `{"name":"work","status":"started"}`); st != 204 {
		t.Fatalf("event through the other replica while the child lives: %d %s", st, raw)
	}

	killedAt := time.Now()
	a.Kill()
	posted := make(chan int, 1)
	go func() {
		st, _ := agent.post(b.URL, d.Body.ResultURL, d.Body.OpenAI.APIKey, `{"result":{"text":"too late"}}`)
		posted <- st
	}()
	limit := processLease*4/3 + 5*time.Second
	got, ok := pollTask(t, b.URL, id, limit, statusIs("failed"))
	took := time.Since(killedAt)
	if !ok {
		t.Fatalf("task not failed within 4/3 lease + 5 s of the kill: %v", got)
	}
	if e, _ := got["error"].(map[string]any); e["code"] != codes.WorkerLost {
		t.Fatalf("failed with %v, want worker_lost", got["error"])
	}
	select {
	case st := <-posted:
		if st != 409 && st != 401 {
			t.Fatalf("result posted while the task was being lost: %d, want 409 or 401", st)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the result post did not come back")
	}
	if _, has := got["result"]; has {
		t.Fatalf("a result was stored for the lost task: %v", got["result"])
	}
	keyEnded(t, d.Body.OpenAI.APIKey, id, b.URL)
	if st, _ := agent.post(b.URL, d.Body.ResultURL, d.Body.OpenAI.APIKey, `{"result":{"text":"later still"}}`); st != 409 {
		t.Fatalf("result after worker_lost: %d, want 409", st)
	}
	final, _ := pollTask(t, b.URL, id, time.Second, statusIs("failed"))
	if _, has := final["result"]; has || final["status"] != "failed" {
		t.Fatalf("task changed after worker_lost: %v", final)
	}
	t.Logf("kill -9 → worker_lost on the other replica in %v (limit %v); the key refused from then on", took.Round(time.Millisecond), limit)
}

// TestExternalAgentPromptDelivery: in the prompt form (the default with an
// external agent) the delivery's request is {"prompt","language"} and the
// agent's Markdown comes back as the task's text result.
func TestExternalAgentPromptDelivery(t *testing.T) {
	got := make(chan json.RawMessage, 1)
	agent := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var d struct {
			Task struct{ Request json.RawMessage } `json:"task"`
		}
		_ = json.NewDecoder(r.Body).Decode(&d)
		got <- d.Task.Request
		_, _ = io.WriteString(w, `{"result":{"text":"**Lisbon** in a day"}}`)
	}))
	t.Cleanup(agent.Close)
	s := startServer(t, map[string]string{"FAREGATE_AGENT_URL": agent.URL, "FAREGATE_AGENT_SECRET": agentSecret})
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","prompt":"Plan a day in Lisbon","language":"zh-CN"}`, nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	task, ok := pollTask(t, s.URL, id, 15*time.Second, statusIs("succeeded"))
	if !ok {
		t.Fatalf("task %v", task)
	}
	if req := string(<-got); req != `{"prompt":"Plan a day in Lisbon","language":"zh-CN"}` {
		t.Fatalf("delivered request %s", req)
	}
	if res, _ := task["result"].(map[string]any); res["text"] != "**Lisbon** in a day" || res["language"] != "zh-CN" {
		t.Fatalf("result %v", task["result"])
	}
}

// waitFailedWith waits for task id (of destination dest) to fail with
// code on base, and for its follower f to get the final events.
func waitFailedWith(t *testing.T, base, id, dest, code string, f *follower) {
	t.Helper()
	got, ok := pollTask(t, base, id, 20*time.Second, statusIs("failed"))
	if !ok {
		t.Fatalf("%s: %v, want failed", dest, got)
	}
	if e, _ := got["error"].(map[string]any); e["code"] != code {
		t.Fatalf("%s: error %v, want %s", dest, got["error"], code)
	}
	assertFinalEvents(t, f.waitEnded(t, 10*time.Second), "failed", code)
}
