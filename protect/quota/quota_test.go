package quota_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"faregate/protect/quota"
	"faregate/protect/redistest"
)

// clock is a settable time source shared by the test and the Quota.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) Now() time.Time  { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) Set(t time.Time) { c.mu.Lock(); c.t = t; c.mu.Unlock() }

// TestConformance runs the same expectations on miniredis and real Redis.
func TestConformance(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			clk := &clock{t: time.Date(2026, 8, 31, 23, 59, 0, 0, time.UTC)}
			q := quota.New(be.Client, quota.Limits{Visitor: 2, Global: 3}, clk.Now)

			steps := []struct {
				name              string
				visitor           string
				wantErr           error
				wantVis, wantGlob int64
			}{
				{"first", "aa", nil, 1, 2},
				{"second", "aa", nil, 0, 1},
				{"visitor over", "aa", quota.ErrVisitorLimit, 0, 1},
				{"other visitor", "bb", nil, 1, 0},
				{"site over", "cc", quota.ErrGlobalLimit, 2, 0},
				{"both over: visitor wins", "aa", quota.ErrVisitorLimit, 0, 0},
			}
			for _, st := range steps {
				d, err := q.Take(ctx, st.visitor)
				if err != nil {
					t.Fatalf("%s: %v", st.name, err)
				}
				if !errors.Is(d.Err, st.wantErr) && d.Err != st.wantErr {
					t.Fatalf("%s: decision %v, want %v", st.name, d.Err, st.wantErr)
				}
				// Remaining counts are exact when Redis was asked; a refusal
				// from memory may report the visitor's as 0.
				if st.wantErr == nil && (d.VisitorRemaining != st.wantVis || d.GlobalRemaining != st.wantGlob) {
					t.Fatalf("%s: remaining %d/%d, want %d/%d", st.name, d.VisitorRemaining, d.GlobalRemaining, st.wantVis, st.wantGlob)
				}
				if d.Reset != time.Date(2026, 9, 1, 0, 0, 0, 0, time.UTC) {
					t.Fatalf("%s: reset %v", st.name, d.Reset)
				}
			}

			// Key names and TTLs are the contract's.
			for _, k := range []string{"faregate:quota:{2026-08-31}:ip:aa", "faregate:quota:{2026-08-31}:ip:bb", "faregate:quota:{2026-08-31}:global"} {
				ttl, err := be.Client.TTL(ctx, k).Result()
				if err != nil {
					t.Fatal(err)
				}
				if ttl <= 172790*time.Second || ttl > 172800*time.Second {
					t.Fatalf("key %s ttl %v, want 172800s", k, ttl)
				}
			}
			if v, _ := be.Client.Get(ctx, "faregate:quota:{2026-08-31}:ip:aa").Int(); v != 2 {
				t.Fatalf("visitor counter = %d, want 2 (refusals must not count)", v)
			}
			if v, _ := be.Client.Get(ctx, "faregate:quota:{2026-08-31}:global").Int(); v != 3 {
				t.Fatalf("global counter = %d, want 3", v)
			}

			// Day rollover: a new UTC day starts from zero, in new keys.
			clk.Set(time.Date(2026, 9, 1, 0, 0, 1, 0, time.UTC))
			d, err := q.Take(ctx, "aa")
			if err != nil || !d.Allowed() || d.VisitorRemaining != 1 || d.GlobalRemaining != 2 {
				t.Fatalf("after rollover: %+v %v", d, err)
			}
			if n, _ := be.Client.Exists(ctx, "faregate:quota:{2026-09-01}:ip:aa").Result(); n != 1 {
				t.Fatal("new day's key missing")
			}
		})
	}
}

func TestCheckDoesNotCount(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			clk := &clock{t: time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)}
			q := quota.New(be.Client, quota.Limits{Visitor: 1, Global: 10}, clk.Now)
			for i := 0; i < 3; i++ {
				d, err := q.Check(ctx, "v")
				if err != nil || !d.Allowed() || d.VisitorRemaining != 1 {
					t.Fatalf("check %d: %+v %v", i, d, err)
				}
			}
			if _, err := q.Take(ctx, "v"); err != nil {
				t.Fatal(err)
			}
			d, err := q.Check(ctx, "v")
			if err != nil || d.Err != quota.ErrVisitorLimit {
				t.Fatalf("check after take: %+v %v", d, err)
			}
		})
	}
}

func TestRedisDownIsUnavailableButDenialsRemembered(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	q := quota.New(c, quota.Limits{Visitor: 1, Global: 10}, nil)
	if d, err := q.Take(ctx, "used"); err != nil || !d.Allowed() {
		t.Fatalf("take: %+v %v", d, err)
	}
	srv.Stop()
	if _, err := q.Take(ctx, "fresh"); !errors.Is(err, quota.ErrUnavailable) {
		t.Fatalf("fresh visitor with Redis down: %v, want ErrUnavailable", err)
	}
	if _, err := q.Check(ctx, "fresh"); !errors.Is(err, quota.ErrUnavailable) {
		t.Fatalf("check with Redis down: %v, want ErrUnavailable", err)
	}
	// The visitor that used its last task is refused from memory, Redis or not.
	d, err := q.Take(ctx, "used")
	if err != nil || d.Err != quota.ErrVisitorLimit {
		t.Fatalf("known visitor with Redis down: %+v %v", d, err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	if d, err := q.Take(ctx, "fresh"); err != nil || !d.Allowed() {
		t.Fatalf("after restart: %+v %v", d, err)
	}
}

func TestUntilReset(t *testing.T) {
	cases := []struct {
		now  time.Time
		want time.Duration
	}{
		{time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), 24 * time.Hour},
		{time.Date(2026, 1, 1, 23, 59, 59, 500e6, time.UTC), time.Second},
		{time.Date(2026, 1, 1, 18, 48, 0, 0, time.UTC), 5*time.Hour + 12*time.Minute},
		{time.Date(2026, 1, 1, 1, 0, 0, 0, time.FixedZone("x", 2*3600)), time.Hour}, // 23:00 UTC the day before
	}
	for _, c := range cases {
		if got := quota.UntilReset(c.now); got != c.want {
			t.Errorf("UntilReset(%v) = %v, want %v", c.now, got, c.want)
		}
	}
}
