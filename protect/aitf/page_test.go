package aitf

import (
	"encoding/json"
	"testing"
)

// pagePresets are the page's interest chips (web/static/app.js PRESETS) as
// it sends them: in the visitor's language (web/static/messages.js).
var pagePresets = map[string][]string{
	"en":    {"Food", "History", "Art", "Nature", "Architecture", "Museums", "Nightlife", "Shopping"},
	"zh-CN": {"美食", "历史", "艺术", "自然", "建筑", "博物馆", "夜生活", "购物"},
}

// subsets returns every subset of items with at most k elements, in order.
func subsets(items []string, k int) [][]string {
	out := [][]string{{}}
	for _, it := range items {
		for _, s := range out {
			if len(s) < k {
				out = append(out, append(append([]string(nil), s...), it))
			}
		}
	}
	return out
}

// TestPageBodiesScoreZero: every body the page can send with its preset
// interests (every combination of up to five, in both languages, sent
// with either language), for several destinations, 1 to 7 days, scores
// exactly 0. So do custom interests that happen to be agent words.
func TestPageBodiesScoreZero(t *testing.T) {
	destinations := []string{"Lisbon", "Kyoto", "Reykjavík", "New York", "São Paulo", "成都", "北京", "上海", "西安"}
	type task struct {
		Token       string   `json:"turnstile_token"`
		Destination string   `json:"destination"`
		Days        int      `json:"days"`
		Interests   []string `json:"interests"`
		Language    string   `json:"language"`
	}
	n := 0
	check := func(tk task) {
		t.Helper()
		b, err := json.Marshal(tk)
		if err != nil {
			t.Fatal(err)
		}
		n++
		if s, v := Score(b); s != 0 {
			t.Errorf("%s scores %.3f [%s], want 0", b, s, v)
		}
	}
	for _, labels := range pagePresets {
		combos := subsets(labels, 5)
		if len(combos) != 219 {
			t.Fatalf("%d combinations of up to 5 of 8 presets, want 219", len(combos))
		}
		for _, lang := range []string{"en", "zh-CN"} {
			for di, dest := range destinations {
				for days := 1; days <= 7; days++ {
					for ci, interests := range combos {
						check(task{token(di*10000 + days*1000 + ci), dest, days, interests, lang})
					}
				}
			}
		}
	}
	// Custom interests are free text of up to 32 characters; words that
	// are keys elsewhere are only values here.
	for _, interests := range [][]string{
		{"tool_call_id", "recursion_depth", "max_retries", "chunk_size", "mode"},
		{"batch", "autonomous agent", "headless", "gpt-4o", "thought"},
		{"call_Hn2kQ8", "doc_78901", "tools/call", "toolu_01", "deep_analysis"},
	} {
		check(task{token(n), "Lisbon", 3, interests, "en"})
	}
	t.Logf("%d page bodies scored 0", n)
}
