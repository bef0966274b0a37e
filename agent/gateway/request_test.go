package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"faregate/agent/tokens"
)

func okUpstream(t *testing.T) *scripted {
	return newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`)
	})
}

func errorOf(t *testing.T, body string) (code, typ, param string) {
	t.Helper()
	var e struct {
		Error struct {
			Code, Type string
			Param      *string
		}
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil {
		t.Fatalf("not an error body: %q", body)
	}
	if e.Error.Param != nil {
		param = *e.Error.Param
	}
	return e.Error.Code, e.Error.Type, param
}

// Every field that changes the cost in a way a reservation cannot see is
// refused before the governor or the provider hears of the call.
func TestRefusedParameters(t *testing.T) {
	up := okUpstream(t)
	e := newEnv(t, up.upstream(), nil)
	chat := `"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]`
	resp := `"model":"gpt-4o-mini","input":"hi"`
	cases := []struct {
		name, path, body, status, code, param string
	}{
		{"n=2", "/v1/chat/completions", `{` + chat + `,"n":2}`, "400", "unsupported_parameter", "n"},
		{"n=1.5", "/v1/chat/completions", `{` + chat + `,"n":1.5}`, "400", "unsupported_parameter", "n"},
		{"best_of=4", "/v1/chat/completions", `{` + chat + `,"best_of":4}`, "400", "unsupported_parameter", "best_of"},
		{"llama.cpp's n_cmpl", "/v1/chat/completions", `{` + chat + `,"n_cmpl":4}`, "400", "unsupported_parameter", "n_cmpl"},
		{"llama.cpp's n_predict", "/v1/chat/completions", `{` + chat + `,"max_tokens":10,"n_predict":-1}`, "400", "unsupported_parameter", "n_predict"},
		{"n_predict on responses", "/v1/responses", `{` + resp + `,"n_predict":100000}`, "400", "unsupported_parameter", "n_predict"},
		{"Hugging Face's max_new_tokens", "/v1/chat/completions", `{` + chat + `,"max_tokens":10,"max_new_tokens":100000}`, "400", "unsupported_parameter", "max_new_tokens"},
		{"Ollama's num_predict", "/v1/chat/completions", `{` + chat + `,"num_predict":-1}`, "400", "unsupported_parameter", "num_predict"},
		{"Ollama's options.num_predict", "/v1/chat/completions", `{` + chat + `,"options":{"temperature":0.2,"num_predict":-2}}`, "400", "unsupported_parameter", "options.num_predict"},
		{"options.num_predict spelled otherwise", "/v1/chat/completions", `{` + chat + `,"options":{"NUM_PREDICT":-2}}`, "400", "invalid_request", "options.NUM_PREDICT"},
		{"num_return_sequences even at 1", "/v1/responses", `{` + resp + `,"num_return_sequences":1}`, "400", "unsupported_parameter", "num_return_sequences"},
		{"Gemini's candidate_count", "/v1/chat/completions", `{` + chat + `,"candidate_count":4}`, "400", "unsupported_parameter", "candidate_count"},
		{"vLLM's min_tokens", "/v1/chat/completions", `{` + chat + `,"min_tokens":5000}`, "400", "unsupported_parameter", "min_tokens"},
		{"vLLM's documents", "/v1/chat/completions", `{` + chat + `,"documents":[{"title":"t","text":"a long text"}]}`, "400", "unsupported_parameter", "documents"},
		{"chat_template", "/v1/chat/completions", `{` + chat + `,"chat_template":"{{ messages }}"}`, "400", "unsupported_parameter", "chat_template"},
		{"chat_template_kwargs", "/v1/chat/completions", `{` + chat + `,"chat_template_kwargs":{"enable_thinking":true}}`, "400", "unsupported_parameter", "chat_template_kwargs"},
		{"add_generation_prompt", "/v1/chat/completions", `{` + chat + `,"add_generation_prompt":false}`, "400", "unsupported_parameter", "add_generation_prompt"},
		{"continue_final_message", "/v1/chat/completions", `{` + chat + `,"continue_final_message":true}`, "400", "unsupported_parameter", "continue_final_message"},
		{"documents on responses", "/v1/responses", `{` + resp + `,"documents":[]}`, "400", "unsupported_parameter", "documents"},
		{"Documents spelled otherwise", "/v1/chat/completions", `{` + chat + `,"Documents":[]}`, "400", "invalid_request", "Documents"},
		{"service_tier priority", "/v1/chat/completions", `{` + chat + `,"service_tier":"priority"}`, "400", "unsupported_parameter", "service_tier"},
		{"service_tier flex", "/v1/responses", `{` + resp + `,"service_tier":"flex"}`, "400", "unsupported_parameter", "service_tier"},
		{"audio modality", "/v1/chat/completions", `{` + chat + `,"modalities":["text","audio"]}`, "400", "unsupported_parameter", "modalities"},
		{"audio", "/v1/chat/completions", `{` + chat + `,"audio":{"voice":"alloy","format":"wav"}}`, "400", "unsupported_parameter", "audio"},
		{"web search tool", "/v1/chat/completions", `{` + chat + `,"tools":[{"type":"function","function":{"name":"f"}},{"type":"custom","custom":{"name":"g"}}]}`, "400", "unsupported_parameter", "tools[1].type"},
		{"web_search_options", "/v1/chat/completions", `{` + chat + `,"web_search_options":{}}`, "400", "unsupported_parameter", "web_search_options"},
		{"background", "/v1/responses", `{` + resp + `,"background":true}`, "400", "unsupported_parameter", "background"},
		{"previous_response_id", "/v1/responses", `{` + resp + `,"previous_response_id":"resp_1"}`, "400", "unsupported_parameter", "previous_response_id"},
		{"conversation", "/v1/responses", `{` + resp + `,"conversation":"conv_1"}`, "400", "unsupported_parameter", "conversation"},
		{"stored prompt", "/v1/responses", `{` + resp + `,"prompt":{"id":"pmpt_1"}}`, "400", "unsupported_parameter", "prompt"},
		{"hosted tool", "/v1/responses", `{` + resp + `,"tools":[{"type":"web_search"}]}`, "400", "unsupported_parameter", "tools[0].type"},
		{"mcp tool", "/v1/responses", `{` + resp + `,"tools":[{"type":"function","name":"f"},{"type":"mcp","server_url":"https://x"}]}`, "400", "unsupported_parameter", "tools[1].type"},
		{"a chat file by id", "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":[{"type":"text","text":"sum up"},{"type":"file","file":{"file_id":"file-abc"}}]}]}`, "400", "unsupported_parameter", "messages[0].content[1].file.file_id"},
		{"a responses file by id", "/v1/responses", `{"model":"gpt-4o-mini","input":[{"role":"user","content":[{"type":"input_file","file_id":"file-abc"}]}]}`, "400", "unsupported_parameter", "input[0].content[0].file_id"},
		{"a responses file by url", "/v1/responses", `{"model":"gpt-4o-mini","input":[{"role":"user","content":"hi"},{"type":"function_call_output","call_id":"c","output":[{"type":"input_file","file_url":"https://x/a.pdf"}]}]}`, "400", "unsupported_parameter", "input[1].output[0].file_url"},
		{"a forced custom tool", "/v1/chat/completions", `{` + chat + `,"tool_choice":{"type":"custom","custom":{"name":"g"}}}`, "400", "unsupported_parameter", "tool_choice.type"},
		{"a forced web search", "/v1/responses", `{` + resp + `,"tool_choice":{"type":"web_search_preview"}}`, "400", "unsupported_parameter", "tool_choice.type"},
		{"a forced mcp tool", "/v1/responses", `{` + resp + `,"tool_choice":{"type":"mcp","server_label":"x"}}`, "400", "unsupported_parameter", "tool_choice.type"},
		{"allowed tools with a hosted one", "/v1/responses", `{` + resp + `,"tool_choice":{"type":"allowed_tools","mode":"auto","tools":[{"type":"function","name":"f"},{"type":"web_search"}]}}`, "400", "unsupported_parameter", "tool_choice.tools[1].type"},
		{"chat allowed tools with a custom one", "/v1/chat/completions", `{` + chat + `,"tool_choice":{"type":"allowed_tools","allowed_tools":{"mode":"auto","tools":[{"type":"custom","custom":{"name":"g"}}]}}}`, "400", "unsupported_parameter", "tool_choice.tools[0].type"},
		{"OpenRouter's models", "/v1/chat/completions", `{` + chat + `,"models":["openai/o1-pro"]}`, "400", "unsupported_parameter", "models"},
		{"OpenRouter's plugins", "/v1/chat/completions", `{` + chat + `,"plugins":[{"id":"web"}]}`, "400", "unsupported_parameter", "plugins"},
		{"unknown model", "/v1/chat/completions", `{"model":"gpt-5-pro","messages":[]}`, "400", "model_not_allowed", ""},
		{"unknown model responses", "/v1/responses", `{"model":"o3","input":"x"}`, "400", "model_not_allowed", ""},
		// The model is checked before anything of the prompt is read (or
		// counted): a prompt no reader would take is not looked at.
		{"unknown model, prompt unread", "/v1/chat/completions", `{"model":"gpt-4o","messages":"not an array"}`, "400", "model_not_allowed", ""},
		{"unknown model, no prompt", "/v1/chat/completions", `{"model":"gpt-4o"}`, "400", "model_not_allowed", ""},
		{"unknown model responses, input unread", "/v1/responses", `{"model":"gpt-4o","input":7}`, "400", "model_not_allowed", ""},
		{"unknown model, before its parameters", "/v1/chat/completions", `{"model":"gpt-4o","n":2,"max_tokens":0}`, "400", "model_not_allowed", ""},
		{"embeddings with a chat model, input unread", "/v1/embeddings", `{"model":"gpt-4o-mini","input":{"not":"text"}}`, "400", "model_not_allowed", ""},
		{"malformed JSON", "/v1/chat/completions", `{"model":"gpt-4o-mini",`, "400", "invalid_request", "body"},
		{"not an object", "/v1/chat/completions", `[1,2]`, "400", "invalid_request", "body"},
		{"trailing data", "/v1/chat/completions", `{` + chat + `}{}`, "400", "invalid_request", "body"},
		{"duplicate model", "/v1/chat/completions", `{` + chat + `,"model":"gpt-5-pro"}`, "400", "invalid_request", "model"},
		{"duplicate stream_options key", "/v1/chat/completions", `{` + chat + `,"stream":true,"stream_options":{"include_usage":false,"include_usage":true}}`, "400", "invalid_request", "stream_options.include_usage"},
		{"no model", "/v1/chat/completions", `{"messages":[]}`, "400", "invalid_request", "model"},
		{"no messages", "/v1/chat/completions", `{"model":"gpt-4o-mini"}`, "400", "invalid_request", "messages"},
		{"max_tokens zero", "/v1/chat/completions", `{` + chat + `,"max_tokens":0}`, "400", "invalid_request", "max_tokens"},
		{"max_tokens huge", "/v1/chat/completions", `{` + chat + `,"max_completion_tokens":1e300}`, "400", "invalid_request", "max_completion_tokens"},
		{"max_output_tokens text", "/v1/responses", `{` + resp + `,"max_output_tokens":"10"}`, "400", "invalid_request", "max_output_tokens"},
		{"stream not bool", "/v1/chat/completions", `{` + chat + `,"stream":"yes"}`, "400", "invalid_request", "stream"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r, body := e.post(t, c.path, c.body)
			code, typ, param := errorOf(t, body)
			if fmt.Sprint(r.StatusCode) != c.status || code != c.code || param != c.param || typ != "invalid_request_error" {
				t.Fatalf("got %d %s %q (%s), want %s %s %q", r.StatusCode, code, param, typ, c.status, c.code, c.param)
			}
		})
	}
	// Allowed values of the same fields pass.
	for _, body := range []string{
		`{` + chat + `,"n":1,"best_of":1,"n_cmpl":1,"n_predict":null,"service_tier":"auto","modalities":["text"],"audio":null}`,
		`{` + chat + `,"options":{"temperature":0.2},"documents":null,"min_tokens":null}`,
		`{` + chat + `,"service_tier":"default","tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"f"}},"models":[]}`,
	} {
		if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 200 {
			t.Fatalf("%s: %d %s", body, r.StatusCode, b)
		}
	}
	if r, b := e.post(t, "/v1/responses", `{`+resp+`,"background":false,"previous_response_id":null,"tools":[{"type":"function","name":"f"}],"tool_choice":{"type":"allowed_tools","mode":"auto","tools":[{"type":"function","name":"f"}]}}`); r.StatusCode != 200 {
		t.Fatalf("allowed responses request: %d %s", r.StatusCode, b)
	}
	// A file's data sent inline is counted, and passes.
	if r, b := e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":[{"type":"file","file":{"filename":"a.pdf","file_data":"data:application/pdf;base64,JVBERi0x","file_id":null}}]}]}`); r.StatusCode != 200 {
		t.Fatalf("inline file: %d %s", r.StatusCode, b)
	}
	if n := len(e.gov.specs); n != 5 {
		t.Fatalf("the governor heard of %d calls, want only the 5 allowed ones", n)
	}
}

