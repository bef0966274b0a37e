package tokens

import (
	"encoding/json"
	"fmt"
	"hash/maphash"
	"math"
	"os"
	"strings"
	"testing"
	"unicode/utf8"
)

// record is one entry of testdata/prompts.json (see testdata/README.md).
type record struct {
	ID           string          `json:"id"`
	Kind         string          `json:"kind"`
	Source       string          `json:"source"` // provider-reported | reference-computed
	Provenance   string          `json:"provenance"`
	Model        string          `json:"model"`
	Messages     []recordMessage `json:"messages"`
	Tools        json.RawMessage `json:"tools"`
	PromptTokens int64           `json:"prompt_tokens"`
}

type recordMessage struct {
	Role      string `json:"role"`
	Name      string `json:"name"`
	Content   string `json:"content"`
	ToolCalls []struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"tool_calls"`
}

func (r record) messages() []Message {
	out := make([]Message, 0, len(r.Messages))
	for _, m := range r.Messages {
		msg := Message{Role: m.Role, Name: m.Name, Content: m.Content}
		for _, c := range m.ToolCalls {
			msg.ToolCalls = append(msg.ToolCalls, ToolCall{Name: c.Name, Arguments: c.Arguments})
		}
		out = append(out, msg)
	}
	return out
}

func (r record) toolsJSON() string {
	if len(r.Tools) == 0 || string(r.Tools) == "null" {
		return ""
	}
	return string(r.Tools)
}

// texts returns every piece of text in the record, for the bound's checks.
func (r record) texts() []string {
	var out []string
	for _, m := range r.Messages {
		out = append(out, m.Content)
		for _, c := range m.ToolCalls {
			out = append(out, c.Arguments)
		}
	}
	if t := r.toolsJSON(); t != "" {
		out = append(out, t)
	}
	return out
}

func loadRecords(t testing.TB) []record {
	t.Helper()
	raw, err := os.ReadFile("testdata/prompts.json")
	if err != nil {
		t.Fatal(err)
	}
	var recs []record
	if err := json.Unmarshal(raw, &recs); err != nil {
		t.Fatal(err)
	}
	return recs
}

// oldEstimate is agent.EstimateTokens as it was before this package: four
// ASCII bytes a token, one token per other code point.
func oldEstimate(s string) int64 {
	var ascii, other int64
	for _, r := range s {
		if r < utf8.RuneSelf {
			ascii++
		} else {
			other++
		}
	}
	return (ascii+3)/4 + other
}

// oldPrompt is agent's estimatePrompt on the same messages: four tokens a
// message, eight more per tool call or tool result, the tools' JSON.
func oldPrompt(msgs []Message, toolsJSON string) int64 {
	var n int64
	for _, m := range msgs {
		n += 4 + oldEstimate(m.Content)
		for _, c := range m.ToolCalls {
			n += oldEstimate(c.Name) + oldEstimate(c.Arguments) + 8
		}
		if m.Role == "tool" {
			n += oldEstimate(m.Name) + 8
		}
	}
	if toolsJSON != "" {
		n += oldEstimate(toolsJSON)
	}
	return n
}

// TestRecordedPrompts is issue #10's tokenizer test: on 20 recorded prompts
// the estimate is never below the recorded count, and within 15% of it
// where the model's encoding is known. It also reports the old estimator on
// the same prompts.
func TestRecordedPrompts(t *testing.T) {
	recs := loadRecords(t)
	if len(recs) != 20 {
		t.Fatalf("testdata has %d records, want 20", len(recs))
	}
	var provider, oldUnder, newUnder int
	oldWorst, newWorstKnown := 0.0, 0.0
	var table strings.Builder
	fmt.Fprintf(&table, "%-44s %-20s %-11s %-18s %6s %6s %7s %6s %7s\n", "id", "model", "encoding", "source", "real", "new", "new%", "old", "old%")
	for _, r := range recs {
		if r.Source == "provider-reported" {
			provider++
		} else if r.Source != "reference-computed" {
			t.Errorf("%s: source %q is neither provider-reported nor reference-computed", r.ID, r.Source)
		}
		if r.PromptTokens <= 0 || r.Provenance == "" {
			t.Errorf("%s: needs prompt_tokens and provenance", r.ID)
			continue
		}
		c := ForModel(r.Model)
		msgs := r.messages()
		got := c.Chat(msgs, r.toolsJSON())
		old := oldPrompt(msgs, r.toolsJSON())
		newErr := float64(got-r.PromptTokens) / float64(r.PromptTokens)
		oldErr := float64(old-r.PromptTokens) / float64(r.PromptTokens)
		fmt.Fprintf(&table, "%-44s %-20s %-11s %-18s %6d %6d %+6.1f%% %6d %+6.1f%%\n", r.ID, r.Model, c.Name(), r.Source, r.PromptTokens, got, 100*newErr, old, 100*oldErr)
		if got < r.PromptTokens {
			newUnder++
			t.Errorf("%s: estimate %d is below the recorded %d", r.ID, got, r.PromptTokens)
		}
		if c.Known() {
			newWorstKnown = math.Max(newWorstKnown, newErr)
			if newErr > 0.15 {
				t.Errorf("%s: estimate %d is more than 15%% above the recorded %d (%s)", r.ID, got, r.PromptTokens, c.Name())
			}
		}
		if old < r.PromptTokens {
			oldUnder++
			oldWorst = math.Min(oldWorst, oldErr)
		}
	}
	t.Logf("%d provider-reported, %d reference-computed\n%s", provider, len(recs)-provider, table.String())
	t.Logf("old estimator: %d of %d under-counted, worst %.1f%%; new: %d under-counted, worst over-count on a known encoding %+.1f%%",
		oldUnder, len(recs), 100*oldWorst, newUnder, 100*newWorstKnown)
}

// TestBoundCoversKnownEncodings checks the bound, as a stand-in for unknown
// tokenizers, against both OpenAI vocabularies on every text in testdata.
func TestBoundCoversKnownEncodings(t *testing.T) {
	o, cl := ForModel("gpt-4o"), ForModel("gpt-4")
	for _, r := range loadRecords(t) {
		for i, s := range r.texts() {
			if s == "" {
				continue
			}
			b, ref := bound(s), max(o.Count(s), cl.Count(s))
			if b < ref {
				t.Errorf("%s text %d: bound %d below %d tokens (%.60q)", r.ID, i, b, ref, s)
			}
			// Conservative, but not absurd: reservations are money.
			if b > 3*ref+4 {
				t.Errorf("%s text %d: bound %d is over three times %d (%.60q)", r.ID, i, b, ref, s)
			}
		}
	}
}

func TestBoundShapes(t *testing.T) {
	tests := []struct {
		name string
		text string
		min  int64 // what cl100k_base or a digit-splitting vocabulary needs
	}{
		{"empty", "", 0},
		{"word", "hello", 1},
		{"compact json", `{"a":1,"b":2}`, 9},
		{"digits split one by one", "1234567890", 10},
		{"chinese", "你好，世界！", 6},
		{"emoji", "🙂🙂🙂", 3},
		{"indented json", "{\n    \"city\": \"Lisbon\",\n    \"days\": 3\n}", 14},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := (Counter{}).Count(tt.text); got < tt.min {
				t.Errorf("bound(%q) = %d, want at least %d", tt.text, got, tt.min)
			}
		})
	}
}

func TestEncodingFor(t *testing.T) {
	tests := map[string]string{
		"gpt-4o":                      O200kBase,
		"gpt-4o-mini-2024-07-18":      O200kBase,
		"chatgpt-4o-latest":           O200kBase,
		"gpt-4.1-nano":                O200kBase,
		"gpt-4.5-preview":             O200kBase,
		"gpt-5":                       O200kBase,
		"gpt-5.1-mini":                O200kBase,
		"o1":                          O200kBase,
		"o1-mini":                     O200kBase,
		"o3-mini":                     O200kBase,
		"o4-mini":                     O200kBase,
		"openai/gpt-4o-mini":          O200kBase,
		"ft:gpt-4o-mini:acme::abc123": O200kBase,
		"GPT-4o":                      O200kBase,
		"gpt-4":                       Cl100kBase,
		"gpt-4-turbo":                 Cl100kBase,
		"gpt-4-0613":                  Cl100kBase,
		"gpt-3.5-turbo":               Cl100kBase,
		"gpt-3.5-turbo-0125":          Cl100kBase,
		"llama3.1:8b":                 Bound,
		"qwen2.5:7b-instruct":         Bound,
		"mistral-large-latest":        Bound,
		"openai/gpt-oss-120b":         Bound,
		"offline-demo-planner":        Bound,
		"o100":                        Bound,
		"gpt-40":                      Bound,
		"":                            Bound,
	}
	for model, want := range tests {
		if got := EncodingFor(model); got != want {
			t.Errorf("EncodingFor(%q) = %q, want %q", model, got, want)
		}
		c := ForModel(model)
		if c.Name() != want || c.Known() != (want != Bound) {
			t.Errorf("ForModel(%q) = %s known=%v, want %s", model, c.Name(), c.Known(), want)
		}
	}
}

func TestChatFraming(t *testing.T) {
	c := ForModel("gpt-4o")
	// The cookbook's rule: 3 per message + role + content (+1 + name), 3 to
	// prime the reply. "user" and "hi" are one token each in o200k_base.
	if got := c.Chat([]Message{{Role: "user", Content: "hi"}}, ""); got != 3+1+1+3 {
		t.Errorf("one short message = %d, want 8", got)
	}
	withName := c.Chat([]Message{{Role: "user", Name: "bob", Content: "hi"}}, "")
	if withName != 8+TokensPerName+c.Count("bob") {
		t.Errorf("named message = %d", withName)
	}
	call := c.Chat([]Message{{Role: "assistant", ToolCalls: []ToolCall{{Name: "weather", Arguments: `{"city":"Lisbon"}`}}}}, "")
	if call <= c.Chat([]Message{{Role: "assistant"}}, "")+c.Count("weather")+c.Count(`{"city":"Lisbon"}`) {
		t.Errorf("a tool call must cost more than its name and arguments: %d", call)
	}
	// Tools that are not a tools array are counted as text rather than lost.
	if got := c.Chat(nil, `not json`); got <= ReplyPriming {
		t.Errorf("unparsable tools counted as %d", got)
	}
}

func TestRenderTools(t *testing.T) {
	tools := `[{"type":"function","function":{"name":"get_current_weather","description":"Get the current weather in a given location",
	 "parameters":{"type":"object","properties":{"location":{"type":"string","description":"The city and state, e.g. San Francisco, CA"},
	 "unit":{"type":"string","enum":["celsius","fahrenheit"]},"days":{"type":["integer","null"]},
	 "tags":{"type":"array","items":{"type":"string"}},"where":{"type":"object","properties":{"lat":{"type":"number"}},"required":["lat"]}},
	 "required":["location"],"additionalProperties":false},"strict":true}},
	 {"type":"function","function":{"name":"ping","parameters":{"type":"object","properties":{}}}}]`
	want := `namespace functions {

// Get the current weather in a given location
type get_current_weather = (_: {
days?: number | null,
// The city and state, e.g. San Francisco, CA
location: string,
tags?: string[],
unit?: "celsius" | "fahrenheit",
where?: {
  lat: number,
  },
}) => any;

type ping = () => any;

} // namespace functions`
	got, err := renderTools(tools)
	if err != nil {
		t.Fatal(err)
	}
	if got != want {
		t.Errorf("renderTools:\n%s\nwant:\n%s", got, want)
	}
	if _, err := renderTools(`{"not":"an array"}`); err == nil {
		t.Error("an object is not a tools array")
	}
}

