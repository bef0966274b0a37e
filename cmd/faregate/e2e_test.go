package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/protect/budget"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// TestE2EOwnAgentModelEndpoint is issue #21's first two tests through the
// binary: two replicas on one redis-server, an httptest provider, and an
// agent written on the official openai-go client that makes every kind of
// call (chat JSON, chat stream with include_usage, a tool round, Responses
// JSON and streamed, embeddings) through both replicas. The delivery is
// signed; every call is reserved and settled (nothing outstanding after),
// one ledger line each with the task and the principal, and the task's
// usage is the sum of what the provider reported; the agent's progress and
// the model steps reach followers on both replicas, the progress in the
// order posted; the result reaches GET /api/tasks/{id}; the client parsed
// every answer (finish reasons, usage, the tool call's id and arguments).
func TestE2EOwnAgentModelEndpoint(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newE2EUpstream(t)
	ag := newE2EAgent(t)
	env := agentEnv(rs.URL(), ag.srv.URL, map[string]string{
		"FAREGATE_LLM_BASE_URL": up.BaseURL(), "FAREGATE_LLM_API_KEY": "sk-e2e-upstream",
		"FAREGATE_LLM_MODEL": "e2e-model", "FAREGATE_EMBEDDING_MODEL": "e2e-embed",
	})
	a := startServer(t, env)
	b := startServer(t, env)
	ag.replicas = []string{a.URL, b.URL}

	id := createTrip(t, a.URL, "ok")
	followers := []*follower{follow(t, a.URL+"/api/tasks/"+id+"/events"), follow(t, b.URL+"/api/tasks/"+id+"/events")}
	got, ok := pollTask(t, b.URL, id, 30*time.Second, func(m map[string]any) bool { return m["status"] == "succeeded" || m["status"] == "failed" })
	ds, calls, events, errs := ag.Seen()
	for _, e := range errs {
		t.Errorf("agent: %s", e)
	}
	if !ok || got["status"] != "succeeded" {
		t.Fatalf("task: %v", got)
	}
	if len(ds) != 1 {
		t.Fatalf("%d deliveries, want 1", len(ds))
	}
	checkDelivery(t, ds[0], id, ag.replicas)
	if d := ds[0].Body.OpenAI; d.Model != "e2e-model" || d.EmbeddingModel != "e2e-embed" {
		t.Fatalf("delivery's openai %+v", d)
	}

	// The result, as the visitor reads it.
	res, _ := got["result"].(map[string]any)
	if res["text"] != "# Lisbon\n\nHills and *trams*." || res["title"] != "Lisbon" || res["model"] != "e2e-model" {
		t.Fatalf("result %v", res)
	}

	// What the provider got: every call, the governed fields patched.
	reqs := up.Requests()
	wantPaths := []string{"/v1/chat/completions", "/v1/chat/completions", "/v1/chat/completions", "/v1/chat/completions",
		"/v1/responses", "/v1/responses", "/v1/embeddings"}
	var paths []string
	for _, q := range reqs {
		paths = append(paths, q.Path)
	}
	if !slices.Equal(paths, wantPaths) {
		t.Fatalf("upstream requests %v, want %v", paths, wantPaths)
	}
	for i, q := range reqs {
		wantModel := "e2e-model"
		if q.Path == "/v1/embeddings" {
			wantModel = "e2e-embed"
		}
		if q.Body["model"] != wantModel {
			t.Errorf("upstream request %d (%s): model %v, want %s", i, q.Path, q.Body["model"], wantModel)
		}
		if !q.Usage {
			t.Errorf("upstream request %d (%s) reported no usage: a chat stream must ask for it (%v)", i, q.Path, q.Body["stream_options"])
		}
	}
	if tool := reqs[3].Body["messages"].([]any); len(tool) != 4 || tool[3].(map[string]any)["tool_call_id"] != reqs[2].ToolCall {
		t.Fatalf("the tool round's second request %v, want the tool result for %s", tool, reqs[2].ToolCall)
	}

	// The client read exactly what the provider reported, and every
	// answer parsed with its finish reason.
	wantCalls := []struct{ what, finish string }{{"chat", "stop"}, {"chat stream", "stop"}, {"tool call", "tool_calls"},
		{"tool result", "stop"}, {"responses", "completed"}, {"responses stream", "completed"}, {"embeddings", ""}}
	if len(calls) != len(wantCalls) {
		t.Fatalf("the agent made %d calls: %+v", len(calls), calls)
	}
	var sumPrompt, sumCompletion int64
	for i, c := range calls {
		q := reqs[i]
		if c.What != wantCalls[i].what || c.Finish != wantCalls[i].finish || c.Prompt != q.Prompt || c.Completion != q.Completion {
			t.Errorf("call %d: the client read %+v; want %s finishing %q with the provider's %d+%d", i, c, wantCalls[i].what,
				wantCalls[i].finish, q.Prompt, q.Completion)
		}
		if c.Finish == "stop" || c.Finish == "completed" {
			if want := strings.Join(e2eWords(i+1, map[bool]string{true: "resp", false: "chat"}[q.Path == "/v1/responses"]), ""); c.Text != want {
				t.Errorf("call %d: text %q, want %q", i, c.Text, want)
			}
		}
		sumPrompt += q.Prompt
		sumCompletion += q.Completion
	}

	// The ledger: one line per call, with the task, the principal and a
	// request id each, the tokens the provider reported (settles run off
	// the client's path: they land just after the answers).
	rec := storedRecord(t, rdb, id)
	var lines []map[string]any
	clocktest.Eventually(t, 10*time.Second, "seven ledger lines of the task", func() bool {
		lines = e2eLedger(t, rdb, rec.Day, id)
		return len(lines) >= len(reqs)
	})
	if len(lines) != len(reqs) {
		t.Fatalf("%d ledger lines of the task, want %d: %v", len(lines), len(reqs), lines)
	}
	var ledgerPairs, upstreamPairs []string
	rids := map[any]bool{}
	models := map[string]int{}
	for _, l := range lines {
		if l["principal"] != rec.Principal || l["outcome"] != "ok" || l["estimated"] != "0" || l["overage_tokens"] != "0" ||
			l["request_id"] == "" || rids[l["request_id"]] {
			t.Errorf("ledger line %v: want principal %s, outcome ok, reported, no overage, a request id of its own", l, rec.Principal)
		}
		rids[l["request_id"]] = true
		models[fmt.Sprint(l["model"])]++
		if l["model"] == "e2e-embed" && (l["prompt_tokens"] != strconv.FormatInt(reqs[6].Prompt, 10) || l["completion_tokens"] != "0") {
			t.Errorf("the embeddings call's ledger line %v, want the provider's %d prompt tokens", l, reqs[6].Prompt)
		}
		ledgerPairs = append(ledgerPairs, fmt.Sprintf("%v+%v", l["prompt_tokens"], l["completion_tokens"]))
	}
	for _, q := range reqs {
		upstreamPairs = append(upstreamPairs, fmt.Sprintf("%d+%d", q.Prompt, q.Completion))
	}
	if models["e2e-model"] != 6 || models["e2e-embed"] != 1 || len(models) != 2 {
		t.Errorf("ledger lines by model %v, want 6 of e2e-model and the embeddings call's of e2e-embed", models)
	}
	slices.Sort(ledgerPairs)
	slices.Sort(upstreamPairs)
	if !slices.Equal(ledgerPairs, upstreamPairs) {
		t.Fatalf("ledger tokens %v, provider reported %v", ledgerPairs, upstreamPairs)
	}

	// Reserved and settled: the task's and the principal's scopes hold
	// nothing, no reservation is open, and the task settled what the
	// provider reported.
	u, err := budget.New(rdb, budget.Options{}).Usage(context.Background(),
		budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: rec.ID})
	if err != nil {
		t.Fatal(err)
	}
	if u.Task.Outstanding != 0 || u.Principal.Outstanding != 0 || u.Reservations != 0 || u.Task.Overage != 0 ||
		u.Task.Settled != sumPrompt+sumCompletion {
		t.Fatalf("after the task: task scope %+v, principal %+v, %d open reservations; the provider reported %d tokens",
			u.Task, u.Principal, u.Reservations, sumPrompt+sumCompletion)
	}
	usage, _ := got["usage"].(map[string]any)
	if usage["prompt_tokens"] != float64(sumPrompt) || usage["completion_tokens"] != float64(sumCompletion) {
		t.Fatalf("task usage %v, the provider reported %d+%d", usage, sumPrompt, sumCompletion)
	}

	// Both followers: the agent's events in the order posted, a model
	// step per call, then the final events.
	if want := []string{"plan:started", "lookup:started", "lookup:ok", "plan:ok"}; !slices.Equal(events, want) {
		t.Fatalf("the agent posted %v, want %v", events, want)
	}
	for i, f := range followers {
		evs := f.waitEnded(t, 10*time.Second)
		assertFinalEvents(t, evs, "succeeded", "")
		var agentSteps, modelSteps []string
		for _, e := range evs {
			if e.Type != "step" {
				continue
			}
			var s task.Step
			if err := json.Unmarshal([]byte(e.Data), &s); err != nil {
				t.Fatalf("step %s: %v", e.Data, err)
			}
			switch s.Kind {
			case task.KindAgent:
				agentSteps = append(agentSteps, s.Name+":"+s.Status)
			case "model":
				modelSteps = append(modelSteps, s.Name+":"+s.Status)
			default:
				t.Fatalf("step of kind %q: %s", s.Kind, e.Data)
			}
		}
		if !slices.Equal(agentSteps, events) {
			t.Errorf("follower %d (on %s): agent steps %v, want %v", i, []string{"a", "b"}[i], agentSteps, events)
		}
		slices.Sort(modelSteps)
		if want := []string{"chat:ok", "chat:ok", "chat:ok", "chat:ok", "embeddings:ok", "responses:ok", "responses:ok"}; !slices.Equal(modelSteps, want) {
			t.Errorf("follower %d: model steps %v, want %v", i, modelSteps, want)
		}
	}
	t.Logf("7 calls of an openai-go agent through two replicas: %d+%d tokens reported = settled = task usage = ledger; nothing outstanding",
		sumPrompt, sumCompletion)
}

// dayLedger is the day's ledger entries of model calls, read on Redis from
// every stream of the day (Ledger.Streams), without the records of what
// leases and direct reservations charged the day's scopes.
func dayLedger(t testing.TB, rdb redis.Cmdable, day string) []redis.XMessage {
	t.Helper()
	ctx := context.Background()
	streams, err := budget.NewLedger(rdb, nil).Streams(ctx, day)
	if err != nil {
		t.Fatal(err)
	}
	var out []redis.XMessage
	for _, s := range streams {
		msgs, err := rdb.XRange(ctx, s, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			if _, record := m.Values["kind"]; !record {
				out = append(out, m)
			}
		}
	}
	return out
}

// e2eLedger is the day's ledger lines of task id, read on Redis.
func e2eLedger(t *testing.T, rdb *redis.Client, day, id string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, m := range dayLedger(t, rdb, day) {
		if m.Values["task"] == id {
			out = append(out, m.Values)
		}
	}
	return out
}
