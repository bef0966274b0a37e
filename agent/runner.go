package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	oteltrace "go.opentelemetry.io/otel/trace"

	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/protect/codes"
	"faregate/protect/kit/pause"
	"faregate/protect/kit/promreg"
	"faregate/protect/kit/randhex"
	"faregate/protect/kit/tracing"
)

// ErrShuttingDown: the runner no longer accepts tasks.
var ErrShuttingDown = errors.New("agent: shutting down")

// Executor runs one task's workflow (the Workflow; a fake in tests).
type Executor interface {
	Run(ctx context.Context, rec *task.Record, progress Progress) error
}

// RunnerOptions configure a Runner.
type RunnerOptions struct {
	// Concurrency is how many tasks this process runs at once.
	Concurrency int
	// Lease is how long a task stays this replica's without a renewal; it is
	// renewed every third of it, and a lapsed one is claimed by any replica.
	Lease time.Duration
	// Timeout is a run's wall clock (the workflow's own bound).
	Timeout time.Duration
	// Consumer names this replica in the consumer group; default: host, pid
	// and random bits, new at every start.
	Consumer string
	// Release gives back a lost task's open token reservations at once.
	Release func(ctx context.Context, rec task.Record) error
	// Succeeded is told of every task that succeeded here, after its final
	// save (the plan cache keeps its plan); nil: nobody.
	Succeeded func(ctx context.Context, rec task.Record)
	// Block is how long one wait for a new task lasts (default 2 s); it
	// bounds how long a stopping runner waits for its taker.
	Block time.Duration
	// Tracer starts each run's task.run span, in the trace of the request
	// that queued it (nil: tracing off, at no cost).
	Tracer oteltrace.Tracer
	// Logger, Registerer and Now as usual.
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	Now        func() time.Time
}

// Runner runs admitted tasks. Tasks wait on the Redis queue, not in a
// process: a free worker of any replica takes the next one, and a task
// whose replica died is claimed by another. Each running task's lease is
// renewed every third of RunnerOptions.Lease; every write of the task is
// fenced by it, so a replica that lost a task changes nothing of it.
type Runner struct {
	store *taskstore.Store
	wf    Executor
	o     RunnerOptions
	lg    *slog.Logger

	slots chan struct{}
	ready chan taskstore.Entry

	mu   sync.Mutex
	held map[string]*holding // by queue entry id

	takeCtx    context.Context // ends when the runner stops taking tasks
	stopTaking context.CancelFunc
	base       context.Context // ends when the shutdown grace ends
	cancelBase context.CancelFunc
	loopsCtx   context.Context // ends when every run is done
	stopLoops  context.CancelFunc
	stopping   bool // under mu: no run starts once set
	runs       sync.WaitGroup
	loops      sync.WaitGroup // renew and reap; take is not waited for

	tasks    *prometheus.CounterVec
	running  prometheus.Gauge
	lost     prometheus.Counter
	duration *prometheus.HistogramVec
}

// holding is a queue entry this replica holds: its lease is renewed until
// it is acknowledged. cancel stops its run when the lease is lost.
type holding struct {
	cancel  context.CancelFunc
	renewed time.Time // last successful renewal (or the take)
}

// NewRunner returns a runner; Start begins taking tasks. The workers wait
// for the next task on store's waits pool (taskstore.Store.WithWaits): give
// it a pool of its own of Concurrency+2 connections, so waiting workers
// hold nobody up.
func NewRunner(store *taskstore.Store, wf Executor, o RunnerOptions) *Runner {
	if o.Concurrency < 1 {
		o.Concurrency = 1
	}
	if o.Lease <= 0 {
		o.Lease = 30 * time.Second
	}
	if o.Timeout <= 0 {
		o.Timeout = 90 * time.Second
	}
	if o.Block <= 0 {
		o.Block = 2 * time.Second
	}
	if o.Consumer == "" {
		host, _ := os.Hostname()
		o.Consumer = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), randhex.New(4))
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	r := &Runner{
		store: store, wf: wf, o: o, lg: o.Logger,
		slots: make(chan struct{}, o.Concurrency),
		ready: make(chan taskstore.Entry, o.Concurrency),
		held:  map[string]*holding{},
		tasks: promreg.Register(o.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_tasks_total", Help: "Tasks that reached each status, counted where it happened.",
		}, []string{"status"})),
		running: promreg.Register(o.Registerer, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_tasks_running", Help: "Tasks running now in this process.",
		})),
		lost: promreg.Register(o.Registerer, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_tasks_lost_total", Help: "Tasks this replica failed with " + codes.WorkerLost + " after their replica's lease lapsed.",
		})),
		duration: promreg.Register(o.Registerer, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_task_duration_seconds", Help: "Run time of tasks run here, by outcome (succeeded, or the failure code).",
			Buckets: []float64{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 300},
		}, []string{"outcome"})),
	}
	r.takeCtx, r.stopTaking = context.WithCancel(context.Background())
	r.base, r.cancelBase = context.WithCancel(context.Background())
	r.loopsCtx, r.stopLoops = context.WithCancel(context.Background())
	return r
}