// fields other providers read included, arrives byte for byte.
func TestForwardPatchesOnlyGovernedFields(t *testing.T) {
	up := okUpstream(t)
	e := newEnv(t, up.upstream(), nil)
	e.gov.model, e.gov.cap = "gpt-4o-mini-2024-07-18", 100
	vendor := `"vendor_extension":{"top_k": 40, "repetition_penalty":1.1, "html":"<b>&</b>"}`
	body := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":5000,` + vendor + `,"temperature":0.2}`
	if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 200 {
		t.Fatalf("%d %s", r.StatusCode, b)
	}
	up.mu.Lock()
	raw := string(up.bodies[0])
	up.mu.Unlock()
	if !strings.Contains(raw, vendor) || !strings.Contains(raw, `"temperature":0.2`) {
		t.Fatalf("unknown fields were changed: %s", raw)
	}
	got := up.lastBody(t)
	if got["model"] != "gpt-4o-mini-2024-07-18" || got["max_tokens"] != float64(100) {
		t.Fatalf("governed fields: %v", got)
	}
	if _, ok := got["max_completion_tokens"]; ok {
		t.Fatal("a second limit field was added beside the client's")
	}
	spec, _, _, _ := e.gov.last(t)
	if spec.MaxOutput != 5000 {
		t.Fatalf("spec.MaxOutput %d", spec.MaxOutput)
	}
	// Without a limit one is set: max_completion_tokens for OpenAI's
	// models, max_tokens for others, max_output_tokens for Responses.
	e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[]}`)
	if got := up.lastBody(t); got["max_completion_tokens"] != float64(100) {
		t.Fatalf("no limit given: %v", got)
	}
	e.gov.model = "llama3.1:8b"
	e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[]}`)
	if got := up.lastBody(t); got["max_tokens"] != float64(100) {
		t.Fatalf("no limit given, other server: %v", got)
	}
	e.post(t, "/v1/responses", `{"model":"gpt-4o-mini","input":"x","max_output_tokens":20}`)
	if got := up.lastBody(t); got["max_output_tokens"] != float64(20) {
		t.Fatalf("responses limit under the cap kept: %v", got)
	}
	// A chat stream always asks for usage upstream, keeping the client's
	// other stream options.
	e.gov.model = ""
	e.post(t, "/v1/chat/completions", `{"model":"gpt-4o-mini","messages":[],"stream":true,"stream_options":{"include_obfuscation":false}}`)
	got = up.lastBody(t)
	so, _ := got["stream_options"].(map[string]any)
	if so["include_usage"] != true || so["include_obfuscation"] != false {
		t.Fatalf("stream_options upstream: %v", got["stream_options"])
	}
}

