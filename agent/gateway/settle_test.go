package gateway

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// TestAnswerCompletesAfterSettle: an answer completes for the client only
// once the Governor has settled the call (and written its step): a JSON
// answer is not written at all before, a stream is relayed up to its
// terminator ([DONE]; the Responses terminal event), which follows the
// settle. An agent that ends its task on the answer's last byte therefore
// cannot end it before the call is on the task. A settle that fails still
// lets the answer out whole.
func TestAnswerCompletesAfterSettle(t *testing.T) {
	broken := newScripted(t, func(w http.ResponseWriter, r *http.Request, _ map[string]any) {
		sse(w, chunkJSON("half an"), chunkJSON(" answer")) // and no [DONE]
	})
	chatBody := func(extra string) string {
		return `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Three days in Lisbon"}]` + extra + `}`
	}
	respBody := func(extra string) string {
		return `{"model":"gpt-4o-mini","input":"A weekend in Rome","max_output_tokens":64` + extra + `}`
	}
	cases := []struct {
		name, path, body string
		up               *Upstream
		cap              int64
		// before: in what the client has when the Governor settles;
		// end: what completes the answer, only after the settle.
		before []string
		end    string
	}{
		{name: "chat JSON", path: "/v1/chat/completions", body: chatBody(""), end: `"chat.completion"`},
		{name: "responses JSON", path: "/v1/responses", body: respBody(""), end: `"output"`},
		{name: "embeddings", path: "/v1/embeddings", body: `{"model":"text-embedding-3-small","input":["hills","trams"]}`, end: `"usage":{`},
		{name: "chat stream", path: "/v1/chat/completions", body: chatBody(`,"stream":true,"stream_options":{"include_usage":true}`),
			before: []string{`"finish_reason":"stop"`, `"usage":{`}, end: "data: [DONE]\n\n"},
		{name: "chat stream cut", path: "/v1/chat/completions", body: chatBody(`,"stream":true,"stream_options":{"include_usage":true}`), cap: 2,
			before: []string{`"finish_reason":"length"`, `"usage":{`}, end: "data: [DONE]\n\n"},
		{name: "chat stream broken", path: "/v1/chat/completions", body: chatBody(`,"stream":true`), up: ptr(broken.upstream()),
			before: []string{"half an", `"model_unavailable"`}, end: "data: [DONE]\n\n"},
		{name: "responses stream", path: "/v1/responses", body: respBody(`,"stream":true`),
			before: []string{"event: response.created", "event: response.output_text.delta", "event: response.output_item.done"},
			end:    "event: response.completed\n"},
		{name: "responses stream cut", path: "/v1/responses", body: respBody(`,"stream":true`), cap: 2,
			before: []string{"event: response.output_text.delta", "event: response.output_item.done"},
			end:    "event: response.incomplete\n"},
	}
	for _, settleErr := range []error{nil, errors.New("test: the settle's round trip failed")} {
		for _, c := range cases {
			name := c.name
			if settleErr != nil {
				name += ", settle failed"
			}
			t.Run(name, func(t *testing.T) {
				up := offlineUpstream()
				if c.up != nil {
					up = *c.up
				}
				gov := &fakeGov{up: &up, cap: 1000, settleErr: settleErr}
				if c.cap > 0 {
					gov.cap = c.cap
				}
				task := Task{ID: "t_test", Principal: "p1", Deadline: time.Now().Add(time.Hour), Models: []string{testModel}}
				h := New(Options{Governor: gov, Records: testRecords, Task: func(*http.Request) (Task, bool) { return task, true },
					Errors: testErrorWriter{}, EmbeddingModel: "text-embedding-3-small"})
				rec := httptest.NewRecorder()
				settled := false
				gov.settle = func() {
					settled = true
					// The handler's goroutine: what was written so far.
					got := rec.Body.String()
					if strings.Contains(got, c.end) {
						t.Errorf("the answer's end reached the client before the settle:\n%s", got)
					}
					if c.before == nil && got != "" {
						t.Errorf("a JSON answer was written before the settle: %q", got)
					}
					for _, b := range c.before {
						if !strings.Contains(got, b) {
							t.Errorf("%s was held back until the settle; the stream is relayed as it comes:\n%s", b, got)
						}
					}
					if c.before != nil && !rec.Flushed {
						t.Error("the stream was not flushed before the settle")
					}
				}
				req := httptest.NewRequest(http.MethodPost, c.path, strings.NewReader(c.body))
				req.Header.Set("Content-Type", "application/json")
				testMux(h).ServeHTTP(rec, req)
				res := rec.Result()
				body, _ := io.ReadAll(res.Body)
				if !settled {
					t.Fatalf("the governor did not settle: %d %s", res.StatusCode, body)
				}
				if res.StatusCode != 200 || strings.Count(string(body), c.end) != 1 {
					t.Fatalf("the answer after the settle: %d, %d times %q in\n%s", res.StatusCode, strings.Count(string(body), c.end), c.end, body)
				}
				if c.before != nil && !strings.HasSuffix(string(body), "\n\n") {
					t.Fatalf("the stream does not end well formed:\n%s", body)
				}
				if c.before == nil && res.Header.Get("Content-Length") != itoa(int64(len(body))) {
					t.Fatalf("Content-Length %q for %d bytes", res.Header.Get("Content-Length"), len(body))
				}
			})
		}
	}
}

func ptr[T any](v T) *T { return &v }
