package chat

import (
	"encoding/json"
	"unicode/utf8"
)

// EstimateTokens approximates a tokenizer: about four bytes of ASCII per
// token, one token per other code point (CJK text is roughly that). It errs
// high for prose, which is the safe side for reservations.
func EstimateTokens(s string) int64 {
	var c Counter
	c.Add(s)
	return c.Tokens()
}

// Counter estimates tokens as text arrives, with the same result as
// EstimateTokens over all of it (given whole code points), in time linear
// in the text: the estimate depends only on how many ASCII and other code
// points there are.
type Counter struct{ ascii, other int64 }

// Add counts s.
func (c *Counter) Add(s string) {
	for _, r := range s {
		c.AddRune(r)
	}
}

// AddRune counts one code point.
func (c *Counter) AddRune(r rune) {
	if r < utf8.RuneSelf {
		c.ascii++
	} else {
		c.other++
	}
}

// Tokens is the estimate for everything counted so far.
func (c Counter) Tokens() int64 { return (c.ascii+3)/4 + c.other }

// With is the estimate for what was counted plus r, without counting r.
func (c Counter) With(r rune) int64 {
	c.AddRune(r)
	return c.Tokens()
}

// EstimateToolCalls approximates the completion tokens of tool calls.
func EstimateToolCalls(calls []ToolCall) int64 {
	var n int64
	for _, tc := range calls {
		n += EstimateTokens(tc.Name) + EstimateTokens(tc.Arguments) + 4
	}
	return n
}

// EstimatePrompt approximates the prompt tokens of a call: the messages
// plus a few tokens of framing each, plus the tool definitions when
// offered, counted in the JSON form a provider is sent.
func EstimatePrompt(msgs []Message, tools []ToolDef) int64 {
	var n int64
	for _, m := range msgs {
		n += 4 + EstimateTokens(m.Content)
		for _, tc := range m.ToolCalls {
			n += EstimateTokens(tc.Name) + EstimateTokens(tc.Arguments) + 8
		}
		if m.Role == RoleTool {
			n += EstimateTokens(m.Name) + 8
		}
	}
	if len(tools) > 0 {
		type function struct {
			Type     string   `json:"type"`
			Function *ToolDef `json:"function"`
		}
		wire := make([]function, len(tools))
		for i := range tools {
			wire[i] = function{Type: "function", Function: &tools[i]}
		}
		raw, _ := json.Marshal(wire)
		n += EstimateTokens(string(raw))
	}
	return n
}
