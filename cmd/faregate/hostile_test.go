package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/redis/go-redis/v9"

	"faregate/agent/tokens"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// Issue #27's attacks on what a call is charged, and issue #30's loop cut
// on /v1, through run on a real redis-server: the scripted upstream
// (failUpstream, with the scenarios below) misbehaves on command, a raw
// socket or the official client plays the agent, and each case reads what
// the ledger and the budget say.

// failText is n of failWords, in no order that reads as a loop.
func failText(n int) string {
	var b strings.Builder
	for i := range n {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(failWords[(i*7+i*i*3)%len(failWords)])
	}
	return b.String()
}

// failCount is what faregate counts for text on the scripted model (the
// conservative bound: fail-model's tokenizer is unknown).
func failCount(text string) int64 { return tokens.ForModel(failModel).Count(text) }

// hostileScenarios serves the scenarios of these tests.
func hostileScenarios(u *failUpstream) func(sc string, w http.ResponseWriter, r *http.Request, body []byte) bool {
	return func(sc string, w http.ResponseWriter, r *http.Request, body []byte) bool {
		rc := http.NewResponseController(w)
		sse := func(lines ...string) bool {
			for _, l := range lines {
				if _, err := io.WriteString(w, l+"\n\n"); err != nil {
					return false
				}
			}
			return rc.Flush() == nil
		}
		words := func(text string) []string {
			var out []string
			for i, word := range strings.Fields(text) {
				if i > 0 {
					word = " " + word
				}
				out = append(out, "data: "+failChunk("content", word))
			}
			return out
		}
		usage := func(p, c int64) string {
			return fmt.Sprintf(`data: {"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":%q,"choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
				failModel, p, c, p+c)
		}
		switch sc {
		case "wait":
			// The request is in; no byte of an answer until the caller
			// hangs up on it.
			<-r.Context().Done()
			u.ended <- sc
		case "zerostream":
			sse(append(words(failText(1700)), "data: "+failFinish, usage(0, 0), "data: [DONE]")...)
		case "truthzero":
			text := failText(1700)
			sse(append(words(text), "data: "+failFinish, usage(12, failCount(text)), usage(0, 0), "data: [DONE]")...)
		case "zerojson":
			_, _ = io.WriteString(w, failChatJSON(failText(1700), `{"prompt_tokens":0,"completion_tokens":0,"total_tokens":0}`))
		case "fivechoices":
			var choices []string
			for i := range 5 {
				choices = append(choices, fmt.Sprintf(`{"index":%d,"message":{"role":"assistant","content":%q},"finish_reason":"stop"}`, i, failText(400)))
			}
			fmt.Fprintf(w, `{"id":"chatcmpl-f","object":"chat.completion","created":1,"model":%q,"choices":[%s],"usage":{"prompt_tokens":12,"completion_tokens":%d,"total_tokens":%d}}`,
				failModel, strings.Join(choices, ","), failCount(failText(400)), 12+failCount(failText(400)))
		case "respzero":
			_, _ = io.WriteString(w, failRespJSON(failText(1700), `{"input_tokens":0,"output_tokens":0,"total_tokens":0}`))
		case "embedzero":
			_, _ = io.WriteString(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}],"model":"fail-embed","usage":{"prompt_tokens":0,"total_tokens":0}}`)
		case "long":
			_, _ = io.WriteString(w, failChatJSON(failText(20000), `{"prompt_tokens":12,"completion_tokens":20000,"total_tokens":20012}`))
		case "twochoices":
			fmt.Fprintf(w, `{"id":"chatcmpl-f","object":"chat.completion","created":1,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%q}},{"index":1,"message":{"role":"assistant","content":"b"}}]}`,
				failModel, failText(3000))
		case "doneonly":
			item, _ := json.Marshal(map[string]any{"type": "message", "id": "msg_f", "status": "completed", "role": "assistant",
				"content": []any{map[string]any{"type": "output_text", "text": failText(5000), "annotations": []any{}}}})
			sse(`event: response.created`+"\n"+`data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_f","object":"response","created_at":1,"model":"fail-model","status":"in_progress","output":[]}}`,
				`event: response.output_item.added`+"\n"+`data: {"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"type":"message","id":"msg_f","role":"assistant","status":"in_progress","content":[]}}`,
				`event: response.output_item.done`+"\n"+`data: {"type":"response.output_item.done","sequence_number":2,"output_index":0,"item":`+string(item)+`}`,
				`event: response.completed`+"\n"+`data: {"type":"response.completed","sequence_number":3,"response":{"id":"resp_f","object":"response","created_at":1,"model":"fail-model","status":"completed","output":[],"usage":{"input_tokens":12,"output_tokens":1,"total_tokens":13}}}`)
		case "slow":
			// 450 words at 10 a second: 45 s, past the server's 30 s write
			// timeout.
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for _, l := range words(failText(450)) {
				select {
				case <-tick.C:
				case <-r.Context().Done():
					return true
				}
				if !sse(l) {
					return true
				}
			}
			sse("data: "+failFinish, usage(12, 450), "data: [DONE]")
		default:
			return hostileLoops(sc, sse)
		}
		return true
	}
}

