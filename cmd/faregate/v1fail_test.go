package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/redis/go-redis/v9"

	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// Issue #21's "bad input on every new route" and "failures of the agent",
// end to end through run on a real redis-server: a scripted upstream
// (failUpstream) plays the model provider, a scripted agent
// (failAgentServer) takes the deliveries, and each case checks the
// documented code, what the ledger says and that nothing stays reserved.

const failModel = "fail-model"

// failUpstream is an OpenAI-compatible provider whose every answer is
// chosen by the request's last message (or input): "fail:<scenario> …".
type failUpstream struct {
	srv *httptest.Server
	mu  sync.Mutex
	got []failGot
	// ended gets the scenario of a stream whose request context ended
	// while the upstream was still streaming (the caller hung up).
	ended chan string
	// more serves the scenarios of other tests first (true: served).
	more func(sc string, w http.ResponseWriter, r *http.Request, body []byte) bool
	// tail holds the "tail" scenario after its first words.
	tail chan struct{}
}

type failGot struct {
	path, scenario string
	body           []byte
}

func newFailUpstream(t *testing.T) *failUpstream {
	u := &failUpstream{ended: make(chan string, 32), tail: make(chan struct{})}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.srv.Close)
	return u
}

// calls is how many requests carried text containing sub.
func (u *failUpstream) calls(sub string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for _, g := range u.got {
		if strings.Contains(string(g.body), sub) {
			n++
		}
	}
	return n
}

func (u *failUpstream) total() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.got)
}

// last is the last request that carried sub.
func (u *failUpstream) last(sub string) (failGot, bool) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for i := len(u.got) - 1; i >= 0; i-- {
		if strings.Contains(string(u.got[i].body), sub) {
			return u.got[i], true
		}
	}
	return failGot{}, false
}

