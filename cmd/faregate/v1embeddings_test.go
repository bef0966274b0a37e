package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// TestV1EmbeddingsAreCalls: issue #27's embeddings outside the call and
// parallel limits, through run on a real redis-server. 500 concurrent
// embedding calls of one task reach the provider at most
// FAREGATE_AGENT_MAX_PARALLEL at a time; calls go on until the embedding
// limit and stop exactly there (429 step_limit); the task record holds one
// step per 100 of them.
func TestV1EmbeddingsAreCalls(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	const parallel, limit = 4, 200
	var inFlight, most, served atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		if r.URL.Path != "/embeddings" {
			http.Error(w, "embeddings only", http.StatusNotFound)
			return
		}
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		served.Add(1)
		// The provider's own time, so that calls overlap.
		select {
		case <-time.After(20 * time.Millisecond):
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"fail-embed","usage":{"prompt_tokens":3,"total_tokens":3}}`)
	}))
	t.Cleanup(up.Close)
	agent := newFailAgent(t, nil)
	s := startServer(t, failEnv(rs.URL(), agent.srv.URL, up.URL, map[string]string{
		"FAREGATE_AGENT_MAX_PARALLEL": "4", "FAREGATE_AGENT_TIMEOUT": "120s", "FAREGATE_AGENT_MAX_EMBEDDING_CALLS": "200",
	}))
	id := createTrip(t, s.URL, "hold")
	d := agent.next(t)
	key, base := d.Body.OpenAI.APIKey, d.Body.OpenAI.BaseURL
	body := `{"model":"fail-embed","input":"a chunk of a document"}`
	embed := func(c *http.Client) (int, string) {
		req, _ := http.NewRequest("POST", base+"/embeddings", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := c.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(raw)
	}

	// 500 at once: at most 4 reach the provider together; the others are
	// refused at once, too_many_calls, never queued and never a 5xx.
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 500}}
	t.Cleanup(client.CloseIdleConnections)
	var wg sync.WaitGroup
	var mu sync.Mutex
	answers := map[string]int{}
	for range 500 {
		wg.Go(func() {
			st, raw := embed(client)
			k := "200"
			if st != 200 {
				k = strings.Join([]string{http.StatusText(st), errorCode(raw)}, " ")
			}
			mu.Lock()
			answers[k]++
			mu.Unlock()
		})
	}
	wg.Wait()
	for k := range answers {
		if k != "200" && k != "Too Many Requests "+codes.TooManyCalls {
			t.Fatalf("500 concurrent embeddings answered %v", answers)
		}
	}
	if m := most.Load(); m > parallel {
		t.Fatalf("%d embedding calls reached the provider at once, want at most %d (answers %v)", m, parallel, answers)
	}

	// Then eight callers go on, each retrying a call refused for being
	// one too many in flight, until the limit refuses them all.
	var stops atomic.Int64
	for range 8 {
		wg.Go(func() {
			for range 2000 {
				st, raw := embed(client)
				switch {
				case st == 200:
				case st == 429 && errorCode(raw) == codes.TooManyCalls:
				case st == 429 && errorCode(raw) == codes.StepLimit:
					stops.Add(1)
					return
				default:
					t.Errorf("an embedding: %d %s", st, raw)
					return
				}
			}
			t.Error("2000 embedding calls and no step_limit")
		})
	}
	wg.Wait()
	if stops.Load() != 8 || served.Load() != limit || most.Load() > parallel {
		t.Fatalf("%d callers stopped by step_limit, %d embeddings served (want %d), %d at once at most (want ≤ %d)",
			stops.Load(), served.Load(), limit, most.Load(), parallel)
	}

	// The task's record: two steps for the 200 calls.
	if a := failPost(t, base+"/tasks/"+id+"/result", key, `{"result":{"text":"done"}}`); a.status != 204 {
		t.Fatalf("result: %d %s", a.status, a.raw)
	}
	var steps []any
	clocktest.Eventually(t, 10*time.Second, "the task to succeed", func() bool {
		task := do(t, "GET", s.URL+"/api/tasks/"+id, "", nil).Body
		steps, _ = task["steps"].([]any)
		return task["status"] == "succeeded"
	})
	var embeds []string
	for _, st := range steps {
		m, _ := st.(map[string]any)
		if m["name"] == "embeddings" {
			embeds = append(embeds, m["detail"].(string))
		}
	}
	if len(embeds) != limit/100 || !strings.HasPrefix(embeds[0], "100 embedding calls, 0 failed") {
		t.Fatalf("embedding steps %q, want %d of 100 calls each", embeds, limit/100)
	}
	t.Logf("500 concurrent embeddings: %v; %d served in all, at most %d at once", answers, served.Load(), most.Load())
}

// errorCode is the code of an OpenAI-shaped error body.
func errorCode(raw string) string {
	_, rest, ok := strings.Cut(raw, `"code":"`)
	if !ok {
		return ""
	}
	code, _, _ := strings.Cut(rest, `"`)
	return code
}