// hostileLoops serves the loop cut's scenarios: "la la la …" as chat
// content, Responses text and a tool call's arguments, and prose as long.
func hostileLoops(sc string, sse func(lines ...string) bool) bool {
	la := strings.Fields(strings.Repeat("la ", 400))
	switch sc {
	case "lachat", "prose":
		text := la
		if sc == "prose" {
			text = strings.Fields(failText(400))
		}
		lines := []string{"data: " + failChunk("role", "assistant")}
		for i, word := range text {
			if i > 0 {
				word = " " + word
			}
			lines = append(lines, "data: "+failChunk("content", word))
		}
		sse(append(lines, "data: "+failFinish, "data: [DONE]")...)
	case "latool":
		call := func(fn string) string {
			return fmt.Sprintf(`data: {"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":%q,"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_f","type":"function","function":%s}]},"finish_reason":null}]}`, failModel, fn)
		}
		lines := []string{call(`{"name":"sing","arguments":"{\"lyrics\":\""}`)}
		for _, word := range la {
			lines = append(lines, call(`{"arguments":" `+word+`"}`))
		}
		sse(append(lines, `data: {"id":"chatcmpl-f","object":"chat.completion.chunk","created":1,"model":"fail-model","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}`, "data: [DONE]")...)
	case "laresp":
		lines := []string{`event: response.created` + "\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_f","object":"response","created_at":1,"model":"fail-model","status":"in_progress","output":[]}}`,
			`event: response.output_item.added` + "\n" + `data: {"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"type":"message","id":"msg_f","role":"assistant","status":"in_progress","content":[]}}`,
			`event: response.content_part.added` + "\n" + `data: {"type":"response.content_part.added","sequence_number":2,"item_id":"msg_f","output_index":0,"content_index":0,"part":{"type":"output_text","text":"","annotations":[]}}`}
		for i, word := range la {
			if i > 0 {
				word = " " + word
			}
			lines = append(lines, fmt.Sprintf(`event: response.output_text.delta`+"\n"+`data: {"type":"response.output_text.delta","sequence_number":%d,"item_id":"msg_f","output_index":0,"content_index":0,"delta":%q}`, 3+i, word))
		}
		sse(append(lines, `event: response.completed`+"\n"+`data: {"type":"response.completed","sequence_number":999,"response":{"id":"resp_f","object":"response","created_at":1,"model":"fail-model","status":"completed","output":[]}}`)...)
	default:
		return false
	}
	return true
}

