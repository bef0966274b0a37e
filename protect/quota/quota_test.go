package quota_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/quota"
)

// maker builds a Quota on a client the way a replica does: plain, or with
// its counting scripts on the client's shared pipeline (Pipelined).
type maker struct {
	name string
	make func(t testing.TB, c redis.UniversalClient, now func() time.Time) *quota.Quota
}

// makers are both ways; the tests that count run on each.
var makers = []maker{
	{"plain", func(_ testing.TB, c redis.UniversalClient, now func() time.Time) *quota.Quota {
		return quota.New(c, now)
	}},
	{"pipelined", func(t testing.TB, c redis.UniversalClient, now func() time.Time) *quota.Quota {
		ap, err := c.AsyncAutoPipeline()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ap.Close() })
		return quota.New(c, now).Pipelined(ap)
	}},
}

func visitor(v string) quota.Subject { return quota.Subject{Visitor: v, Limit: 2, Global: 3} }

// TestConformance runs the same expectations on miniredis and real Redis.
// Two Quota instances stand for two replicas: "fresh" has no denial memory,
// so its refusals come from Redis with exact remaining counts; "warm" has
// seen every answer, so it refuses from memory, reporting nothing left.
func TestConformance(t *testing.T) {
	for _, be := range redistest.Both(t) {
		for _, mk := range makers {
			t.Run(be.Name+"/"+mk.name, func(t *testing.T) { conformance(t, be, mk) })
		}
	}
}

func conformance(t *testing.T, be redistest.Backend, mk maker) {
	{
		{
			ctx := context.Background()
			// A fresh day's keys per maker: both share the backend.
			if err := be.Client.FlushDB(ctx).Err(); err != nil {
				t.Fatal(err)
			}
			clk := clocktest.New(time.Date(2026, 8, 31, 23, 59, 0, 0, time.UTC))
			warm := mk.make(t, be.Client, clk.Now)

			steps := []struct {
				name              string
				visitor           string
				fresh             bool // ask through a replica with no memory
				wantErr           error
				wantVis, wantGlob int64
			}{
				{"first", "aa", false, nil, 1, 2},
				{"second", "aa", false, nil, 0, 1},
				{"visitor over, from Redis", "aa", true, quota.ErrVisitorLimit, 0, 1},
				{"visitor over, from memory", "aa", false, quota.ErrVisitorLimit, 0, 0},
				{"other visitor", "bb", false, nil, 1, 0},
				{"site over, from Redis", "cc", true, quota.ErrGlobalLimit, 2, 0},
				{"site over, from memory", "cc", false, quota.ErrGlobalLimit, 0, 0},
				{"both over: visitor wins", "aa", true, quota.ErrVisitorLimit, 0, 0},
			}
			for _, st := range steps {
				q := warm
				if st.fresh {
					q = mk.make(t, be.Client, clk.Now)
				}
				d, err := q.Take(ctx, visitor(st.visitor))
				if !errors.Is(err, st.wantErr) || (st.wantErr == nil) != (err == nil) {
					t.Fatalf("%s: err %v, want %v", st.name, err, st.wantErr)
				}
				if d.Remaining != st.wantVis || d.GlobalRemaining != st.wantGlob {
					t.Fatalf("%s: remaining %d/%d, want %d/%d", st.name, d.Remaining, d.GlobalRemaining, st.wantVis, st.wantGlob)
				}
				if d.Reset != time.Date(2026, 9, 1, 0, 0, 0, 0, time.UTC) || d.Limit != 2 {
					t.Fatalf("%s: reset %v limit %d", st.name, d.Reset, d.Limit)
				}
				var le *quota.LimitError
				if st.wantErr != nil && (!errors.As(err, &le) || le.RetryAfter() != time.Minute) {
					t.Fatalf("%s: %v: want a LimitError retrying after 1m", st.name, err)
				}
			}

			// Key names and TTLs are the documented ones.
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

			// A raised limit (a policy reload) makes the memory stale.
			if d, err := warm.Take(ctx, quota.Subject{Visitor: "aa", Limit: 3, Global: 4}); err != nil || d.Remaining != 0 || d.GlobalRemaining != 0 {
				t.Fatalf("after raising both limits: %+v %v", d, err)
			}

			// Day rollover: a new UTC day starts from zero, in new keys.
			clk.Set(time.Date(2026, 9, 1, 0, 0, 1, 0, time.UTC))
			d, err := warm.Take(ctx, visitor("aa"))
			if err != nil || d.Remaining != 1 || d.GlobalRemaining != 2 {
				t.Fatalf("after rollover: %+v %v", d, err)
			}
			if n, _ := be.Client.Exists(ctx, "faregate:quota:{2026-09-01}:ip:aa").Result(); n != 1 {
				t.Fatal("new day's key missing")
			}
		}
	}
}

