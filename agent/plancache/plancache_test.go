package plancache_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"faregate/agent/plancache"
	"faregate/protect/kit/testkit/redistest"
)

var (
	zurich = plancache.Request{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}}
	t0     = time.Date(2026, 11, 25, 9, 30, 0, 123456789, time.UTC)
)

const result = `{"summary":"Three days in Zürich","days":[{"day":1,"title":"Old town","items":["Lindenhof"]}],"warnings":[],"model":"gpt-4o-mini","offline":false}`

func fixedNow() time.Time { return t0 }

func TestPutGetRoundTrip(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			c := plancache.New(b.Client, plancache.Options{Now: fixedNow})
			if _, ok, err := c.Get(ctx, zurich); ok || err != nil {
				t.Fatalf("get before put: ok=%v err=%v, want a miss", ok, err)
			}
			plan := plancache.Plan{Result: json.RawMessage(" \n" + result + "\n"), Model: "gpt-4o-mini", CachedAt: t0.Add(-time.Hour)}
			if err := c.Put(ctx, zurich, plan); err != nil {
				t.Fatal(err)
			}
			// The same trip, written differently, finds the plan.
			same := plancache.Request{Destination: "  ZURICH ", Days: 3, Interests: []string{"Museums", "food", "food"}, Language: "EN"}
			got, ok, err := c.Get(ctx, same)
			if err != nil || !ok {
				t.Fatalf("get after put: ok=%v err=%v", ok, err)
			}
			if string(got.Result) != result {
				t.Fatalf("result = %s, want %s", got.Result, result)
			}
			if got.Model != "gpt-4o-mini" || !got.CachedAt.Equal(t0) || got.Warnings != nil {
				t.Fatalf("plan = %+v, want model gpt-4o-mini, cached at %v (Put's clock), no warnings", got, t0)
			}
			// Another trip does not.
			for _, other := range []plancache.Request{
				{Destination: "Zürich", Days: 4, Interests: []string{"food", "museums"}},
				{Destination: "Zürich", Days: 3, Interests: []string{"food", "museums"}, Language: "zh-CN"},
			} {
				if _, ok, err := c.Get(ctx, other); ok || err != nil {
					t.Fatalf("get %+v: ok=%v err=%v, want a miss", other, ok, err)
				}
			}
			// The only key written is the request's, and its TTL is the default.
			keys, err := b.Client.Keys(ctx, "*").Result()
			if err != nil || len(keys) != 1 || keys[0] != plancache.Key(zurich) {
				t.Fatalf("keys = %v, %v; want only %s", keys, err, plancache.Key(zurich))
			}
			ttl, err := b.Client.PTTL(ctx, keys[0]).Result()
			if err != nil || ttl <= plancache.DefaultTTL-time.Minute || ttl > plancache.DefaultTTL {
				t.Fatalf("PTTL = %v, %v; want about %v", ttl, err, plancache.DefaultTTL)
			}
		})
	}
}

func TestPutReplaces(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			now := t0
			c := plancache.New(b.Client, plancache.Options{Now: func() time.Time { return now }})
			if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(`{"summary":"old"}`)}); err != nil {
				t.Fatal(err)
			}
			now = t0.Add(time.Hour)
			if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(`{"summary":"new"}`)}); err != nil {
				t.Fatal(err)
			}
			got, ok, err := c.Get(ctx, zurich)
			if err != nil || !ok || string(got.Result) != `{"summary":"new"}` || !got.CachedAt.Equal(now) {
				t.Fatalf("get = %+v, %v, %v; want the newer plan", got, ok, err)
			}
		})
	}
}

func TestTTLExpiry(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			const ttl = 90 * time.Minute
			c := plancache.New(b.Client, plancache.Options{TTL: ttl, Now: fixedNow})
			if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result)}); err != nil {
				t.Fatal(err)
			}
			got, err := b.Client.PTTL(ctx, plancache.Key(zurich)).Result()
			if err != nil || got <= ttl-time.Minute || got > ttl {
				t.Fatalf("PTTL = %v, %v; want about %v", got, err, ttl)
			}
			if b.Mini == nil {
				return // a real server's clock cannot be moved; its TTL is checked above
			}
			b.Mini.FastForward(ttl - time.Second)
			if _, ok, err := c.Get(ctx, zurich); !ok || err != nil {
				t.Fatalf("a second before expiry: ok=%v err=%v, want a hit", ok, err)
			}
			b.Mini.FastForward(time.Second)
			if _, ok, err := c.Get(ctx, zurich); ok || err != nil {
				t.Fatalf("at expiry: ok=%v err=%v, want a miss", ok, err)
			}
		})
	}
}

