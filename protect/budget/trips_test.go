package budget

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// trips counts a client's scripts and its sequential round trips: a
// command's round is one more than the highest round of the commands that
// had finished when it started, so commands sent at once share a round.
// Each is held for hold after its reply, which makes "at once" independent
// of how fast a busy machine schedules goroutines. gate, when set, is
// waited on before a script goes.
type trips struct {
	hold time.Duration
	gate func(cmd redis.Cmder)

	mu       sync.Mutex
	finished int
	highest  int
	base     int
	scripts  []string // each script's slot (its first key's hash tag)
}

func (h *trips) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *trips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		name := cmd.Name()
		script := name == "evalsha" || name == "eval"
		if script && h.gate != nil {
			h.gate(cmd)
		}
		h.mu.Lock()
		round := h.finished + 1
		h.highest = max(h.highest, round)
		if script {
			h.scripts = append(h.scripts, tagOf(cmd))
		}
		h.mu.Unlock()
		err := next(ctx, cmd)
		if h.hold > 0 {
			clocktest.Pass(h.hold) // widens "at once"; the counts do not depend on it
		}
		h.mu.Lock()
		h.finished = max(h.finished, round)
		h.mu.Unlock()
		return err
	}
}

func (h *trips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// tagOf is the hash tag of a script's first key.
func tagOf(cmd redis.Cmder) string {
	args := cmd.Args()
	if len(args) < 4 {
		return ""
	}
	k, _ := args[3].(string)
	i, j := strings.IndexByte(k, '{'), strings.IndexByte(k, '}')
	if i < 0 || j < i {
		return k
	}
	return k[i+1 : j]
}

// mark is the rounds and scripts since the last mark; every earlier
// command has finished when it is called.
func (h *trips) mark() (rounds int, scripts []string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	rounds, scripts = h.highest-h.base, h.scripts
	h.base, h.scripts = h.highest, nil
	return rounds, scripts
}

// leaseOps counts the lease operations replica b has sent.
func leaseOps(b *Budget) int64 {
	m := b.leases
	m.mu.Lock()
	defer m.mu.Unlock()
	var n int64
	for _, dl := range m.days {
		n += dl.seq
	}
	for _, dl := range m.retired {
		n += dl.seq
	}
	return n
}

// TestRoundTripsPerCall counts the round trips and scripts of each call's
// reserve and settle, on a single redis-server and on the 3-master
// cluster, while a site budget of 40 reservations (80 calls settled at half their hold) runs out with a second replica
// holding a lease: every way a call can go, each seen at least once.
//
//   - fast path (the day scopes in the replica's block): one script in the
//     principal's slot, one round trip, for the reserve and for the settle;
//   - a block short of the call: the lease operation goes with the
//     principal's reservation, in the same round trip (2 scripts on a
//     cluster, one per slot; 1 on a single server, where a slot's
//     operations and the day's share one script);
//   - the scope turning per call in that lease operation: the call is
//     reserved per call in it, still one round trip;
//   - per call: the day's part goes with the principal's, one round trip,
//     and so does its settle; on a cluster, within tightCalls reservations
//     of a day scope's limit, the day's part follows the principal's once
//     granted (afterPrincipal), 2 round trips.
//
// Never more than 2 round trips, nor more than one script per slot.
func TestRoundTripsPerCall(t *testing.T) {
	targets := []struct {
		name string
		rdb  func(t *testing.T) redis.UniversalClient
	}{
		{"redis", func(t *testing.T) redis.UniversalClient {
			be := redistest.Real(t)
			if err := be.Client.FlushDB(context.Background()).Err(); err != nil {
				t.Fatal(err)
			}
			return be.Client
		}},
		{"cluster", func(t *testing.T) redis.UniversalClient {
			redistest.WantCluster(t, false)
			return redistest.SharedCluster(t).Client(t)
		}},
	}
	for _, tg := range targets {
		t.Run(tg.name, func(t *testing.T) {
			rdb := tg.rdb(t)
			_, cluster := rdb.(*redis.ClusterClient)
			ctx := context.Background()
			clk := clocktest.New(start)
			const hold = 200
			b := New(rdb, Options{Limits: Limits{Site: 40 * hold, Principal: 1 << 40, Task: 1 << 40}, Now: clk.Now,
				Lease: LeaseOptions{Calls: 4, Idle: time.Hour}})
			t.Cleanup(func() { _ = b.Close(ctx) })
			if _, err := b.layoutOf(ctx, day); err != nil { // once a day per replica, not per call
				t.Fatal(err)
			}
			// A second replica holds a lease: near the limit, headroom for
			// both replicas' largest calls is kept, and the scope goes per
			// call before it runs out.
			other := New(rdb, Options{Limits: b.Limits(), Now: clk.Now, Lease: LeaseOptions{Calls: 1, Idle: time.Hour}})
			t.Cleanup(func() { _ = other.Close(ctx) })
			if _, err := other.Reserve(ctx, tok(visB, "t_other", hold)); err != nil {
				t.Fatal(err)
			}
			h := &trips{hold: 20 * time.Millisecond}
			rdb.AddHook(h)
			both := 1 // the principal's slot and the day's
			if cluster {
				both = 2
			}
			seen := map[string]int{}
			for n := 0; ; n++ {
				h.mark()
				ops := leaseOps(b)
				r, err := b.Reserve(ctx, tok(visA, fmt.Sprintf("t_%d", n), hold))
				if errors.Is(err, ErrExhausted) {
					break
				}
				if err != nil || n > 100 {
					t.Fatalf("call %d: %v", n, err)
				}
				rr, rs := h.mark()
				leaseOp := leaseOps(b) > ops
				if _, err := b.Settle(ctx, r, hold/2, 0); err != nil { // half back: the limit is reached slowly
					t.Fatal(err)
				}
				sr, ss := h.mark()
				var way string
				wantTrips, wantScripts, settleScripts := 1, both, 1
				switch {
				case r.how == heldLease && !leaseOp:
					way, wantScripts = "fast path", 1
				case r.how == heldLease:
					way = "lease operation"
				case leaseOp:
					way, settleScripts = "turned per call in its lease operation", both
				case cluster && rr == 2:
					way, wantTrips, settleScripts = "per call near the limit", 2, both
				default:
					way, settleScripts = "per call", both
				}
				seen[way]++
				t.Logf("call %d, %s: reserve %d round trip(s), scripts %v; settle %d, scripts %v", n, way, rr, rs, sr, ss)
				if rr != wantTrips || len(rs) != wantScripts || sr != 1 || len(ss) != settleScripts {
					t.Fatalf("call %d, %s: reserve %d round trips, %d scripts; settle %d, %d; want %d, %d and 1, %d",
						n, way, rr, len(rs), sr, len(ss), wantTrips, wantScripts, settleScripts)
				}
			}
			ways := []string{"fast path", "lease operation", "turned per call in its lease operation", "per call"}
			if cluster {
				// Per call is near the limit here (leases are on): always so.
				ways[3] = "per call near the limit"
			}
			for _, way := range ways {
				if seen[way] == 0 {
					t.Errorf("no call went %s (%v)", way, seen)
				}
			}
		})
	}
}

// TestGroupCommit: the operations of concurrent calls to one slot that
// gather while a script of the replica's is on its way go together in the
// next script: 40 reserves in 2 scripts, each answered on its own.
func TestGroupCommit(t *testing.T) {
	be := redistest.Real(t)
	rdb := be.Client
	f := newFixture(t, rdb, Limits{})
	// The lease lives an hour: no renewal nor idle give-back of the
	// background loop may send a script of its own while the test counts
	// (on a busy machine the default's 10 s renewal once did, took the
	// gate, and the count of 39 was never seen).
	b := New(rdb, Options{Limits: Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}, Now: f.clk.Now,
		Lease: LeaseOptions{Calls: 1000, TTL: time.Hour, Idle: time.Hour}})
	t.Cleanup(func() { _ = b.Close(f.ctx) })
	// A first call decides the day's layout and leases a block.
	if _, err := b.Reserve(f.ctx, tok(visA, "t_first", 10)); err != nil {
		t.Fatal(err)
	}
	const calls = 40
	release, gated := make(chan struct{}), make(chan struct{})
	var once, opened sync.Once
	open := func() { opened.Do(func() { close(release) }) }
	// Registered after Close, so it runs first: a test that fails while
	// the gate is shut must not leave the script, and Close, waiting.
	t.Cleanup(open)
	h := &trips{gate: func(redis.Cmder) {
		// The first script waits until the other 39 are queued behind it.
		once.Do(func() { close(gated); <-release })
	}}
	rdb.AddHook(h)
	h.mark()
	var wg sync.WaitGroup
	errs := make(chan error, calls)
	reserve := func(i int) {
		wg.Go(func() {
			_, err := b.Reserve(f.ctx, tok(visA, fmt.Sprintf("t_%d", i), 10))
			errs <- err
		})
	}
	// The first reserve alone reaches the gate before the others start:
	// started together, a committer slow to be scheduled (a busy machine,
	// -race) finds all 40 pending and sends them in one script.
	reserve(0)
	select {
	case <-gated:
	case <-time.After(time.Minute):
		t.Fatal("the first reserve's script never reached Redis")
	}
	for i := 1; i < calls; i++ {
		reserve(i)
	}
	b.commitMu.Lock()
	c := b.committers[""]
	b.commitMu.Unlock()
	clocktest.Eventually(t, time.Minute, "39 reserves queued behind the first", func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return len(c.pending) == calls-1
	})
	open()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, scripts := h.mark(); len(scripts) != 2 {
		t.Fatalf("%d reserves went in %d scripts; want 2", calls, len(scripts))
	}
	u, err := b.Usage(f.ctx, UsageQuery{Day: day, Principal: visA})
	if err != nil || u.Principal.Outstanding != 10*(calls+1) || u.Reservations != calls+1 {
		t.Fatalf("principal %+v, %d open, %v; want each reserve held once", u.Principal, u.Reservations, err)
	}
}

