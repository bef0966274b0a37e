package aitf

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// diffBodies are the bodies the scanner is compared on: the fuzz seeds,
// the benchmark bodies, the page's bodies and the whole labelled corpus.
func diffBodies(t testing.TB) [][]byte {
	out := [][]byte{
		[]byte(pageBody(1)), agentBody(600), agentBody(1 << 10), agentBody(16 << 10), agentBody(64 << 10),
		cleanBody(1 << 10), cleanBody(8 << 10),
		[]byte(`{"tool_call_id":"call_abc","content":"42"}`),
		[]byte(`{"tool\u005fcall_id":"c","mode":"batch","recursion_depth":3}`),
		[]byte(`{"metadata":{"confidence":0.9},"tool_calls":[{"id":"x","function":{"name":"f"}}]}`),
		[]byte(`{"recursion_depth":1e99999,"context_window":-1e400,"temperature":0e999999}`),
		[]byte(`{"a":"\\\\\\"}`), []byte(`{"\u00zz":1}`), []byte(`]]]}}}{{{[[[`),
		[]byte(strings.Repeat("[", 300)),
		[]byte(strings.Repeat(`{"a":`, 100) + `{"tool_call_id":"x"`),
		[]byte(strings.Repeat(`{"a":[`, 70) + `{"tool_call_id":"x","mode":"batch"}`),
		[]byte(strings.Repeat(`{"a":`, 5000) + `{"tool_call_id":"x","top_p":0.5}`),
		[]byte("\x00\xff\"\\"), []byte(`{"id":78901,"doc":"doc_78912"}`), nil,
		[]byte(`{"Mode":"batch","MAX_TOKENS":5,"Tool-Call.ID":"call_q","t\u006fp_p":1,"top\u005Fk":3,"x\"y":1}`),
		[]byte(`{"type":"tool_use","type":"web_search_20250305","role":"Tool","id":"chatcmpl-1","id":"call_9"}`),
	}
	// The bounds: nesting around maxParents and maxTracked, enumeration
	// candidates around their length limits, keys around normCap and
	// maxKeyRaw (padded with separators, or written in \u escapes).
	for d := 56; d <= 70; d++ {
		for _, tail := range []string{`{"tool_calls":{"id":"abc"}}`, `{"tools":[{"function":"f"}]}`, `{"metadata":[{"confidence":0.5}]}`} {
			out = append(out, []byte(strings.Repeat("[", d)+tail))
		}
	}
	for d := 4090; d <= 4100; d++ {
		out = append(out, []byte(strings.Repeat("[", d)+`{"top_p":0.5}`))
	}
	for n := 2; n <= 52; n++ {
		id := strings.Repeat("d", max(n-5, 1)) + "_" + strings.Repeat("7", min(n, 4))
		out = append(out, []byte(`{"x":"`+id+`","doc_`+strings.Repeat("i", n)+`d":`+strings.Repeat("9", n%20)+`}`))
	}
	for n := 30; n <= 150; n += 1 {
		pad := strings.Repeat("_", max(n-len("maxtokens"), 0))
		esc := strings.Repeat(`\u005f`, max(n-len("maxtokens"), 0)/6)
		out = append(out, []byte(`{"max`+pad+`tokens":5,"top`+esc+`p":0.5,"`+strings.Repeat("A", n)+`":1}`))
	}
	// Plain and snake-case keys around the word size and normCap, the
	// underscore first met early or late.
	for n := 1; n <= 50; n++ {
		a := strings.Repeat("a", n)
		out = append(out, []byte(`{"`+a+`":1,"`+a+`_id":2,"`+a+`_top_p":0.5,"max_`+a[:min(n, 3)]+`":3,"`+a+`\u005fx":4}`))
	}
	for n := 30; n <= 46; n++ {
		out = append(out, []byte(`{"model":"`+strings.Repeat("x", n)+`gpt","mode":"`+strings.Repeat("_", n)+`batch"}`))
	}
	for n := 250; n <= 260; n++ {
		out = append(out, []byte(`{"tool_call_id":"`+strings.Repeat("c", n)+`"}`))
	}
	for _, s := range loadCorpus(t) {
		out = append(out, s.body)
	}
	return out
}

// mutate returns body with a few random edits, biased to the bytes that
// steer the scanner: quotes, backslashes, brackets, separators, digits.
func mutate(r *rand.Rand, body []byte) []byte {
	const steer = "\"\\{}[]:, \t\n-0123456789.eEtfnu_AZaz\x00\xff"
	b := append([]byte(nil), body...)
	for range 1 + r.IntN(4) {
		switch op := r.IntN(5); {
		case len(b) == 0 || op == 0:
			i := r.IntN(len(b) + 1)
			b = append(b[:i], append([]byte{steer[r.IntN(len(steer))]}, b[i:]...)...)
		case op == 1:
			b[r.IntN(len(b))] = steer[r.IntN(len(steer))]
		case op == 2:
			i := r.IntN(len(b))
			b = append(b[:i], b[i+1:]...)
		case op == 3:
			b = b[:r.IntN(len(b))]
		default:
			// Duplicate a slice of the body elsewhere (keys repeated in a
			// history, nesting deepened).
			i := r.IntN(len(b))
			j := i + r.IntN(min(len(b)-i, 64)+1)
			k := r.IntN(len(b) + 1)
			b = append(b[:k], append(append([]byte(nil), b[i:j]...), b[k:]...)...)
		}
	}
	return b
}

// checkSame fails when the scanner and the frozen reference disagree on
// body, with the memo on and off.
func checkSame(t testing.TB, body []byte) {
	t.Helper()
	want := refScanMemo(body, false)
	for _, memo := range []bool{false, true} {
		if got := scanMemo(body, memo); got != want {
			t.Fatalf("memo %v on %.80q…:\n got %+v\nwant %+v", memo, body, got, want)
		}
	}
	if got, want := scan(body), refScan(body); got != want {
		t.Fatalf("scan on %.80q…:\n got %+v\nwant %+v", body, got, want)
	}
}

// TestScanMatchesReference: on every test body, and on mutations of each,
// the scanner gives exactly what the scanner before the speed work gave.
func TestScanMatchesReference(t *testing.T) {
	r := rand.New(rand.NewPCG(20, 3))
	rounds := 40
	if testing.Short() {
		rounds = 4
	}
	for _, body := range diffBodies(t) {
		checkSame(t, body)
		for range rounds {
			checkSame(t, mutate(r, body))
		}
	}
}

// FuzzScanMatchesReference: any body scans exactly as it did before the
// speed work; `go test -run x -fuzz FuzzScanMatchesReference` explores.
func FuzzScanMatchesReference(f *testing.F) {
	for _, b := range diffBodies(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, body []byte) { checkSame(t, body) })
}
