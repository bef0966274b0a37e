// Package openai is faregate's model adapter for OpenAI-compatible chat
// servers (OpenAI, vLLM, llama.cpp, Ollama's /v1 …), built on langchaingo's
// openai provider. It is the only package that imports langchaingo: the
// workflow sees a chat.Model, and the turn and reply are translated here,
// tool calls and token usage included.
package openai

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/tmc/langchaingo/llms"
	lcopenai "github.com/tmc/langchaingo/llms/openai"

	"faregate/agent/chat"
	"faregate/protect/breaker"
)

// DefaultModel is the provider's own default, named so the ledger says so.
const DefaultModel = "gpt-3.5-turbo"

// ErrNoChoices: the server answered without a choice.
var ErrNoChoices = errors.New("openai: the model returned no choices")

// StatusError is the server's answer with a status other than 200, as
// the breaker judges it (breaker.StatusFault: a refusal of the request
// is the caller's, a 429 a throttle, the rest the provider's).
type StatusError struct {
	Status int
	// After is the server's Retry-After in seconds (0: none; at most a
	// minute).
	After time.Duration
}

func (e *StatusError) Error() string { return fmt.Sprintf("openai: the server answered %d", e.Status) }

// BreakerFault implements breaker.Judged.
func (e *StatusError) BreakerFault() breaker.Fault { return breaker.StatusFault(e.Status) }

// RetryAfter is the server's Retry-After (0 when none).
func (e *StatusError) RetryAfter() time.Duration { return e.After }

// HTTPStatus is the server's status, for the ledger.
func (e *StatusError) HTTPStatus() int { return e.Status }

var _ breaker.Judged = (*StatusError)(nil)

// statusError is resp's status as a StatusError.
func statusError(resp *http.Response) *StatusError {
	e := &StatusError{Status: resp.StatusCode}
	if s, err := strconv.Atoi(strings.TrimSpace(resp.Header.Get("Retry-After"))); err == nil && s > 0 {
		e.After = time.Duration(min(s, 60)) * time.Second
	}
	return e
}

// Options configures a model on an OpenAI-compatible server.
type Options struct {
	// BaseURL is the server's API root, e.g. "https://api.openai.com/v1".
	BaseURL string
	// APIKey may be empty for local servers.
	APIKey string
	// Model is the model name; DefaultModel when empty.
	Model string
	// LegacyMaxTokens sends max_tokens instead of max_completion_tokens
	// (Ollama's /v1, older vLLM and llama.cpp read only that).
	LegacyMaxTokens bool
	// HTTPClient is copied and given the stream shim; nil: a default client.
	HTTPClient *http.Client
}

// Model is a chat.Model on an OpenAI-compatible server. Every call streams;
// the call options fixed at construction (the max_tokens field) go with
// every call.
type Model struct {
	llm  llms.Model
	name string
	opts []llms.CallOption
}

// New builds a model through langchaingo's openai provider.
func New(o Options) (*Model, error) {
	token := o.APIKey
	if token == "" {
		// The provider refuses an empty token even for local servers that
		// need none; a placeholder is what they expect.
		token = "faregate-no-key"
	}
	name := o.Model
	if name == "" {
		name = DefaultModel
	}
	// Every call streams; the shim keeps servers that answer in one piece usable.
	hc := &http.Client{}
	if o.HTTPClient != nil {
		*hc = *o.HTTPClient
	}
	base := hc.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	hc.Transport = streamShim{next: base}
	llm, err := lcopenai.New(lcopenai.WithBaseURL(o.BaseURL), lcopenai.WithToken(token),
		lcopenai.WithModel(name), lcopenai.WithHTTPClient(hc))
	if err != nil {
		return nil, fmt.Errorf("openai: model %s: %w", o.BaseURL, err)
	}
	m := &Model{llm: llm, name: name}
	if o.LegacyMaxTokens {
		m.opts = append(m.opts, lcopenai.WithLegacyMaxTokensField())
	}
	return m, nil
}

// Name is the model's name as the server knows it.
func (m *Model) Name() string { return m.name }

