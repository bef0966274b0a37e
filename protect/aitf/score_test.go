package aitf

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// token returns a Turnstile-like token of about 700 characters; seed makes
// each one different, as the page's single-use tokens are.
func token(seed int) string {
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
	var b strings.Builder
	b.WriteString("0.")
	x := uint32(seed*2654435761 + 1)
	for b.Len() < 700 {
		x ^= x << 13
		x ^= x >> 17
		x ^= x << 5
		b.WriteByte(alphabet[x%uint32(len(alphabet))])
	}
	return b.String()
}

// pageBody is the page's own task body.
func pageBody(seed int) string {
	return `{"turnstile_token":"` + token(seed) + `","destination":"Lisbon","days":3,"interests":["food","history"]}`
}

func TestScoreCalibration(t *testing.T) {
	clean := []struct{ name, body string }{
		{"page task", pageBody(1)},
		{"page task pretty", strings.ReplaceAll(pageBody(2), ",", ",\n  ")},
		{"page task one interest", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Kyoto","days":7,"interests":["temples"]}`},
		{"ui settings", `{"mode":"dark","language":"en","notifications":true}`},
		{"theme auto, player loop", `{"theme":{"mode":"auto"},"player":{"mode":"loop"},"sync":{"mode":"background"}}`},
		{"rest filter depth 1", `{"filter":{"depth":1,"status":"open"},"sort":"created_at","page":2,"per_page":50}`},
		{"tree depth 2", `{"tree":{"root":"a","depth":2}}`},
		{"user", `{"name":"Alice Example","email":"alice@example.com","age":31,"address":{"city":"Lisbon","zip":"1100-148"}}`},
		{"car model", `{"make":"Toyota","model":"Corolla","year":2019}`},
		{"thermostat", `{"temperature":21.5,"unit":"celsius","room":"kitchen"}`},
		{"order", `{"items":[{"sku":"A-100","qty":2},{"sku":"B-7","qty":1}],"coupon":null,"notes":"leave at door"}`},
		{"issue", `{"title":"Crash on save","body":"Steps: open, save.","labels":["bug"],"assignees":["octocat"],"milestone":1}`},
		{"payment", `{"amount":2000,"currency":"eur","payment_method_types":["card"],"metadata":{"order_id":"6735"}}`},
		{"ids", `{"id":42,"user_id":78901,"status":"paid"}`},
		{"calculator", `{"function":"sum","args":[1,2]}`},
		{"empty object", `{}`},
		{"empty", ``},
		{"null", `null`},
	}
	for _, tc := range clean {
		t.Run("clean/"+tc.name, func(t *testing.T) {
			if s, v := Score([]byte(tc.body)); s >= 0.2 {
				t.Errorf("score %.3f ≥ 0.2, vector %s", s, v)
			}
		})
	}

	strong := []struct{ name, body string }{
		{"tool_call_id", `{"tool_call_id":"call_abc123","content":"42"}`},
		{"tool_calls", `{"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{}"}}]}`},
		{"MCP tools/call", `{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"create_task"}}`},
		{"Anthropic tool_result block", `{"type":"tool_result","tool_use_id":"toolu_01","content":"ok"}`},
		{"Responses call_id", `{"call_id":"call_Hn2kQ8","output":"{}"}`},
		{"intermediate_steps", `{"input":"x","intermediate_steps":[["search","Lisbon"]]}`},
		{"CrewAI backstory", `{"role":"Researcher","backstory":"A veteran."}`},
		{"browser-use next_goal", `{"current_state":{"next_goal":"open the page"}}`},
		{"agent mode", `{"query":"trams","mode":"deep_research"}`},
	}
	for _, tc := range strong {
		t.Run("one strong/"+tc.name, func(t *testing.T) {
			if s, v := Score([]byte(tc.body)); s < 0.6 {
				t.Errorf("score %.3f < 0.6, vector %s", s, v)
			}
		})
	}

	// Issue #13: two weak signals, even from one family, add up.
	weakPairs := []struct{ name, body string }{
		{"seed: deep_analysis and max_retries", `{"mode": "deep_analysis", "max_retries": 5}`},
		{"chunk_size and chunk_overlap", `{"chunk_size":512,"chunk_overlap":64}`},
		{"recursion_depth and a model", `{"recursion_depth":3,"model":"gpt-4o-mini"}`},
		{"max_iterations and temperature", `{"max_iterations":5,"temperature":0.2}`},
		{"thought and action", `{"thought":"search first","action":{"name":"search"}}`},
	}
	for _, tc := range weakPairs {
		t.Run("weak pair/"+tc.name, func(t *testing.T) {
			if s, v := Score([]byte(tc.body)); s < DefaultThreshold {
				t.Errorf("score %.3f < %.1f, vector %s", s, DefaultThreshold, v)
			}
		})
	}

	// People and ordinary jobs that carry one or two of the same words.
	people := []struct{ name, body string }{
		{"LLM playground turn", `{"model":"gpt-4o-mini","temperature":0.7,"messages":[{"role":"user","content":"a haiku"}]}`},
		{"CI end-to-end run", `{"suite":"checkout","browser":"chromium","headless":true,"retries":2}`},
		{"job queue retry", `{"opts":{"attempts":5,"backoff":{"type":"exponential","delay":1000}}}`},
		{"journal thought", `{"mood":"hopeful","thought":"Grateful for the walk."}`},
		{"recursion alone", `{"recursion_depth":3}`},
		{"upload chunk", `{"upload_id":"u1","chunk_index":3,"chunk_size":5242880}`},
		{"phone call", `{"call_id":"c-20260101-7781","duration":184}`},
	}
	for _, tc := range people {
		t.Run("under the threshold/"+tc.name, func(t *testing.T) {
			if s, v := Score([]byte(tc.body)); s >= DefaultThreshold {
				t.Errorf("score %.3f ≥ %.1f, vector %s", s, DefaultThreshold, v)
			}
		})
	}

	three := []struct{ name, body string }{
		{"batch retry chunk", `{"mode":"batch","max_retries":5,"backoff":"exponential","chunk_size":512,"chunk_overlap":64}`},
		{"seed: batch_process, retry_strategy, chunk_size", `{"mode":"batch_process","retry_strategy":"exponential","chunk_size":1024}`},
		{"single keys: auto_chain, max_attempts, chunk_overlap", `{"q":"x","mode":"auto_chain","max_attempts":4,"chunk_overlap":64}`},
		{"recursion interactive context", `{"recursion_depth":3,"interactive":false,"context_window":32768}`},
		{"tool sampling trace", `{"tool_call_id":"c","temperature":0.2,"top_p":0.9,"max_tokens":512,"intermediate_steps":[["a","b"]]}`},
		{"weakest three", `{"context_window":65536,"chunk_size":1,"chunk_overlap":1,"retry_policy":"x","max_attempts":3,"system_fingerprint":"fp_1"}`},
	}
	for _, tc := range three {
		t.Run("three/"+tc.name, func(t *testing.T) {
			if s, v := Score([]byte(tc.body)); s < 0.8 {
				t.Errorf("score %.3f < 0.8, vector %s", s, v)
			}
		})
	}

	t.Run("everything stays below 1", func(t *testing.T) {
		body := `{"recursion_depth":9,"mode":"auto_chain","context_window":1e9,"chunk_size":9,"chunk_overlap":9,` +
			`"max_retries":9,"backoff":"x","tool_call_id":"c","metadata":{"confidence":1},"temperature":1,"top_p":1,` +
			`"max_tokens":9,"run_id":"r","thought":"t","observation":"o","agent_scratchpad":"s"}`
		s, v := Score([]byte(body))
		if s > 1 || s < 0.99 {
			t.Errorf("score %v, want in [0.99,1], vector %s", s, v)
		}
		full := v
		full[dimEnumeration], full[dimRepeat], full[dimBurst] = 1, 1, 1
		if c := combine(full); c > 1 || c < s {
			t.Errorf("all twelve dimensions full: %v, want in [%v,1]", c, s)
		}
	})
}

func TestScoreSignals(t *testing.T) {
	tests := []struct {
		name string
		body string
		dim  int
		want float64
	}{
		{"recursion_depth 1", `{"recursion_depth":1}`, dimRecursion, 0},
		{"recursion_depth 2", `{"recursion_depth":2}`, dimRecursion, 0.5},
		{"recursion_depth 3", `{"recursion_depth":3}`, dimRecursion, 1},
		{"recursion_depth as string", `{"recursion_depth":"5"}`, dimRecursion, 1},
		{"recursion_limit", `{"config":{"recursion_limit":25}}`, dimRecursion, 1},
		{"max_depth medium", `{"max_depth":3}`, dimRecursion, 0.5},
		{"max_iter", `{"max_iter":20}`, dimRecursion, 1},
		{"maxDiscoveryDepth", `{"maxDiscoveryDepth":3}`, dimRecursion, 1},
		{"depth weak", `{"depth":5}`, dimRecursion, 0.3},
		{"depth 1", `{"depth":1}`, dimRecursion, 0},
		{"mode batch", `{"mode":"batch"}`, dimNonInteractive, 1},
		{"mode batch_process", `{"mode":"batch_process"}`, dimNonInteractive, 1},
		{"mode autonomous-agent", `{"run_mode":"autonomous-agent"}`, dimNonInteractive, 1},
		{"mode auto (a theme)", `{"mode":"auto"}`, dimNonInteractive, 0},
		{"mode auto-chain", `{"mode":"Auto-Chain"}`, dimNonInteractive, 1},
		{"mode dark", `{"mode":"dark"}`, dimNonInteractive, 0},
		{"interactive false", `{"interactive":false}`, dimNonInteractive, 1},
		{"interactive true", `{"interactive":true}`, dimNonInteractive, 0},
		{"headless", `{"options":{"headless":true}}`, dimNonInteractive, 0.6},
		{"mode deep_analysis", `{"mode":"deep_analysis"}`, dimNonInteractive, 1},
		{"mode payment", `{"mode":"payment"}`, dimNonInteractive, 0},
		{"human_input_mode NEVER", `{"human_input_mode":"NEVER"}`, dimNonInteractive, 1},
		{"crawler startUrls", `{"startUrls":[{"url":"https://example.com"}]}`, dimNonInteractive, 1},
		{"batch completion_window", `{"completion_window":"24h"}`, dimNonInteractive, 1},
		{"context 4096", `{"context_window":4096}`, dimContext, 0},
		{"context 8192", `{"context_window":8192}`, dimContext, 1.0 / 3},
		{"context 32768", `{"num_ctx":32768}`, dimContext, 1},
		{"context 128k", `{"context_length":128000}`, dimContext, 1},
		{"chunk_size", `{"chunk_size":512}`, dimChunking, 1},
		{"chunk_size and overlap", `{"chunk_size":512,"chunk_overlap":64}`, dimChunking, 1},
		{"upload chunk_size", `{"chunk_size":5242880}`, dimChunking, 0.2},
		{"chunk_size zero", `{"chunk_size":0}`, dimChunking, 0},
		{"max_retries", `{"max_retries":3}`, dimRetry, 1},
		{"retry strategy and backoff", `{"retry_strategy":"exponential","backoff":2}`, dimRetry, 1},
		{"max_retries zero", `{"max_retries":0}`, dimRetry, 0},
		{"tool_call_id", `{"tool_call_id":"call_1"}`, dimToolCall, 1},
		{"tool_call_id empty", `{"tool_call_id":""}`, dimToolCall, 0},
		{"tool_calls empty", `{"tool_calls":[]}`, dimToolCall, 0},
		{"function_call", `{"function_call":{"name":"f"}}`, dimToolCall, 1},
		{"function object", `{"function":{"name":"f"}}`, dimToolCall, 0.4},
		{"function in tools", `{"tools":[{"function":{"name":"f"}}]}`, dimToolCall, 1 - 0.75*0.2},
		{"MCP tools/call", `{"method":"tools/call"}`, dimToolCall, 1},
		{"MCP initialize", `{"method":"initialize"}`, dimToolCall, 0.8},
		{"JSON-RPC eth_call", `{"method":"eth_call"}`, dimToolCall, 0},
		{"type tool_use", `{"type":"tool_use"}`, dimToolCall, 1},
		{"type function_call_output", `{"type":"function_call_output"}`, dimToolCall, 1},
		{"type payment_intent.succeeded", `{"type":"payment_intent.succeeded"}`, dimToolCall, 0},
		{"role tool", `{"role":"tool"}`, dimToolCall, 1},
		{"call_id of a tool call", `{"call_id":"call_9Pq2"}`, dimToolCall, 1},
		{"call_id of a phone call", `{"call_id":"c-7781"}`, dimToolCall, 0.4},
		{"tool_choice", `{"tool_choice":"auto"}`, dimToolCall, 0.8},
		{"tools", `{"tools":["hammer"]}`, dimToolCall, 0.25},
		{"metadata.confidence", `{"metadata":{"confidence":0.93}}`, dimMetadata, 1},
		{"metadata.confidence in list", `{"metadata":[{"confidence":0.93}]}`, dimMetadata, 1},
		{"flattened metadata.confidence", `{"metadata.confidence":0.5}`, dimMetadata, 1},
		{"bare confidence", `{"confidence":0.93}`, dimMetadata, 0.3},
		{"confidence deeper", `{"metadata":{"scores":{"confidence":0.9}}}`, dimMetadata, 0.3},
		{"finish_reason", `{"finish_reason":"stop"}`, dimMetadata, 0.8},
		{"model gpt", `{"model":"gpt-4o-mini"}`, dimMetadata, 0.4},
		{"model o3-mini", `{"model":"o3-mini"}`, dimMetadata, 0.4},
		{"llm setting", `{"llm":"claude-3-5-sonnet"}`, dimMetadata, 1},
		{"llm object", `{"llm":{"provider":"x"}}`, dimMetadata, 0.6},
		{"object chat.completion", `{"object":"chat.completion"}`, dimMetadata, 0.8},
		{"object event", `{"object":"event"}`, dimMetadata, 0},
		{"model car", `{"model":"Corolla"}`, dimMetadata, 0},
		{"temperature", `{"temperature":0.7}`, dimSampling, 0.5},
		{"temperature thermostat", `{"temperature":21}`, dimSampling, 0},
		{"temperature top_p", `{"temperature":0.7,"top_p":0.9}`, dimSampling, 0.75},
		{"three sampling", `{"temperature":0,"top_p":1,"max_tokens":256}`, dimSampling, 0.875},
		{"sampling repeated in list counts once", `[{"temperature":0.1},{"temperature":0.2}]`, dimSampling, 0.5},
		{"run_id", `{"run_id":"r1"}`, dimTrace, 0.5},
		{"thought observation", `{"thought":"I should search","observation":"found"}`, dimTrace, 0.84},
		{"observation object (a bird sighting)", `{"observation":{"species":"stork"}}`, dimTrace, 0},
		{"action string (GitHub)", `{"action":"opened"}`, dimTrace, 0},
		{"action list (browser agent)", `{"action":[{"click_element":{"index":1}}]}`, dimTrace, 0.5},
		{"run_type chain", `{"run_type":"chain"}`, dimTrace, 1},
		{"CrewAI max_rpm", `{"max_rpm":10}`, dimTrace, 0.8},
		{"trace_id", `{"trace_id":"abc"}`, dimTrace, 0.3},
		{"intermediate_steps", `{"intermediate_steps":[["search","Lisbon"]]}`, dimTrace, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, v := Score([]byte(tc.body))
			if math.Abs(v[tc.dim]-tc.want) > 1e-9 {
				t.Errorf("%s = %.3f, want %.3f (vector %s)", Dimensions[tc.dim], v[tc.dim], tc.want, v)
			}
			for d, x := range v {
				if d != tc.dim && x != 0 {
					t.Errorf("unrelated dimension %s = %.3f", Dimensions[d], x)
				}
			}
		})
	}
}

