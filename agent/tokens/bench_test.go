package tokens

import (
	"strings"
	"testing"
)

// prompt4K is a 4 KiB prompt of the kind the agent sends: instructions,
// a request and JSON tool output, English and Chinese.
var prompt4K = func() string {
	parts := []string{
		"You are faregate's trip planner. Plan a day-by-day itinerary for the visitor's request. ",
		`{"results":[{"title":"Alfama","area":"old town","text":"Lisbon's oldest quarter; walk it early.","tags":["history","walk"]}],"count":1} `,
		"请为我规划在里斯本的三天行程。兴趣：美食、历史。",
		"Day 1: Baixa, Rossio and the 28 tram up to the castle; fado in Alfama at night.\n",
	}
	var b strings.Builder
	for b.Len() < 4096 {
		b.WriteString(parts[b.Len()%len(parts)])
	}
	return b.String()[:4096]
}()

// benchCount counts a 4 KiB text that is new each time (the memo cannot
// answer), which is what a new message costs.
func benchCount(b *testing.B, c Counter) {
	texts := make([]string, 64)
	for i := range texts {
		texts[i] = prompt4K[:4096-len(texts)] + strings.Repeat(" ", i) + strings.Repeat("x", len(texts)-i)
	}
	b.SetBytes(4096)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if c.enc != nil {
			c.enc.mu.Lock()
			clear(c.enc.memo)
			c.enc.mu.Unlock()
		}
		c.Count(texts[i%len(texts)])
		i++
	}
}

func BenchmarkCount4KiB_o200k(b *testing.B)  { benchCount(b, ForModel("gpt-4o")) }
func BenchmarkCount4KiB_cl100k(b *testing.B) { benchCount(b, ForModel("gpt-4")) }
func BenchmarkCount4KiB_bound(b *testing.B)  { benchCount(b, ForModel("llama3.1:8b")) }

// BenchmarkCount4KiBRepeated_o200k counts a text already counted: an
// earlier message re-sent with the next model call.
func BenchmarkCount4KiBRepeated_o200k(b *testing.B) {
	c := ForModel("gpt-4o")
	c.Count(prompt4K)
	b.SetBytes(4096)
	b.ReportAllocs()
	for b.Loop() {
		c.Count(prompt4K)
	}
}

// BenchmarkLoad measures building an encoder from the embedded ranks, the
// one-time cost ForModel pays per encoding.
func BenchmarkLoad_o200k(b *testing.B) {
	for b.Loop() {
		e := &encoding{name: o200k.name, file: o200k.file, pattern: o200k.pattern}
		if _, err := e.load(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkCountShort counts the short texts of a typical chat request
// (roles, a one-line system prompt and question), each already seen:
// what every call of an agent's conversation re-sends.
func BenchmarkCountShort_o200k(b *testing.B) {
	c := ForModel("gpt-4o")
	texts := []string{"system", "You plan trips.", "user", "Three days in Lisbon, food and history."}
	b.ReportAllocs()
	for b.Loop() {
		for _, t := range texts {
			c.Count(t)
		}
	}
}
