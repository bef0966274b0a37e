package aitf

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"testing"
	"testing/synctest"
	"time"
)

func TestLRU(t *testing.T) {
	l := newLRU[string, int](3)
	for i, k := range []string{"a", "b", "c"} {
		v, existed := l.touch(k)
		if existed {
			t.Fatalf("%s existed before insertion", k)
		}
		*v = i + 1
	}
	// Touching "a" makes "b" the least recently used, so "d" evicts it.
	if v, existed := l.touch("a"); !existed || *v != 1 {
		t.Fatalf(`touch("a") = %d, %v; want 1, true`, *v, existed)
	}
	if v, existed := l.touch("d"); existed || *v != 0 {
		t.Fatalf(`touch("d") = %d, %v; want a zeroed new entry`, *v, existed)
	}
	if l.Len() != 3 {
		t.Fatalf("Len = %d, want 3", l.Len())
	}
	tests := []struct {
		key  string
		want bool
	}{{"a", true}, {"c", true}, {"d", true}, {"b", false}}
	for _, tc := range tests {
		t.Run(tc.key, func(t *testing.T) {
			if ok := l.l.Contains(tc.key); ok != tc.want {
				t.Errorf("%s held = %v, want %v", tc.key, ok, tc.want)
			}
		})
	}
}

// TestMemoryCap feeds a million distinct visitors through the behaviour
// memory and checks it never holds more than its cap.
func TestMemoryCap(t *testing.T) {
	const visitors, capacity = 1_000_000, 10_000
	m := newMemory(capacity)
	now := time.Unix(1_800_000_000, 0)
	key := make([]byte, 0, 32)
	for i := range visitors {
		key = strconv.AppendInt(append(key[:0], "visitor-"...), int64(i), 16)
		m.observe(string(key), now, uint64(i), true, enumCand{})
		if i%100_000 == 0 && m.Len() > capacity {
			t.Fatalf("after %d visitors: %d entries, cap %d", i+1, m.Len(), capacity)
		}
	}
	if n := m.Len(); n != capacity {
		t.Fatalf("%d entries after %d visitors, want exactly the cap %d", n, visitors, capacity)
	}
}

// BenchmarkMemoryObserve measures one request through the behaviour memory
// (hashicorp/golang-lru underneath): a returning visitor, and a stream of
// new visitors that keeps a full table evicting.
func BenchmarkMemoryObserve(b *testing.B) {
	const capacity = 100_000
	now := time.Unix(1_800_000_000, 0)
	keys := make([]string, 2*capacity)
	for i := range keys {
		keys[i] = "visitor-" + strconv.Itoa(i)
	}
	b.Run("returning", func(b *testing.B) {
		m := newMemory(capacity)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			m.observe(keys[i%1000], now, uint64(i), true, enumCand{})
			i++
		}
	})
	b.Run("new-evicting", func(b *testing.B) {
		m := newMemory(capacity)
		for i := range capacity {
			m.observe(keys[i], now, 1, true, enumCand{})
		}
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			m.observe(keys[i%len(keys)], now, uint64(i), true, enumCand{})
			i++
		}
	})
}