func TestScoreKeys(t *testing.T) {
	tests := []struct {
		name string
		body string
		want float64 // toolcall dimension
	}{
		{"escaped underscore", `{"tool\u005fcall_id":"c1"}`, 1},
		{"every letter escaped", `{"\u0074\u006F\u006f\u006c\u005f\u0063\u0061\u006c\u006c\u005f\u0069\u0064":"c1"}`, 1},
		{"upper case", `{"TOOL_CALL_ID":"c1"}`, 1},
		{"camel case", `{"toolCallId":"c1"}`, 1},
		{"kebab case", `{"tool-call-id":"c1"}`, 1},
		{"nested deep", `{"a":{"b":[{"c":{"d":[[{"tool_call_id":"c1"}]]}}]}}`, 1},
		{"after escaped quote in key", `{"a\"b":"x\\","tool_call_id":"c1"}`, 1},
		{"after array value", `{"x":[1,{"y":"z"},[]],"tool_call_id":"c1"}`, 1},
		{"missing commas", `{"x":1 "tool_call_id":"c1"}`, 1},
		{"key inside a string value", `{"content":"{\"tool_call_id\":\"x\"}"}`, 0},
		{"key as array element", `["tool_call_id","c1"]`, 0},
		{"value not key", `{"name":"tool_call_id"}`, 0},
		{"non-ascii escape", `{"tool\u00e9call_id":"c1"}`, 0},
		{"longer key", `{"tool_call_id_hint":"c1"}`, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, v := Score([]byte(tc.body))
			if v[dimToolCall] != tc.want {
				t.Errorf("toolcall = %.2f, want %.2f (vector %s)", v[dimToolCall], tc.want, v)
			}
		})
	}
}