// Generate implements chat.Model with one streaming chat completion.
func (m *Model) Generate(ctx context.Context, t chat.Turn) (chat.Reply, error) {
	msgs, err := messages(t.Messages)
	if err != nil {
		return chat.Reply{}, err
	}
	// The call's state is shared with the stream shim, which hands it
	// reasoning and usage (langchaingo sees neither); langchaingo always
	// streams, so it always has a streaming function.
	call := &callState{emit: t.Stream}
	ctx = withCall(ctx, call)
	opts := []llms.CallOption{llms.WithMaxTokens(t.MaxTokens)}
	opts = append(opts, llms.WithStreamingFunc(func(_ context.Context, raw []byte) error {
		c := chunk(raw)
		if c.Text == "" && c.ToolCall == "" {
			return nil
		}
		return call.send(c)
	}))
	if len(t.Tools) > 0 {
		opts = append(opts, llms.WithTools(toolDefs(t.Tools)))
	}
	opts = append(opts, m.opts...)
	resp, err := m.llm.GenerateContent(ctx, msgs, opts...)
	usage, unreadable, _, emitErr := call.close()
	switch {
	case emitErr != nil:
		// The caller's stream stopped the call (a cut): its own error.
		return chat.Reply{Usage: usage}, fmt.Errorf("openai: %w", emitErr)
	case err != nil && ctx.Err() != nil:
		// langchaingo sanitizes a deadline into an error errors.Is cannot
		// match; the context says what happened.
		return chat.Reply{Usage: usage}, fmt.Errorf("openai: %w (%v)", ctx.Err(), err)
	case unreadable != "":
		return chat.Reply{Usage: usage}, fmt.Errorf("openai: %w: %s", chat.ErrUnreadable, unreadable)
	case err != nil:
		if up := call.upstreamErr(); up != nil {
			// What the provider did, for the breaker (a status it judges,
			// a transport's timeout), beside langchaingo's words for it.
			return chat.Reply{Usage: usage}, fmt.Errorf("openai: %w (%v)", up, err)
		}
		return chat.Reply{Usage: usage}, fmt.Errorf("openai: %w", err)
	}
	if resp == nil || len(resp.Choices) == 0 {
		return chat.Reply{Usage: usage}, ErrNoChoices
	}
	c := resp.Choices[0]
	reply := chat.Reply{Content: c.Content, StopReason: c.StopReason, Usage: usage}
	for _, tc := range c.ToolCalls {
		if tc.FunctionCall == nil {
			continue
		}
		reply.ToolCalls = append(reply.ToolCalls, chat.ToolCall{ID: tc.ID, Name: tc.FunctionCall.Name, Arguments: tc.FunctionCall.Arguments})
	}
	return reply, nil
}

// messages translates a conversation into langchaingo's form: tool calls
// as parts of the assistant message, each answer as a tool message of its
// own. Data never leaves the process.
func messages(in []chat.Message) ([]llms.MessageContent, error) {
	out := make([]llms.MessageContent, 0, len(in))
	for _, m := range in {
		switch m.Role {
		case chat.RoleSystem:
			out = append(out, llms.TextParts(llms.ChatMessageTypeSystem, m.Content))
		case chat.RoleUser:
			out = append(out, llms.TextParts(llms.ChatMessageTypeHuman, m.Content))
		case chat.RoleAssistant:
			mc := llms.MessageContent{Role: llms.ChatMessageTypeAI}
			if m.Content != "" {
				mc.Parts = append(mc.Parts, llms.TextContent{Text: m.Content})
			}
			for _, tc := range m.ToolCalls {
				mc.Parts = append(mc.Parts, llms.ToolCall{ID: tc.ID, Type: "function",
					FunctionCall: &llms.FunctionCall{Name: tc.Name, Arguments: tc.Arguments}})
			}
			out = append(out, mc)
		case chat.RoleTool:
			out = append(out, llms.MessageContent{Role: llms.ChatMessageTypeTool,
				Parts: []llms.ContentPart{llms.ToolCallResponse{ToolCallID: m.ToolCallID, Name: m.Name, Content: m.Content}}})
		default:
			return nil, fmt.Errorf("openai: message role %q not supported", m.Role)
		}
	}
	return out, nil
}

// toolDefs offers the tools as functions.
func toolDefs(defs []chat.ToolDef) []llms.Tool {
	out := make([]llms.Tool, len(defs))
	for i, d := range defs {
		out[i] = llms.Tool{Type: "function", Function: &llms.FunctionDefinition{
			Name: d.Name, Description: d.Description, Parameters: d.Parameters}}
	}
	return out
}

// streamedToolCall is one tool-call fragment as langchaingo hands it to the
// streaming function: the delta's tool_calls array, marshalled.
type streamedToolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// chunk types one piece of a stream. langchaingo passes content deltas as
// they are, and tool-call deltas as the JSON array of the delta's calls; a
// piece that decodes as such an array, with an id, a type, a name or
// arguments in it, is tool-call output: its names and arguments count.
func chunk(raw []byte) chat.Chunk {
	if len(raw) > 1 && raw[0] == '[' && raw[1] == '{' {
		var calls []streamedToolCall
		if json.Unmarshal(raw, &calls) == nil {
			var b strings.Builder
			isCall := false
			for _, c := range calls {
				isCall = isCall || c.ID != "" || c.Type != "" || c.Function.Name != "" || c.Function.Arguments != ""
				b.WriteString(c.Function.Name)
				b.WriteString(c.Function.Arguments)
			}
			if isCall {
				return chat.Chunk{ToolCall: b.String()}
			}
		}
	}
	return chat.Chunk{Text: string(raw)}
}