// Consumer is this replica's name in the consumer group.
func (r *Runner) Consumer() string { return r.o.Consumer }

// Submit stores a new queued task and puts it on the queue. The record is
// stored first (it is what GET /api/tasks answers); a task whose enqueue
// fails is failed at once, since no worker will ever see it.
func (r *Runner) Submit(ctx context.Context, rec task.Record) (task.Record, error) {
	rec = r.newRecord(rec, task.StatusQueued)
	rec.Trace = tracing.TraceParent(ctx)
	if err := r.store.Create(ctx, rec); err != nil {
		return task.Record{}, err
	}
	// The task is counted and stored; a Redis hiccup now must not leave it
	// queued for ever with no queue entry. Try again a little (three tries,
	// 100 ms then 400 ms apart), then end it.
	err := pause.Retry(ctx, pause.Policy{First: 100 * time.Millisecond, Max: 400 * time.Millisecond, Factor: 4, Tries: 3},
		func(time.Duration) error { return r.store.Enqueue(ctx, rec.ID) })
	if err == nil {
		r.tasks.WithLabelValues(task.StatusQueued).Inc()
		return rec, nil
	}
	r.lg.Error("task stored but not queued", "task", rec.ID, "request_id", rec.RequestID, "err", err.Error())
	rec.Status = task.StatusFailed
	rec.UpdatedAt = r.o.Now().UTC()
	rec.Error = &task.TaskError{Code: codes.AgentFailed, Message: "the task could not be queued; please try again later"}
	if ferr := r.store.FailUnqueued(context.WithoutCancel(ctx), rec); ferr != nil {
		r.lg.Error("unqueued task not marked failed", "task", rec.ID, "err", ferr.Error())
	}
	return task.Record{}, err
}

// Cached stores a task that is final at once: a plan served from the plan
// cache. It never enters the queue.
func (r *Runner) Cached(ctx context.Context, rec task.Record) (task.Record, error) {
	rec = r.newRecord(rec, task.StatusSucceeded)
	if err := r.store.CreateFinal(ctx, rec); err != nil {
		return task.Record{}, err
	}
	r.tasks.WithLabelValues(task.StatusSucceeded).Inc()
	return rec, nil
}

// newRecord is rec as a new task: a fresh id, the status, created now,
// and empty (not null) steps and warnings.
func (r *Runner) newRecord(rec task.Record, status string) task.Record {
	now := r.o.Now().UTC()
	rec.ID = task.NewID()
	rec.Status = status
	rec.CreatedAt, rec.UpdatedAt = now, now
	rec.Steps, rec.Warnings = []task.Step{}, []string{}
	return rec
}

// Depth is how many tasks wait or run, for the admission's queue bound.
func (r *Runner) Depth(ctx context.Context) (int64, error) { return r.store.Depth(ctx) }

// Start begins taking tasks, renewing leases and reaping lapsed ones.
func (r *Runner) Start(ctx context.Context) error {
	if err := r.store.EnsureGroup(ctx); err != nil {
		// Not fatal: Redis may come later; Next creates the group then.
		r.lg.Warn("task queue not ready yet", "err", err.Error())
	}
	r.loops.Add(2)
	go r.take()
	go r.renew()
	go r.reap()
	return nil
}