// failScenario is the scenario word of a request body.
func failScenario(body []byte) string {
	var req struct {
		Messages []struct {
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
		Input json.RawMessage `json:"input"`
	}
	_ = json.Unmarshal(body, &req)
	var text string
	if n := len(req.Messages); n > 0 {
		_ = json.Unmarshal(req.Messages[n-1].Content, &text)
	} else {
		_ = json.Unmarshal(req.Input, &text)
	}
	word, _, _ := strings.Cut(strings.TrimPrefix(text, "fail:"), " ")
	return word
}

// failWords are short words a provider's answer is made of: picked in no
// order, they never read as a loop.
var failWords = strings.Fields("the and for sun sea red old new hill tram fish wine port view walk park town city bay boat cafe tile lamp rain " +
	"west east gold blue fig rice soup cake tea jam map bus taxi road step door roof bell song")

// failChunk is a chat.completion.chunk with one delta field set.
func failChunk(field, text string) string {
	v, _ := json.Marshal(text)
	return fmt.Sprintf(`{"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{%q:%s},"finish_reason":null}]}`,
		failModel, field, v)
}

const failFinish = `{"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":"fail-model","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}`

// failChatJSON is a chat completion answer with usage (a JSON object, or
// "" for none).
func failChatJSON(text, usage string) string {
	s := fmt.Sprintf(`{"id":"chatcmpl-f","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}]`,
		failModel, text)
	if usage != "" {
		s += `,"usage":` + usage
	}
	return s + "}"
}

func failRespJSON(text, usage string) string {
	s := fmt.Sprintf(`{"id":"resp_f","object":"response","created_at":1,"status":"completed","model":%q,"output":[{"type":"message","id":"msg_f","status":"completed","role":"assistant","content":[{"type":"output_text","text":%q,"annotations":[]}]}]`,
		failModel, text)
	if usage != "" {
		s += `,"usage":` + usage
	}
	return s + "}"
}

func (u *failUpstream) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	sc := failScenario(body)
	u.mu.Lock()
	u.got = append(u.got, failGot{path: r.URL.Path, scenario: sc, body: body})
	u.mu.Unlock()
	rc := http.NewResponseController(w)
	sse := func(lines ...string) bool {
		for _, l := range lines {
			if _, err := io.WriteString(w, l+"\n\n"); err != nil {
				return false
			}
		}
		return rc.Flush() == nil
	}
	stream := strings.Contains(string(body), `"stream":true`)
	if stream {
		w.Header().Set("Content-Type", "text/event-stream")
	} else {
		w.Header().Set("Content-Type", "application/json")
	}
	chat := r.URL.Path == "/chat/completions"
	if u.more != nil && u.more(sc, w, r, body) {
		return
	}
	switch {
	case r.URL.Path == "/embeddings":
		_, _ = io.WriteString(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"fail-embed","usage":{"prompt_tokens":3,"total_tokens":3}}`)
	case sc == "hold":
		// Part of an answer, then nothing until the caller hangs up.
		sse("data: "+failChunk("role", "assistant"), "data: "+failChunk("content", "Partial answer so far"))
		select {
		case <-r.Context().Done():
			u.ended <- sc
		case <-time.After(time.Minute):
		}
	case sc == "tail":
		// Part of an answer; once released, the rest and the usage,
		// whether or not the caller is still there.
		sse("data: "+failChunk("role", "assistant"), "data: "+failChunk("content", "Partial answer so far"))
		select {
		case <-u.tail:
		case <-r.Context().Done():
			u.ended <- sc
			return
		}
		// At a provider's pace (a second in all): the caller's hang-up
		// is long known to faregate before the end.
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for i := range 200 {
			<-tick.C
			sse("data: " + failChunk("content", " "+failWords[(i*7+i*i*3)%len(failWords)]))
		}
		sse("data: "+failFinish, `data: {"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":"fail-model","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":610,"total_tokens":622}}`, "data: [DONE]")
		u.ended <- "tail done"
	case sc == "nousage" && stream:
		lines := []string{"data: " + failChunk("role", "assistant")}
		for _, p := range []string{"The quick", " brown fox", " jumps over", " the lazy dog."} {
			lines = append(lines, "data: "+failChunk("content", p))
		}
		sse(append(lines, "data: "+failFinish, "data: [DONE]")...)
	case sc == "nousage" && chat:
		_, _ = io.WriteString(w, failChatJSON("The quick brown fox jumps over the lazy dog.", ""))
	case sc == "nousage":
		_, _ = io.WriteString(w, failRespJSON("The quick brown fox jumps over the lazy dog.", ""))
	case sc == "badmid":
		sse("data: "+failChunk("role", "assistant"), "data: "+failChunk("content", "Half an answer"),
			`data: {"choices":[{"delta":{"content":"bro`, "data: [DONE]")
	case sc == "badfirst" && chat:
		sse(`data: {"choices":[{"delta":`, "data: [DONE]")
	case sc == "badfirst":
		sse(`event: response.created`+"\n"+`data: {"type":"response.created","response":`, "")
	case sc == "reasoning":
		// Reasoning only, far past any small limit, until the caller
		// stops reading.
		sse("data: " + failChunk("role", "assistant"))
		for i := 0; i < 2000; i++ {
			if !sse("data: " + failChunk("reasoning_content", "Let me think about the question once more. ")) {
				break
			}
			if r.Context().Err() != nil {
				break
			}
		}
		if r.Context().Err() != nil {
			u.ended <- sc
			return
		}
		sse("data: "+failFinish, "data: [DONE]")
	case sc == "huge":
		_, _ = io.WriteString(w, failChatJSON("Short.", `{"prompt_tokens":12,"completion_tokens":5000000000000000,"total_tokens":5000000000000012}`))
	case sc == "unreadable":
		_, _ = io.WriteString(w, failChatJSON("Short.", `{"prompt_tokens":"many","completion_tokens":3}`))
	case sc == "negative":
		sse("data: "+failChunk("content", "Short."), "data: "+failFinish,
			`data: {"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":"fail-model","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":-50,"total_tokens":-38}}`,
			"data: [DONE]")
	case chat:
		_, _ = io.WriteString(w, failChatJSON("Fine.", `{"prompt_tokens":12,"completion_tokens":2,"total_tokens":14}`))
	default:
		_, _ = io.WriteString(w, failRespJSON("Fine.", `{"input_tokens":12,"output_tokens":2,"total_tokens":14}`))
	}
}

// failAgentServer takes deliveries. Destination "hold" answers 202 and
// hands the delivery to the test; the "f…" destinations first open a model
// stream the upstream holds (a reservation stays open), then fail in their
// own way: f500 (500), finvalid (an invalid body), fhang (no answer past
// the deadline), fsilent (202 and nothing).
type failAgentServer struct {
	srv       *httptest.Server
	delivered chan delivery
	up        *failUpstream

	mu      sync.Mutex
	streams map[string]chan failStreamEnd // by task id: how its held stream ended
}

// failStreamEnd is how the agent's held stream ended for it.
type failStreamEnd struct {
	status int
	body   string
	err    error
}

func newFailAgent(t *testing.T, up *failUpstream) *failAgentServer {
	a := &failAgentServer{delivered: make(chan delivery, 16), up: up, streams: map[string]chan failStreamEnd{}}
	a.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		d := delivery{Raw: raw}
		if err := json.Unmarshal(raw, &d.Body); err != nil {
			t.Errorf("delivery: %v", err)
			return
		}
		var req struct{ Destination string }
		_ = json.Unmarshal(d.Body.Task.Request, &req)
		d.destination = req.Destination
		if d.destination == "hold" {
			w.WriteHeader(http.StatusAccepted)
			a.delivered <- d
			return
		}
		a.hold(t, d)
		switch d.destination {
		case "f500":
			http.Error(w, "boom", http.StatusInternalServerError)
		case "finvalid":
			_, _ = io.WriteString(w, `{"answer":42}`)
		case "fhang":
			select {
			case <-r.Context().Done():
			case <-time.After(time.Minute):
			}
		case "fsilent":
			w.WriteHeader(http.StatusAccepted)
		default:
			t.Errorf("unknown destination %q", d.destination)
		}
	}))
	t.Cleanup(a.srv.Close)
	return a
}