func TestToolCallID(t *testing.T) {
	tests := []struct{ name, body, want string }{
		{"plain", `{"role":"tool","tool_call_id":"call_abc","content":"x"}`, "call_abc"},
		{"escaped", `{"tool_call_id":"call\u005f1\"q"}`, `call_1"q`},
		{"in tool_calls", `{"tool_calls":[{"id":"call_9","function":{"name":"f"}}]}`, "call_9"},
		{"first wins", `{"tool_call_id":"a","x":{"tool_call_id":"b"}}`, "a"},
		{"anthropic", `{"type":"tool_result","tool_use_id":"toolu_01"}`, "toolu_01"},
		{"plain id is no tool call", `{"id":"42"}`, ""},
		{"id shaped like a tool call", `{"id":"call_9"}`, "call_9"},
		{"Responses call_id", `{"type":"function_call_output","call_id":"call_r2","output":"x"}`, "call_r2"},
		{"phone call_id", `{"call_id":"c-7781"}`, ""},
		{"truncated body", `{"tool_call_id":"call_tr`, "call_tr"},
		{"none", pageBody(3), ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := []byte(tc.body)
			if got := scan(b).toolID(b); got != tc.want {
				t.Errorf("toolID = %q, want %q", got, tc.want)
			}
		})
	}
	t.Run("bounded", func(t *testing.T) {
		b := []byte(`{"tool_call_id":"` + strings.Repeat("x", 5000) + `"}`)
		if got := scan(b).toolID(b); len(got) != maxToolID {
			t.Errorf("len = %d, want %d", len(got), maxToolID)
		}
	})
}

