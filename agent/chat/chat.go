// Package chat is faregate's own vocabulary for talking to a model: a turn
// of messages and offered tools goes in; a reply with typed tool calls and
// token usage comes out. The workflow sees only Model. Adapters implement
// it: agent/openai for OpenAI-compatible servers, agent/offline for the
// built-in demo planner. Nothing here knows any provider's wire format.
package chat

import (
	"context"
	"errors"

	"faregate/agent/task"
)

// ErrUnreadable reports a provider answer that came back (200) but could
// not be read: not a completion, a line or body past what faregate reads.
// Tokens may have been spent on it, so the caller charges at least the
// call's reservation.
var ErrUnreadable = errors.New("chat: the model's answer could not be read")

// Model answers one turn of a conversation.
type Model interface {
	// Generate makes one model call. When turn.Stream is set, the reply is
	// also delivered piece by piece as it is produced; if Stream returns an
	// error the call stops and Generate returns an error wrapping it.
	Generate(ctx context.Context, turn Turn) (Reply, error)
}

// Role says who wrote a message.
type Role string

// The roles of a conversation.
const (
	RoleSystem    Role = "system"
	RoleUser      Role = "user"
	RoleAssistant Role = "assistant"
	RoleTool      Role = "tool"
)

// Message is one message of a conversation.
type Message struct {
	Role    Role
	Content string
	// ToolCalls are, on an assistant message, the calls it asked for.
	ToolCalls []ToolCall
	// ToolCallID and Name say, on a tool message, which call it answers
	// and which tool answered.
	ToolCallID string
	Name       string
	// Data is, on a tool message, the tool's result as typed values (for
	// example the guide entries or the forecast it found), next to Content,
	// the text a language model reads. It is for planners that are not
	// language models; adapters never send it to a provider.
	Data any
}

// Text returns a message of role with content and nothing else.
func Text(role Role, content string) Message { return Message{Role: role, Content: content} }

// ToolCall is a model's request to run one tool.
type ToolCall struct {
	// ID pairs the call with the tool message that answers it.
	ID   string
	Name string
	// Arguments is the JSON object of arguments, as the model wrote it.
	Arguments string
}

// ToolDef describes a tool to the model. The JSON form is the one OpenAI's
// chat API takes inside {"type": "function", "function": …}.
type ToolDef struct {
	Name        string `json:"name"`
	Description string `json:"description"`
	// Parameters is the JSON Schema of the arguments object.
	Parameters map[string]any `json:"parameters,omitempty"`
}

// Chunk is one streamed piece of a reply.
type Chunk struct {
	// Text is a piece of the reply's content.
	Text string
	// ToolCall is a piece of a tool call being written (its name or part of
	// its arguments): output the model produced, which counts against the
	// completion limit, but not prose.
	ToolCall string
	// Reasoning is a piece of a reasoning model's thinking
	// (reasoning_content): output tokens like any other, counted and cut
	// at the limit, never kept.
	Reasoning string
}

// Turn is everything one model call gets.
type Turn struct {
	Messages []Message
	// Tools are the tools offered for this call; none means the model must
	// answer in text.
	Tools []ToolDef
	// MaxTokens bounds the completion.
	MaxTokens int
	// Stream, when set, receives the reply as it is produced.
	Stream func(Chunk) error
	// Request is the visitor's request as typed data. A language model
	// reads the request from the messages; a planner that is not one (the
	// offline demo planner) reads it here.
	Request *task.Request
}

// Usage is the tokens a call consumed.
type Usage struct {
	PromptTokens     int64
	CompletionTokens int64
	// Reported is true when the provider counted them; false means the
	// caller has to estimate.
	Reported bool
	// Unreadable is true when the provider sent a usage that is not a pair
	// of integers (a fraction, past 64 bits, a string): Reported is then
	// true and the counts are 0. Raw is the usage object as it came
	// (bounded), for the ledger when it is not charged as it stands.
	Unreadable bool
	Raw        string
	// ReasoningTokens is the part of CompletionTokens the provider
	// reported as reasoning; CacheCreationTokens and CacheReadTokens are
	// prompt tokens it reported as written to and read from its prompt
	// cache. Each is 0 where the provider reports none; the ledger
	// carries them to billing.
	ReasoningTokens, CacheCreationTokens, CacheReadTokens int64
}

// Reply is a model's answer to one turn.
type Reply struct {
	Content   string
	ToolCalls []ToolCall
	Usage     Usage
	// StopReason is why the model stopped ("stop", "length", "tool_calls",
	// or whatever the provider said).
	StopReason string
}
