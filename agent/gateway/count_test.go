package gateway

import (
	"encoding/json"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"faregate/agent/tokens"
)

// texts are agent/tokens' recorded prompts (English, Chinese, mixed, JSON)
// plus shapes that stress the runs: digits, white space, invalid UTF-8.
func countTexts(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile("../tokens/testdata/prompts.json")
	if err != nil {
		t.Fatal(err)
	}
	var recs []struct {
		Messages []struct{ Content string } `json:"messages"`
	}
	if err := json.Unmarshal(raw, &recs); err != nil {
		t.Fatal(err)
	}
	out := []string{"1234567890 12 3", "  \n\n\t  x   y", "a\xffb\xe4\xb8c", "日本語のテキスト、そして English.", `{"a":[1,2,{"b":"c"}]}`}
	for _, r := range recs {
		var b strings.Builder
		for _, m := range r.Messages {
			b.WriteString(m.Content + "\n")
		}
		out = append(out, b.String())
	}
	return out
}

// split cuts s into pieces of 1 to 8 bytes, code points split too.
func split(s string, rng *rand.Rand) []string {
	var out []string
	for s != "" {
		n := min(len(s), 1+rng.IntN(8))
		out = append(out, s[:n])
		s = s[n:]
	}
	return out
}

// For a model without a known tokenizer the stream's count is exactly
// agent/tokens' bound over the whole text, however the text was split.
func TestStreamCountEqualsBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	var bound tokens.Counter
	for _, text := range countTexts(t) {
		for range 20 {
			c := newOutCounter("llama3.1:8b")
			for _, p := range split(text, rng) {
				c.Add(p)
			}
			if got, want := c.Tokens(), bound.Count(text); got != want {
				t.Fatalf("%.40q: streamed %d, bound %d", text, got, want)
			}
		}
	}
}

// With a known tokenizer the windowed count stays at or just above the
// tokenizer's count of the whole text, split the way providers stream
// (whole tokens) or not.
func TestStreamCountKnownTokenizer(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	whole := tokens.ForModel(testModel)
	for _, text := range countTexts(t) {
		want := whole.Count(text)
		words := strings.SplitAfter(text, " ")
		c := newOutCounter(testModel)
		for _, w := range words {
			c.Add(w)
		}
		if got := c.Tokens(); got < want || got > want+want/20+2 {
			t.Fatalf("%.40q by words: %d, whole %d", text, got, want)
		}
		c = newOutCounter(testModel)
		for _, p := range split(text, rng) {
			c.Add(p)
		}
		if got := c.Tokens(); got < want || got > want+want/10+4 {
			t.Fatalf("%.40q by bytes: %d, whole %d", text, got, want)
		}
	}
}

func BenchmarkStreamCount(b *testing.B) {
	piece := " hello"
	for _, model := range []string{testModel, "llama3.1:8b"} {
		b.Run(model, func(b *testing.B) {
			c := newOutCounter(model)
			for b.Loop() {
				c.Add(piece)
				_ = c.Tokens()
			}
		})
	}
}