func TestScoreInvalid(t *testing.T) {
	deep := func(open, close string, n int, inner string) string {
		return strings.Repeat(open, n) + inner + strings.Repeat(close, n)
	}
	tests := []struct {
		name    string
		body    string
		minTool float64 // toolcall dimension at least this
	}{
		{"truncated in value", `{"tool_call_id":"call_`, 1},
		{"truncated after colon", `{"recursion_depth":`, 0},
		{"truncated after key", `{"tool_call_id"`, 0},
		{"garbage", "\x00\xff}{][::,,\"\\", 0},
		{"lone backslashes", `{"a":"\\\\\\`, 0},
		{"bad escape in key", `{"tool\u00zz_call_id":"x"}`, 0},
		{"unbalanced closers then key", `]]]}}}{"tool_call_id":"c"}`, 1},
		{"huge numbers", `{"recursion_depth":1e99999,"context_window":-1e400,"temperature":0e999999}`, 0},
		{"brackets 10000 deep", deep("[", "]", 10000, ""), 0},
		{"objects 3000 deep (as deep as 16 KiB allows) with key at the bottom", deep(`{"a":`, "}", 3000, `{"tool_call_id":"c"}`), 1},
		{"objects 10000 deep", deep(`{"a":`, "}", 10000, `{"tool_call_id":"c"}`), 0},
		{"brackets 100000 deep unclosed", strings.Repeat("[{", 100000), 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, v := Score([]byte(tc.body))
			if s < 0 || s > 1 || math.IsNaN(s) {
				t.Fatalf("score %v out of [0,1]", s)
			}
			for d, x := range v {
				if x < 0 || x > 1 || math.IsNaN(x) {
					t.Errorf("%s = %v out of [0,1]", Dimensions[d], x)
				}
			}
			if v[dimToolCall] < tc.minTool {
				t.Errorf("toolcall = %.2f, want ≥ %.2f", v[dimToolCall], tc.minTool)
			}
		})
	}
}