func TestCountEmptyAndConcurrent(t *testing.T) {
	c := ForModel("gpt-4")
	if c.Count("") != 0 || (Counter{}).Count("") != 0 {
		t.Error("empty text must count 0")
	}
	want := c.Count("The quick brown fox jumps over the lazy dog.")
	done := make(chan int64)
	for range 8 {
		go func() { done <- c.Count("The quick brown fox jumps over the lazy dog.") }()
	}
	for range 8 {
		if got := <-done; got != want {
			t.Errorf("concurrent Count = %d, want %d", got, want)
		}
	}
}

func TestMemoGivesSameCounts(t *testing.T) {
	c := ForModel("gpt-4o")
	long := strings.Repeat("Lisbon's trams climb seven hills. 里斯本有七座山丘。", 5) // over memoLongBytes
	first, second := c.Count(long), c.Count(long)
	tk, _ := c.enc.load()
	if want := int64(len(tk.EncodeOrdinary(long))); first != want || second != want {
		t.Fatalf("counts %d, %d, want %d", first, second, want)
	}
	// A full memo is emptied, not grown.
	for i := range memoEntries + 10 {
		c.Count(fmt.Sprintf("%d %s", i, long))
	}
	c.enc.mu.Lock()
	n := len(c.enc.memo)
	c.enc.mu.Unlock()
	if n > memoEntries {
		t.Errorf("memo holds %d entries, limit %d", n, memoEntries)
	}
	// Short texts are remembered too, apart: a flood of them neither
	// grows their memo past its limit nor empties the long one.
	short := "Three days in Lisbon, food and history."
	if got, want := c.Count(short), int64(len(tk.EncodeOrdinary(short))); got != want || c.Count(short) != want {
		t.Fatalf("short count %d, want %d", got, want)
	}
	c.Count(long)
	for i := range memoEntries + 10 {
		c.Count(fmt.Sprintf("%d words", i))
	}
	c.enc.mu.Lock()
	ns := len(c.enc.short)
	_, kept := c.enc.memo[maphash.String(c.enc.seed, long)]
	c.enc.mu.Unlock()
	if ns > memoEntries || !kept {
		t.Errorf("short memo holds %d entries (limit %d); long text kept: %v", ns, memoEntries, kept)
	}
}