// hold opens a chat stream for d's task that the upstream holds, and
// returns once the upstream has it (the call's reservation is open).
func (a *failAgentServer) hold(t *testing.T, d delivery) {
	id := d.Body.Task.ID
	end := make(chan failStreamEnd, 1)
	a.mu.Lock()
	a.streams[id] = end
	a.mu.Unlock()
	marker := "fail:hold " + id
	go func() {
		st, raw, err := failStream(d.Body.OpenAI.BaseURL+"/chat/completions", d.Body.OpenAI.APIKey,
			failChatBody(marker, true, ""))
		end <- failStreamEnd{st, raw, err}
	}()
	if !clocktest.Poll(10*time.Second, func() bool { return a.up.calls(marker) > 0 }) {
		t.Errorf("%s: the held stream never reached the upstream", d.destination)
	}
}

// next is the next "hold" delivery, within 20 s.
func (a *failAgentServer) next(t *testing.T) delivery {
	t.Helper()
	select {
	case d := <-a.delivered:
		return d
	case <-time.After(20 * time.Second):
		t.Fatal("no delivery")
		return delivery{}
	}
}

func (a *failAgentServer) streamEnd(id string) chan failStreamEnd {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.streams[id]
}

// failChatBody is a chat request for scenario text; extra is more JSON
// members (",\"n\":2").
func failChatBody(text string, stream bool, extra string) string {
	s := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":%q}]`, failModel, text)
	if stream {
		s += `,"stream":true,"stream_options":{"include_usage":true}`
	}
	return s + extra + "}"
}

// failStream posts body and reads the whole answer.
func failStream(url, key, body string) (int, string, error) {
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw), err
}

// failAnswer is one /v1 answer as the plain client got it.
type failAnswer struct {
	status int
	header http.Header
	raw    string
	code   string
	typ    string
	param  string
}

func failPost(t *testing.T, url, key, body string) failAnswer {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := failAnswer{status: resp.StatusCode, header: resp.Header, raw: string(raw)}
	var e struct {
		Error struct{ Code, Type, Param string }
	}
	if json.Unmarshal(raw, &e) == nil {
		a.code, a.typ, a.param = e.Error.Code, e.Error.Type, e.Error.Param
	}
	return a
}

// failLedger is the day's ledger entries whose field is value.
func failLedger(t *testing.T, rdb *redis.Client, field, value string) []map[string]string {
	t.Helper()
	var out []map[string]string
	for _, m := range dayLedger(t, rdb, utcToday()) {
		if m.Values[field] != value {
			continue
		}
		e := map[string]string{}
		for k, v := range m.Values {
			e[k], _ = v.(string)
		}
		out = append(out, e)
	}
	return out
}

// failEntry waits for the one ledger entry of request id.
func failEntry(t *testing.T, rdb *redis.Client, requestID string) map[string]string {
	t.Helper()
	var got []map[string]string
	if !clocktest.Poll(10*time.Second, func() bool { got = failLedger(t, rdb, "request_id", requestID); return len(got) > 0 }) {
		t.Fatalf("no ledger entry for request %s", requestID)
	}
	if len(got) != 1 {
		t.Fatalf("%d ledger entries for request %s, want 1: %v", len(got), requestID, got)
	}
	return got[0]
}

func failInt(t *testing.T, e map[string]string, field string) int64 {
	t.Helper()
	n, err := strconv.ParseInt(e[field], 10, 64)
	if err != nil {
		t.Fatalf("ledger %s = %q: %v", field, e[field], err)
	}
	return n
}

// failNothingHeld checks that task id holds nothing, nor its principal,
// and that the day has no open reservation (callers run nothing else).
func failNothingHeld(t *testing.T, rdb *redis.Client, id string) {
	t.Helper()
	rec := storedRecord(t, rdb, id)
	var held, principal, open int64
	if !clocktest.Poll(5*time.Second, func() bool {
		held, principal, open = taskOutstanding(t, rdb, rec)
		return held == 0 && principal == 0 && open == 0
	}) {
		t.Fatalf("task %s: outstanding %d, principal outstanding %d, %d open reservations; want all 0", id, held, principal, open)
	}
}

