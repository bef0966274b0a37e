package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

const testSecret = "example-secret-0123456789"

// fakeFaregate is the part of faregate the agent calls back: a small
// /v1/chat/completions (a tool call first, then an answer that quotes the
// tool's result), /v1/tools/fetch, and the task's events and result.
type fakeFaregate struct {
	t   *testing.T
	srv *httptest.Server

	mu      sync.Mutex
	chats   int
	fetched []string
	events  []string
	result  chan map[string]any
}

func newFakeFaregate(t *testing.T) *fakeFaregate {
	f := &fakeFaregate{t: t, result: make(chan map[string]any, 1)}
	f.srv = httptest.NewServer(http.HandlerFunc(f.serve))
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeFaregate) serve(w http.ResponseWriter, r *http.Request) {
	// Anthropic's SDKs send the key as x-api-key or as a bearer token
	// (the Go SDK's v2 the latter); faregate takes both on /v1.
	key := r.Header.Get("Authorization")
	if k := r.Header.Get("X-Api-Key"); k != "" && key == "" {
		key = "Bearer " + k
	}
	if key != "Bearer fgt_test" {
		w.WriteHeader(http.StatusUnauthorized)
		_, _ = io.WriteString(w, `{"error":{"code":"invalid_api_key","message":"no","type":"authentication_error"}}`)
		return
	}
	var body map[string]any
	_ = json.NewDecoder(r.Body).Decode(&body)
	f.mu.Lock()
	defer f.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	switch r.URL.Path {
	case "/v1/chat/completions":
		f.chats++
		msgs, _ := body["messages"].([]any)
		var toolText string
		for _, m := range msgs {
			mm, _ := m.(map[string]any)
			if mm["role"] == "tool" {
				toolText, _ = mm["content"].(string)
			}
		}
		if toolText == "" {
			if tools, _ := body["tools"].([]any); len(tools) != 1 {
				f.t.Errorf("first call offers tools %v, want fetch_page", body["tools"])
			}
			_, _ = io.WriteString(w, `{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"tool_calls",
"message":{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"fetch_page","arguments":"{\"url\":\"https://example.org/guide\"}"}}]}}],
"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}}`)
			return
		}
		answer, _ := json.Marshal("# Lisbon\n\nFrom the guide: " + toolText)
		fmt.Fprintf(w, `{"id":"c2","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"finish_reason":"stop",
"message":{"role":"assistant","content":%s}}],"usage":{"prompt_tokens":20,"completion_tokens":9,"total_tokens":29}}`, answer)
	case "/v1/messages":
		f.messages(w, body)
	case "/v1/tools/fetch":
		u, _ := body["url"].(string)
		f.fetched = append(f.fetched, u)
		_, _ = io.WriteString(w, `{"status":200,"content_type":"text/html","text":"Ride tram 28.","truncated":false}`)
	case "/v1/tasks/t_1/events":
		f.events = append(f.events, fmt.Sprintf("%v:%v", body["name"], body["status"]))
		w.WriteHeader(http.StatusNoContent)
	case "/v1/tasks/t_1/result":
		f.result <- body
		w.WriteHeader(http.StatusNoContent)
	default:
		f.t.Errorf("unexpected %s %s", r.Method, r.URL.Path)
		w.WriteHeader(http.StatusNotFound)
	}
}

// messages is a small /v1/messages: a tool_use first, then an answer that
// quotes the tool's result.
func (f *fakeFaregate) messages(w http.ResponseWriter, body map[string]any) {
	f.chats++
	if _, ok := body["max_tokens"].(float64); !ok {
		f.t.Errorf("a Messages call without max_tokens: %v", body)
	}
	msgs, _ := body["messages"].([]any)
	var toolText string
	for _, m := range msgs {
		blocks, _ := m.(map[string]any)["content"].([]any)
		for _, b := range blocks {
			if bm, _ := b.(map[string]any); bm["type"] == "tool_result" && bm["tool_use_id"] == "toolu_1" {
				toolText = fmt.Sprint(bm["content"])
			}
		}
	}
	if toolText == "" {
		if tools, _ := body["tools"].([]any); len(tools) != 1 {
			f.t.Errorf("first call offers tools %v, want fetch_page", body["tools"])
		}
		_, _ = io.WriteString(w, `{"id":"msg_1","type":"message","role":"assistant","model":"m","stop_reason":"tool_use","stop_sequence":null,
"content":[{"type":"tool_use","id":"toolu_1","name":"fetch_page","input":{"url":"https://example.org/guide"}}],
"usage":{"input_tokens":10,"output_tokens":5}}`)
		return
	}
	answer, _ := json.Marshal("# Lisbon\n\nFrom the guide: " + toolText)
	fmt.Fprintf(w, `{"id":"msg_2","type":"message","role":"assistant","model":"m","stop_reason":"end_turn","stop_sequence":null,
"content":[{"type":"text","text":%s}],"usage":{"input_tokens":20,"output_tokens":9}}`, answer)
}