// The prompt estimate uses the model's tokenizer and sees every part of a
// request the provider charges for.
func TestPromptEstimate(t *testing.T) {
	c, err := parseCall(KindChat, []byte(`{"model":"gpt-4o","messages":[{"role":"system","content":"You are brief."},{"role":"user","content":[{"type":"text","text":"What is in this image?"},{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	if c.prompt < tokens.ImageTokens("gpt-4o", false)+10 {
		t.Fatalf("image prompt %d", c.prompt)
	}
	// gpt-4o-mini's images cost 33 times gpt-4o's tokens: one image is
	// held at 48,169.
	mini, err := parseCall(KindChat, []byte(`{"model":"gpt-4o-mini","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png","detail":"high"}}]}]}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	if mini.prompt < 48169 {
		t.Fatalf("a gpt-4o-mini image held at %d tokens", mini.prompt)
	}
	// At low detail it is held at gpt-4o-mini's base.
	low, err := parseCall(KindResponses, []byte(`{"model":"gpt-4o-mini","input":[{"role":"user","content":[{"type":"input_image","image_url":"https://x/y.png","detail":"low"}]}]}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	if low.prompt < 2833 || low.prompt > 3000 {
		t.Fatalf("a low-detail gpt-4o-mini image held at %d tokens", low.prompt)
	}
	r, err := parseCall(KindResponses, []byte(`{"model":"gpt-4o","instructions":"Be brief.","input":[{"role":"user","content":[{"type":"input_text","text":"hello there"}]},{"type":"function_call","name":"lookup","arguments":"{\"city\":\"Rome\"}","call_id":"c"},{"type":"function_call_output","call_id":"c","output":"sunny"}],"tools":[{"type":"function","name":"lookup","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}]}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := parseCall(KindResponses, []byte(`{"model":"gpt-4o","input":"hello there"}`), anyModel)
	if r.prompt <= plain.prompt+10 {
		t.Fatalf("items and tools were not counted: %d vs %d", r.prompt, plain.prompt)
	}
	// An item reference (the Vercel AI SDK's form of each earlier answer)
	// is held at the most one call may produce, its content unseen; one
	// with neither type nor role is one too.
	refs, err := parseCallHolding(KindResponses, []byte(`{"model":"gpt-4o","input":[{"role":"user","content":"hello there"},{"type":"item_reference","id":"msg_1"},{"id":"fc_2"}]}`), anyModel, 700, nil)
	if err != nil {
		t.Fatal(err)
	}
	if refs.prompt < plain.prompt+2*700 || refs.prompt > plain.prompt+2*700+40 {
		t.Fatalf("two item references added %d to the prompt, want 1,400 and their JSON", refs.prompt-plain.prompt)
	}
	// A predicted output is billed, where the model does not use it, as
	// output past max_tokens: it is reserved with the prompt.
	code := strings.Repeat(`func main() { fmt.Println(42) }\n`, 100)
	pred, err := parseCall(KindChat, []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"rename main"}],"prediction":{"type":"content","content":"`+code+`"}}`), anyModel)
	if err != nil {
		t.Fatal(err)
	}
	bare, _ := parseCall(KindChat, []byte(`{"model":"gpt-4o","messages":[{"role":"user","content":"rename main"}]}`), anyModel)
	if pred.prompt < bare.prompt+1000 {
		t.Fatalf("a prediction of about 1,100 tokens added %d to the prompt", pred.prompt-bare.prompt)
	}
}

func anyModel(string) bool { return true }

// BenchmarkRefusedModel is what a refused model costs beside what a body
// the JSON reader refuses costs, both of the same 1.5 MiB of prompt (run:
// go test -run '^$' -bench RefusedModel -benchtime 5x ./agent/gateway).
// The model is checked before the prompt is read and counted, so both are
// the JSON scan of the body; counting it (o200k, the allowed model's
// encoding, loaded before) costs tens of times more. Each op's prompt
// differs (its first bytes, at random), as an agent burning CPU would send
// it: the tokenizer's memo must not hide the count.
func BenchmarkRefusedModel(b *testing.B) {
	tokens.ForModel(testModel)
	h := New(Options{Governor: &fakeGov{}, Records: testRecords, Errors: testErrorWriter{},
		Task: func(*http.Request) (Task, bool) { return Task{ID: "t_bench", Models: []string{testModel}}, true }})
	prompt := strings.Repeat("Lisbon has seven hills, yellow trams and custard tarts. ", 1536<<10/56)
	for _, c := range []struct{ name, body, code string }{
		{"model=gpt-4o", `{"model":"gpt-4o","messages":[{"role":"user","content":"` + prompt + `"}]}`, "model_not_allowed"},
		{"baseline=trailing-data", `{"model":"` + testModel + `","messages":[{"role":"user","content":"` + prompt + `"}]} {}`, "invalid_request"},
	} {
		b.Run(c.name, func(b *testing.B) {
			body := []byte(c.body)
			at := strings.Index(c.body, "Lisbon")
			for b.Loop() {
				copy(body[at:], fmt.Sprintf("%016x", rand.Uint64()))
				req := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
				w := httptest.NewRecorder()
				h.Chat(w, req, body)
				if w.Code != 400 || !strings.Contains(w.Body.String(), c.code) {
					b.Fatalf("%d %s", w.Code, w.Body.String())
				}
			}
		})
	}
}

// passedChat and passedResponses are the OpenAI request fields the model
// endpoint forwards byte for byte (as well as any field it does not know):
// the list the manual and the closing note give. Governed, and so
// rewritten: model, the output limit, stream_options; refused: the
// cost-changing ones (TestRefusedParameters).
var passedChat = []string{
	`"messages":[{"role":"developer","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"hi"}],"name":"ana"}]`,
	`"temperature":0.2`, `"top_p":0.9`, `"frequency_penalty":0.1`, `"presence_penalty":-0.1`,
	`"logit_bias":{"50256":-100}`, `"logprobs":true`, `"top_logprobs":3`, `"stop":["\n\n","END"]`, `"seed":42`,
	`"user":"u-1"`, `"safety_identifier":"s-1"`, `"prompt_cache_key":"k-1"`, `"metadata":{"run":"a"}`, `"store":false`,
	`"response_format":{"type":"json_schema","json_schema":{"name":"trip","schema":{"type":"object"},"strict":true}}`,
	`"tools":[{"type":"function","function":{"name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}},"strict":true}}]`,
	`"tool_choice":{"type":"function","function":{"name":"get_weather"}}`, `"parallel_tool_calls":false`,
	`"reasoning_effort":"low"`, `"verbosity":"low"`, `"modalities":["text"]`, `"n":1`, `"service_tier":"auto"`,
}

var passedResponses = []string{
	`"input":[{"role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call_output","call_id":"c1","output":"{}"}]`,
	`"instructions":"Be brief."`, `"temperature":0.2`, `"top_p":0.9`, `"top_logprobs":2`,
	`"tools":[{"type":"function","name":"get_weather","parameters":{"type":"object"},"strict":false}]`,
	`"tool_choice":"auto"`, `"parallel_tool_calls":true`, `"max_tool_calls":4`,
	`"text":{"format":{"type":"json_schema","name":"trip","schema":{"type":"object"}},"verbosity":"low"}`,
	`"reasoning":{"effort":"low","summary":"auto"}`, `"include":["reasoning.encrypted_content"]`, `"truncation":"disabled"`,
	`"metadata":{"run":"a"}`, `"store":false`, `"user":"u-1"`, `"safety_identifier":"s-1"`, `"prompt_cache_key":"k-1"`,
	`"service_tier":"default"`,
}

// TestOpenAIFieldsPassUntouched: every field of passedChat and
// passedResponses reaches the provider exactly as the client wrote it.
func TestOpenAIFieldsPassUntouched(t *testing.T) {
	for _, tc := range []struct {
		path   string
		head   string
		fields []string
	}{
		{"/v1/chat/completions", `"model":"gpt-4o-mini","max_completion_tokens":50`, passedChat},
		{"/v1/responses", `"model":"gpt-4o-mini","max_output_tokens":50`, passedResponses},
	} {
		up := okUpstream(t)
		e := newEnv(t, up.upstream(), nil)
		body := "{" + tc.head + "," + strings.Join(tc.fields, ",") + "}"
		if r, b := e.post(t, tc.path, body); r.StatusCode != 200 {
			t.Fatalf("%s: %d %s", tc.path, r.StatusCode, b)
		}
		up.mu.Lock()
		raw := string(up.bodies[0])
		up.mu.Unlock()
		for _, f := range tc.fields {
			if !strings.Contains(raw, f) {
				t.Errorf("%s: %s did not arrive as sent; the provider got %s", tc.path, f, raw)
			}
		}
	}
}