// take hands tasks to free workers: first those the reaper claimed for
// this replica, else the next one from the queue.
//
// Shutdown does not wait for it: it may be blocked in a queue read for up
// to Block, and waiting would hold every shutdown that long. Once the
// runner stops it starts nothing; its read ends at Block or when the
// queue's client is closed, and an entry it took meanwhile is left
// pending, claimed by another replica after the lease.
func (r *Runner) take() {
	// Waits while the queue is unavailable; jitter keeps the replicas from
	// coming back in one instant.
	backoff := pause.Policy{First: 100 * time.Millisecond, Max: 2 * time.Second, Jitter: 0.2}.Backoff()
	for {
		select {
		case <-r.takeCtx.Done():
			return
		case r.slots <- struct{}{}:
		}
		var e taskstore.Entry
		var ok bool
		select {
		case e = <-r.ready:
			ok = true
		default:
			var err error
			e, ok, err = r.store.Next(r.takeCtx, r.o.Consumer, r.o.Block)
			if err != nil {
				<-r.slots
				if r.takeCtx.Err() != nil {
					return
				}
				r.lg.Debug("task queue unavailable", "err", err.Error())
				_ = backoff.Wait(r.takeCtx)
				continue
			}
			backoff.Reset()
			if ok && r.takeCtx.Err() != nil {
				// Taken while stopping: leave it unstarted and unrenewed, so
				// another replica claims it after the lease and runs it.
				<-r.slots
				return
			}
		}
		if !ok {
			<-r.slots
			continue
		}
		if !r.admitRun(e.ID) {
			r.unhold(e.ID) // not renewed: claimed elsewhere after the lease
			<-r.slots
			return
		}
		go func() {
			defer r.runs.Done()
			defer func() { <-r.slots }()
			r.execute(e)
		}()
	}
}

// admitRun holds entry and counts its run, unless the runner is stopping:
// under mu, so a run is counted before Shutdown waits for runs or never.
func (r *Runner) admitRun(entry string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopping {
		return false
	}
	if _, ok := r.held[entry]; !ok {
		r.held[entry] = &holding{renewed: r.o.Now()}
	}
	r.runs.Add(1)
	return true
}

// hold starts renewing e's lease (cancel stops its run if the lease is lost).
func (r *Runner) hold(entry string, cancel context.CancelFunc) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if h, ok := r.held[entry]; ok {
		if cancel != nil {
			h.cancel = cancel
		}
		return
	}
	r.held[entry] = &holding{cancel: cancel, renewed: r.o.Now()}
}

func (r *Runner) unhold(entry string) {
	r.mu.Lock()
	delete(r.held, entry)
	r.mu.Unlock()
}

// leaseLeft is how long e's lease lasts from now by the last renewal seen.
func (r *Runner) leaseLeft(entry string) time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	h, ok := r.held[entry]
	if !ok {
		return 0
	}
	return r.o.Lease - r.o.Now().Sub(h.renewed)
}

// renew keeps the leases of every held entry, every third of the lease, and
// stops the runs whose lease another replica took.
func (r *Runner) renew() {
	r.every(r.renewHeld)
}

// renewHeld renews the lease of every held entry once.
func (r *Runner) renewHeld() {
	r.mu.Lock()
	entries := make([]string, 0, len(r.held))
	for e := range r.held {
		entries = append(entries, e)
	}
	r.mu.Unlock()
	if len(entries) == 0 {
		return
	}
	at := r.o.Now()
	ctx, cancel := context.WithTimeout(r.loopsCtx, r.o.Lease/3)
	lost, err := r.store.Renew(ctx, r.o.Consumer, entries)
	cancel()
	if err != nil {
		r.lg.Warn("task leases not renewed", "tasks", len(entries), "err", err.Error())
		return
	}
	gone := map[string]bool{}
	for _, e := range lost {
		gone[e] = true
	}
	r.mu.Lock()
	for _, e := range entries {
		h, ok := r.held[e]
		if !ok {
			continue
		}
		if gone[e] {
			delete(r.held, e)
			if h.cancel != nil {
				h.cancel()
			}
			continue
		}
		h.renewed = at
	}
	r.mu.Unlock()
	for _, e := range lost {
		r.lg.Warn("task lease lost to another replica: run stopped", "entry", e)
	}
}

// every calls f every third of the lease until the loops stop.
func (r *Runner) every(f func()) {
	defer r.loops.Done()
	t := time.NewTicker(r.o.Lease / 3)
	defer t.Stop()
	for {
		select {
		case <-r.loopsCtx.Done():
			return
		case <-t.C:
		}
		f()
	}
}

// reap claims entries whose lease lapsed (their replica stopped renewing)
// and settles each: a task not started runs here, a started one fails with
// worker_lost, a finished one is acknowledged. Every replica reaps; the
// claim itself (XAUTOCLAIM) makes it safe for them to race.
func (r *Runner) reap() {
	r.every(func() {
		ctx, cancel := context.WithTimeout(r.loopsCtx, r.o.Lease/3)
		defer cancel()
		entries, err := r.store.Claim(ctx, r.o.Consumer, r.o.Lease, 16)
		if err != nil {
			r.lg.Debug("task queue not reaped", "err", err.Error())
			return
		}
		for _, e := range entries {
			r.reapOne(ctx, e)
		}
	})
}