// hostileEnv is the environment of these tests: generous daily caps (each
// case spends a task's worth), a 3 s call deadline, FAREGATE_LLM_MAX_TOKENS
// 4096 so that the 2,000-token answers fit their reservation.
func hostileEnv(redisURL, agentURL, llmURL string, extra map[string]string) map[string]string {
	env := failEnv(redisURL, agentURL, llmURL, map[string]string{
		"FAREGATE_AGENT_TIMEOUT": "120s", "FAREGATE_LLM_TIMEOUT": "3s", "FAREGATE_LLM_MAX_TOKENS": "4096",
		"FAREGATE_TASK_TOKEN_LIMIT": "60000", "FAREGATE_IP_DAILY_TOKENS": "2000000", "FAREGATE_DAILY_TOKEN_BUDGET": "20000000",
		"FAREGATE_LLM_MAX_CALL_TOKENS": "200000", "FAREGATE_V1_MAX_BODY": "262144",
	})
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// hostileTask is one delivered task: its id, key and /v1 base.
type hostileTask struct{ id, key, base, resultURL string }

func newHostileTask(t *testing.T, s *server, agent *failAgentServer) hostileTask {
	t.Helper()
	id := createTrip(t, s.URL, "hold")
	d := agent.next(t)
	if d.Body.Task.ID != id {
		t.Fatalf("delivered %s, want %s", d.Body.Task.ID, id)
	}
	return hostileTask{id: id, key: d.Body.OpenAI.APIKey, base: d.Body.OpenAI.BaseURL, resultURL: d.Body.ResultURL}
}

// taskEntries waits for n ledger entries of task id and returns them.
func taskEntries(t *testing.T, rdb *redis.Client, id string, n int) []map[string]string {
	t.Helper()
	var got []map[string]string
	if !clocktest.Poll(15*time.Second, func() bool { got = failLedger(t, rdb, "task", id); return len(got) >= n }) || len(got) != n {
		t.Fatalf("task %s: %d ledger entries, want %d: %v", id, len(got), n, got)
	}
	return got
}

// hangUpAfterWrite posts body to path over a raw socket, waits until the
// upstream has the request (it carries marker), and closes the socket.
func hangUpAfterWrite(t *testing.T, tk hostileTask, up *failUpstream, path, body, marker string) {
	t.Helper()
	u, _ := url.Parse(tk.base)
	c, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(c, "POST %s%s HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		u.Path, path, u.Host, tk.key, len(body), body)
	if !clocktest.Poll(10*time.Second, func() bool { return up.calls(marker) > 0 }) {
		c.Close()
		t.Fatal("the upstream never got the request")
	}
	c.Close()
}

// TestV1HostileCharges: what reached the provider is charged, whoever
// ended the call; a report below faregate's count is charged the count;
// an answer past its reservation is cut or refused, and charged.
func TestV1HostileCharges(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newFailUpstream(t)
	up.more = hostileScenarios(up)
	agent := newFailAgent(t, up)
	alerts := newAlertReceiver(t, "alert-secret-0123456789")
	s := startServer(t, hostileEnv(rs.URL(), agent.srv.URL, up.srv.URL, alerts.env()))
	long := strings.Repeat("word ", 9900)

	// The reproduction: a prompt of "word " × 9900, the socket
	// closed once the provider has it. Before, nothing was charged.
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "JSON", true: "stream"}[stream]
		t.Run("hang-up after the write, "+name, func(t *testing.T) {
			tk := newHostileTask(t, s, agent)
			marker := "fail:wait " + name
			hangUpAfterWrite(t, tk, up, "/chat/completions", failChatBody(marker+" "+long, stream, ""), marker)
			select {
			case <-up.ended:
			case <-time.After(15 * time.Second):
				t.Fatal("the upstream was never hung up on")
			}
			e := taskEntries(t, rdb, tk.id, 1)[0]
			charged := failInt(t, e, "prompt_tokens") + failInt(t, e, "completion_tokens")
			// A JSON call is cut at once, a stream read on until the
			// call's deadline (3 s) without its usage: each the whole
			// reservation.
			if e["outcome"] != "client_closed" || failInt(t, e, "prompt_tokens") < 9900 || charged != failInt(t, e, "reserved") {
				t.Fatalf("ledger %v: want the whole reservation charged, client_closed", e)
			}
			if settled, outstanding, _ := budgetHash(t, rdb, "task:"+tk.id); settled != charged || outstanding != 0 {
				t.Fatalf("task settled %d outstanding %d, want %d and 0", settled, outstanding, charged)
			}
		})
	}

	t.Run("task ended with calls in flight", func(t *testing.T) {
		tk := newHostileTask(t, s, agent)
		type answer struct {
			status int
			raw    string
		}
		got := make(chan answer, 2)
		for _, stream := range []bool{false, true} {
			body := failChatBody(fmt.Sprintf("fail:wait inflight-%v %s", stream, long), stream, "")
			go func() {
				st, raw, _ := failStream(tk.base+"/chat/completions", tk.key, body)
				got <- answer{st, raw}
			}()
		}
		if !clocktest.Poll(10*time.Second, func() bool { return up.calls("fail:wait inflight") == 2 }) {
			t.Fatal("the calls never reached the upstream")
		}
		if st, raw, _ := failStream(tk.resultURL, tk.key, `{"result":{"text":"done"}}`); st != 204 {
			t.Fatalf("result: %d %s", st, raw)
		}
		for range 2 {
			if a := <-got; a.status != 409 || !strings.Contains(a.raw, `"task_finished"`) {
				t.Fatalf("a call in flight at the task's end: %d %s", a.status, a.raw)
			}
		}
		for _, e := range taskEntries(t, rdb, tk.id, 2) {
			p, c := failInt(t, e, "prompt_tokens"), failInt(t, e, "completion_tokens")
			// The JSON call its reservation, the stream (nothing passed)
			// its prompt.
			if e["outcome"] != "task_ended" || p < 9900 || c != 0 && p+c != failInt(t, e, "reserved") {
				t.Fatalf("ledger %v: want at least the prompt, task_ended", e)
			}
		}
		failNothingHeld(t, rdb, tk.id)
	})

	t.Run("call's deadline", func(t *testing.T) {
		tk := newHostileTask(t, s, agent)
		f := follow(t, s.URL+"/api/tasks/"+tk.id+"/events")
		a := failPost(t, tk.base+"/chat/completions", tk.key, failChatBody("fail:wait deadline", false, ""))
		if a.status != 503 || a.code != "model_unavailable" {
			t.Fatalf("a JSON call past its deadline: %d %s", a.status, a.raw)
		}
		if e := failEntry(t, rdb, a.header.Get("X-Request-Id")); e["outcome"] != "timeout" ||
			failInt(t, e, "prompt_tokens")+failInt(t, e, "completion_tokens") != failInt(t, e, "reserved") {
			t.Fatalf("ledger %v: want the reservation, timeout", e)
		}
		// A stream past its deadline ends well formed for the official
		// client, with what passed.
		client := openai.NewClient(option.WithBaseURL(tk.base+"/"), option.WithAPIKey(tk.key), option.WithMaxRetries(0))
		var hdr *http.Response
		stream := client.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{Model: failModel,
			Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("fail:hold deadline")},
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}, option.WithResponseInto(&hdr))
		var acc openai.ChatCompletionAccumulator
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil || acc.Choices[0].FinishReason != "length" || acc.Usage.CompletionTokens < 1 ||
			acc.Choices[0].Message.Content != "Partial answer so far" {
			t.Fatalf("err %v, choices %+v usage %+v", err, acc.Choices, acc.Usage)
		}
		if e := failEntry(t, rdb, hdr.Header.Get("X-Request-Id")); e["outcome"] != "timeout" || failInt(t, e, "completion_tokens") != acc.Usage.CompletionTokens {
			t.Fatalf("ledger %v, the client was told %+v", e, acc.Usage)
		}
		if st, raw, _ := failStream(tk.resultURL, tk.key, `{"result":{"text":"done"}}`); st != 204 {
			t.Fatalf("result: %d %s", st, raw)
		}
		if !hasStepSaying(f.waitEnded(t, 10*time.Second), "output_truncated") {
			t.Fatalf("no model step says output_truncated: %v", f.Events())
		}
		if task := waitTask(t, s.URL, tk.id); !slices.Contains(task["warnings"].([]any), any("output_truncated")) {
			t.Fatalf("task warnings %v", task["warnings"])
		}
	})

	t.Run("reports below the count", func(t *testing.T) {
		tk := newHostileTask(t, s, agent)
		text := failText(1700)
		for _, c := range []struct {
			name, path, body string
			prompt, output   func(e map[string]string) bool
			implausible      string
		}{
			{"a 2,000-token stream reporting 0", "/chat/completions", failChatBody("fail:zerostream", true, ""),
				nil, func(e map[string]string) bool { return failInt(t, e, "completion_tokens") == failCount(text) }, "1"},
			{"the truth, then 0 in a second usage chunk", "/chat/completions", failChatBody("fail:truthzero", true, ""),
				nil, func(e map[string]string) bool { return failInt(t, e, "completion_tokens") == failCount(text) }, "0"},
			{"a 2,000-token JSON answer reporting 0", "/chat/completions", failChatBody("fail:zerojson", false, ""),
				nil, func(e map[string]string) bool { return failInt(t, e, "completion_tokens") == failCount(text) }, "1"},
			{"5 choices with usage for one", "/chat/completions", failChatBody("fail:fivechoices", false, ""),
				nil, func(e map[string]string) bool {
					return failInt(t, e, "completion_tokens") >= 5*failCount(failText(400))
				}, "1"},
			{"a Responses answer reporting 0", "/responses", `{"model":"fail-model","input":"fail:respzero"}`,
				nil, func(e map[string]string) bool { return failInt(t, e, "completion_tokens") == failCount(text) }, "1"},
			{"embeddings reporting 0", "/embeddings", `{"model":"fail-embed","input":"fail:embedzero ` + text + `"}`,
				func(e map[string]string) bool {
					return failInt(t, e, "prompt_tokens") == failCount("fail:embedzero "+text)
				}, nil, "1"},
		} {
			t.Run(c.name, func(t *testing.T) {
				a := failPost(t, tk.base+c.path, tk.key, c.body)
				if a.status != 200 {
					t.Fatalf("%d %s", a.status, a.raw)
				}
				e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
				if c.output != nil && !c.output(e) || c.prompt != nil && !c.prompt(e) || e["implausible"] != c.implausible {
					t.Fatalf("ledger %v: want faregate's count charged (%d), implausible %s", e, failCount(text), c.implausible)
				}
				if c.implausible == "1" && e["usage_raw"] == "" {
					t.Fatalf("ledger %v: the raw report is not kept", e)
				}
			})
		}
		if got := alerts.waitEvent(t, "usage_implausible"); !strings.Contains(fmt.Sprint(got.Details["raw_usage"]), `"completion_tokens":0`) &&
			!strings.Contains(fmt.Sprint(got.Details["raw_usage"]), `"prompt_tokens":0`) {
			t.Fatalf("alert %+v", got)
		}
		failNothingHeld(t, rdb, tk.id)
	})

	t.Run("answers past the reservation", func(t *testing.T) {
		tk := newHostileTask(t, s, agent)
		// 20,000 tokens on an 18-token reservation: relayed cut to it.
		a := failPost(t, tk.base+"/chat/completions", tk.key, failChatBody("fail:long", false, `,"max_tokens":18`))
		var got struct {
			Choices []struct {
				Message      struct{ Content string }
				FinishReason string `json:"finish_reason"`
			}
		}
		if err := json.Unmarshal([]byte(a.raw), &got); err != nil || a.status != 200 || len(got.Choices) != 1 ||
			got.Choices[0].FinishReason != "length" || failCount(got.Choices[0].Message.Content) > 18 {
			t.Fatalf("%d %v %.300s", a.status, err, a.raw)
		}
		e := failEntry(t, rdb, a.header.Get("X-Request-Id"))
		// The bound counts more than the report, by less than twice:
		// the report stands (a model's own tokenizer counts less than
		// the bound), all of it charged past the reservation.
		if failInt(t, e, "completion_tokens") < 20000 || failInt(t, e, "overage_tokens") <= 0 || e["outcome"] != "output_truncated" {
			t.Fatalf("ledger %v: want all 20,000 tokens charged, the excess as overage", e)
		}
		// Two choices cannot be cut well formed: refused, and charged.
		a = failPost(t, tk.base+"/chat/completions", tk.key, failChatBody("fail:twochoices", false, `,"max_tokens":18`))
		if a.status != 502 || a.code != "upstream_invalid" || a.typ != "api_error" {
			t.Fatalf("%d %s", a.status, a.raw)
		}
		if e := failEntry(t, rdb, a.header.Get("X-Request-Id")); failInt(t, e, "completion_tokens") < failCount(failText(3000)) {
			t.Fatalf("ledger %v: want the answer's tokens charged", e)
		}
		// A Responses stream whose text comes only in output_item.done:
		// counted, cut, charged.
		client := openai.NewClient(option.WithBaseURL(tk.base+"/"), option.WithAPIKey(tk.key), option.WithMaxRetries(0))
		var hdr *http.Response
		stream := client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{Model: failModel,
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("fail:doneonly")}, MaxOutputTokens: openai.Int(32)},
			option.WithResponseInto(&hdr))
		last, text := "", ""
		for stream.Next() {
			ev := stream.Current()
			last = ev.Type
			if ev.Type == "response.incomplete" {
				text = ev.AsResponseIncomplete().Response.OutputText()
			}
		}
		if err := stream.Err(); err != nil || last != "response.incomplete" || strings.Contains(text, failText(50)) {
			t.Fatalf("err %v, last event %q, text %.100q", err, last, text)
		}
		if e := failEntry(t, rdb, hdr.Header.Get("X-Request-Id")); failInt(t, e, "completion_tokens") < failCount(failText(5000)) {
			t.Fatalf("ledger %v: want the done-only text's tokens charged", e)
		}
	})
}