func TestPutRefuses(t *testing.T) {
	tests := []struct {
		name string
		plan plancache.Plan
	}{
		{"task warnings", plancache.Plan{Result: json.RawMessage(result), Warnings: []string{"weather_unavailable"}}},
		{"result warnings", plancache.Plan{Result: json.RawMessage(`{"summary":"x","warnings":["weather_unavailable"]}`)}},
		{"served from the cache", plancache.Plan{Result: json.RawMessage(`{"summary":"x","cached":true}`)}},
		{"no result", plancache.Plan{}},
		{"null result", plancache.Plan{Result: json.RawMessage(`null`)}},
		{"array result", plancache.Plan{Result: json.RawMessage(`[{"summary":"x"}]`)}},
		{"invalid JSON", plancache.Plan{Result: json.RawMessage(`{"summary":`)}},
		{"trailing data", plancache.Plan{Result: json.RawMessage(`{"summary":"x"} {}`)}},
		{"warnings not an array", plancache.Plan{Result: json.RawMessage(`{"warnings":"none"}`)}},
		{"oversize", plancache.Plan{Result: json.RawMessage(`{"summary":"` + strings.Repeat("x", plancache.MaxEntryBytes) + `"}`)}},
	}
	ctx := context.Background()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := plancache.New(redistest.Mini(t).Client, plancache.Options{})
			if err := c.Put(ctx, zurich, tt.plan); !errors.Is(err, plancache.ErrNotCacheable) {
				t.Fatalf("Put = %v, want ErrNotCacheable", err)
			}
			if _, ok, err := c.Get(ctx, zurich); ok || err != nil {
				t.Fatalf("after a refused put: ok=%v err=%v, want a miss", ok, err)
			}
		})
	}
}

// TestRefusesNonCanonicalText (#19 item 7): a request whose text holds
// format or control characters, or is not in the NFKC form the model is
// given, is neither stored nor served, whatever its key folds to; the
// plain request keeps its own plan.
func TestRefusesNonCanonicalText(t *testing.T) {
	ctx := context.Background()
	b := redistest.Mini(t)
	c := plancache.New(b.Client, plancache.Options{})
	plain := plancache.Request{Destination: "Lisbon", Days: 2}
	if err := c.Put(ctx, plain, plancache.Plan{Result: json.RawMessage(result)}); err != nil {
		t.Fatal(err)
	}
	for _, req := range []plancache.Request{
		{Destination: "Lisbon\U000E0020\U000E0062\U000E0065", Days: 2},
		{Destination: "Lisbon", Days: 2, Interests: []string{"\U000E0061\U000E0062"}},
		{Destination: "Lis\u200bbon", Days: 2},
		{Destination: "Lis\u00adbon", Days: 2},
		{Destination: "Lisbon\x00", Days: 2},
		{Destination: "Lisbon", Days: 2, Interests: []string{"\xff"}},
		{Destination: "ＬＩＳＢＯＮ", Days: 2}, // the model is given NFKC, never this
	} {
		if err := c.Put(ctx, req, plancache.Plan{Result: json.RawMessage(result)}); !errors.Is(err, plancache.ErrNotCacheable) {
			t.Errorf("Put(%#v) = %v, want ErrNotCacheable", req, err)
		}
		if _, ok, err := c.Get(ctx, req); ok || err != nil {
			t.Errorf("Get(%#v): ok=%v err=%v, want a miss", req, ok, err)
		}
		if err := plancache.CheckRequest(req); !errors.Is(err, plancache.ErrNotCacheable) {
			t.Errorf("CheckRequest(%#v) = %v", req, err)
		}
	}
	if keys := b.Client.Keys(ctx, "*").Val(); len(keys) != 1 || keys[0] != plancache.Key(plain) {
		t.Fatalf("keys %v, want only the plain request's", keys)
	}
	if _, ok, err := c.Get(ctx, plancache.Request{Destination: "LISBON", Days: 2}); !ok || err != nil {
		t.Fatalf("LISBON: ok=%v err=%v, want the plain plan (the key folds case)", ok, err)
	}
}

// TestSizeBound fills an entry to exactly MaxEntryBytes, which is stored,
// and one byte more, which is refused.
func TestSizeBound(t *testing.T) {
	b := redistest.Mini(t)
	ctx := context.Background()
	c := plancache.New(b.Client, plancache.Options{Now: fixedNow})
	padded := func(n int) plancache.Plan {
		return plancache.Plan{Result: json.RawMessage(`{"summary":"` + strings.Repeat("x", n) + `"}`), Model: "m"}
	}
	if err := c.Put(ctx, zurich, padded(0)); err != nil {
		t.Fatal(err)
	}
	overhead, err := b.Client.StrLen(ctx, plancache.Key(zurich)).Result()
	if err != nil {
		t.Fatal(err)
	}
	fill := plancache.MaxEntryBytes - int(overhead)
	if err := c.Put(ctx, zurich, padded(fill)); err != nil {
		t.Fatalf("an entry of exactly MaxEntryBytes: %v", err)
	}
	if n, err := b.Client.StrLen(ctx, plancache.Key(zurich)).Result(); err != nil || n != plancache.MaxEntryBytes {
		t.Fatalf("stored %d bytes (%v), want %d", n, err, plancache.MaxEntryBytes)
	}
	if err := c.Put(ctx, zurich, padded(fill+1)); !errors.Is(err, plancache.ErrNotCacheable) {
		t.Fatalf("an entry one byte over: %v, want ErrNotCacheable", err)
	}
}

