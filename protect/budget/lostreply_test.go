package budget

import (
	"bytes"
	"context"
	"net"
	"reflect"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"

	"faregate/protect/redistest"
)

// lossyProxy forwards loopback TCP connections to a Redis. When armed, it
// lets the next EVALSHA through to Redis but swallows its reply (and
// whatever else that connection would receive): the script is applied,
// the client times out and go-redis re-sends the same EVALSHA on another
// connection. That is the lost reply of issue #8, made on purpose.
type lossyProxy struct {
	ln     net.Listener
	target string

	armed     atomic.Bool
	evalshas  atomic.Int64 // EVALSHA commands forwarded
	swallowed chan []byte  // the first bytes of each swallowed reply
	wg        sync.WaitGroup
	mu        sync.Mutex
	conns     []net.Conn
}

func newLossyProxy(t *testing.T, target string) *lossyProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &lossyProxy{ln: ln, target: target, swallowed: make(chan []byte, 16)}
	p.wg.Go(p.serve)
	t.Cleanup(func() {
		_ = ln.Close()
		p.mu.Lock()
		for _, c := range p.conns {
			_ = c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p
}

func (p *lossyProxy) Addr() string { return p.ln.Addr().String() }

func (p *lossyProxy) serve() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		var mute atomic.Bool
		p.wg.Go(func() { p.upstream(client, server, &mute) })
		p.wg.Go(func() { p.downstream(server, client, &mute) })
	}
}

// upstream copies commands to Redis. A chunk carrying an EVALSHA while the
// proxy is armed mutes this connection's replies before it is forwarded,
// so the reply cannot slip through. go-redis waits for each reply before
// it writes the next command, so nothing earlier is muted by mistake.
func (p *lossyProxy) upstream(client, server net.Conn, mute *atomic.Bool) {
	defer server.Close()
	buf := make([]byte, 64<<10)
	for {
		n, err := client.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			if k := bytes.Count(bytes.ToLower(chunk), []byte("evalsha")); k > 0 {
				p.evalshas.Add(int64(k))
				if p.armed.CompareAndSwap(true, false) {
					mute.Store(true)
				}
			}
			if _, err := server.Write(chunk); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// downstream copies replies to the client unless the connection is muted.
func (p *lossyProxy) downstream(server, client net.Conn, mute *atomic.Bool) {
	defer client.Close()
	buf := make([]byte, 64<<10)
	reported := false
	for {
		n, err := server.Read(buf)
		if n > 0 {
			if mute.Load() {
				if !reported {
					p.swallowed <- bytes.Clone(buf[:n])
					reported = true
				}
			} else if _, err := client.Write(buf[:n]); err != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// lose arms the proxy, runs op, and checks that exactly one reply was
// swallowed, that it was the script's real answer (an array, not an error
// such as NOSCRIPT: the script was applied), and that the client re-sent it.
func (p *lossyProxy) lose(t *testing.T, op func() error) {
	t.Helper()
	before := p.evalshas.Load()
	p.armed.Store(true)
	if err := op(); err != nil {
		t.Fatalf("operation after a lost reply: %v", err)
	}
	if p.armed.Load() {
		t.Fatal("the operation sent no EVALSHA")
	}
	select {
	case b := <-p.swallowed:
		if len(b) == 0 || b[0] != '*' {
			t.Fatalf("swallowed reply %q is not a script result", b)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no reply was swallowed")
	}
	if sent := p.evalshas.Load() - before; sent != 2 {
		t.Fatalf("EVALSHA sent %d times; want the original and one re-send", sent)
	}
}

// TestLostReplyAppliedOnce: a reserve, settle or release whose reply is
// lost and that go-redis re-sends moves the counters exactly once. Real
// Redis only: the loss happens on a real TCP connection.
func TestLostReplyAppliedOnce(t *testing.T) {
	be := redistest.Real(t)
	opt, err := redis.ParseURL(be.URL)
	if err != nil {
		t.Fatal(err)
	}
	proxy := newLossyProxy(t, opt.Addr)
	opt.Addr = proxy.Addr()
	// A short read timeout makes the lost reply a quick timeout, which
	// go-redis retries (MaxRetries) on a fresh connection.
	opt.ReadTimeout = 250 * time.Millisecond
	opt.MaxRetries = 3
	opt.MinRetryBackoff, opt.MaxRetryBackoff = time.Millisecond, 10*time.Millisecond
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })

	f := newFixture(t, be.Client, Limits{SpendMicro: 1000000})
	b := New(rdb, Options{Limits: f.b.Limits(), Prices: testPrices, ReservationTTL: time.Minute, Now: f.clk.Now, Registerer: f.reg})
	ctx := context.Background()

	// Load every script first (EVALSHA → NOSCRIPT → EVAL), so the armed
	// EVALSHA below is the one that runs.
	warm, err := b.Reserve(ctx, Request{Day: "2026-01-01", Principal: keyA, Task: "t_warm", Model: "free", PromptTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Settle(ctx, warm, 1, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ReleaseTask(ctx, "2026-01-01", "t_warm"); err != nil {
		t.Fatal(err)
	}

	req := Request{Day: day, Principal: keyA, Tier: partner, TierLimit: 100000, Task: taskOne, Model: "dear", PromptTokens: 100, MaxTokens: 100}
	q := UsageQuery{Principal: keyA, Tier: partner, Task: taskOne}
	var r Reservation
	proxy.lose(t, func() (err error) { r, err = b.Reserve(ctx, req); return err })
	held := su{0, 200, 0}
	f.check(t, q, state{site: held, spend: su{0, 1250, 0}, tier: held, principal: held, task: held, n: 1})

	var s Settlement
	proxy.lose(t, func() (err error) { s, err = b.Settle(ctx, r, 100, 150); return err })
	want := Settlement{Tokens: 250, CostMicro: 1750, OverageTokens: 50, OverageCostMicro: 500}
	if !reflect.DeepEqual(s, want) {
		t.Fatalf("settle after a lost reply = %+v; want %+v", s, want)
	}
	done := su{250, 0, 50}
	f.check(t, q, state{site: done, spend: su{1750, 0, 500}, tier: done, principal: done, task: done})
	if v := testutil.ToFloat64(b.m.overageTokens.WithLabelValues(causeExcess)); v != 50 {
		t.Fatalf("overage metric = %v; want 50, counted once", v)
	}

	open := f.reserve(t, req)
	var released int64
	proxy.lose(t, func() (err error) { released, err = b.ReleaseTask(ctx, day, taskOne); return err })
	if released != 1 {
		t.Fatalf("ReleaseTask after a lost reply = %d; want the first answer, 1", released)
	}
	f.check(t, q, state{site: done, spend: su{1750, 0, 500}, tier: done, principal: done, task: done})

	// The late settle of the released hold, its reply lost too: charged once.
	proxy.lose(t, func() (err error) { s, err = b.Settle(ctx, open, 10, 10); return err })
	if !s.Late || s.Tokens != 20 || s.OverageTokens != 20 {
		t.Fatalf("late settle after a lost reply = %+v", s)
	}
	lateDone := su{270, 0, 70}
	f.check(t, q, state{site: lateDone, spend: su{1875, 0, 625}, tier: lateDone, principal: lateDone, task: lateDone})
}