// failEnv is one replica's environment for the scripted upstream and agent.
func failEnv(redisURL, agentURL, llmURL string, extra map[string]string) map[string]string {
	env := agentEnv(redisURL, agentURL, map[string]string{
		"FAREGATE_LLM_BASE_URL": llmURL, "FAREGATE_LLM_MODEL": failModel, "FAREGATE_EMBEDDING_MODEL": "fail-embed",
		"FAREGATE_V1_MAX_BODY": "65536", "FAREGATE_AGENT_MAX_CALLS": "100", "FAREGATE_TASK_TOKEN_LIMIT": "40000",
		"FAREGATE_LLM_MAX_CALL_TOKENS": "100000",
		// The scripted failures are the point here, not the breaker's
		// answer to them (tested on its own).
		"FAREGATE_BREAKER_MIN_CALLS": "1000",
	})
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// TestV1BadInput: every new /v1 route with bad input, and every way a
// provider's answer can be wrong, through run on a real redis-server with
// one delivered task's key.
func TestV1BadInput(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newFailUpstream(t)
	agent := newFailAgent(t, up)
	alerts := newAlertReceiver(t, "alert-secret-0123456789")
	env := failEnv(rs.URL(), agent.srv.URL, up.srv.URL, alerts.env())
	env["FAREGATE_AGENT_TIMEOUT"] = "60s"
	s := startServer(t, env)
	id := createTrip(t, s.URL, "hold")
	d := agent.next(t)
	key, base := d.Body.OpenAI.APIKey, d.Body.OpenAI.BaseURL
	if d.Body.Task.ID != id || d.Body.OpenAI.Model != failModel {
		t.Fatalf("delivery %+v", d.Body)
	}
	f := follow(t, s.URL+"/api/tasks/"+id+"/events")

	routes := []struct{ name, path string }{
		{"chat", "/chat/completions"}, {"responses", "/responses"}, {"embeddings", "/embeddings"},
		{"fetch", "/tools/fetch"}, {"events", "/tasks/" + id + "/events"},
	}

	t.Run("malformed JSON", func(t *testing.T) {
		for _, r := range routes {
			for _, body := range []string{`{"model":`, `not json`, `[1,2]`, `{"model":"fail-model"} {}`} {
				a := failPost(t, base+r.path, key, body)
				if a.status != 400 || a.code != codes.InvalidRequest || a.typ != "invalid_request_error" {
					t.Fatalf("%s %q: %d %s", r.name, body, a.status, a.raw)
				}
			}
		}
		if n := up.total(); n != 0 {
			t.Fatalf("the upstream got %d requests for malformed bodies", n)
		}
	})

	t.Run("body over FAREGATE_V1_MAX_BODY from the headers", func(t *testing.T) {
		u, _ := url.Parse(base)
		for _, r := range routes {
			// Headers only: the answer must come before any byte of the body.
			c, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			fmt.Fprintf(c, "POST %s%s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: 65537\r\n\r\n",
				u.Path, r.path, u.Host, key)
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				c.Close()
				t.Fatalf("%s: no answer before the body: %v", r.name, err)
			}
			raw, _ := io.ReadAll(resp.Body)
			c.Close()
			var e struct{ Error struct{ Code, Type string } }
			_ = json.Unmarshal(raw, &e)
			if resp.StatusCode != 413 || e.Error.Code != codes.RequestTooLarge || e.Error.Type != "invalid_request_error" {
				t.Fatalf("%s: %d %s, want 413 request_too_large", r.name, resp.StatusCode, raw)
			}
		}
		// At the limit exactly the body is read (and judged on its merits).
		a := failPost(t, base+"/chat/completions", key, failChatBody("fail:ok", false, ","+`"pad":"`+strings.Repeat("x", 65536-len(failChatBody("fail:ok", false, ""))-9)+`"`))
		if a.status != 200 {
			t.Fatalf("a body of exactly the limit: %d %s", a.status, a.raw)
		}
	})

	t.Run("unknown model", func(t *testing.T) {
		before := up.total()
		for _, c := range []struct{ path, body string }{
			{"/chat/completions", `{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}`},
			{"/chat/completions", `{"model":"fail-embed","messages":[{"role":"user","content":"hi"}]}`},
			{"/responses", `{"model":"o3-pro","input":"hi"}`},
			{"/embeddings", `{"model":"fail-model","input":"hi"}`},
		} {
			a := failPost(t, base+c.path, key, c.body)
			if a.status != 400 || a.code != "model_not_allowed" || a.typ != "invalid_request_error" {
				t.Fatalf("%s %s: %d %s", c.path, c.body, a.status, a.raw)
			}
		}
		if up.total() != before {
			t.Fatal("an unknown model reached the upstream")
		}
	})

	t.Run("refused parameters", func(t *testing.T) {
		before := up.total()
		chat := func(extra string) string { return failChatBody("fail:ok", false, extra) }
		resp := func(extra string) string { return `{"model":"fail-model","input":"fail:ok"` + extra + "}" }
		cases := []struct{ name, path, body, param string }{
			{"n=2", "/chat/completions", chat(`,"n":2`), "n"},
			{"n=0", "/chat/completions", chat(`,"n":0`), "n"},
			{"service_tier priority", "/chat/completions", chat(`,"service_tier":"priority"`), "service_tier"},
			{"service_tier flex", "/responses", resp(`,"service_tier":"flex"`), "service_tier"},
			{"audio output", "/chat/completions", chat(`,"modalities":["text","audio"],"audio":{"voice":"alloy","format":"mp3"}`), "modalities"},
			{"audio object", "/chat/completions", chat(`,"audio":{"voice":"alloy","format":"mp3"}`), "audio"},
			{"hosted tool (chat)", "/chat/completions", chat(`,"tools":[{"type":"function","function":{"name":"f"}},{"type":"web_search"}]`), "tools[1].type"},
			{"web_search_options", "/chat/completions", chat(`,"web_search_options":{}`), "web_search_options"},
			{"background", "/responses", resp(`,"background":true`), "background"},
			{"previous_response_id", "/responses", resp(`,"previous_response_id":"resp_123"`), "previous_response_id"},
			{"conversation", "/responses", resp(`,"conversation":"conv_123"`), "conversation"},
			{"stored prompt", "/responses", resp(`,"prompt":{"id":"pmpt_1"}`), "prompt"},
			{"hosted tool (responses)", "/responses", resp(`,"tools":[{"type":"file_search","vector_store_ids":["vs_1"]}]`), "tools[0].type"},
			// Other servers' output limits and sequence counts, and what
			// a server expands into the prompt on its side.
			{"max_new_tokens", "/chat/completions", chat(`,"max_new_tokens":100000`), "max_new_tokens"},
			{"num_predict", "/chat/completions", chat(`,"num_predict":-1`), "num_predict"},
			{"options.num_predict", "/chat/completions", chat(`,"options":{"num_predict":-2}`), "options.num_predict"},
			{"num_return_sequences", "/responses", resp(`,"num_return_sequences":4`), "num_return_sequences"},
			{"candidate_count", "/chat/completions", chat(`,"candidate_count":8`), "candidate_count"},
			{"min_tokens", "/chat/completions", chat(`,"min_tokens":5000`), "min_tokens"},
			{"documents", "/chat/completions", chat(`,"documents":[{"title":"a","text":"` + strings.Repeat("x", 2000) + `"}]`), "documents"},
			{"chat_template", "/chat/completions", chat(`,"chat_template":"{{ messages }}"`), "chat_template"},
			{"chat_template_kwargs", "/chat/completions", chat(`,"chat_template_kwargs":{"documents":[]}`), "chat_template_kwargs"},
			{"add_generation_prompt", "/chat/completions", chat(`,"add_generation_prompt":false`), "add_generation_prompt"},
			{"continue_final_message", "/chat/completions", chat(`,"continue_final_message":true`), "continue_final_message"},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				a := failPost(t, base+c.path, key, c.body)
				if a.status != 400 || a.code != "unsupported_parameter" || a.typ != "invalid_request_error" || a.param != c.param {
					t.Fatalf("%d %s, want 400 unsupported_parameter naming %s", a.status, a.raw, c.param)
				}
			})
		}
		if up.total() != before {
			t.Fatal("a refused parameter reached the upstream")
		}
		// The allowed values of the same fields pass.
		for _, body := range []string{chat(`,"n":1,"service_tier":"auto","modalities":["text"]`), chat(`,"service_tier":"default"`)} {
			if a := failPost(t, base+"/chat/completions", key, body); a.status != 200 {
				t.Fatalf("%s: %d %s", body, a.status, a.raw)
			}
		}
		if a := failPost(t, base+"/responses", key, resp(`,"background":false`)); a.status != 200 {
			t.Fatalf("background false: %d %s", a.status, a.raw)
		}
	})

	t.Run("stream abandoned half way", func(t *testing.T) {
		req, _ := http.NewRequest("POST", base+"/chat/completions", strings.NewReader(failChatBody("fail:tail abandon", true, "")))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		rid := resp.Header.Get("X-Request-Id")
		br := bufio.NewReader(resp.Body)
		var got []string
		for len(got) < 2 {
			line, err := br.ReadString('\n')
			if err != nil {
				t.Fatalf("stream ended after %v: %v", got, err)
			}
			if strings.HasPrefix(line, "data: ") {
				got = append(got, line)
			}
		}
		if !strings.Contains(got[1], "Partial answer so far") {
			t.Fatalf("relayed %v", got)
		}
		resp.Body.Close() // the client leaves
		close(up.tail)    // and the provider goes on: it has the prompt
		select {
		case sc := <-up.ended:
			if sc != "tail done" {
				t.Fatalf("the upstream's stream ended %q: it was hung up on", sc)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("the upstream's stream never ended")
		}
		e := failEntry(t, rdb, rid)
		// Read on to its usage after the client left, and charged it.
		if e["outcome"] != "client_closed" || failInt(t, e, "completion_tokens") != 610 || e["estimated"] != "0" || e["task"] != id {
			t.Fatalf("ledger %v: want the provider's 610 output tokens, client_closed", e)
		}
		failNothingHeld(t, rdb, id)
	})

	t.Run("no usage", func(t *testing.T) {
		client := openai.NewClient(option.WithBaseURL(base+"/"), option.WithAPIKey(key), option.WithMaxRetries(0))
		var hdr *http.Response
		p := openai.ChatCompletionNewParams{Model: failModel, Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("fail:nousage stream")},
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}
		stream := client.Chat.Completions.NewStreaming(context.Background(), p, option.WithResponseInto(&hdr))
		var acc openai.ChatCompletionAccumulator
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if acc.Choices[0].Message.Content != "The quick brown fox jumps over the lazy dog." || acc.Usage.CompletionTokens < 1 {
			t.Fatalf("accumulated %+v usage %+v", acc.Choices[0].Message, acc.Usage)
		}
		e := failEntry(t, rdb, hdr.Header.Get("X-Request-Id"))
		if e["estimated"] != "1" || failInt(t, e, "completion_tokens") != acc.Usage.CompletionTokens ||
			failInt(t, e, "prompt_tokens") != acc.Usage.PromptTokens || e["outcome"] != "ok" {
			t.Fatalf("ledger %v; the client's usage chunk %+v", e, acc.Usage)
		}
		// The estimate errs high: the bound counts at least what a
		// tokenizer does (9 words, 10 tokens in cl100k).
		if acc.Usage.CompletionTokens < 10 {
			t.Fatalf("estimate %d tokens for a 10-token answer", acc.Usage.CompletionTokens)
		}
		// JSON answers without usage, chat and responses.
		for _, c := range []struct{ path, body string }{
			{"/chat/completions", failChatBody("fail:nousage json", false, "")},
			{"/responses", `{"model":"fail-model","input":"fail:nousage json"}`},
		} {
			a := failPost(t, base+c.path, key, c.body)
			if a.status != 200 {
				t.Fatalf("%s: %d %s", c.path, a.status, a.raw)
			}
			e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
			if e["estimated"] != "1" || failInt(t, e, "completion_tokens") < 10 || e["outcome"] != "ok" {
				t.Fatalf("%s: ledger %v", c.path, e)
			}
		}
		failNothingHeld(t, rdb, id)
	})

	t.Run("malformed SSE line", func(t *testing.T) {
		// After the answer started: it ends with an error event and
		// [DONE]; what passed is charged.
		a := failPost(t, base+"/chat/completions", key, failChatBody("fail:badmid", true, ""))
		if a.status != 200 || !strings.Contains(a.raw, "Half an answer") || strings.Contains(a.raw, `"bro`) ||
			!strings.Contains(a.raw, `data: {"error":{"code":"model_unavailable"`) || !strings.HasSuffix(a.raw, "data: [DONE]\n\n") {
			t.Fatalf("stream %d %q", a.status, a.raw)
		}
		// The error event is the API's table's envelope (its message, the
		// request's id), as a refusal before the answer would be.
		if !strings.Contains(a.raw, `"request_id":"`+a.header.Get("X-Request-Id")+`"`) ||
			!strings.Contains(a.raw, `"message":"The model provider is unavailable right now. Please try again shortly."`) {
			t.Fatalf("error event not the table's: %q", a.raw)
		}
		e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
		if c := failInt(t, e, "completion_tokens"); c < 1 || e["estimated"] != "1" || e["outcome"] != "error" {
			t.Fatalf("ledger %v", e)
		}
		// Before anything passed: a 503 in the OpenAI shape, nothing charged.
		for _, c := range []struct{ path, body string }{
			{"/chat/completions", failChatBody("fail:badfirst", true, "")},
			{"/responses", `{"model":"fail-model","input":"fail:badfirst","stream":true}`},
		} {
			a := failPost(t, base+c.path, key, c.body)
			if a.status != 503 || a.code != codes.ModelUnavailable || a.typ != "api_error" {
				t.Fatalf("%s: %d %s", c.path, a.status, a.raw)
			}
			e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
			if failInt(t, e, "completion_tokens")+failInt(t, e, "prompt_tokens") != 0 || e["outcome"] != "error" {
				t.Fatalf("%s: ledger %v, want nothing charged", c.path, e)
			}
		}
		failNothingHeld(t, rdb, id)
	})

	t.Run("reasoning stream", func(t *testing.T) {
		// Reasoning only, with max_tokens 20: the reasoning counts
		// toward the limit, so the stream is cut there.
		a := failPost(t, base+"/chat/completions", key, failChatBody("fail:reasoning", true, `,"max_tokens":20`))
		if a.status != 200 || !strings.Contains(a.raw, `"finish_reason":"length"`) || !strings.HasSuffix(a.raw, "data: [DONE]\n\n") {
			t.Fatalf("stream %d %q", a.status, a.raw)
		}
		if g, _ := up.last("fail:reasoning"); !strings.Contains(string(g.body), `"max_tokens":20`) {
			t.Fatalf("upstream request %s", g.body)
		}
		select {
		case <-up.ended:
		case <-time.After(10 * time.Second):
			t.Fatal("the upstream kept streaming after the cut")
		}
		e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
		if c := failInt(t, e, "completion_tokens"); c < 10 || c > 20 || e["outcome"] != codes.OutputTruncated {
			t.Fatalf("ledger %v: want the reasoning that passed (10-20 tokens), output_truncated", e)
		}
		failNothingHeld(t, rdb, id)
	})

	t.Run("usage past the ceiling", func(t *testing.T) {
		cases := []struct{ name, body string }{
			{"huge", failChatBody("fail:huge", false, "")},
			{"negative", failChatBody("fail:negative", true, "")},
			{"unreadable", failChatBody("fail:unreadable", false, "")},
		}
		for _, c := range cases {
			t.Run(c.name, func(t *testing.T) {
				a := failPost(t, base+"/chat/completions", key, c.body)
				if a.status != 200 {
					t.Fatalf("%d %s", a.status, a.raw)
				}
				e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
				charged := failInt(t, e, "prompt_tokens") + failInt(t, e, "completion_tokens")
				reserved := failInt(t, e, "reserved")
				// Charged the larger of the reservation and the count,
				// within the ceiling; the raw report kept; alerted.
				if e["implausible"] != "1" || charged < reserved || charged > 100000 || e["usage_raw"] == "" {
					t.Fatalf("ledger %v (charged %d, reserved %d)", e, charged, reserved)
				}
			})
		}
		// One alert per model and window (the notifier deduplicates):
		// the first report's, with its raw usage; the other two counted.
		first := alerts.waitEvent(t, "usage_implausible")
		if raw := fmt.Sprint(first.Details["raw_usage"]); !strings.Contains(raw, "5000000000000000") || !first.Signed {
			t.Fatalf("alert %+v, want the first report's raw usage", first)
		}
		var n float64
		if !clocktest.Poll(10*time.Second, func() bool {
			n = scrapeMetric(t, s.URL, "faregate_alerts_total", `event="usage_implausible"`)
			return n == 3
		}) {
			t.Fatalf("faregate_alerts_total for usage_implausible %v, want 3 (sent and deduplicated)", n)
		}
		// Not the visitor's anomaly: the task runs on.
		if a := failPost(t, base+"/chat/completions", key, failChatBody("fail:ok", false, "")); a.status != 200 {
			t.Fatalf("a call after the implausible reports: %d %s", a.status, a.raw)
		}
		failNothingHeld(t, rdb, id)
	})

	t.Run("events and fetch", func(t *testing.T) {
		for _, body := range []string{`{"name":"x"}`, `{"name":"x","status":"done"}`, `{"name":"x","status":"ok","detail":"a` + "\u202e" + `b"}`,
			`{"name":"x","status":"ok","detail":"` + strings.Repeat("d", 501) + `"}`, `{"name":"","status":"ok"}`} {
			a := failPost(t, base+"/tasks/"+id+"/events", key, body)
			if a.status != 400 || a.code != codes.InvalidRequest || a.typ != "invalid_request_error" {
				t.Fatalf("%s: %d %s", body, a.status, a.raw)
			}
		}
		// Refused on their face, these cost none of the task's tool calls
		// (FAREGATE_AGENT_MAX_TOOL_CALLS, 12 by default): twice round
		// is more than it has.
		for range 2 {
			for _, body := range []string{`{"url":"http://127.0.0.1/"}`, `{"url":"http://[::1]/"}`, `{"url":"http://169.254.169.254/latest"}`,
				`{"url":"ftp://example.org/"}`, `{"url":"file:///etc/passwd"}`, `{"url":"http://user:pw@example.org/"}`, `{"url":"http://[::ffff:10.0.0.1]/"}`, `{"url":"https:///x"}`} {
				a := failPost(t, base+"/tools/fetch", key, body)
				if a.status != 400 || a.code != "fetch_refused" || a.typ != "invalid_request_error" {
					t.Fatalf("fetch %s: %d %s", body, a.status, a.raw)
				}
			}
		}
		// A name is judged by what it resolves to: that fetch counts, and
		// is refused as it is.
		if a := failPost(t, base+"/tools/fetch", key, `{"url":"http://localhost/"}`); a.status != 400 || a.code != "fetch_refused" {
			t.Fatalf("fetch localhost: %d %s", a.status, a.raw)
		}
		for _, body := range []string{`{"url":42}`, `{"max_bytes":10}`} {
			if a := failPost(t, base+"/tools/fetch", key, body); a.status != 400 || a.code != codes.InvalidRequest {
				t.Fatalf("fetch %s: %d %s", body, a.status, a.raw)
			}
		}
	})

	// The task ends with a result; the follower sees it; every call was
	// settled and on the ledger with the task, nothing held.
	if st, raw, _ := failStream(d.Body.ResultURL, key, `{"result":{"text":"done"}}`); st != 204 {
		t.Fatalf("result: %d %s", st, raw)
	}
	assertFinalEvents(t, f.waitEnded(t, 10*time.Second), "succeeded", "")
	failNothingHeld(t, rdb, id)
	entries := failLedger(t, rdb, "task", id)
	if len(entries) == 0 {
		t.Fatal("no ledger entries for the task")
	}
	var sum int64
	for _, e := range entries {
		sum += failInt(t, e, "prompt_tokens") + failInt(t, e, "completion_tokens")
	}
	settled, outstanding, _ := budgetHash(t, rdb, "task:"+id)
	if settled != sum || outstanding != 0 {
		t.Fatalf("task budget settled %d outstanding %d; its %d ledger entries sum to %d", settled, outstanding, len(entries), sum)
	}
	t.Logf("%d governed calls of one task: %d tokens settled = the ledger's sum, none outstanding", len(entries), sum)
}

