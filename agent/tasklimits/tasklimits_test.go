package tasklimits

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

func limitTask(id string) Task { return Task{ID: id, Deadline: time.Now().Add(90 * time.Second)} }

// retryAfter is the Retry-After a refusal carries.
func retryAfter(err error) time.Duration {
	var ra interface{ RetryAfter() time.Duration }
	if errors.As(err, &ra) {
		return ra.RetryAfter()
	}
	return 0
}

// The same limits on the embedded and a real Redis: calls per task,
// calls in flight, release, refund, and a dead process's slot lapsing.
func TestCallSlots(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(b.Client, Options{Limits: Limits{Calls: 3, Embeddings: -1, Parallel: 2, Tools: -1, Events: -1}, Lease: 300 * time.Millisecond})
			task := limitTask("t_lim_" + b.Name)

			r1, err := s.Acquire(ctx, task, Calls)
			if err != nil {
				t.Fatal(err)
			}
			r2, err := s.Acquire(ctx, task, Calls)
			if err != nil {
				t.Fatal(err)
			}
			_, err = s.Acquire(ctx, task, Calls)
			if !errors.Is(err, ErrTooManyCalls) || retryAfter(err) != time.Second {
				t.Fatalf("third in flight: %v (retry %v)", err, retryAfter(err))
			}
			r1(ctx, false) // refused by the governor: not counted
			r1(ctx, false) // twice is once
			r3, err := s.Acquire(ctx, task, Calls)
			if err != nil {
				t.Fatalf("after a release: %v", err)
			}
			r2(ctx, true)
			r3(ctx, true)
			r4, err := s.Acquire(ctx, task, Calls)
			if err != nil {
				t.Fatalf("third call: %v", err)
			}
			r4(ctx, true)
			_, err = s.Acquire(ctx, task, Calls)
			var le *LimitError
			if !errors.Is(err, ErrStepLimit) || !errors.As(err, &le) || le.Limit() != 3 || retryAfter(err) < 80*time.Second {
				t.Fatalf("fourth call: %v (retry %v, want the task's deadline)", err, retryAfter(err))
			}
			if ttl := b.Client.PTTL(ctx, LimitsKey(task.ID)).Val(); ttl <= 0 || ttl > 91*time.Second {
				t.Fatalf("limits key ttl %v", ttl)
			}
			if c, err := s.Read(ctx, task.ID); err != nil || c != (Counts{Calls: 3}) {
				t.Fatalf("read %+v %v", c, err)
			}

			// A process that dies holding slots: they lapse with their lease.
			other := limitTask("t_dead_" + b.Name)
			keys := []string{LimitsKey(other.ID), InflightKey(other.ID)}
			for _, slot := range []string{"dead1", "dead2"} {
				if err := acquireScript.Run(ctx, b.Client, keys, "calls", -1, 2, 300, slot, 60000).Err(); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := s.Acquire(ctx, other, Calls); !errors.Is(err, ErrTooManyCalls) {
				t.Fatalf("while the dead slots live: %v", err)
			}
			if b.Mini != nil {
				b.Mini.SetTime(time.Now().Add(time.Second))
			}
			clocktest.Eventually(t, 10*time.Second, "the dead slots to lapse", func() bool {
				r, err := s.Acquire(ctx, other, Calls)
				if err == nil {
					r(ctx, true)
				}
				return err == nil
			})
		})
	}
}