// hasStepSaying reports whether a follower saw a model step whose detail
// names code.
func hasStepSaying(evs []sseEvent, code string) bool {
	for _, e := range evs {
		var st struct{ Kind, Detail string }
		if e.Type == "step" && json.Unmarshal([]byte(e.Data), &st) == nil && st.Kind == "model" && strings.Contains(st.Detail, code) {
			return true
		}
	}
	return false
}

// TestV1HangUpBeforeWrite: an agent that hangs up before its call was
// written to the provider (here, while the call waits for its turn at the
// site's pacing) spends nothing: no upstream request, no ledger entry,
// nothing settled or held.
func TestV1HangUpBeforeWrite(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newFailUpstream(t)
	up.more = hostileScenarios(up)
	agent := newFailAgent(t, up)
	// A call books about 1,045 tokens (its prompt and 1,024 of output):
	// with one in flight, the bucket's 1,920 leave the next ~10 s to wait.
	s := startServer(t, hostileEnv(rs.URL(), agent.srv.URL, up.srv.URL, map[string]string{
		"FAREGATE_SITE_TOKENS_PER_MINUTE": "960", "FAREGATE_LLM_MAX_TOKENS": "1024"}))
	tk := newHostileTask(t, s, agent)
	first := make(chan failAnswer, 1)
	go func() {
		first <- failPostNoFatal(tk.base+"/chat/completions", tk.key, failChatBody("fail:wait first", false, ""))
	}()
	if !clocktest.Poll(10*time.Second, func() bool { return up.calls("fail:wait first") > 0 }) {
		t.Fatal("the first call never reached the upstream")
	}
	_, held, _ := budgetHash(t, rdb, "task:"+tk.id)
	u, _ := url.Parse(tk.base)
	c, err := net.DialTimeout("tcp", u.Host, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	body := failChatBody("fail:ok second", false, "")
	fmt.Fprintf(c, "POST %s/chat/completions HTTP/1.1\r\nHost: %s\r\nAuthorization: Bearer %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		u.Path, u.Host, tk.key, len(body), body)
	// Reserved beside the first, and so waiting for its turn: the agent
	// hangs up.
	if !clocktest.Poll(10*time.Second, func() bool { _, o, _ := budgetHash(t, rdb, "task:"+tk.id); return o > held }) {
		t.Fatal("the second call was never reserved")
	}
	c.Close()
	if a := <-first; a.status != 503 {
		t.Fatalf("the first call (held past its deadline): %d %s", a.status, a.raw)
	}
	failNothingHeld(t, rdb, tk.id)
	entries := failLedger(t, rdb, "task", tk.id)
	settled, _, _ := budgetHash(t, rdb, "task:"+tk.id)
	if up.calls("fail:ok second") != 0 || len(entries) != 1 || entries[0]["outcome"] != "timeout" ||
		settled != failInt(t, entries[0], "prompt_tokens")+failInt(t, entries[0], "completion_tokens") {
		t.Fatalf("upstream got the second call %d times; task settled %d; ledger %v: want the first call's alone", up.calls("fail:ok second"), settled, entries)
	}
}

// failPostNoFatal is failPost for a goroutine: a failed request is a
// status 0.
func failPostNoFatal(url, key, body string) failAnswer {
	st, raw, _ := failStream(url, key, body)
	return failAnswer{status: st, raw: raw}
}

// TestV1LegacyMaxTokens: FAREGATE_LLM_LEGACY_MAX_TOKENS=true applies to
// /v1: the upstream receives max_tokens beside max_completion_tokens, at
// the same value, whichever the agent chose.
func TestV1LegacyMaxTokens(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	up := newFailUpstream(t)
	agent := newFailAgent(t, up)
	s := startServer(t, hostileEnv(rs.URL(), agent.srv.URL, up.srv.URL, map[string]string{"FAREGATE_LLM_LEGACY_MAX_TOKENS": "true"}))
	tk := newHostileTask(t, s, agent)
	if a := failPost(t, tk.base+"/chat/completions", tk.key, failChatBody("fail:ok legacy", false, `,"max_completion_tokens":50`)); a.status != 200 {
		t.Fatalf("%d %s", a.status, a.raw)
	}
	g, _ := up.last("fail:ok legacy")
	var sent struct {
		MaxTokens           *int64 `json:"max_tokens"`
		MaxCompletionTokens *int64 `json:"max_completion_tokens"`
	}
	if err := json.Unmarshal(g.body, &sent); err != nil || sent.MaxTokens == nil || sent.MaxCompletionTokens == nil || *sent.MaxTokens != 50 || *sent.MaxCompletionTokens != 50 {
		t.Fatalf("upstream request %s: want max_tokens and max_completion_tokens both 50", g.body)
	}
}

// TestV1LoopCut: issue #30's loop cut on /v1. A repetitive chat stream,
// Responses stream and tool-call argument stream are each cut under 100
// tokens, well formed for the official client, with output_loop on the
// step, the ledger and the task; prose of the same length is not cut; and
// a replica with FAREGATE_LOOP_CUT=false relays the loop whole.
func TestV1LoopCut(t *testing.T) {
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newFailUpstream(t)
	up.more = hostileScenarios(up)
	agent := newFailAgent(t, up)
	env := hostileEnv(rs.URL(), agent.srv.URL, up.srv.URL, nil)
	s := startServer(t, env)
	env["FAREGATE_LOOP_CUT"] = "false"
	off := startServer(t, env)
	tk := newHostileTask(t, s, agent)
	f := follow(t, s.URL+"/api/tasks/"+tk.id+"/events")
	client := openai.NewClient(option.WithBaseURL(tk.base+"/"), option.WithAPIKey(tk.key), option.WithMaxRetries(0))
	chat := func(t *testing.T, c openai.Client, scenario string) (openai.ChatCompletionAccumulator, map[string]string) {
		t.Helper()
		var hdr *http.Response
		stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{Model: failModel,
			Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("fail:" + scenario)},
			StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}, option.WithResponseInto(&hdr))
		var acc openai.ChatCompletionAccumulator
		for stream.Next() {
			acc.AddChunk(stream.Current())
		}
		if err := stream.Err(); err != nil || len(acc.Choices) != 1 {
			t.Fatalf("%s: %v, %+v", scenario, err, acc.Choices)
		}
		return acc, failEntry(t, rdb, hdr.Header.Get("X-Request-Id"))
	}
	for _, sc := range []string{"lachat", "latool"} {
		t.Run(sc, func(t *testing.T) {
			acc, e := chat(t, client, sc)
			if acc.Choices[0].FinishReason != "length" || acc.Usage.CompletionTokens >= 100 || e["outcome"] != "output_loop" ||
				failInt(t, e, "completion_tokens") != acc.Usage.CompletionTokens {
				t.Fatalf("finish %q usage %+v ledger %v: want cut at the loop under 100 tokens, output_loop", acc.Choices[0].FinishReason, acc.Usage, e)
			}
		})
	}
	t.Run("laresp", func(t *testing.T) {
		var hdr *http.Response
		stream := client.Responses.NewStreaming(context.Background(), responses.ResponseNewParams{Model: failModel,
			Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("fail:laresp")}}, option.WithResponseInto(&hdr))
		var final responses.Response
		last := ""
		for stream.Next() {
			ev := stream.Current()
			if last = ev.Type; last == "response.incomplete" {
				final = ev.AsResponseIncomplete().Response
			}
		}
		if err := stream.Err(); err != nil || last != "response.incomplete" || final.Usage.OutputTokens >= 100 {
			t.Fatalf("err %v, last %q, usage %+v", err, last, final.Usage)
		}
		if e := failEntry(t, rdb, hdr.Header.Get("X-Request-Id")); e["outcome"] != "output_loop" {
			t.Fatalf("ledger %v", e)
		}
	})
	t.Run("prose of the same length", func(t *testing.T) {
		acc, e := chat(t, client, "prose")
		if acc.Choices[0].FinishReason != "stop" || acc.Usage.CompletionTokens < 400 || e["outcome"] != "ok" {
			t.Fatalf("finish %q usage %+v ledger %v: want it whole", acc.Choices[0].FinishReason, acc.Usage, e)
		}
	})
	t.Run("FAREGATE_LOOP_CUT=false", func(t *testing.T) {
		u, _ := url.Parse(tk.base)
		offBase := off.URL + u.Path
		acc, e := chat(t, openai.NewClient(option.WithBaseURL(offBase+"/"), option.WithAPIKey(tk.key), option.WithMaxRetries(0)), "lachat")
		if acc.Choices[0].FinishReason != "stop" || acc.Usage.CompletionTokens < 400 || e["outcome"] != "ok" {
			t.Fatalf("finish %q usage %+v ledger %v: want the loop relayed whole", acc.Choices[0].FinishReason, acc.Usage, e)
		}
	})
	if st, raw, _ := failStream(tk.resultURL, tk.key, `{"result":{"text":"done"}}`); st != 204 {
		t.Fatalf("result: %d %s", st, raw)
	}
	evs := f.waitEnded(t, 10*time.Second)
	if !hasStepSaying(evs, "output_loop") {
		t.Fatalf("no model step says output_loop: %v", evs)
	}
	task := waitTask(t, s.URL, tk.id)
	ws, _ := task["warnings"].([]any)
	if !slices.Contains(ws, any("output_loop")) {
		t.Fatalf("task warnings %v, want output_loop", task["warnings"])
	}
}