// TestV1AgentFailures: an agent that fails while one of its model streams
// is open (a 500, an invalid body, no answer past the deadline, a 202 and
// no result): the documented task code, the final events on the
// follower's stream, the open stream ended well formed and settled, and no
// reservation left outstanding. Connection refused (no agent at all) ends
// agent_unreachable with the same final events.
func TestV1AgentFailures(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newFailUpstream(t)
	agent := newFailAgent(t, up)
	s := startServer(t, failEnv(rs.URL(), agent.srv.URL, up.srv.URL, map[string]string{"FAREGATE_AGENT_TIMEOUT": "3s"}))
	cases := []struct{ dest, code string }{
		{"f500", codes.AgentFailed},
		{"finvalid", codes.AgentFailed},
		{"fhang", codes.AgentUnreachable},
		{"fsilent", codes.AgentTimeout},
	}
	ids := map[string]string{}
	followers := map[string]*follower{}
	for _, c := range cases {
		ids[c.dest] = createTrip(t, s.URL, c.dest)
		followers[c.dest] = follow(t, s.URL+"/api/tasks/"+ids[c.dest]+"/events")
	}
	for _, c := range cases {
		id := ids[c.dest]
		waitFailedWith(t, s.URL, id, c.dest, c.code, followers[c.dest])
		var end failStreamEnd
		select {
		case end = <-agent.streamEnd(id):
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the agent's open stream was not ended with its task", c.dest)
		}
		if end.err != nil || end.status != 200 || !strings.Contains(end.body, "Partial answer so far") ||
			!strings.Contains(end.body, `"finish_reason":"length"`) || !strings.HasSuffix(end.body, "data: [DONE]\n\n") {
			t.Fatalf("%s: the open stream ended %d %v %q", c.dest, end.status, end.err, end.body)
		}
		// The task's end cut the stream: charged what passed and its
		// prompt, and the ledger says why.
		entries := failLedger(t, rdb, "task", id)
		if len(entries) != 1 || entries[0]["outcome"] != "task_ended" || failInt(t, entries[0], "completion_tokens") < 1 ||
			failInt(t, entries[0], "prompt_tokens") < 1 {
			t.Fatalf("%s: ledger %v, want the cut stream's one entry", c.dest, entries)
		}
		settled, outstanding, _ := budgetHash(t, rdb, "task:"+id)
		if outstanding != 0 || settled != failInt(t, entries[0], "prompt_tokens")+failInt(t, entries[0], "completion_tokens") {
			t.Fatalf("%s: task settled %d outstanding %d; ledger %v", c.dest, settled, outstanding, entries[0])
		}
	}
	for _, c := range cases {
		failNothingHeld(t, rdb, ids[c.dest])
	}

	// Connection refused: the same final events, nothing held. The first
	// replica stops so that the task is the dead agent's.
	if err := s.Stop(); err != nil {
		t.Fatal(err)
	}
	dead := startServer(t, failEnv(rs.URL(), deadURL(t), up.srv.URL, map[string]string{"FAREGATE_AGENT_TIMEOUT": "10s"}))
	id := createTrip(t, dead.URL, "refused")
	f := follow(t, dead.URL+"/api/tasks/"+id+"/events")
	got, ok := pollTask(t, dead.URL, id, 15*time.Second, statusIs("failed"))
	if e, _ := got["error"].(map[string]any); !ok || e["code"] != codes.AgentUnreachable {
		t.Fatalf("connection refused: %v, want failed agent_unreachable", got)
	}
	assertFinalEvents(t, f.waitEnded(t, 10*time.Second), "failed", codes.AgentUnreachable)
	failNothingHeld(t, rdb, id)
}