// Embedding calls have a count of their own and share the slots in
// flight with model calls; tools and events are counts alone, each
// refused with its own error; a limit of 0 allows none, a negative one
// any number.
func TestKinds(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(b.Client, Options{Limits: Limits{Calls: 5, Embeddings: 2, Parallel: 2, Tools: 1, Events: 0}})
			task := limitTask("t_kinds_" + b.Name)
			call, err := s.Acquire(ctx, task, Calls)
			if err != nil {
				t.Fatal(err)
			}
			emb, err := s.Acquire(ctx, task, Embeddings)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.Acquire(ctx, task, Embeddings); !errors.Is(err, ErrTooManyCalls) {
				t.Fatalf("an embedding past Parallel: %v", err)
			}
			if _, err := s.Acquire(ctx, task, Calls); !errors.Is(err, ErrTooManyCalls) {
				t.Fatalf("a call past Parallel: %v", err)
			}
			if c, _ := s.Read(ctx, task.ID); c.InFlight != 2 {
				t.Fatalf("in flight %+v", c)
			}
			call(ctx, true)
			emb(ctx, true)
			emb2, err := s.Acquire(ctx, task, Embeddings)
			if err != nil {
				t.Fatal(err)
			}
			emb2(ctx, true)
			_, err = s.Acquire(ctx, task, Embeddings)
			var le *LimitError
			if !errors.Is(err, ErrStepLimit) || !errors.As(err, &le) || le.Kind != Embeddings || le.Max != 2 {
				t.Fatalf("the third embedding: %v", err)
			}
			// The call count is its own.
			r, err := s.Acquire(ctx, task, Calls)
			if err != nil {
				t.Fatalf("a call after the embeddings ran out: %v", err)
			}
			r(ctx, true)

			if err := s.Take(ctx, task, Tools); err != nil {
				t.Fatal(err)
			}
			if err := s.Take(ctx, task, Tools); !errors.Is(err, ErrToolLimit) || !errors.As(err, &le) || le.Limit() != 1 {
				t.Fatalf("the second tool call: %v", err)
			}
			if err := s.Take(ctx, task, Events); !errors.Is(err, ErrEventLimit) {
				t.Fatalf("an event with a limit of 0: %v", err)
			}
			if c, err := s.Read(ctx, task.ID); err != nil || c != (Counts{Calls: 2, Embeddings: 2, Tools: 1}) {
				t.Fatalf("read %+v %v", c, err)
			}

			any := New(b.Client, Options{Limits: Limits{Calls: -1, Embeddings: -1, Parallel: -1, Tools: -1, Events: -1}})
			free := limitTask("t_free_" + b.Name)
			for range 50 {
				if err := any.Take(ctx, free, Events); err != nil {
					t.Fatal(err)
				}
				if _, err := any.Acquire(ctx, free, Embeddings); err != nil {
					t.Fatal(err)
				}
			}
		})
	}
}

// A Redis that fails refuses: fail closed.
func TestUnavailable(t *testing.T) {
	b := redistest.Mini(t)
	s := New(b.Client, Options{Limits: Limits{Calls: 5, Parallel: 2, Tools: 5, Events: 5, Embeddings: 5}})
	b.Mini.SetError("LOADING")
	ctx := context.Background()
	task := limitTask("t_down")
	if _, err := s.Acquire(ctx, task, Calls); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("acquire: %v", err)
	}
	if err := s.Take(ctx, task, Events); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("take: %v", err)
	}
	if _, err := s.Read(ctx, task.ID); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("read: %v", err)
	}
}

// A live call renews its lease: a stream longer than the lease keeps its
// slot.
func TestRenewLiveSlot(t *testing.T) {
	redistest.Require(t)
	b := redistest.Real(t)
	ctx := context.Background()
	s := New(b.Client, Options{Limits: Limits{Calls: -1, Parallel: 1}, Lease: 300 * time.Millisecond})
	task := limitTask("t_renew")
	release, err := s.Acquire(ctx, task, Calls)
	if err != nil {
		t.Fatal(err)
	}
	defer release(ctx, true)
	// Sampled every 50 ms for a second (over three leases): a property
	// over time, not a wait for an event.
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for end := time.Now().Add(time.Second); time.Now().Before(end); <-tick.C {
		if _, err := s.Acquire(ctx, task, Calls); !errors.Is(err, ErrTooManyCalls) {
			t.Fatalf("the live slot lapsed: %v", err)
		}
	}
}

// A held slot costs no goroutine of its own: its renewals are timers, so
// 1,000 open streams do not hold 1,000 goroutine stacks for their leases
// (BenchmarkGovernedOpenStreams in cmd/faregate). Renewing still works:
// TestRenewLiveSlot.
func TestHeldSlotsHoldNoGoroutine(t *testing.T) {
	redistest.Require(t)
	b := redistest.Real(t)
	ctx := context.Background()
	s := New(b.Client, Options{Limits: Limits{Calls: -1, Parallel: -1}, Lease: 300 * time.Millisecond})
	task := limitTask("t_nogoroutine")
	warm, err := s.Acquire(ctx, task, Calls) // the client's connection, dialled once
	if err != nil {
		t.Fatal(err)
	}
	warm(ctx, true)
	const n = 50
	before := runtime.NumGoroutine()
	releases := make([]func(context.Context, bool), 0, n)
	for range n {
		release, err := s.Acquire(ctx, task, Calls)
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
