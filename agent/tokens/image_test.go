package tokens

import "testing"

func TestImageTokens(t *testing.T) {
	for _, c := range []struct {
		model string
		want  int64
	}{
		{"gpt-4o-mini", 48169},
		{"gpt-4o-mini-2024-07-18", 48169},
		{"openai/gpt-4o-mini", 48169},
		{"gpt-4o", 1445},
		{"gpt-4.1", 1445},
		{"gpt-4.1-mini", 2488},
		{"gpt-4.1-nano", 3778},
		{"gpt-5", 1190},
		{"gpt-5.1", 1190},
		{"gpt-5-mini", 2488},
		{"gpt-5.2-nano", 3778},
		{"o4-mini", 2641},
		{"o3", 1275},
		{"o1-pro", 1275},
		{"gpt-3.5-turbo", 48169}, // an OpenAI model not in the table: the largest
		{"llava:13b", 16384},
		{"qwen2.5-vl-72b", 16384},
	} {
		if got := ImageTokens(c.model, false); got != c.want {
			t.Errorf("ImageTokens(%q) = %d, want %d", c.model, got, c.want)
		}
	}
	// Low detail: a tile model's base; the others as at any detail.
	for _, c := range []struct {
		model string
		want  int64
	}{
		{"gpt-4o-mini", 2833},
		{"gpt-4o", 85},
		{"o3", 75},
		{"gpt-5", 70},
		{"gpt-4.1-mini", 2488},
		{"gpt-3.5-turbo", 2833},
		{"llava:13b", 16384},
	} {
		if got := ImageTokens(c.model, true); got != c.want {
			t.Errorf("ImageTokens(%q, low) = %d, want %d", c.model, got, c.want)
		}
	}
}