// TestV1LongStream: a 45-second stream at 10 tokens a second arrives
// whole through the real server (its write timeout is 30 s): every word,
// finish_reason, the usage chunk and [DONE].
func TestV1LongStream(t *testing.T) {
	t.Parallel()
	redistest.Require(t)
	rs := redistest.Start(t)
	rdb := rs.Client(t)
	up := newFailUpstream(t)
	up.more = hostileScenarios(up)
	agent := newFailAgent(t, up)
	s := startServer(t, hostileEnv(rs.URL(), agent.srv.URL, up.srv.URL, map[string]string{"FAREGATE_LLM_TIMEOUT": "60s"}))
	tk := newHostileTask(t, s, agent)
	start := time.Now()
	req, _ := http.NewRequest("POST", tk.base+"/chat/completions", strings.NewReader(failChatBody("fail:slow", true, "")))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+tk.key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	took := time.Since(start)
	text := string(raw)
	if err != nil || !strings.HasSuffix(text, "data: [DONE]\n\n") || !strings.Contains(text, `"finish_reason":"stop"`) ||
		!strings.Contains(text, `"completion_tokens":450`) || strings.Count(text, `"content":`) < 450 {
		t.Fatalf("after %v: %v, %d bytes ending %q", took, err, len(text), text[max(len(text)-300, 0):])
	}
	if e := failEntry(t, rdb, resp.Header.Get("X-Request-Id")); e["outcome"] != "ok" || failInt(t, e, "completion_tokens") != 450 {
		t.Fatalf("ledger %v", e)
	}
	t.Logf("a stream of %v arrived whole (%d bytes)", took.Round(time.Millisecond), len(raw))
}