// TestKeys: an API key has its own daily counter and ignores the site's.
func TestKeys(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			clk := clocktest.New(time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC))
			q := quota.New(be.Client, clk.Now)
			// The site is full for visitors.
			if err := be.Client.Set(ctx, quota.GlobalKey("2026-08-31"), 100, 0).Err(); err != nil {
				t.Fatal(err)
			}
			key := quota.Subject{Key: "acme", Limit: 2}
			for i, want := range []int64{1, 0} {
				d, err := q.Take(ctx, key)
				if err != nil || d.Remaining != want {
					t.Fatalf("take %d: %+v %v", i, d, err)
				}
			}
			for _, qq := range []*quota.Quota{q, quota.New(be.Client, clk.Now)} {
				_, err := qq.Take(ctx, key)
				var le *quota.LimitError
				if !errors.Is(err, quota.ErrKeyLimit) || !errors.As(err, &le) || le.RetryAfter() != 12*time.Hour {
					t.Fatalf("third take: %v", err)
				}
				if _, err := qq.Check(ctx, key); !errors.Is(err, quota.ErrKeyLimit) {
					t.Fatalf("check: %v", err)
				}
			}
			if v, _ := be.Client.Get(ctx, quota.KeyKey("2026-08-31", "acme")).Int(); v != 2 {
				t.Fatalf("key counter = %d, want 2", v)
			}
			if _, err := q.Take(ctx, quota.Subject{Key: "other", Limit: 1}); err != nil {
				t.Fatalf("other key: %v", err)
			}
		})
	}
}

func TestCheckDoesNotCount(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			clk := clocktest.New(time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC))
			q := quota.New(be.Client, clk.Now)
			s := quota.Subject{Visitor: "v", Limit: 1, Global: 10}
			for i := 0; i < 3; i++ {
				d, err := q.Check(ctx, s)
				if err != nil || d.Remaining != 1 || d.GlobalRemaining != 10 {
					t.Fatalf("check %d: %+v %v", i, d, err)
				}
			}
			if _, err := q.Take(ctx, s); err != nil {
				t.Fatal(err)
			}
			if _, err := quota.New(be.Client, clk.Now).Check(ctx, s); !errors.Is(err, quota.ErrVisitorLimit) {
				t.Fatalf("check after take: %v", err)
			}
		})
	}
}

func TestInvalidSubject(t *testing.T) {
	q := quota.New(redistest.Mini(t).Client, nil)
	for _, s := range []quota.Subject{{}, {Visitor: "v", Key: "k", Limit: 1, Global: 1}, {Visitor: "v", Limit: 0, Global: 1}, {Visitor: "v", Limit: 1}, {Key: "k"}} {
		if _, err := q.Take(context.Background(), s); !errors.Is(err, quota.ErrInvalid) {
			t.Errorf("Take(%+v) = %v, want ErrInvalid", s, err)
		}
	}
}

func TestRedisDownIsUnavailableButDenialsRemembered(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	q := quota.New(c, nil)
	s := func(v string) quota.Subject { return quota.Subject{Visitor: v, Limit: 1, Global: 10} }
	if _, err := q.Take(ctx, s("used")); err != nil {
		t.Fatalf("take: %v", err)
	}
	srv.Stop()
	if _, err := q.Take(ctx, s("fresh")); !errors.Is(err, quota.ErrUnavailable) {
		t.Fatalf("fresh visitor with Redis down: %v, want ErrUnavailable", err)
	}
	if _, err := q.Check(ctx, s("fresh")); !errors.Is(err, quota.ErrUnavailable) {
		t.Fatalf("check with Redis down: %v, want ErrUnavailable", err)
	}
	// The visitor that used its last task is refused from memory, Redis or not.
	if _, err := q.Take(ctx, s("used")); !errors.Is(err, quota.ErrVisitorLimit) {
		t.Fatalf("known visitor with Redis down: %v", err)
	}
	if err := srv.Start(); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Take(ctx, s("fresh")); err != nil {
		t.Fatalf("after restart: %v", err)
	}
}

