package gateway

import (
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"faregate/agent/tokens"
)

const benchMessagesAnswer = `{"id":"msg_1","type":"message","role":"assistant","model":"gpt-4o-mini","content":[{"type":"text","text":"Lisbon has seven hills and a good tram."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":20,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":10}}`

const benchMessagesBody = `{"model":"gpt-4o-mini","system":"You plan trips.","messages":[{"role":"user","content":"Three days in Lisbon, food and history."}],"max_tokens":200}`

// BenchmarkMessagesEndpoint is /v1/messages beside the chat route in one
// run, on one instant upstream that answers both wires the same message,
// 32 concurrent JSON calls each (run: go test -run '^$' -bench
// MessagesEndpoint -benchtime 2000x ./agent/gateway): chat, the chat
// route; messages=anthropic, forwarded to an Anthropic upstream;
// messages=openai, translated to chat completions and back.
func BenchmarkMessagesEndpoint(b *testing.B) {
	tokens.ForModel(testModel)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		if r.URL.Path == "/v1/messages" {
			_, _ = io.WriteString(w, benchMessagesAnswer)
			return
		}
		_, _ = io.WriteString(w, benchAnswer)
	}))
	b.Cleanup(upstream.Close)
	o := Options{
		Governor: passGov{Upstream{BaseURL: upstream.URL + "/v1", Client: benchClient()}},

		Records: testRecords,
		Task:    func(*http.Request) (Task, bool) { return Task{ID: "t_bench", Models: []string{testModel}}, true },
		Errors:  testErrorWriter{},
	}
	for _, c := range []struct {
		name, path, body string
		h                http.Handler
	}{
		{"chat", "/v1/chat/completions", benchBody, testMux(New(o))},
		{"messages=anthropic", "/v1/messages", benchMessagesBody, msgMux(NewMessages(o, MessagesOptions{Wire: WireAnthropic}))},
		{"messages=openai", "/v1/messages", benchMessagesBody, msgMux(NewMessages(o, MessagesOptions{Wire: WireOpenAI}))},
	} {
		srv := httptest.NewServer(c.h)
		b.Cleanup(srv.Close)
		b.Run(c.name, func(b *testing.B) { run32(b, srv.URL+c.path, c.body, false) })
	}
}
