package taskkey

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// running stores a task, queues it and takes its lease for owner, as a
// runner would: the key's fence is that lease.
func running(t *testing.T, rdb redis.UniversalClient, owner string) (task.Record, taskstore.Lease) {
	t.Helper()
	ctx := context.Background()
	s := taskstore.New(rdb)
	now := time.Now().UTC()
	rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
		Steps: []task.Step{}, Warnings: []string{}}, Principal: "v_abc", Tier: "public", Day: now.Format("2006-01-02")}
	if err := s.Create(ctx, rec); err != nil {
		t.Fatal(err)
	}
	l, _, err := s.Acquire(ctx, taskstore.Entry{ID: "1-1", Task: rec.ID}, owner)
	if err != nil {
		t.Fatal(err)
	}
	return rec, l
}

// replicas are two Keys on two clients of one real redis-server: two
// processes' views, sharing nothing but Redis.
func replicas(t *testing.T, o Options) (a, b *Keys, rdb *redis.Client) {
	t.Helper()
	redistest.Require(t)
	srv := redistest.Start(t)
	return New(srv.Client(t), o), New(srv.Client(t), o), srv.Client(t)
}

// within polls cond until it holds or d passes, and says how long it took.
func within(d time.Duration, cond func() bool) (time.Duration, bool) {
	start := time.Now()
	ok := clocktest.Poll(d, cond)
	return time.Since(start), ok
}

