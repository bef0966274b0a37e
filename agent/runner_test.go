package agent

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// execFn is an Executor made of a function.
type execFn func(ctx context.Context, rec *task.Record, progress Progress) error

func (f execFn) Run(ctx context.Context, rec *task.Record, progress Progress) error {
	return f(ctx, rec, progress)
}

// succeed is a run that plans at once.
func succeed(_ context.Context, rec *task.Record, _ Progress) error {
	rec.Result = &task.Result{Summary: "ok", Model: "fake"}
	return nil
}

// testLease is the shortest lease the configuration allows: tests never
// depend on timing tighter than it.
const testLease = 3 * time.Second

func newRunner(t *testing.T, rdb redis.UniversalClient, wf Executor, name string, release func(context.Context, task.Record) error) *Runner {
	t.Helper()
	r := NewRunner(taskstore.New(rdb), wf, RunnerOptions{
		Concurrency: 1, Lease: testLease, Timeout: time.Minute, Consumer: name,
		Release: release, Block: 100 * time.Millisecond,
	})
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	return r
}

// waitStatus polls the store until the task has the status (a real event:
// the runner's work in other goroutines), failing after d.
func waitStatus(t *testing.T, s *taskstore.Store, id, status string, d time.Duration) task.Record {
	t.Helper()
	var rec task.Record
	var err error
	if !clocktest.Poll(d, func() bool {
		rec, err = s.Get(context.Background(), id)
		return err == nil && rec.Status == status
	}) {
		t.Fatalf("task %s: status %q (err %v), want %q within %v", id, rec.Status, err, status, d)
	}
	return rec
}

// TestRunnerRunsQueuedTasks: tasks submitted anywhere run on a free worker
// and end succeeded, leaving the queue empty.
func TestRunnerRunsQueuedTasks(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			r := newRunner(t, be.Client, execFn(succeed), "a", nil)
			defer r.Shutdown(context.Background())
			var ids []string
			for i := 0; i < 3; i++ {
				rec, err := r.Submit(context.Background(), task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
				if err != nil {
					t.Fatal(err)
				}
				ids = append(ids, rec.ID)
			}
			for _, id := range ids {
				rec := waitStatus(t, r.store, id, task.StatusSucceeded, 30*time.Second)
				if rec.Result == nil || rec.Result.Summary != "ok" {
					t.Fatalf("result %+v", rec.Result)
				}
			}
			clocktest.Eventually(t, 10*time.Second, "an empty queue after every task finished", func() bool {
				n, err := r.Depth(context.Background())
				return err == nil && n == 0
			})
		})
	}
}

// crash stops a runner the way kill -9 would, as far as Redis can tell: it
// takes no more tasks and renews no leases, and its running task never
// writes again (its run is parked until the test ends).
func crash(r *Runner) {
	r.stopTaking()
	r.stopLoops()
}

