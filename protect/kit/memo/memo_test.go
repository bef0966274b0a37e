package memo_test

import (
	"strconv"
	"sync"
	"testing"
	"time"

	"faregate/protect/kit/memo"
	"faregate/protect/kit/testkit/clocktest"
)

func TestMemo(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	steps := []struct {
		name     string
		do       func(m *memo.Memo[string, int], clk *clocktest.Clock)
		key      string
		want     int
		wantLeft time.Duration
		wantOK   bool
	}{
		{"absent", func(*memo.Memo[string, int], *clocktest.Clock) {}, "a", 0, 0, false},
		{"put", func(m *memo.Memo[string, int], _ *clocktest.Clock) { m.Put("a", 1, t0.Add(time.Minute)) }, "a", 1, time.Minute, true},
		{"shorter put keeps the longer", func(m *memo.Memo[string, int], _ *clocktest.Clock) { m.Put("a", 2, t0.Add(time.Second)) }, "a", 1, time.Minute, true},
		{"longer put replaces", func(m *memo.Memo[string, int], _ *clocktest.Clock) { m.Put("a", 3, t0.Add(time.Hour)) }, "a", 3, time.Hour, true},
		{"past deadline is not stored", func(m *memo.Memo[string, int], _ *clocktest.Clock) { m.Put("b", 1, t0) }, "b", 0, 0, false},
		{"time passes", func(_ *memo.Memo[string, int], clk *clocktest.Clock) { clk.Set(t0.Add(30 * time.Minute)) }, "a", 3, 30 * time.Minute, true},
		{"expires", func(_ *memo.Memo[string, int], clk *clocktest.Clock) { clk.Set(t0.Add(time.Hour)) }, "a", 0, 0, false},
	}
	clk := clocktest.New(t0)
	m := memo.New[string, int](10, clk.Now)
	for _, st := range steps {
		st.do(m, clk)
		v, left, ok := m.Get(st.key)
		if v != st.want || left != st.wantLeft || ok != st.wantOK {
			t.Fatalf("%s: Get(%q) = %d, %v, %v; want %d, %v, %v", st.name, st.key, v, left, ok, st.want, st.wantLeft, st.wantOK)
		}
	}
	if m.Len() != 0 {
		t.Fatalf("an expired entry read is dropped: %d held", m.Len())
	}
}

func TestMemoBoundedAndRemoveIf(t *testing.T) {
	clk := clocktest.New(time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC))
	m := memo.New[int, int](100, clk.Now)
	for i := 0; i < 1000; i++ {
		m.Put(i, i, clk.Now().Add(time.Hour))
	}
	if m.Len() != 100 {
		t.Fatalf("holds %d, want its capacity 100", m.Len())
	}
	if _, _, ok := m.Get(0); ok {
		t.Fatal("the least recently used entry should be forgotten first")
	}
	if _, _, ok := m.Get(999); !ok {
		t.Fatal("the newest entry is kept")
	}
	m.RemoveIf(func(k, v int) bool { return v%2 == 0 })
	if m.Len() != 50 {
		t.Fatalf("after removing even values: %d held, want 50", m.Len())
	}
	m.Remove(999)
	if _, _, ok := m.Get(999); ok {
		t.Fatal("removed entry still there")
	}
	m.Purge()
	if m.Len() != 0 {
		t.Fatal("purge left entries")
	}
}

func TestMemoConcurrent(t *testing.T) {
	m := memo.New[string, int](64, nil)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 1000; i++ {
				k := strconv.Itoa(i % 100)
				m.Put(k, g, time.Now().Add(time.Minute))
				m.Get(k)
			}
		}(g)
	}
	wg.Wait()
	if m.Len() > 64 {
		t.Fatalf("holds %d past its capacity 64", m.Len())
	}
}

// BenchmarkLookup measures a hit, the refusal path's cost, on the LRU and
// on the plain map under a mutex the memories used before (why the library
// is worth its few nanoseconds: bounded by recency, with less code).
func BenchmarkLookup(b *testing.B) {
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = "visitor-" + strconv.Itoa(i)
	}
	until := time.Now().Add(time.Hour)
	b.Run("memo", func(b *testing.B) {
		m := memo.New[string, int64](200_000, nil)
		for _, k := range keys {
			m.Put(k, 5, until)
		}
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				m.Get(keys[i&1023])
				i++
			}
		})
	})
	b.Run("map", func(b *testing.B) {
		var mu sync.Mutex
		m := map[string]int64{}
		for _, k := range keys {
			m[k] = 5
		}
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				mu.Lock()
				_ = m[keys[i&1023]]
				mu.Unlock()
				_ = time.Until(until)
				i++
			}
		})
	})
}

// TestMemoPutNeverShortens: Puts of one key racing from many goroutines
// leave the longest deadline, whatever their order. A check-then-add Put
// loses it when a shorter Put's add lands after a longer one's.
func TestMemoPutNeverShortens(t *testing.T) {
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	clk := clocktest.New(t0)
	const puts = 16
	for round := 0; round < 2000; round++ {
		m := memo.New[string, int](8, clk.Now)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := 1; i <= puts; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				for j := 0; j < 20; j++ {
					m.Put("k", i, t0.Add(time.Duration(i)*time.Minute))
				}
			}()
		}
		close(start)
		wg.Wait()
		if v, left, ok := m.Get("k"); !ok || v != puts || left != puts*time.Minute {
			t.Fatalf("round %d: Get = %d, %v, %v; want the longest, %d, %v", round, v, left, ok, puts, puts*time.Minute)
		}
	}
}
