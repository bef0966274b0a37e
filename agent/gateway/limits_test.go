package gateway

import (
	"context"
	"errors"
	"net/http"
	"runtime"
	"sync"
	"testing"
	"time"

	"faregate/protect/redistest"
)

func limitTask(id string) Task {
	return Task{ID: id, Deadline: time.Now().Add(90 * time.Second), Models: []string{testModel}}
}

// The same limits on the embedded and a real Redis: calls per task,
// calls in flight, release, refund, and a dead process's slot lapsing.
func TestRedisLimits(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			l := &RedisLimits{Client: b.Client, MaxCalls: 3, MaxParallel: 2, Lease: 300 * time.Millisecond}
			task := limitTask("t_lim_" + b.Name)

			r1, err := l.Acquire(ctx, task)
			if err != nil {
				t.Fatal(err)
			}
			r2, err := l.Acquire(ctx, task)
			if err != nil {
				t.Fatal(err)
			}
			_, err = l.Acquire(ctx, task)
			if d, _ := retryAfterOf(err); !errors.Is(err, ErrTooManyCalls) || d != time.Second {
				t.Fatalf("third in flight: %v (retry %v)", err, d)
			}
			r1(ctx, false) // refused by the governor: not counted
			r1(ctx, false) // twice is once
			r3, err := l.Acquire(ctx, task)
			if err != nil {
				t.Fatalf("after a release: %v", err)
			}
			r2(ctx, true)
			r3(ctx, true)
			r4, err := l.Acquire(ctx, task)
			if err != nil {
				t.Fatalf("third call: %v", err)
			}
			r4(ctx, true)
			_, err = l.Acquire(ctx, task)
			if d, _ := retryAfterOf(err); !errors.Is(err, ErrStepLimit) || d < 80*time.Second {
				t.Fatalf("fourth call: %v (retry %v, want the task's deadline)", err, d)
			}
			if ttl := b.Client.PTTL(ctx, CallsKey(task.ID)).Val(); ttl <= 0 || ttl > 91*time.Second {
				t.Fatalf("calls key ttl %v", ttl)
			}

			// A process that dies holding slots: they lapse with their lease.
			other := limitTask("t_dead_" + b.Name)
			keys := []string{CallsKey(other.ID), InflightKey(other.ID)}
			for _, slot := range []string{"dead1", "dead2"} {
				if err := limitsAcquire.Run(ctx, b.Client, keys, 300, 0, 2, slot, 60000).Err(); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := l.Acquire(ctx, other); !errors.Is(err, ErrTooManyCalls) {
				t.Fatalf("while the dead slots live: %v", err)
			}
			if b.Mini != nil {
				b.Mini.SetTime(time.Now().Add(time.Second))
			}
			waitFor(t, "the dead slots to lapse", func() bool {
				r, err := l.Acquire(ctx, other)
				if err == nil {
					r(ctx, true)
				}
				return err == nil
			})
		})
	}
}

// A live call renews its lease: a stream longer than the lease keeps its
// slot.
func TestRedisLimitsRenewLiveSlot(t *testing.T) {
	redistest.Require(t)
	b := redistest.Real(t)
	ctx := context.Background()
	l := &RedisLimits{Client: b.Client, MaxParallel: 1, Lease: 300 * time.Millisecond}
	task := limitTask("t_renew")
	release, err := l.Acquire(ctx, task)
	if err != nil {
		t.Fatal(err)
	}
	defer release(ctx, true)
	// Sampled every 50 ms for a second (over three leases): a property
	// over time, not a wait for an event.
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for end := time.Now().Add(time.Second); time.Now().Before(end); <-tick.C {
		if _, err := l.Acquire(ctx, task); !errors.Is(err, ErrTooManyCalls) {
			t.Fatalf("the live slot lapsed: %v", err)
		}
	}
}