// keySlot is the Redis Cluster slot of a hash tag (CRC16-XMODEM mod
// 16384).
func keySlot(tag string) int {
	var crc uint16
	for i := 0; i < len(tag); i++ {
		crc ^= uint16(tag[i]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

// TestClusterSpread: on the 3-master test cluster, 1,000 calls from 100
// visitors through two replicas with leases. Each master runs at least
// 20% of the per-call scripts (the principals' buckets spread over every
// master), and the slot of the day's scopes sees at most one script per
// 20 calls (one per lease operation, not per call).
func TestClusterSpread(t *testing.T) {
	redistest.WantCluster(t, false)
	cc := redistest.SharedCluster(t).Client(t)
	ctx := context.Background()
	if keySlot("123456789") != 12739 {
		t.Fatal("keySlot is not Redis Cluster's CRC16")
	}
	clk := clocktest.New(start)
	l := Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}
	var replicas []*Budget
	for range 2 {
		b := New(cc, Options{Limits: l, Now: clk.Now, Lease: LeaseOptions{Calls: DefaultLeaseCalls, Idle: time.Hour}})
		t.Cleanup(func() { _ = b.Close(ctx) })
		replicas = append(replicas, b)
	}
	h := &trips{}
	cc.AddHook(h)
	const calls, visitors, workers = 1000, 100, 20
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			for i := w; i < calls; i += workers {
				b := replicas[i%2]
				r, err := b.Reserve(ctx, Request{Day: day, Principal: fmt.Sprintf("v_visitor%03d", i%visitors),
					Task: fmt.Sprintf("t_%d", i), Model: "free", PromptTokens: 30, MaxTokens: 200})
				if err == nil {
					_, err = b.Settle(ctx, r, 30, 50)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	_, scripts := h.mark()
	shards, err := cc.ClusterShards(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	// The shard's master names it (a shard lists its master and replicas).
	master := func(slot int) string {
		for _, sh := range shards {
			for _, r := range sh.Slots {
				if slot < int(r.Start) || slot > int(r.End) {
					continue
				}
				for _, n := range sh.Nodes {
					if n.Role == "master" {
						return fmt.Sprintf("%s:%d", n.IP, n.Port)
					}
				}
			}
		}
		return ""
	}
	perMaster := map[string]int{}
	var perCall, daySlot int
	for _, tag := range scripts {
		if tag == day {
			daySlot++
			continue
		}
		perCall++
		perMaster[master(keySlot(tag))]++
	}
	t.Logf("%d calls: %d per-call scripts by master %v; %d in the day's slot", calls, perCall, perMaster, daySlot)
	if len(perMaster) != 3 {
		t.Fatalf("per-call scripts on %d masters; want all 3", len(perMaster))
	}
	for m, n := range perMaster {
		if n*5 < perCall {
			t.Errorf("master %s ran %d of %d per-call scripts; want at least 20%%", m, n, perCall)
		}
	}
	if daySlot*20 > calls {
		t.Errorf("the day's slot saw %d scripts for %d calls; want at most one per 20", daySlot, calls)
	}
}
