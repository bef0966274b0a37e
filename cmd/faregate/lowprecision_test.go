package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/protect/codes"
)

// lowPrecisionAgent answers each delivery after one non-streamed
// /v1/chat/completions call with the delivery's key and model, keeping
// the delivery's task object and the call's status by the prompt.
type lowPrecisionAgent struct {
	srv *httptest.Server

	mu     sync.Mutex
	tasks  map[string]map[string]json.RawMessage
	status map[string]int
	errs   []string
}

func newLowPrecisionAgent(t *testing.T) *lowPrecisionAgent {
	a := &lowPrecisionAgent{tasks: map[string]map[string]json.RawMessage{}, status: map[string]int{}}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *lowPrecisionAgent) serve(w http.ResponseWriter, r *http.Request) {
	var d struct {
		Task   map[string]json.RawMessage `json:"task"`
		OpenAI struct {
			BaseURL string `json:"base_url"`
			APIKey  string `json:"api_key"`
			Model   string `json:"model"`
		} `json:"openai"`
	}
	var req struct{ Prompt string }
	if err := json.NewDecoder(r.Body).Decode(&d); err != nil || json.Unmarshal(d.Task["request"], &req) != nil {
		a.fail("delivery: %v", err)
		http.Error(w, "bad delivery", 400)
		return
	}
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello"}]}`, d.OpenAI.Model)
	call, _ := http.NewRequestWithContext(r.Context(), "POST", d.OpenAI.BaseURL+"/chat/completions", strings.NewReader(body))
	call.Header.Set("Content-Type", "application/json")
	call.Header.Set("Authorization", "Bearer "+d.OpenAI.APIKey)
	st := 0
	if resp, err := http.DefaultClient.Do(call); err != nil {
		a.fail("model call: %v", err)
	} else {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		st = resp.StatusCode
	}
	a.mu.Lock()
	a.tasks[req.Prompt], a.status[req.Prompt] = d.Task, st
	a.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"result":{"text":"done"}}`)
}

func (a *lowPrecisionAgent) fail(format string, args ...any) {
	a.mu.Lock()
	a.errs = append(a.errs, fmt.Sprintf(format, args...))
	a.mu.Unlock()
}

// delivered is the task object and model-call status of prompt's delivery.
func (a *lowPrecisionAgent) delivered(prompt string) (map[string]json.RawMessage, int, []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.tasks[prompt], a.status[prompt], append([]string(nil), a.errs...)
}

// TestExternalAgentLowPrecision (#30 item 6): a task AITF lets through at
// low precision (a suspicious request while the delay queue is long) is
// delivered with "precision": "low" inside task, its /v1 model call
// reaches the fallback upstream and not the primary, its step names the
// fallback model, and its result carries low_precision. An ordinary task
// of the same run is delivered without precision and calls the primary.
// Before, the degraded task was delivered as any other and its call went
// to the primary.
func TestExternalAgentLowPrecision(t *testing.T) {
	reply := func(text string) func(chatRequest, int) fakeReply {
		return func(chatRequest, int) fakeReply { return fakeReply{Content: text} }
	}
	primary, fallback := newFakeLLM(t, reply("from the primary")), newFakeLLM(t, reply("from the fallback"))
	// Siteverify holds the token "hold" until released (then refuses it),
	// which keeps a request holding its tool_call_id's turn in the AITF
	// queue; every other token passes at once.
	hold := make(chan struct{})
	var holdOnce sync.Once
	release := func() { holdOnce.Do(func() { close(hold) }) }
	t.Cleanup(release)
	sv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseForm()
		w.Header().Set("Content-Type", "application/json")
		if r.Form.Get("response") == "hold" {
			select {
			case <-hold:
			case <-r.Context().Done():
			}
			fmt.Fprint(w, `{"success":false,"error-codes":["invalid-input-response"]}`)
			return
		}
		fmt.Fprint(w, `{"success":true,"hostname":"demo.example"}`)
	}))
	t.Cleanup(sv.Close)
	agent := newLowPrecisionAgent(t)
	s := startServer(t, map[string]string{
		"FAREGATE_AGENT_URL": agent.srv.URL, "FAREGATE_AGENT_SECRET": agentSecret,
		"FAREGATE_LLM_BASE_URL": primary.BaseURL(), "FAREGATE_LLM_MODEL": "primary-model",
		"FAREGATE_LLM_FALLBACK_BASE_URL": fallback.BaseURL(), "FAREGATE_LLM_FALLBACK_MODEL": "fallback-model",
		"FAREGATE_AITF_MODE": "enforce", "FAREGATE_AITF_MAX_QUEUE": "10", "FAREGATE_AITF_DEGRADE_BACKLOG": "1",
		"FAREGATE_TURNSTILE_SECRET_KEY": "test-secret", "FAREGATE_TURNSTILE_HOSTNAMES": "demo.example",
		"FAREGATE_TURNSTILE_VERIFY_URL": sv.URL, "FAREGATE_TURNSTILE_TIMEOUT": "50s", "FAREGATE_IP_DAILY_LIMIT": "50",
	})

	// An ordinary task: no precision, the primary answers.
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"ok","prompt":"ordinary"}`, nil)
	if r.Status != 202 {
		t.Fatalf("ordinary task: %d %s", r.Status, r.Raw)
	}
	if got, ok := pollTask(t, s.URL, r.Body["id"].(string), 20*time.Second, statusIs("succeeded")); !ok {
		t.Fatalf("ordinary task: %v", got)
	}
	if tk, st, errs := agent.delivered("ordinary"); tk["precision"] != nil || st != 200 || len(errs) > 0 {
		t.Fatalf("ordinary task: precision %s, model call %d, agent errors %v", tk["precision"], st, errs)
	}
	if p, f := primary.Count(), fallback.Count(); p != 1 || f != 0 {
		t.Fatalf("ordinary task's call reached the primary %d and the fallback %d times; want 1 and 0", p, f)
	}

	// A backlog: one request holds call_Z's turn in Turnstile, two more of
	// call_Z wait behind it.
	optIn := map[string]string{"X-AITF-Opt-In": "true"}
	var waiting sync.WaitGroup
	for i := range 3 {
		waiting.Go(func() {
			if i == 0 {
				doOn(t, &http.Client{Timeout: 60 * time.Second}, false, "POST", s.URL+"/api/tasks",
					`{"turnstile_token":"hold","prompt":"holder","tool_call_id":"call_Z"}`, optIn)
				return
			}
			doOn(t, &http.Client{Timeout: 60 * time.Second}, false, "GET", s.URL+"/api/config", `{"tool_call_id":"call_Z"}`, optIn)
		})
	}
	t.Cleanup(waiting.Wait)
	t.Cleanup(release)
	pollUntil(t, 20*time.Second, "two call_Z requests queued behind the holder", func() bool {
		return metricValue(t, s.URL, "faregate_aitf_queue_depth") >= 2
	})

	// A request scoring above 0.7 passes at once, degraded.
	r = doOn(t, http.DefaultClient, false, "POST", s.URL+"/api/tasks",
		`{"turnstile_token":"ok","prompt":"degraded","tool_call_id":"call_Y","recursion_depth":4,"mode":"batch_process","retry_strategy":{"max_retries":5}}`, optIn)
	if r.Status != 202 {
		t.Fatalf("degraded task: %d %s", r.Status, r.Raw)
	}
	release()
	got, ok := pollTask(t, s.URL, r.Body["id"].(string), 20*time.Second, statusIs("succeeded"))
	if !ok {
		t.Fatalf("degraded task: %v", got)
	}
	tk, st, errs := agent.delivered("degraded")
	if string(tk["precision"]) != `"low"` || st != 200 || len(errs) > 0 {
		t.Fatalf("degraded task: precision %s, model call %d, agent errors %v", tk["precision"], st, errs)
	}
	if p, f := primary.Count(), fallback.Count(); p != 1 || f != 1 {
		t.Fatalf("degraded task's call: primary %d, fallback %d requests in all; want 1 and 1", p, f)
	}
	if m := fallback.Requests()[0].Model; m != "fallback-model" {
		t.Fatalf("the fallback was asked for %q", m)
	}
	res, _ := got["result"].(map[string]any)
	warnings, _ := res["warnings"].([]any)
	if !slices.Contains(warnings, any(codes.LowPrecision)) {
		t.Errorf("result warnings %v lack %s", warnings, codes.LowPrecision)
	}
	steps, _ := json.Marshal(got["steps"])
	if !bytes.Contains(steps, []byte(`"detail":"fallback-model: `)) || !bytes.Contains(steps, []byte("low precision")) {
		t.Errorf("no model step names the fallback model at low precision: %s", steps)
	}
}