func (r *Runner) reapOne(ctx context.Context, e taskstore.Entry) {
	l, rec, err := r.store.Acquire(ctx, e, r.o.Consumer)
	switch {
	case errors.Is(err, task.ErrNotFound):
		_ = r.store.Ack(ctx, e.ID)
		return
	case err != nil:
		return // unclaimed in effect: reclaimed after another lease
	}
	switch rec.Status {
	case task.StatusQueued:
		// Never started: it runs here, when a worker is free. Until then
		// its lease is renewed like a running task's.
		if r.takeCtx.Err() != nil {
			return
		}
		select {
		case r.ready <- e:
			r.hold(e.ID, nil)
		default:
			// No room now; another lease from now, someone runs it.
		}
	case task.StatusRunning:
		r.workerLost(ctx, l, rec)
	default:
		_ = r.store.Ack(ctx, e.ID)
	}
}

// workerLost fails a task whose replica died mid-run: it may have spent
// tokens and called tools, so it is not run twice. Its open reservations
// are given back at once and its followers' streams end.
func (r *Runner) workerLost(ctx context.Context, l taskstore.Lease, rec task.Record) {
	r.hold(l.Entry.ID, nil)
	defer r.unhold(l.Entry.ID)
	if r.o.Release != nil {
		if err := r.o.Release(ctx, rec); err != nil {
			r.lg.Warn("lost task's reservations not given back (they expire)", "task", rec.ID, "err", err.Error())
		}
	}
	rec.Status = task.StatusFailed
	rec.Result = nil
	rec.Error = &task.TaskError{Code: codes.WorkerLost,
		Message: "the server running this task stopped; the task was not run twice"}
	if !r.save(ctx, l, &rec, true) {
		return
	}
	_ = r.store.Ack(ctx, l.Entry.ID)
	r.lost.Inc()
	r.tasks.WithLabelValues(task.StatusFailed).Inc()
	r.lg.Info("task failed: worker lost", "task", rec.ID, "request_id", rec.RequestID)
}

// acquire takes e's lease and its task for a run. It reports false, with
// the entry settled and no longer held, when there is nothing to run: the
// record is gone, Redis is away, or the task started or ended elsewhere.
func (r *Runner) acquire(e taskstore.Entry) (taskstore.Lease, task.Record, bool) {
	ctx := r.base
	l, rec, err := r.store.Acquire(ctx, e, r.o.Consumer)
	switch {
	case errors.Is(err, task.ErrNotFound):
		_ = r.store.Ack(ctx, e.ID)
	case err != nil:
		// Redis is away: the entry stays pending, unrenewed, and is claimed
		// after its lease (by us, if we are the one left).
		r.lg.Warn("task not started: its lease could not be taken", "task", e.Task, "err", err.Error())
	case rec.Status == task.StatusQueued:
		return l, rec, true
	case rec.Status == task.StatusRunning:
		// Started by a replica that lost it before we got it.
		r.workerLost(ctx, l, rec)
	default:
		_ = r.store.Ack(ctx, e.ID)
	}
	r.unhold(e.ID)
	return taskstore.Lease{}, task.Record{}, false
}

