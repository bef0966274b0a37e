package chat

import (
	"strings"
	"testing"
)

func TestEstimateTokens(t *testing.T) {
	cases := map[string]int64{"": 0, "abcd": 1, "abcde": 2, "東京": 2, strings.Repeat("word ", 100): 125}
	for s, want := range cases {
		if got := EstimateTokens(s); got != want {
			t.Errorf("EstimateTokens(%.20q) = %d, want %d", s, got, want)
		}
	}
}

// TestCounterMatchesWholeText: counting piece by piece gives what counting
// the whole text gives, and With looks ahead without counting.
func TestCounterMatchesWholeText(t *testing.T) {
	text := "Day 1: 里斯本 Alfama, then pastéis de nata… " + strings.Repeat("ab 東", 7)
	for size := 1; size <= 9; size++ {
		var c Counter
		var sofar strings.Builder
		for _, r := range text {
			if c.With(r) != EstimateTokens(sofar.String()+string(r)) {
				t.Fatalf("With(%q) after %q", r, sofar.String())
			}
			c.AddRune(r)
			sofar.WriteRune(r)
			if sofar.Len()%size == 0 && c.Tokens() != EstimateTokens(sofar.String()) {
				t.Fatalf("after %q: %d, want %d", sofar.String(), c.Tokens(), EstimateTokens(sofar.String()))
			}
		}
	}
}

func TestEstimatePrompt(t *testing.T) {
	msgs := []Message{
		Text(RoleSystem, "abcd"),
		{Role: RoleAssistant, ToolCalls: []ToolCall{{ID: "c1", Name: "weather", Arguments: `{"location":"Lisbon"}`}}},
		{Role: RoleTool, ToolCallID: "c1", Name: "weather", Content: "sunny", Data: struct{ Huge string }{strings.Repeat("x", 1e5)}},
	}
	// system 4+1; assistant 4 + name 2 + args 6 + 8; tool 4 + content 2 + name 2 + 8.
	if got := EstimatePrompt(msgs, nil); got != 5+20+16 {
		t.Fatalf("EstimatePrompt = %d, want %d (Data is never counted)", got, 5+20+16)
	}
	def := ToolDef{Name: "weather", Description: "forecast", Parameters: map[string]any{"type": "object"}}
	wire := `[{"type":"function","function":{"name":"weather","description":"forecast","parameters":{"type":"object"}}}]`
	if got := EstimatePrompt(nil, []ToolDef{def}); got != EstimateTokens(wire) {
		t.Fatalf("tools counted as %d, want %d", got, EstimateTokens(wire))
	}
	if got := EstimateToolCalls(msgs[1].ToolCalls); got != 2+6+4 {
		t.Fatalf("EstimateToolCalls = %d", got)
	}
}