// TestV1InputSpikeAnswered: the call that trips the input-spike check is
// answered 429 input_spike (insufficient_quota, x-should-retry false) even
// though that refusal ends its task at once: the lease holder reads the
// failed step and revokes the key, cutting the call's request, while the
// answer is being written (it once answered 409 task_finished). The task
// then fails input_spike, and its key is refused.
func TestV1InputSpikeAnswered(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	up := newFailUpstream(t)
	agent := newFailAgent(t, up)
	s := startServer(t, failEnv(rs.URL(), agent.srv.URL, up.srv.URL, map[string]string{"FAREGATE_AGENT_TIMEOUT": "60s"}))
	id := createTrip(t, s.URL, "hold")
	d := agent.next(t)
	key, base := d.Body.OpenAI.APIKey, d.Body.OpenAI.BaseURL
	// Six calls teach the principal's average prompt (five are needed).
	for i := range 6 {
		if a := failPost(t, base+"/chat/completions", key, failChatBody("fail:ok", false, "")); a.status != 200 {
			t.Fatalf("call %d: %d %s", i, a.status, a.raw)
		}
	}
	before := up.total()
	a := failPost(t, base+"/chat/completions", key, failChatBody("fail:ok "+strings.Repeat("Lisbon has seven hills. ", 1500), false, ""))
	if a.status != 429 || a.code != codes.InputSpike || a.typ != "insufficient_quota" || a.header.Get("X-Should-Retry") != "false" {
		t.Fatalf("the spiking call: %d %v %s", a.status, a.header, a.raw)
	}
	if n := up.total() - before; n != 0 {
		t.Fatalf("the spiking call reached the upstream %d times", n)
	}
	task := waitTask(t, s.URL, id)
	if task["status"] != "failed" || taskError(task) != codes.InputSpike {
		t.Fatalf("task %v", task)
	}
	if a := failPost(t, base+"/chat/completions", key, failChatBody("fail:ok", false, "")); a.status != 409 || a.code != codes.TaskFinished {
		t.Fatalf("the key after the spike: %d %s, want 409 task_finished", a.status, a.raw)
	}
}
