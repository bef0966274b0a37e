package offline

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"faregate/agent/tokens"
)

func post(t *testing.T, c *http.Client, path, body string) *http.Response {
	t.Helper()
	resp, err := c.Post(BaseURL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

// The demo model answers the same request the same way, says what it is,
// reports usage by the bound faregate counts with, and keeps to the
// output limit it is sent.
func TestWireChatDeterministicAndHonest(t *testing.T) {
	c := Client()
	body := `{"model":"offline-demo-planner","messages":[{"role":"user","content":"Three days in Lisbon"}]}`
	read := func(body string) (string, map[string]any) {
		resp := post(t, c, "/chat/completions", body)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil || resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		return string(b), m
	}
	a, m := read(body)
	b, _ := read(body)
	if a != b {
		t.Fatal("two answers to one request differ")
	}
	choice := m["choices"].([]any)[0].(map[string]any)
	text := choice["message"].(map[string]any)["content"].(string)
	if !strings.Contains(text, "not a language model") || !strings.Contains(text, "Three days in Lisbon") {
		t.Fatalf("text %q", text)
	}
	usage := m["usage"].(map[string]any)
	var bound tokens.Counter
	if int64(usage["completion_tokens"].(float64)) != bound.Count(text) {
		t.Fatalf("completion %v, bound %d", usage["completion_tokens"], bound.Count(text))
	}
	_, m = read(`{"model":"offline-demo-planner","max_tokens":5,"messages":[{"role":"user","content":"x"}]}`)
	choice = m["choices"].([]any)[0].(map[string]any)
	if choice["finish_reason"] != "length" || m["usage"].(map[string]any)["completion_tokens"].(float64) > 5 {
		t.Fatalf("limit not kept: %v", m)
	}
}

// Streams go through the in-process transport as they are written, and
// the request's context ending stops the handler.
func TestWireStreamAndCancel(t *testing.T) {
	c := Client()
	resp := post(t, c, "/responses", `{"model":"m","stream":true,"input":"hi"}`)
	sc := bufio.NewScanner(resp.Body)
	var types []string
	for sc.Scan() {
		if ev, ok := strings.CutPrefix(sc.Text(), "event: "); ok {
			types = append(types, ev)
		}
	}
	resp.Body.Close()
	if types[0] != "response.created" || types[len(types)-1] != "response.completed" {
		t.Fatalf("events %v", types)
	}

	ctx, cancel := context.WithCancel(context.Background())
	stopped := make(chan struct{})
	slow := &http.Client{Transport: HandlerTransport(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(stopped)
		w.WriteHeader(200)
		for r.Context().Err() == nil {
			if _, err := io.WriteString(w, "data: x\n\n"); err != nil {
				return
			}
		}
	}))}
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, BaseURL+"/x", strings.NewReader("{}"))
	resp, err := slow.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the handler kept writing after the context ended")
	}
	if _, err := io.ReadAll(resp.Body); !errors.Is(err, context.Canceled) {
		t.Fatalf("read after cancel: %v", err)
	}
}

// A tool taking a URL is called only with a URL the user gave: the demo
// never fetches the request's words as an address.
func TestWireURLToolNeedsAURL(t *testing.T) {
	c := Client()
	tool := `"tools":[{"type":"function","function":{"name":"fetch_page","parameters":{"type":"object","properties":{"url":{"type":"string"}},"required":["url"]}}}]`
	cases := []struct {
		name, user, wantFinish, wantArgs string
	}{
		{"no url", "Plan a day in Lisbon", "stop", ""},
		{"url given", "Summarise https://example.com/page, please", "tool_calls", `{"url":"https://example.com/page"}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			resp := post(t, c, "/chat/completions", `{"model":"offline-demo-planner",`+tool+`,"messages":[{"role":"user","content":"`+tc.user+`"}]}`)
			defer resp.Body.Close()
			var m struct {
				Choices []struct {
					FinishReason string `json:"finish_reason"`
					Message      struct {
						ToolCalls []struct {
							Function struct{ Arguments string } `json:"function"`
						} `json:"tool_calls"`
					} `json:"message"`
				} `json:"choices"`
			}
			if err := json.NewDecoder(resp.Body).Decode(&m); err != nil || len(m.Choices) != 1 {
				t.Fatalf("%v %+v", err, m)
			}
			ch := m.Choices[0]
			args := ""
			if len(ch.Message.ToolCalls) > 0 {
				args = ch.Message.ToolCalls[0].Function.Arguments
			}
			if ch.FinishReason != tc.wantFinish || args != tc.wantArgs {
				t.Fatalf("finish %q args %q, want %q %q", ch.FinishReason, args, tc.wantFinish, tc.wantArgs)
			}
		})
	}
}