// TestKeyScope: a minted key works on both replicas for its own task; a
// forged, malformed or other-task key never does; a refusal is one error.
func TestKeyScope(t *testing.T) {
	a, b, rdb := replicas(t, Options{})
	ctx := context.Background()
	rec, l := running(t, rdb, "replica-a")
	deadline := time.Now().Add(time.Minute).Truncate(time.Millisecond)
	key, err := a.Mint(ctx, l, rec, deadline)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(key, Prefix) || len(key) < len(Prefix)+32+1+26 {
		t.Fatalf("key %q: want fgt_ + task + 130 random bits", key)
	}
	if raw, _ := rdb.HGetAll(ctx, keyKey(rec.ID)).Result(); strings.Contains(strings.Join(mapValues(raw), " "), key) {
		t.Fatal("the key itself is stored in Redis; only its SHA-256 may be")
	}
	for _, k := range []*Keys{a, b} {
		g, err := k.Authenticate(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if g.Task != rec.ID || g.Principal != "v_abc" || g.Tier != "public" || g.Owner != "replica-a" || g.Epoch != l.Epoch || !g.Deadline.Equal(deadline) {
			t.Fatalf("grant %+v", g)
		}
	}
	other, ol := running(t, rdb, "replica-a")
	otherKey, err := a.Mint(ctx, ol, other, deadline)
	if err != nil {
		t.Fatal(err)
	}
	// The key with its last character changed (to one it is not: a
	// random key ends in "A" one time in 32).
	last := "A"
	if strings.HasSuffix(key, last) {
		last = "B"
	}
	forged := []string{
		"", "fgt_", "fg_abc", key + "x", key[:len(key)-1] + last,
		// Another task's random part under this task's id, and the reverse.
		Prefix + strings.TrimPrefix(rec.ID, "t_") + otherKey[len(Prefix)+32:],
		Prefix + strings.TrimPrefix(other.ID, "t_") + key[len(Prefix)+32:],
		Prefix + strings.TrimPrefix(task.NewID(), "t_") + "_" + strings.Repeat("A", 26),
	}
	for _, f := range forged {
		for _, k := range []*Keys{a, b} {
			if _, err := k.Authenticate(ctx, f); !errors.Is(err, ErrInvalid) {
				t.Fatalf("forged %q: %v, want ErrInvalid", f, err)
			}
		}
	}
	// A mint by a replica that no longer holds the lease writes nothing.
	stale := l
	stale.Epoch--
	if _, err := a.Mint(ctx, stale, rec, deadline); !errors.Is(err, taskstore.ErrLeaseLost) {
		t.Fatalf("mint under a stale lease: %v", err)
	}
}

func mapValues(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// TestKeyEndsOnEveryReplica: when the task ends on replica a (its key
// revoked), replica b refuses the key and cuts the requests it has open
// within 1 s; likewise when the lease is lost (the reaper took it) and
// when the deadline passes.
func TestKeyEndsOnEveryReplica(t *testing.T) {
	a, b, rdb := replicas(t, Options{})
	ctx := context.Background()
	cases := []struct {
		name string
		end  func(rec task.Record)
		life time.Duration
	}{
		{"revoked", func(rec task.Record) {
			if err := a.Revoke(ctx, rec.ID); err != nil {
				t.Fatal(err)
			}
		}, time.Minute},
		{"lease lost", func(rec task.Record) {
			if _, _, err := taskstore.New(rdb).Acquire(ctx, taskstore.Entry{ID: "1-1", Task: rec.ID}, "replica-b"); err != nil {
				t.Fatal(err)
			}
		}, time.Minute},
		{"deadline", func(task.Record) {}, 1500 * time.Millisecond},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			rec, l := running(t, rdb, "replica-a")
			key, err := a.Mint(ctx, l, rec, time.Now().Add(tc.life))
			if err != nil {
				t.Fatal(err)
			}
			g, err := b.Authenticate(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			open, done := b.Watch(ctx, g)
			defer done()
			// Warm b's cache right before the end: the refusal must still
			// come within 1 s.
			if _, err := b.Authenticate(ctx, key); err != nil {
				t.Fatal(err)
			}
			endAt := time.Now()
			tc.end(rec)
			if tc.name == "deadline" {
				endAt = g.Deadline
			}
			wait := time.Until(endAt.Add(time.Second))
			if _, ok := within(wait, func() bool { return open.Err() != nil }); !ok {
				t.Fatalf("the open request on the other replica still runs 1 s after the task ended")
			}
			// Why it ended is the answer the request gets: 409
			// task_finished for an ended task, the deadline's own error.
			want := ErrFinished
			if tc.name == "deadline" {
				want = context.DeadlineExceeded
			}
			if why := context.Cause(open); !errors.Is(why, want) {
				t.Fatalf("the request ended because %v, want %v", why, want)
			}
			// The key is answered "your task is over" (409), not "no such
			// key" (401), on both replicas, for every use.
			if _, ok := within(time.Until(endAt.Add(time.Second)), func() bool {
				_, err := b.Authenticate(ctx, key)
				return errors.Is(err, ErrFinished)
			}); !ok {
				t.Fatalf("the other replica does not answer ErrFinished 1 s after the task ended")
			}
			if _, err := a.Authenticate(ctx, key); !errors.Is(err, ErrFinished) {
				t.Fatalf("the ending replica: %v, want ErrFinished", err)
			}
			if err := b.Result(ctx, g, []byte(`{"result":{"text":"late"}}`)); !errors.Is(err, ErrFinished) {
				t.Fatalf("a result after the end: %v, want ErrFinished", err)
			}
			if err := b.Event(ctx, g, []byte(`{"name":"late","status":"ok"}`)); !errors.Is(err, ErrFinished) {
				t.Fatalf("an event after the end: %v, want ErrFinished", err)
			}
			// A forged key of the same task is still no key at all.
			forged := key[:len(key)-2] + "AA"
			if forged == key {
				forged = key[:len(key)-2] + "BB"
			}
			if _, err := b.Authenticate(ctx, forged); !errors.Is(err, ErrInvalid) {
				t.Fatalf("a forged key of the ended task: %v, want ErrInvalid", err)
			}
			// And so it stays for the day.
			if ttl := rdb.PTTL(ctx, keyKey(rec.ID)).Val(); ttl < 23*time.Hour {
				t.Fatalf("the ended key is kept %v, want a day", ttl)
			}
			msgs, err := a.Read(ctx, nil, rec.ID, "0", 0)
			if err != nil || len(msgs) != 0 {
				t.Fatalf("inbox after refused writes: %v %v", msgs, err)
			}
			t.Logf("%s: refused on the other replica %v after the end", tc.name, time.Since(endAt).Round(time.Millisecond))
		})
	}
}

// TestKeyWrites: events from every replica reach the inbox in order; a
// result is taken once. (How many events a task may post is counted by
// agent/tasklimits.)
func TestKeyWrites(t *testing.T) {
	a, b, rdb := replicas(t, Options{})
	ctx := context.Background()
	rec, l := running(t, rdb, "replica-a")
	deadline := time.Now().Add(time.Minute)
	key, err := a.Mint(ctx, l, rec, deadline)
	if err != nil {
		t.Fatal(err)
	}
	ga, _ := a.Authenticate(ctx, key)
	gb, _ := b.Authenticate(ctx, key)
	for i, k := range []*Keys{a, b, a} {
		g := ga
		if k == b {
			g = gb
		}
		if err := k.Event(ctx, g, []byte{'0' + byte(i)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := b.Step(ctx, gb, []byte("s")); err != nil {
		t.Fatal(err)
	}
	if err := b.Result(ctx, gb, []byte("r")); err != nil {
		t.Fatal(err)
	}
	if err := a.Result(ctx, ga, []byte("again")); !errors.Is(err, ErrFinished) {
		t.Fatalf("second result: %v, want ErrFinished", err)
	}
	msgs, err := a.Read(ctx, nil, rec.ID, "0", 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range msgs {
		got = append(got, m.Type+":"+string(m.Data))
	}
	if strings.Join(got, " ") != "event:0 event:1 event:2 step:s result:r" {
		t.Fatalf("inbox %v", got)
	}
	// A blocking read from the last entry wakes when one arrives.
	last := msgs[len(msgs)-1].ID
	woke := make(chan []Message, 1)
	go func() {
		m, _ := a.Read(ctx, nil, rec.ID, last, 5*time.Second)
		woke <- m
	}()
	if err := b.Step(ctx, gb, []byte("late")); err != nil {
		t.Fatal(err)
	}
	select {
	case m := <-woke:
		if len(m) != 1 || string(m[0].Data) != "late" {
			t.Fatalf("woke with %+v", m)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the blocked reader did not wake")
	}
}

// checkCount counts a client's single commands (Authenticate's checks)
// and its pipelines (the watch loop's).
type checkCount struct {
	mu               sync.Mutex
	single, pipeline int
}

func (h *checkCount) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *checkCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.mu.Lock()
		h.single++
		h.mu.Unlock()
		return next(ctx, cmd)
	}
}
func (h *checkCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.mu.Lock()
		h.pipeline++
		h.mu.Unlock()
		return err
	}
}

func (h *checkCount) counts() (single, pipeline int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.single, h.pipeline
}

// TestKeyWatchKeepsCheckCached: while a task has a request open on a
// replica, the watch loop's checks keep the key's cached answer fresh, so
// the task's next call is not checked again on its critical path; the
// answer is still never older than CacheFor (once nothing is watched, a
// check past CacheFor goes to Redis).
func TestKeyWatchKeepsCheckCached(t *testing.T) {
	redistest.Require(t)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	clock := clocktest.New(time.Now())
	o := Options{CacheFor: 200 * time.Millisecond, WatchEvery: 20 * time.Millisecond, Now: clock.Now}
	k := New(rdb, o)
	ctx := context.Background()
	rec, l := running(t, srv.Client(t), "replica-a")
	key, err := k.Mint(ctx, l, rec, time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	h := &checkCount{}
	rdb.AddHook(h)
	g, err := k.Authenticate(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	_, done := k.Watch(ctx, g)
	clock.Advance(2 * o.CacheFor) // past the first check's cache
	_, p0 := h.counts()
	// Two pipelines finished after the advance: the first's answer is in
	// the cache by the time the second has run.
	clocktest.Eventually(t, 5*time.Second, "the watch loop to check the key twice", func() bool {
		_, p := h.counts()
		return p >= p0+2
	})
	s0, _ := h.counts()
	if _, err := k.Authenticate(ctx, key); err != nil {
		t.Fatal(err)
	}
	if s, _ := h.counts(); s != s0 {
		t.Fatalf("a watched key was checked again on the call's path (%d commands)", s-s0)
	}
	done()
	clock.Advance(2 * o.CacheFor)
	if _, err := k.Authenticate(ctx, key); err != nil {
		t.Fatal(err)
	}
	if s, _ := h.counts(); s != s0+1 {
		t.Fatalf("an unwatched key past CacheFor: %d commands; want 1 check", s-s0)
	}
}

// watched is an open request of a running task's key on k, watched until
// the test ends, and the task.
func watched(t *testing.T, k *Keys, srv *redistest.Server) (context.Context, task.Record) {
	t.Helper()
	ctx := context.Background()
	rec, l := running(t, srv.Client(t), "replica-a")
	key, err := k.Mint(ctx, l, rec, time.Now().Add(time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	g, err := k.Authenticate(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	open, done := k.Watch(ctx, g)
	t.Cleanup(done)
	return open, rec
}

// failingPipelines fails every pipeline once on is set: a Redis that no
// longer answers the watch loop's checks.
type failingPipelines struct{ on atomic.Bool }

func (h *failingPipelines) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *failingPipelines) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *failingPipelines) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.on.Load() {
			for _, c := range cmds {
				c.SetErr(context.DeadlineExceeded)
			}
			return context.DeadlineExceeded
		}
		return next(ctx, cmds)
	}
}

// TestKeyWatchUncheckedFailsClosed: a key whose checks fail for a second
// ends its open requests (fail closed) with ErrUnavailable as the cause,
// so they are answered 503 demo_protection_unavailable, not 409
// task_finished: the task has not finished.
func TestKeyWatchUncheckedFailsClosed(t *testing.T) {
	redistest.Require(t)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	fail := &failingPipelines{}
	rdb.AddHook(fail)
	k := New(rdb, Options{WatchEvery: 20 * time.Millisecond})
	open, _ := watched(t, k, srv)
	fail.on.Store(true)
	if _, ok := within(10*time.Second, func() bool { return open.Err() != nil }); !ok {
		t.Fatal("a request whose key cannot be checked still runs")
	}
	if why := context.Cause(open); !errors.Is(why, ErrUnavailable) {
		t.Fatalf("the request ended because %v, want ErrUnavailable", why)
	}
}

// slowPipelines delays every pipeline by delay once on is set and counts
// the delayed ones: a Redis that still answers, slowly (a saturated
// machine, a race-detector build).
type slowPipelines struct {
	on    atomic.Bool
	delay time.Duration
	slow  atomic.Int64
}

func (h *slowPipelines) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (h *slowPipelines) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (h *slowPipelines) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if h.on.Load() {
			select {
			case <-time.After(h.delay):
			case <-ctx.Done():
				return ctx.Err()
			}
			err := next(ctx, cmds)
			h.slow.Add(1)
			return err
		}
		return next(ctx, cmds)
	}
}

// TestKeyWatchSlowRedisIsNotAFailure: checks that answer later than two
// rounds (they once timed out at 2 × WatchEvery whatever the configured
// Redis timeout, and cut every open stream of the exactness soak under
// -race) keep the request open for well past a second, and a task that
// ends is still cut, with ErrFinished, through the same slow checks.
func TestKeyWatchSlowRedisIsNotAFailure(t *testing.T) {
	redistest.Require(t)
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	slow := &slowPipelines{delay: 150 * time.Millisecond}
	rdb.AddHook(slow)
	k := New(rdb, Options{WatchEvery: 20 * time.Millisecond, CheckTimeout: time.Minute})
	open, rec := watched(t, k, srv)
	ctx := context.Background()
	slow.on.Store(true)
	// 12 slow rounds: 1.8 s of checks each 7.5 × WatchEvery late.
	if _, ok := within(time.Minute, func() bool { return slow.slow.Load() >= 12 || open.Err() != nil }); !ok {
		t.Fatal("the slow checks did not run")
	}
	if open.Err() != nil {
		t.Fatalf("a slow but answering Redis ended the request (%v) after %d checks", context.Cause(open), slow.slow.Load())
	}
	// The task ends on another replica: its own Keys revoke the key.
	other := New(srv.Client(t), Options{})
	if err := other.Revoke(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	if _, ok := within(time.Minute, func() bool { return open.Err() != nil }); !ok {
		t.Fatal("a request of an ended task still runs")
	}
	if why := context.Cause(open); !errors.Is(why, ErrFinished) {
		t.Fatalf("the request ended because %v, want ErrFinished", why)
	}
}