// execute runs one taken entry: acquire its lease, then run, finish, ack.
func (r *Runner) execute(e taskstore.Entry) {
	l, rec, ok := r.acquire(e)
	if !ok {
		return
	}
	defer r.unhold(e.ID)
	tctx, endRun := r.startRun(r.base, &rec)
	defer endRun()
	lg := tracing.Logger(tctx, r.lg).With("task", rec.ID, "request_id", rec.RequestID)
	runCtx, cancelRun := context.WithTimeout(tctx, r.o.Timeout)
	defer cancelRun()
	// An external agent's /v1 writes are fenced by this run's lease.
	runCtx = taskstore.WithLease(runCtx, l)
	r.hold(e.ID, cancelRun)

	rec.Status = task.StatusRunning
	rec.UpdatedAt = r.o.Now().UTC()
	status, _ := json.Marshal(map[string]string{"status": task.StatusRunning})
	if err := r.store.Save(runCtx, l, rec, task.Event{Type: task.EventStatus, Data: status}); err != nil {
		if errors.Is(err, taskstore.ErrLeaseLost) {
			return
		}
		lg.Warn("task start not saved", "err", err.Error())
	}
	r.tasks.WithLabelValues(task.StatusRunning).Inc()
	r.running.Inc()
	defer r.running.Dec()

	progress := func(cur *task.Record, events ...task.Event) error {
		cur.UpdatedAt = r.o.Now().UTC()
		err := r.store.Save(context.WithoutCancel(runCtx), l, *cur, events...)
		if errors.Is(err, taskstore.ErrLeaseLost) {
			cancelRun() // another replica owns the task now: stop spending
		}
		return err
	}
	started := time.Now()
	err := r.wf.Run(runCtx, &rec, progress)
	outcome := task.StatusSucceeded
	if err != nil {
		code, msg := r.failure(err, runCtx)
		rec.Status, rec.Result = task.StatusFailed, nil
		rec.Error = &task.TaskError{Code: code, Message: msg}
		outcome = code
		lg.Info("task failed", "code", code, "reason", msg)
	} else {
		rec.Status = task.StatusSucceeded
	}
	if !r.save(context.WithoutCancel(runCtx), l, &rec, true) {
		return
	}
	_ = r.store.Ack(context.WithoutCancel(runCtx), e.ID)
	r.tasks.WithLabelValues(rec.Status).Inc()
	r.duration.WithLabelValues(outcome).Observe(time.Since(started).Seconds())
	if err == nil {
		if r.o.Succeeded != nil {
			r.o.Succeeded(context.WithoutCancel(runCtx), rec)
		}
		lg.Info("task succeeded", "duration_ms", time.Since(started).Milliseconds(),
			"steps", len(rec.Steps), "prompt_tokens", rec.Usage.PromptTokens,
			"completion_tokens", rec.Usage.CompletionTokens, "warnings", rec.Warnings)
	}
}

// failure turns a run's error into the task's failure code and message.
func (r *Runner) failure(err error, runCtx context.Context) (code, msg string) {
	if code, msg, ok := task.FailureOf(err); ok {
		return code, msg
	}
	switch {
	case r.base.Err() != nil:
		return codes.AgentFailed, "the server shut down while the task was running"
	case runCtx.Err() != nil:
		return codes.AgentFailed, "the task ran out of time"
	}
	r.lg.Error("task failed", "err", err.Error())
	return codes.AgentFailed, "the planner failed"
}

// save writes a final record with its status and done events, retrying
// with backoff for as long as the lease lasts: a final save that meets a
// Redis outage still lands once Redis is back, or the lease lapses and the
// reaper ends the task with worker_lost. It reports whether it landed.
func (r *Runner) save(ctx context.Context, l taskstore.Lease, rec *task.Record, final bool) bool {
	rec.UpdatedAt = r.o.Now().UTC()
	status, _ := json.Marshal(map[string]string{"status": rec.Status})
	done, _ := json.Marshal(rec.Task)
	events := []task.Event{{Type: task.EventStatus, Data: status}}
	if final {
		events = append(events, task.Event{Type: task.EventDone, Data: done})
	}
	// The waits are not cut short by ctx: the save must outlive the run's
	// end; the lease bounds them.
	err := pause.Retry(context.Background(), pause.Policy{First: 100 * time.Millisecond, Max: 2 * time.Second},
		func(next time.Duration) error {
			sctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := r.store.Save(sctx, l, *rec, events...)
			cancel()
			switch {
			case err == nil:
				return nil
			case errors.Is(err, taskstore.ErrLeaseLost):
				r.lg.Warn("final task state not saved: lease lost to another replica", "task", rec.ID)
				return pause.Stop(err)
			}
			if r.leaseLeft(l.Entry.ID) <= next {
				r.lg.Error("final task state not saved before the lease ran out; another replica will fail it", "task", rec.ID, "err", err.Error())
				return pause.Stop(err)
			}
			r.lg.Warn("final task state not saved; retrying", "task", rec.ID, "retry_in", next.String(), "err", err.Error())
			return err
		})
	return err == nil
}

// Shutdown stops taking tasks and waits for running ones until ctx ends;
// then it cancels them, and they are marked failed (their final events
// written) before it returns. Tasks taken but not started are left to be
// claimed by another replica.
func (r *Runner) Shutdown(ctx context.Context) error {
	r.mu.Lock()
	r.stopping = true
	r.mu.Unlock()
	r.stopTaking()
	done := make(chan struct{})
	go func() { r.runs.Wait(); close(done) }()
	var err error
	select {
	case <-done:
	case <-ctx.Done():
		r.cancelBase()
		<-done
		err = ctx.Err()
	}
	r.cancelBase()
	r.stopLoops()
	r.loops.Wait()
	return err
}
