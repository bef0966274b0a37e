package gateway

import (
	"fmt"
	"strings"
	"testing"

	"faregate/agent/tokens"
)

// agentBody is a real agent's chat call: a system prompt, the user's
// question, then rounds of an assistant tool call and its tool result
// (about 1.4 KB each), with a tools array; rounds+2 messages in all.
// result is the text of the last tool result.
func agentBody(rounds int, result string) string {
	var b strings.Builder
	b.WriteString(`{"model":"gpt-4o-mini","temperature":0.2,"stream":false,"tools":[`)
	for i := range 4 {
		if i > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, `{"type":"function","function":{"name":"tool_%d","description":"Fetches a public page and returns its readable text, trimmed to the part that answers the question.","parameters":{"type":"object","properties":{"url":{"type":"string","description":"An absolute http(s) URL."},"max_bytes":{"type":"integer","description":"At most this many bytes of text."}},"required":["url"]}}}`, i)
	}
	b.WriteString(`],"messages":[{"role":"system","content":"`)
	b.WriteString(strings.Repeat("You are a careful travel researcher. Cite sources and keep answers short. ", 20))
	b.WriteString(`"},{"role":"user","content":"Plan three days in Lisbon for someone who loves food and history."}`)
	page := strings.Repeat("Lisbon's Alfama district keeps its medieval street plan; trams climb past the cathedral. ", 16)
	for i := range rounds / 2 {
		text := page
		if i == rounds/2-1 {
			text = result
		}
		fmt.Fprintf(&b, `,{"role":"assistant","content":null,"tool_calls":[{"id":"call_%d","type":"function","function":{"name":"tool_%d","arguments":"{\"url\":\"https://example.org/lisbon/%d\"}"}}]}`, i, i%4, i)
		fmt.Fprintf(&b, `,{"role":"tool","tool_call_id":"call_%d","content":"%s (page %d)"}`, i, text, i)
	}
	b.WriteString(`]}`)
	return b.String()
}

// BenchmarkAgentCallParse is what parsing and counting a real agent's
// call costs (go test -run '^$' -bench AgentCallParse ./agent/gateway):
// a 20 KB, 22-message chat body with tools.
//
//	seen:        the whole body was parsed before (the history an agent
//	             re-sends unchanged on every call): the part already seen.
//	seen-without-memo: the same without the memo of seen messages.
//	new-result:  the history seen before plus one new 1.4 KB tool result,
//	             different on every call (an agent's next call).
//	count-result: the new tool result's own count alone (tiktoken), which
//	             new-result includes.
func BenchmarkAgentCallParse(b *testing.B) {
	tokens.ForModel(testModel)
	allowed := func(m string) bool { return m == testModel }
	memo := newSeenMemo()
	parseCall := func(kind string, body []byte, allowed func(string) bool) (*call, error) {
		return parseCallHolding(kind, body, allowed, DefaultReferenceTokens, memo)
	}
	page := strings.Repeat("Lisbon's Alfama district keeps its medieval street plan; trams climb past the cathedral. ", 16)
	seen := agentBody(20, page)
	if n := len(seen); n < 18<<10 || n > 24<<10 {
		b.Fatalf("body is %d bytes, want about 20 KB", n)
	}
	body := []byte(seen)
	b.Run("seen", func(b *testing.B) {
		if _, err := parseCall(KindChat, body, allowed); err != nil {
			b.Fatal(err)
		}
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := parseCall(KindChat, body, allowed); err != nil {
				b.Fatal(err)
			}
		}
	})
	// The same body without the memo, every part decoded, checked and
	// counted (the tokenizer's own memo still knows every text): the
	// baseline the memo is measured against, in the same run.
	b.Run("seen-without-memo", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := parseCallHolding(KindChat, body, allowed, DefaultReferenceTokens, nil); err != nil {
				b.Fatal(err)
			}
		}
	})
	fresh := func(i int) string {
		return fmt.Sprintf("Result %d: ", i) + strings.Repeat("The Jerónimos Monastery in Belém took a century to build. ", 24)
	}
	b.Run("new-result", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			if _, err := parseCall(KindChat, []byte(agentBody(20, fresh(i))), allowed); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("count-result", func(b *testing.B) {
		c := tokens.ForModel(testModel)
		i := 1 << 30
		for b.Loop() {
			i++
			c.Count(fresh(i))
		}
	})
}