func TestScoreDoesNotAllocate(t *testing.T) {
	bodies := map[string][]byte{
		"clean page body": []byte(pageBody(4)),
		"agent body":      agentBody(1 << 10),
		"invalid":         []byte(`{"tool\u005fcall_id":"c","mode":"batch","model":"gpt-4o"`),
	}
	for name, b := range bodies {
		t.Run(name, func(t *testing.T) {
			if n := testing.AllocsPerRun(50, func() { Score(b) }); n != 0 {
				t.Errorf("%v allocations per Score, want 0", n)
			}
		})
	}
}

func TestVectorString(t *testing.T) {
	v := Vector{1, 0.5, 0.333}
	want := "1.00,0.50,0.33,0.00,0.00,0.00,0.00,0.00,0.00,0.00,0.00,0.00"
	if got := v.String(); got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

func TestParseMode(t *testing.T) {
	tests := []struct {
		in      string
		want    Mode
		wantErr bool
	}{
		{"", ModeObserve, false},
		{"off", ModeOff, false},
		{" Enforce ", ModeEnforce, false},
		{"observe", ModeObserve, false},
		{"block", "", true},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			got, err := ParseMode(tc.in)
			if (err != nil) != tc.wantErr || got != tc.want {
				t.Errorf("ParseMode(%q) = %q, %v; want %q, error %v", tc.in, got, err, tc.want, tc.wantErr)
			}
			if tc.wantErr && !errors.Is(err, ErrMode) {
				t.Errorf("error %v is not ErrMode", err)
			}
		})
	}
}