// TestKilledReplica: a replica with one worker dies with one task running
// and two queued. The running one ends worker_lost within lease + 5 s on the
// other replica, with its reservations given back at once; the two queued
// ones run to succeeded there.
func TestKilledReplica(t *testing.T) {
	be := redistest.Real(t)
	ctx := context.Background()
	parked := make(chan struct{})
	defer close(parked)
	startedA := make(chan string, 1)
	a := newRunner(t, be.Client, execFn(func(ctx context.Context, rec *task.Record, _ Progress) error {
		startedA <- rec.ID
		<-parked // the dead process never comes back
		return nil
	}), "a", nil)

	first, err := a.Submit(ctx, task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
	if err != nil {
		t.Fatal(err)
	}
	if got := <-startedA; got != first.ID {
		t.Fatalf("replica a started %s, want %s", got, first.ID)
	}
	waitStatus(t, a.store, first.ID, task.StatusRunning, 10*time.Second)
	var queued []string
	for i := 0; i < 2; i++ {
		rec, err := a.Submit(ctx, task.Record{Task: task.Task{Request: task.Request{Destination: "Porto", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
		if err != nil {
			t.Fatal(err)
		}
		queued = append(queued, rec.ID)
	}
	killedAt := time.Now()
	crash(a)

	var mu sync.Mutex
	var released []string
	b := newRunner(t, be.Client, execFn(succeed), "b", func(_ context.Context, rec task.Record) error {
		mu.Lock()
		released = append(released, rec.ID)
		mu.Unlock()
		return nil
	})
	defer b.Shutdown(ctx)
	for _, id := range queued {
		waitStatus(t, b.store, id, task.StatusSucceeded, 30*time.Second)
	}
	lost := waitStatus(t, b.store, first.ID, task.StatusFailed, testLease+5*time.Second)
	took := time.Since(killedAt)
	if lost.Error == nil || lost.Error.Code != codes.WorkerLost {
		t.Fatalf("lost task error %+v, want worker_lost", lost.Error)
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(released) != fmt.Sprint([]string{first.ID}) {
		t.Fatalf("reservations given back for %v, want only the lost task", released)
	}
	t.Logf("kill → worker_lost in %v (lease %v)", took.Round(time.Millisecond), testLease)
}

// TestFinalSaveAcrossAnOutage: the task finishes while Redis is cut off;
// its final save is retried and lands once Redis is back.
func TestFinalSaveAcrossAnOutage(t *testing.T) {
	srv := redistest.Start(t)
	f := redistest.NewFaults()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Dialer: f.Dialer(nil), MaxRetries: -1,
		DialTimeout: 500 * time.Millisecond, ReadTimeout: 500 * time.Millisecond, WriteTimeout: 500 * time.Millisecond})
	t.Cleanup(func() { _ = rdb.Close() })
	cut := make(chan struct{})
	r := newRunner(t, rdb, execFn(func(ctx context.Context, rec *task.Record, _ Progress) error {
		f.Cut() // Redis goes away while the task runs
		close(cut)
		rec.Result = &task.Result{Summary: "ok"}
		return nil
	}), "a", nil)
	defer r.Shutdown(context.Background())
	rec, err := r.Submit(context.Background(), task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
	if err != nil {
		t.Fatal(err)
	}
	<-cut
	// The outage outlasts several save attempts, but not the lease.
	clocktest.Pass(testLease / 3) // the outage's length: what the test is about
	f.Restore()
	got := waitStatus(t, taskstore.New(srv.Client(t)), rec.ID, task.StatusSucceeded, 30*time.Second)
	if got.Result == nil || got.Result.Summary != "ok" {
		t.Fatalf("result %+v", got.Result)
	}
}

// TestLostLeaseStopsTheRun: when another replica takes a task's lease, the
// first one's run is stopped and nothing it writes lands.
func TestLostLeaseStopsTheRun(t *testing.T) {
	be := redistest.Real(t)
	ctx := context.Background()
	stopped := make(chan error, 1)
	running := make(chan task.Record, 1)
	a := newRunner(t, be.Client, execFn(func(ctx context.Context, rec *task.Record, _ Progress) error {
		running <- *rec
		<-ctx.Done()
		stopped <- ctx.Err()
		return ctx.Err()
	}), "a", nil)
	defer a.Shutdown(ctx)
	rec, err := a.Submit(ctx, task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
	if err != nil {
		t.Fatal(err)
	}
	<-running
	// Another replica claims the entry, as its reaper would after a lapse.
	s := taskstore.New(be.Client)
	pend, err := be.Client.XPendingExt(ctx, &redis.XPendingExtArgs{Stream: taskstore.QueueKey, Group: taskstore.Group, Start: "-", End: "+", Count: 10}).Result()
	if err != nil || len(pend) != 1 {
		t.Fatalf("pending %v %v", pend, err)
	}
	if err := be.Client.XClaim(ctx, &redis.XClaimArgs{Stream: taskstore.QueueKey, Group: taskstore.Group, Consumer: "b", Messages: []string{pend[0].ID}}).Err(); err != nil {
		t.Fatal(err)
	}
	l, cur, err := s.Acquire(ctx, taskstore.Entry{ID: pend[0].ID, Task: rec.ID}, "b")
	if err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-stopped:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("run ended with %v", err)
		}
	case <-time.After(testLease + 5*time.Second):
		t.Fatal("the run was not stopped after its lease was taken")
	}
	cur.Status = task.StatusFailed
	if err := s.Save(ctx, l, cur); err != nil {
		t.Fatalf("the new owner cannot write: %v", err)
	}
	if got, _ := s.Get(ctx, rec.ID); got.Status != task.StatusFailed {
		t.Fatalf("status %s: the old owner overwrote the new one", got.Status)
	}
}

// TestShutdownGrace: a run that outlasts the grace is cancelled and saved
// failed before Shutdown returns.
func TestShutdownGrace(t *testing.T) {
	be := redistest.Mini(t)
	running := make(chan struct{})
	r := newRunner(t, be.Client, execFn(func(ctx context.Context, rec *task.Record, _ Progress) error {
		close(running)
		<-ctx.Done()
		return ctx.Err()
	}), "a", nil)
	rec, err := r.Submit(context.Background(), task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
	if err != nil {
		t.Fatal(err)
	}
	<-running
	ctx, cancel := context.WithCancel(context.Background())
	cancel() // no grace at all
	if err := r.Shutdown(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("shutdown: %v", err)
	}
	got, err := r.store.Get(context.Background(), rec.ID)
	if err != nil || got.Status != task.StatusFailed || got.Error == nil || got.Error.Code != codes.AgentFailed {
		t.Fatalf("after shutdown: %+v %v", got, err)
	}
	if _, err := r.Submit(context.Background(), task.Record{Principal: "v_a", Day: "2026-12-01"}); err != nil {
		// Submit only stores and enqueues; another replica would run it.
		t.Fatalf("submit after shutdown: %v", err)
	}
}

// TestCached: a served cached plan is stored final at once, never queued.
func TestCached(t *testing.T) {
	be := redistest.Mini(t)
	r := NewRunner(taskstore.New(be.Client), execFn(succeed), RunnerOptions{})
	rec, err := r.Cached(context.Background(), task.Record{Task: task.Task{Result: &task.Result{Summary: "cached", Cached: true}}, Principal: "v_a", Day: "2026-12-01"})
	if err != nil || rec.Status != task.StatusSucceeded {
		t.Fatalf("%+v %v", rec, err)
	}
	if n, _ := r.Depth(context.Background()); n != 0 {
		t.Fatalf("a cached plan entered the queue (depth %d)", n)
	}
}

// TestSubmitNotQueued: a task stored but refused by the queue (here the
// queue key is of the wrong type) is not left queued for ever: it ends
// failed with its final events, and Submit reports the error.
func TestSubmitNotQueued(t *testing.T) {
	be := redistest.Mini(t)
	ctx := context.Background()
	if err := be.Client.Set(ctx, taskstore.QueueKey, "not a stream", 0).Err(); err != nil {
		t.Fatal(err)
	}
	store := taskstore.New(be.Client)
	r := NewRunner(store, execFn(succeed), RunnerOptions{})
	if _, err := r.Submit(ctx, task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"}); !errors.Is(err, taskstore.ErrUnavailable) {
		t.Fatalf("submit: %v, want ErrUnavailable", err)
	}
	keys, err := be.Client.Keys(ctx, "faregate:task:{*}").Result()
	if err != nil || len(keys) != 1 {
		t.Fatalf("task keys %v %v", keys, err)
	}
	id := keys[0][len("faregate:task:{") : len(keys[0])-1]
	rec, err := store.Get(ctx, id)
	if err != nil || rec.Status != task.StatusFailed || rec.Error == nil || rec.Error.Code != codes.AgentFailed {
		t.Fatalf("the unqueued task: %+v %v", rec, err)
	}
	evs, _ := be.Client.XRange(ctx, "faregate:task:{"+id+"}:events", "-", "+").Result()
	if len(evs) != 3 || evs[2].Values["type"] != task.EventDone {
		t.Fatalf("events %v, want status, status, done", evs)
	}
}

// TestShutdownDoesNotWaitForTheQueueRead: an idle runner blocked in a queue
// read of an hour shuts down without waiting for it, and starts nothing
// afterwards: a task queued after Shutdown stays queued for another replica.
func TestShutdownDoesNotWaitForTheQueueRead(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			started := make(chan string, 1)
			r := NewRunner(taskstore.New(be.Client), execFn(func(_ context.Context, rec *task.Record, _ Progress) error {
				started <- rec.ID
				return nil
			}), RunnerOptions{Concurrency: 1, Lease: testLease, Timeout: time.Minute, Consumer: "idle", Block: time.Hour})
			if err := r.Start(context.Background()); err != nil {
				t.Fatal(err)
			}
			// The test's own bound, far below the read's hour.
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- r.Shutdown(ctx) }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("shutdown: %v", err)
				}
			case <-ctx.Done():
				t.Fatal("Shutdown waited for the queue read")
			}
			rec, err := r.Submit(context.Background(), task.Record{Task: task.Task{Request: task.Request{Destination: "Lisbon", Days: 1}}, Principal: "v_a", Day: "2026-12-01"})
			if err != nil {
				t.Fatal(err)
			}
			// The blocked read may take the entry; it must not run it.
			// Another runner sees it (claimed after the lease if taken).
			other := newRunner(t, be.Client, execFn(succeed), "b", nil)
			defer other.Shutdown(context.Background())
			waitStatus(t, r.store, rec.ID, task.StatusSucceeded, 10*testLease)
			select {
			case id := <-started:
				t.Fatalf("the stopped runner started %s", id)
			default:
			}
		})
	}
}