// lineWriter hands run's first line (the address) to the test.
type lineWriter struct {
	mu   sync.Mutex
	buf  bytes.Buffer
	addr chan string
}

func (l *lineWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf.Write(p)
	if rest, ok := strings.CutPrefix(l.buf.String(), "example-agent: listening on "); ok {
		if i := strings.IndexByte(rest, '\n'); i >= 0 {
			select {
			case l.addr <- rest[:i]:
			default:
			}
		}
	}
	return len(p), nil
}

func sign(body []byte) string {
	m := hmac.New(sha256.New, []byte(testSecret))
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// TestExampleAgent: a signed delivery is taken (202) and answered through
// faregate's endpoints: the model asked with a tool, the page fetched
// through /v1/tools/fetch, progress posted in order, a Markdown answer
// posted to result_url. A delivery with a bad signature or past its
// deadline is refused without any call back.
func TestExampleAgent(t *testing.T) {
	for _, api := range []string{"", "anthropic"} {
		t.Run("api="+api, func(t *testing.T) { testExampleAgent(t, api) })
	}
}

func testExampleAgent(t *testing.T, api string) {
	fg := newFakeFaregate(t)
	out := &lineWriter{addr: make(chan string, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	env := map[string]string{"FAREGATE_AGENT_SECRET": testSecret, "EXAMPLE_AGENT_ADDR": "127.0.0.1:0", "EXAMPLE_AGENT_API": api}
	go func() { done <- run(ctx, []string{"example-agent"}, func(k string) string { return env[k] }, out) }()
	var url string
	select {
	case url = <-out.addr:
	case err := <-done:
		t.Fatalf("run: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("no listening line")
	}

	deliver := func(deadline time.Time, sig func([]byte) string) int {
		body, _ := json.Marshal(map[string]any{
			"task": map[string]any{"id": "t_1", "request": map[string]any{"destination": "Lisbon", "days": 2, "interests": []string{"food"}, "language": "en"},
				"deadline": deadline, "sent_at": time.Now()},
			"openai":     map[string]any{"base_url": fg.srv.URL + "/v1", "api_key": "fgt_test", "model": "m", "embedding_model": ""},
			"anthropic":  map[string]any{"base_url": fg.srv.URL, "api_key": "fgt_test", "model": "m"},
			"tools":      map[string]any{"fetch_url": fg.srv.URL + "/v1/tools/fetch"},
			"events_url": fg.srv.URL + "/v1/tasks/t_1/events",
			"result_url": fg.srv.URL + "/v1/tasks/t_1/result",
		})
		req, _ := http.NewRequest("POST", url, bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Faregate-Signature", sig(body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if st := deliver(time.Now().Add(time.Minute), func([]byte) string { return "sha256=" + strings.Repeat("0", 64) }); st != 401 {
		t.Fatalf("bad signature: %d, want 401", st)
	}
	if st := deliver(time.Now().Add(-time.Second), sign); st != 400 {
		t.Fatalf("past its deadline: %d, want 400", st)
	}
	fg.mu.Lock()
	calls := fg.chats + len(fg.events)
	fg.mu.Unlock()
	if calls != 0 {
		t.Fatalf("refused deliveries called back %d times", calls)
	}

	if st := deliver(time.Now().Add(time.Minute), sign); st != 202 {
		t.Fatalf("delivery: %d, want 202", st)
	}
	var res map[string]any
	select {
	case res = <-fg.result:
	case <-time.After(20 * time.Second):
		t.Fatal("no result posted")
	}
	r, _ := res["result"].(map[string]any)
	if text, _ := r["text"].(string); !strings.HasPrefix(text, "# Lisbon") || !strings.Contains(text, "Ride tram 28.") {
		t.Fatalf("result %v", res)
	}
	fg.mu.Lock()
	defer fg.mu.Unlock()
	if fg.chats != 2 || len(fg.fetched) != 1 || fg.fetched[0] != "https://example.org/guide" {
		t.Fatalf("%d model calls, fetched %v", fg.chats, fg.fetched)
	}
	if got := strings.Join(fg.events, " "); got != "think:started fetch:started fetch:ok think:ok" {
		t.Fatalf("events %s", got)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run after cancel: %v", err)
	}
}
