// Package tokens estimates how many prompt tokens a model call will be
// charged before it is made, so a budget reservation covers it.
//
// For OpenAI model families it counts with the model's real BPE vocabulary
// (tiktoken's o200k_base or cl100k_base, ranks embedded in the binary by
// github.com/pkoukk/tiktoken-go-loader: nothing is fetched at run time).
// For any other model (Llama, Qwen or Mistral behind vLLM or Ollama, the
// offline planner) it uses a conservative bound that is meant to stay at or
// above what common BPE tokenizers report for English, Chinese and JSON.
//
// The package knows nothing of faregate's agent types: callers turn their
// messages into Message values.
package tokens

import "strings"

// Chat framing, from OpenAI's cookbook "How to count tokens with tiktoken"
// (num_tokens_from_messages, for gpt-3.5-turbo-0125, gpt-4 and gpt-4o
// models): every message costs three tokens besides its role and content
// (<|start|>role<|message|>content<|end|>), a name one more, and the reply is
// primed with three (<|start|>assistant<|message|>). The cookbook checks the
// result against the API's usage.prompt_tokens for its example conversation.
const (
	TokensPerMessage = 3
	TokensPerName    = 1
	ReplyPriming     = 3
)

// framing is what a chat request costs besides the text of its messages.
// The values other than the cookbook's were read off provider-reported
// usage.prompt_tokens of recorded requests (testdata/prompts.json and the
// evaluation described in its README):
//   - tools: the rendered definitions (see renderTools) plus this much once;
//     with 10 (and 12 a tool call) none of 60-odd recorded gpt-4o, gpt-4o-mini
//     and gpt-4.1 requests with tools was under-counted; gpt-5 models carry a
//     tools preamble about 77 tokens longer;
//   - perToolCall: each tool call an assistant message carries, besides its
//     function name and arguments (ids are not charged);
//   - o1 models add about 7 hidden tokens per request.
//
// For models whose tokenizer is unknown the framing is a guess that errs
// high: chat templates of open models add their own hidden text (Llama 3's
// date header about 40 tokens, gpt-oss's harmony system message about 70,
// Qwen's and Llama's tool instructions 100 to 200 and more).
type framing struct {
	perMessage, perName, priming, tools, perToolCall int64
}

var (
	openAIFraming    = framing{perMessage: TokensPerMessage, perName: TokensPerName, priming: ReplyPriming, tools: 10, perToolCall: 12}
	o1Framing        = framing{perMessage: TokensPerMessage, perName: TokensPerName, priming: ReplyPriming + 8, tools: 10, perToolCall: 12}
	reasoningFraming = framing{perMessage: TokensPerMessage, perName: TokensPerName, priming: ReplyPriming, tools: 90, perToolCall: 16}
	boundFraming     = framing{perMessage: 6, perName: 2, priming: 100, tools: 300, perToolCall: 16}
)

// Message is one chat message as the provider receives it: an assistant
// message may carry tool calls, a tool result has Role "tool".
type Message struct {
	Role      string
	Name      string
	Content   string
	ToolCalls []ToolCall
}

// ToolCall is one function call requested by an assistant message.
type ToolCall struct {
	Name      string
	Arguments string // JSON text, as sent back to the provider
}

// Counter counts tokens for one model's vocabulary, or with the
// conservative bound when the model's vocabulary is unknown. The zero
// Counter uses the bound. Counters are cheap values, safe for concurrent use.
type Counter struct {
	enc   *encoding
	frame *framing // nil: boundFraming
}

// ForModel returns the Counter for a model name as sent to the provider.
// Known OpenAI families map to their encoding (see EncodingFor); everything
// else gets the bound. The first Counter of an encoding loads its tables
// (a fraction of a second, tens of megabytes), so call it at start-up.
// Should the embedded tables fail to load, which only a broken build can
// cause, the Counter falls back to the bound, which errs high.
func ForModel(model string) Counter {
	var e *encoding
	switch EncodingFor(model) {
	case O200kBase:
		e = o200k
	case Cl100kBase:
		e = cl100k
	default:
		return Counter{}
	}
	if _, err := e.load(); err != nil {
		return Counter{}
	}
	f := &openAIFraming
	switch m := baseName(model); {
	case family(m, "o1"):
		f = &o1Framing
	case family(m, "gpt-5"), family(m, "o3"), family(m, "o4"):
		// Only gpt-5 models were measured with tools; o3 and o4 share
		// their reasoning lineage and get the larger allowance.
		f = &reasoningFraming
	}
	return Counter{enc: e, frame: f}
}

