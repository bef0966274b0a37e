package tokens

import "strings"

// ImageTokens is the most one image can cost in a prompt to model, at
// any size and detail: what a reservation holds for it, the image not
// being looked at. OpenAI prices images in prompt tokens, by family
// (its vision guide, "Calculating costs"):
//   - tiles of 512 px, the image fitted in 2048 px and its short side
//     scaled to 768 px, so at most 8 tiles: base + 8 × per tile; gpt-4o,
//     gpt-4.1 and gpt-4.5 85 + 170 a tile, o1 and o3 75 + 150, gpt-5 70 +
//     140, computer-use 65 + 129, and gpt-4o-mini 2,833 + 5,667 (its
//     images cost what gpt-4o's do at a thirtieth of the token price:
//     48,169 tokens for one large image);
//   - patches of 32 px, at most 1,536, times the model's multiplier:
//     gpt-4.1-mini and gpt-5-mini 1.62, gpt-4.1-nano and gpt-5-nano
//     2.46, o4-mini 1.72.
//
// Another OpenAI model is held at the largest of these; any other model
// at 16,384 (Qwen2.5-VL's most at its default resolution; Llama and
// Claude images cost a few thousand).
//
// With low, the image's detail is "low": a tile model bills its base
// only (gpt-4o-mini 2,833); the others are held as above.
func ImageTokens(model string, low bool) int64 {
	const patches = 1536
	tiles := int64(8)
	if low {
		tiles = 0
	}
	m := baseName(model)
	mini, nano := strings.Contains(m, "-mini"), strings.Contains(m, "-nano")
	switch {
	case family(m, "gpt-4o-mini"):
		return 2833 + tiles*5667
	case family(m, "gpt-4.1") && nano, family(m, "gpt-5") && nano || gpt5x(m) && nano:
		return patches * 246 / 100
	case family(m, "gpt-4.1") && mini, family(m, "gpt-5") && mini || gpt5x(m) && mini:
		return patches * 162 / 100
	case family(m, "o4-mini"):
		return patches * 172 / 100
	case family(m, "gpt-4o"), family(m, "chatgpt-4o"), family(m, "gpt-4.1"), family(m, "gpt-4.5"), family(m, "gpt-4-turbo"):
		return 85 + tiles*170
	case family(m, "o1"), family(m, "o3"):
		return 75 + tiles*150
	case family(m, "gpt-5") || gpt5x(m):
		return 70 + tiles*140
	case family(m, "computer-use-preview"):
		return 65 + tiles*129
	case EncodingFor(model) != Bound:
		return 2833 + tiles*5667
	}
	return 16384
}

// gpt5x reports whether m is of a gpt-5 point release (gpt-5.1, …).
func gpt5x(m string) bool {
	rest, ok := strings.CutPrefix(m, "gpt-5.")
	return ok && rest != "" && rest[0] >= '0' && rest[0] <= '9'
}