func TestMemoryBehaviour(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	doc := func(n int) enumCand { return enumOf("doc_" + strconv.Itoa(n)) }
	type dims struct{ enum, repeat, burst float64 }
	tests := []struct {
		name string
		reqs []memReq
		want dims // of the last request
	}{
		{
			name: "enumeration doc_78901 to doc_78912",
			reqs: []memReq{
				{0, 1, true, doc(78901)}, {2 * time.Second, 2, true, doc(78905)},
				{4 * time.Second, 3, true, doc(78909)}, {6 * time.Second, 4, true, doc(78912)},
				{8 * time.Second, 5, true, doc(78920)},
			},
			want: dims{enum: 1},
		},
		{
			name: "enumeration broken by a jump",
			reqs: []memReq{
				{0, 1, true, doc(78901)}, {2 * time.Second, 2, true, doc(78902)},
				{4 * time.Second, 3, true, doc(99999)},
			},
			want: dims{},
		},
		{
			name: "enumeration of another prefix starts over",
			reqs: []memReq{
				{0, 1, true, doc(1001)}, {2 * time.Second, 2, true, doc(1002)},
				{4 * time.Second, 3, true, enumOf("img_1003")},
			},
			want: dims{},
		},
		{
			name: "enumeration forgotten after ten minutes",
			reqs: []memReq{
				{0, 1, true, doc(1001)}, {time.Second * 2, 2, true, doc(1002)},
				{15 * time.Minute, 3, true, doc(1003)},
			},
			want: dims{},
		},
		{
			name: "identical body three times within a minute",
			reqs: []memReq{{0, 7, true, enumCand{}}, {20 * time.Second, 7, true, enumCand{}}, {40 * time.Second, 7, true, enumCand{}}},
			want: dims{repeat: 0.5},
		},
		{
			name: "identical body five times",
			reqs: []memReq{
				{0, 7, true, enumCand{}}, {10 * time.Second, 7, true, enumCand{}}, {20 * time.Second, 7, true, enumCand{}},
				{30 * time.Second, 7, true, enumCand{}}, {40 * time.Second, 7, true, enumCand{}},
			},
			want: dims{repeat: 1},
		},
		{
			name: "identical body after more than 60 s",
			reqs: []memReq{{0, 7, true, enumCand{}}, {61 * time.Second, 7, true, enumCand{}}},
			want: dims{},
		},
		{
			name: "empty bodies are not repeats",
			reqs: []memReq{{0, 7, false, enumCand{}}, {10 * time.Second, 7, false, enumCand{}}, {20 * time.Second, 7, false, enumCand{}}},
			want: dims{},
		},
		{
			name: "distinct bodies a few times a minute",
			reqs: []memReq{{0, 1, true, enumCand{}}, {15 * time.Second, 2, true, enumCand{}}, {30 * time.Second, 3, true, enumCand{}}, {45 * time.Second, 4, true, enumCand{}}},
			want: dims{},
		},
		{
			name: "twelve requests in a second after silence",
			reqs: burst(12, 0),
			want: dims{burst: 1},
		},
		{
			name: "four requests in a second (a page load)",
			reqs: burst(4, 0),
			want: dims{},
		},
		{
			name: "twelve requests in a second without a quiet spell",
			reqs: append(burst(1, 0), burst(12, 2*time.Second)...),
			want: dims{burst: 0.5},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemory(100)
			var got dims
			for _, r := range tc.reqs {
				got.enum, got.repeat, got.burst = m.observe("v", t0.Add(r.at), r.hash, r.hasBody, r.cand)
			}
			if got != tc.want {
				t.Errorf("enumeration, repeat, burst = %+v, want %+v", got, tc.want)
			}
		})
	}
}

// memReq is one request as the behaviour memory sees it.
type memReq struct {
	at      time.Duration
	hash    uint64
	hasBody bool
	cand    enumCand
}

// burst returns n requests with distinct bodies spread over 900 ms from at.
func burst(n int, at time.Duration) []memReq {
	out := make([]memReq, n)
	for i := range out {
		out[i] = memReq{at: at + time.Duration(i)*900*time.Millisecond/time.Duration(n), hash: uint64(1000 + i), hasBody: true}
	}
	return out
}

func TestEnumOf(t *testing.T) {
	tests := []struct {
		in     string
		wantOK bool
		wantN  int64
	}{
		{"doc_78901", true, 78901},
		{"DOC-78901", true, 78901},
		{"user:123", true, 123},
		{"doc_12", false, 0},
		{"78901", false, 0},
		{"2026-08-31", false, 0},
		{"doc 78901", false, 0},
		{"Lisbon", false, 0},
		{"", false, 0},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			c := enumOf(tc.in)
			if c.ok != tc.wantOK || c.n != tc.wantN {
				t.Errorf("enumOf(%q) = %+v, want ok %v n %d", tc.in, c, tc.wantOK, tc.wantN)
			}
		})
	}
	if enumOf("doc_1234").prefix != enumOf("DOC_5678").prefix {
		t.Error("prefix hash depends on case")
	}
}

// TestBehaviourOnTheDefaultClock runs a Guard whose behaviour memory reads
// time.Now (Options.Now unset) in a synctest bubble: time.Sleep there only
// moves the bubble's fake clock, so the pacing is exact and costs nothing.
func TestBehaviourOnTheDefaultClock(t *testing.T) {
	tests := []struct {
		name      string
		gap       time.Duration
		wantBurst float64
	}{
		{"twelve requests in 600 ms after silence", 50 * time.Millisecond, 1},
		{"twelve requests a second apart", time.Second, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				g := New(Options{VisitorKey: func(*http.Request) string { return visitorHash }})
				var last Result
				h := g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					last, _ = FromContext(r.Context())
				}))
				for i := range 12 {
					h.ServeHTTP(httptest.NewRecorder(), post(`{"q":"`+strconv.Itoa(i)+`"}`))
					time.Sleep(tc.gap)
				}
				if got := last.Vector[dimBurst]; got != tc.wantBurst {
					t.Errorf("burst = %.2f, want %.2f (vector %s)", got, tc.wantBurst, last.Vector)
				}
			})
		})
	}
}