// TestLostReplyCountsOnce: the reply to the counting script is lost after
// Redis applied it; the client times out and sends the script again. The
// attempt id makes the second run answer the first result, so the counters
// move by exactly one, on a single node and on a cluster (whose client
// re-sends on its own retry loop, whatever MaxRetries says).
func TestLostReplyCountsOnce(t *testing.T) {
	type target struct {
		name string
		rdb  func(t *testing.T, f *redistest.Faults) redis.UniversalClient
	}
	targets := []target{
		{"redis", func(t *testing.T, f *redistest.Faults) redis.UniversalClient {
			srv := redistest.Start(t)
			c := redis.NewClient(&redis.Options{Addr: srv.Addr(), Dialer: f.Dialer(nil), ReadTimeout: 300 * time.Millisecond, MaxRetries: 2})
			t.Cleanup(func() { _ = c.Close() })
			return c
		}},
		{"cluster", func(t *testing.T, f *redistest.Faults) redis.UniversalClient {
			cl := redistest.SharedCluster(t)
			opt, err := redis.ParseClusterURL(cl.URL)
			if err != nil {
				t.Fatal(err)
			}
			opt.Dialer, opt.ReadTimeout = f.Dialer(nil), 300*time.Millisecond
			opt.MaxRetries = -1 // the cluster client re-sends anyway
			c := redis.NewClusterClient(opt)
			t.Cleanup(func() { _ = c.Close() })
			return c
		}},
	}
	for _, tg := range targets {
		for _, mk := range makers {
			t.Run(tg.name+"/"+mk.name, func(t *testing.T) { lostReply(t, tg.rdb, mk) })
		}
	}
}