// A held slot costs no goroutine of its own: its renewals are timers, so
// 1,000 open streams do not hold 1,000 goroutine stacks for their leases
// (BenchmarkGovernedOpenStreams in cmd/faregate). Renewing still works:
// TestRedisLimitsRenewLiveSlot.
func TestRedisLimitsHeldSlotsHoldNoGoroutine(t *testing.T) {
	redistest.Require(t)
	b := redistest.Real(t)
	ctx := context.Background()
	l := &RedisLimits{Client: b.Client, Lease: 300 * time.Millisecond}
	task := limitTask("t_nogoroutine")
	warm, err := l.Acquire(ctx, task) // the client's connection, dialled once
	if err != nil {
		t.Fatal(err)
	}
	warm(ctx, true)
	const n = 50
	before := runtime.NumGoroutine()
	releases := make([]func(context.Context, bool), 0, n)
	for range n {
		release, err := l.Acquire(ctx, task)
		if err != nil {
			t.Fatal(err)
		}
		releases = append(releases, release)
	}
	grew := runtime.NumGoroutine() - before
	for _, release := range releases {
		release(ctx, true)
	}
	if grew >= n/2 {
		t.Fatalf("%d held slots started %d goroutines", n, grew)
	}
}

// Through the handler: parallel calls past the limit get 429
// too_many_calls with Retry-After 1; past the call limit 429 step_limit;
// embeddings count for neither; a Redis that fails refuses (fail closed).
func TestHandlerLimits(t *testing.T) {
	b := redistest.Mini(t)
	gate := make(chan struct{})
	var entered sync.WaitGroup
	up := newScripted(t, func(w http.ResponseWriter, r *http.Request, body map[string]any) {
		if body["model"] == testModel && body["input"] == nil {
			entered.Done()
			<-gate
		}
		okAnswer(w)
	})
	e := newEnv(t, up.upstream(), func(o *Options) {
		o.Limits = &RedisLimits{Client: b.Client, MaxCalls: 3, MaxParallel: 2}
	})
	e.task = limitTask("t_handler")
	body := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}]}`
	entered.Add(2)
	results := make(chan int, 2)
	for range 2 {
		go func() {
			r, _ := e.post(t, "/v1/chat/completions", body)
			results <- r.StatusCode
		}()
	}
	entered.Wait()
	r, b3 := e.post(t, "/v1/chat/completions", body)
	if code, typ, _ := errorOf(t, b3); r.StatusCode != 429 || code != "too_many_calls" || typ != "rate_limit_error" || r.Header.Get("Retry-After") != "1" {
		t.Fatalf("third in flight: %d %s %s", r.StatusCode, b3, r.Header.Get("Retry-After"))
	}
	if r, _ := e.post(t, "/v1/embeddings", `{"model":"text-embedding-3-small","input":"x"}`); r.StatusCode != 200 {
		t.Fatalf("embeddings are not limited: %d", r.StatusCode)
	}
	close(gate)
	for range 2 {
		if s := <-results; s != 200 {
			t.Fatalf("parallel call: %d", s)
		}
	}
	// A refusal by the governor gives the call back.
	e.gov.refuse = errBudget
	e.post(t, "/v1/chat/completions", body)
	e.gov.refuse = nil
	entered.Add(1)
	gate = make(chan struct{})
	close(gate)
	if r, b := e.post(t, "/v1/chat/completions", body); r.StatusCode != 200 {
		t.Fatalf("third call: %d %s", r.StatusCode, b)
	}
	r, b4 := e.post(t, "/v1/chat/completions", body)
	if code, typ, _ := errorOf(t, b4); r.StatusCode != 429 || code != "step_limit" || typ != "insufficient_quota" || r.Header.Get("X-Should-Retry") != "false" {
		t.Fatalf("fourth call: %d %s", r.StatusCode, b4)
	}
	b.Mini.SetError("LOADING")
	r, b5 := e.post(t, "/v1/chat/completions", body)
	if code, _, _ := errorOf(t, b5); r.StatusCode != 503 || code != "demo_protection_unavailable" {
		t.Fatalf("Redis down: %d %s", r.StatusCode, b5)
	}
}

func okAnswer(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write([]byte(`{"id":"x","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`))
}