// baseName lower-cases a model name and strips a fine-tune prefix and a
// provider prefix ("ft:", "openai/").
func baseName(model string) string {
	m := strings.ToLower(strings.TrimSpace(model))
	m = strings.TrimPrefix(m, "ft:")
	if i := strings.LastIndexByte(m, '/'); i >= 0 {
		m = m[i+1:]
	}
	return m
}

// EncodingFor names the encoding a model uses: O200kBase for gpt-4o,
// gpt-4.1, gpt-4.5, gpt-5 and the o-series; Cl100kBase for gpt-4 and
// gpt-3.5; Bound for anything else. A provider prefix ("openai/gpt-4o") and
// a fine-tune prefix ("ft:gpt-4o-mini:org::id") are ignored.
func EncodingFor(model string) string {
	m := baseName(model)
	switch {
	case family(m, "gpt-4o"), family(m, "chatgpt-4o"), family(m, "gpt-4.1"), family(m, "gpt-4.5"),
		family(m, "gpt-5"), family(m, "o1"), family(m, "o3"), family(m, "o4"):
		return O200kBase
	case family(m, "gpt-4"), family(m, "gpt-3.5"):
		return Cl100kBase
	}
	return Bound
}

// family reports whether model is name itself or name followed by a
// separator, so "o1-mini" and "gpt-5.1" match but "o100" does not.
func family(model, name string) bool {
	if !strings.HasPrefix(model, name) {
		return false
	}
	rest := model[len(name):]
	return rest == "" || rest[0] == '-' || rest[0] == '.' || rest[0] == ':' || rest[0] == '@'
}

// Name is the encoding's name, or Bound.
func (c Counter) Name() string {
	if c.enc == nil {
		return Bound
	}
	return c.enc.name
}

// Known reports whether counts come from the model's real vocabulary.
func (c Counter) Known() bool { return c.enc != nil }

// Count returns the tokens of text on its own, without chat framing.
func (c Counter) Count(text string) int64 {
	if text == "" {
		return 0
	}
	if c.enc == nil {
		return bound(text)
	}
	return c.enc.count(text) // loaded by ForModel
}

// Chat returns the prompt tokens of a chat completion request with these
// messages and, when toolsJSON is not empty, these tool definitions (the
// JSON of the request's "tools" array): Priming, plus Message of each
// message, plus Tools.
func (c Counter) Chat(messages []Message, toolsJSON string) int64 {
	n := c.Priming()
	for _, m := range messages {
		n += c.Message(m)
	}
	return n + c.Tools(toolsJSON)
}

// framing is c's chat framing.
func (c Counter) framing() *framing {
	if c.frame == nil {
		return &boundFraming
	}
	return c.frame
}

// Priming is what a chat prompt costs before its first message.
func (c Counter) Priming() int64 { return c.framing().priming }

// Message is what one message adds to a chat prompt, its framing included:
// a caller that remembers it for a message it has seen (an agent re-sends
// its history on every call) need not count that message again.
func (c Counter) Message(m Message) int64 {
	f := c.framing()
	n := f.perMessage + c.Count(m.Role) + c.Count(m.Content)
	if m.Name != "" {
		n += f.perName + c.Count(m.Name)
	}
	for _, tc := range m.ToolCalls {
		n += f.perToolCall + c.Count(tc.Name) + c.Count(tc.Arguments)
	}
	return n
}

// Tools is what the tool definitions toolsJSON add to a chat prompt (0
// when it is empty).
func (c Counter) Tools(toolsJSON string) int64 {
	if toolsJSON == "" {
		return 0
	}
	return c.framing().tools + c.Count(c.toolsText(toolsJSON))
}

// toolsText is the text the tool definitions are counted as. OpenAI models
// see a rendered form (see renderTools); other chat templates (Llama, Qwen,
// Mistral) paste the JSON itself into the prompt, so the bound counts that.
// JSON that is not a tools array is counted as it is.
func (c Counter) toolsText(toolsJSON string) string {
	if c.enc == nil {
		return toolsJSON
	}
	if s, err := renderTools(toolsJSON); err == nil {
		return s
	}
	return toolsJSON
}