func lostReply(t *testing.T, mkClient func(t *testing.T, f *redistest.Faults) redis.UniversalClient, mk maker) {
	{
		{
			if !redistest.Available() {
				redistest.Require(t)
			}
			f := redistest.NewFaults()
			rdb := mkClient(t, f)
			ctx := context.Background()
			// The day is the test's own: cluster targets share one cluster.
			if err := rdb.Del(ctx, "faregate:quota:{2026-08-31}:ip:aa", "faregate:quota:{2026-08-31}:global").Err(); err != nil {
				t.Fatal(err)
			}
			clk := clocktest.New(time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC))
			q := mk.make(t, rdb, clk.Now)
			// Load the scripts first, so the lost reply is the EVALSHA's.
			if _, err := q.Check(ctx, visitor("warmup")); err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 2; i++ {
				f.LoseNextReply("faregate:quota:{2026-08-31}:ip:aa")
				d, err := q.Take(ctx, visitor("aa"))
				if err != nil {
					t.Fatalf("take %d after a lost reply: %v", i, err)
				}
				if d.Remaining != int64(1-i) {
					t.Fatalf("take %d: remaining %d, want %d", i, d.Remaining, 1-i)
				}
			}
			if f.Lost() != 2 {
				t.Fatalf("%d replies lost, want 2 (the fault did not fire)", f.Lost())
			}
			ip, _ := rdb.Get(ctx, "faregate:quota:{2026-08-31}:ip:aa").Int()
			g, _ := rdb.Get(ctx, "faregate:quota:{2026-08-31}:global").Int()
			if ip != 2 || g != 2 {
				t.Fatalf("counters visitor=%d global=%d after 2 admitted tasks, want 2 and 2", ip, g)
			}
		}
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

// countHook counts the counting scripts a client sends on its own and in
// pipelines.
type countHook struct {
	mu              sync.Mutex
	alone, piped    int
	pipelines       int
	largestPipeline int
}

func (h *countHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "evalsha" || cmd.Name() == "eval" {
			h.mu.Lock()
			h.alone++
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, c := range cmds {
			if c.Name() == "evalsha" {
				n++
			}
		}
		h.mu.Lock()
		h.piped += n
		h.pipelines++
		h.largestPipeline = max(h.largestPipeline, n)
		h.mu.Unlock()
		return next(ctx, cmds)
	}
}

// TestPipelinedSharesRoundTrips: concurrent admissions through Pipelined
// ride shared pipelines (none is sent on its own), and count exactly.
func TestPipelinedSharesRoundTrips(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			h := &countHook{}
			opt := *be.Client.Options()
			c := redis.NewClient(&opt)
			c.AddHook(h)
			t.Cleanup(func() { _ = c.Close() })
			ap, err := c.AsyncAutoPipeline()
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = ap.Close() })
			clk := clocktest.New(time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC))
			q := quota.New(c, clk.Now).Pipelined(ap)
			// Load the script first (the pipeline sends EVALSHA only).
			if _, err := quota.New(c, clk.Now).Check(ctx, visitor("warmup")); err != nil {
				t.Fatal(err)
			}
			if _, err := quota.New(c, clk.Now).Take(ctx, quota.Subject{Visitor: "warmup", Limit: 1, Global: 1000}); err != nil {
				t.Fatal(err)
			}
			h.mu.Lock()
			h.alone, h.piped, h.pipelines, h.largestPipeline = 0, 0, 0, 0
			h.mu.Unlock()
			// On a real server, writes are held for a moment, so the first
			// script is in flight while the others queue behind it: they
			// must then leave together. (A lone script may be sent on its
			// own: that is the pipeliner's choice, and costs nothing.)
			paused := be.Name != "miniredis"
			if paused {
				if err := c.Do(ctx, "CLIENT", "PAUSE", 3000, "WRITE").Err(); err != nil {
					t.Fatal(err)
				}
			}
			const n = 64
			var wg sync.WaitGroup
			errs := make(chan error, n)
			for i := 0; i < n; i++ {
				wg.Add(1)
				go func(i int) {
					defer wg.Done()
					_, err := q.Take(ctx, quota.Subject{Visitor: fmt.Sprintf("p%d", i), Limit: 1, Global: 1000})
					errs <- err
				}(i)
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.alone+h.piped != n {
				t.Fatalf("%d scripts sent alone, %d in pipelines; want %d sent once each", h.alone, h.piped, n)
			}
			if paused && h.largestPipeline < n/2 {
				t.Fatalf("largest pipeline carried %d scripts of %d queued behind a held one", h.largestPipeline, n)
			}
			if g, _ := c.Get(ctx, quota.GlobalKey("2026-08-31")).Int(); g != n+1 {
				t.Fatalf("global counter %d, want %d", g, n+1)
			}
			t.Logf("%d scripts in %d pipelines (largest %d)", h.piped, h.pipelines, h.largestPipeline)
		})
	}
}

// TestPipelinedHonoursDeadline: a script queued behind a Redis that does
// not answer (writes paused) fails closed when the caller's context ends,
// long before Redis answers again.
func TestPipelinedHonoursDeadline(t *testing.T) {
	srv := redistest.Start(t)
	c := srv.Client(t)
	ctx := context.Background()
	ap, err := c.AsyncAutoPipeline()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ap.Close() })
	q := quota.New(c, nil).Pipelined(ap)
	if _, err := q.Take(ctx, quota.Subject{Visitor: "before", Limit: 5, Global: 100}); err != nil {
		t.Fatal(err)
	}
	// Scripts write, so a write pause holds them for its whole length.
	const pause = 20 * time.Second
	admin := srv.Client(t)
	if err := admin.Do(ctx, "CLIENT", "PAUSE", pause.Milliseconds(), "WRITE").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = admin.Do(context.Background(), "CLIENT", "UNPAUSE").Err() })
	start := time.Now()
	tctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = q.Take(tctx, quota.Subject{Visitor: "during", Limit: 5, Global: 100})
	if !errors.Is(err, quota.ErrUnavailable) {
		t.Fatalf("take while Redis holds writes: %v, want ErrUnavailable", err)
	}
	// The bound is the pause, not the deadline: only a wait for Redis to
	// answer could take that long.
	if took := time.Since(start); took >= pause/2 {
		t.Fatalf("take returned after %v: it waited for Redis, not for its own deadline", took)
	}
}