func TestRedisDownIsUnavailable(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	c := plancache.New(srv.Client(t), plancache.Options{})
	if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result)}); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	plan, ok, err := c.Get(ctx, zurich)
	if !errors.Is(err, plancache.ErrUnavailable) || ok || plan.Result != nil {
		t.Fatalf("get with Redis down: %+v, ok=%v, err=%v; want ErrUnavailable and no plan", plan, ok, err)
	}
	if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result)}); !errors.Is(err, plancache.ErrUnavailable) {
		t.Fatalf("put with Redis down: %v, want ErrUnavailable", err)
	}
	// A plan that may not be cached is refused as such, Redis or not.
	if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result), Warnings: []string{"w"}}); !errors.Is(err, plancache.ErrNotCacheable) {
		t.Fatalf("put of a plan with warnings, Redis down: %v, want ErrNotCacheable", err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	if _, _, err := c.Get(ctx, zurich); err != nil {
		t.Fatalf("get after restart: %v", err)
	}
}

func TestCanceledContextIsUnavailable(t *testing.T) {
	b := redistest.Mini(t)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	c := plancache.New(b.Client, plancache.Options{})
	_, ok, err := c.Get(ctx, zurich)
	if !errors.Is(err, plancache.ErrUnavailable) || !errors.Is(err, context.Canceled) || ok {
		t.Fatalf("get on a canceled context: ok=%v err=%v; want ErrUnavailable wrapping context.Canceled", ok, err)
	}
}

func TestUnreadableEntry(t *testing.T) {
	for _, tt := range []struct {
		name, stored string
		wantErr      error
	}{
		{"not JSON", "not json", plancache.ErrUnavailable},
		{"another version", `{"v":99,"result":{"summary":"x"}}`, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			b := redistest.Mini(t)
			ctx := context.Background()
			if err := b.Client.Set(ctx, plancache.Key(zurich), tt.stored, time.Hour).Err(); err != nil {
				t.Fatal(err)
			}
			c := plancache.New(b.Client, plancache.Options{})
			_, ok, err := c.Get(ctx, zurich)
			if ok || !errors.Is(err, tt.wantErr) || (tt.wantErr == nil && err != nil) {
				t.Fatalf("get = ok %v, err %v; want no hit and error %v", ok, err, tt.wantErr)
			}
		})
	}
}

func TestMetrics(t *testing.T) {
	b := redistest.Mini(t)
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	// Two caches on one registry share the series.
	c := plancache.New(b.Client, plancache.Options{Registerer: reg})
	other := plancache.New(b.Client, plancache.Options{Registerer: reg})

	if _, _, err := c.Get(ctx, zurich); err != nil { // miss
		t.Fatal(err)
	}
	if err := c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result)}); err != nil { // ok
		t.Fatal(err)
	}
	if _, _, err := other.Get(ctx, zurich); err != nil { // hit
		t.Fatal(err)
	}
	if _, _, err := c.Get(ctx, zurich); err != nil { // hit
		t.Fatal(err)
	}
	_ = c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result), Warnings: []string{"w"}}) // skipped
	b.Mini.SetError("LOADING Redis is loading the dataset in memory")
	_, _, _ = c.Get(ctx, zurich)                                            // error
	_ = c.Put(ctx, zurich, plancache.Plan{Result: json.RawMessage(result)}) // error

	want := `
# HELP faregate_plan_cache_total Plan cache operations: get (hit, miss, error) and put (ok, error, skipped for a plan that may not be cached).
# TYPE faregate_plan_cache_total counter
faregate_plan_cache_total{op="get",outcome="error"} 1
faregate_plan_cache_total{op="get",outcome="hit"} 2
faregate_plan_cache_total{op="get",outcome="miss"} 1
faregate_plan_cache_total{op="put",outcome="error"} 1
faregate_plan_cache_total{op="put",outcome="ok"} 1
faregate_plan_cache_total{op="put",outcome="skipped"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "faregate_plan_cache_total"); err != nil {
		t.Fatal(err)
	}
}

func TestMetricsStartAtZero(t *testing.T) {
	reg := prometheus.NewRegistry()
	plancache.New(redistest.Mini(t).Client, plancache.Options{Registerer: reg})
	if n, err := testutil.GatherAndCount(reg, "faregate_plan_cache_total"); err != nil || n != 6 {
		t.Fatalf("series before any operation: %d, %v; want all 6", n, err)
	}
}
