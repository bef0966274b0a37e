package agent

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/agent/task"
)

// ErrShuttingDown: the runner no longer accepts tasks.
var ErrShuttingDown = errors.New("agent: shutting down")

// Store keeps tasks and their events (agent/taskstore).
type Store interface {
	// Create stores a new task and its first status event.
	Create(ctx context.Context, rec task.Record) error
	// Save writes the task and appends events, together.
	Save(ctx context.Context, rec task.Record, events ...task.Event) error
}

// Runner executes tasks in the background, at most Concurrency at a time,
// moving each queued → running → succeeded/failed with a deadline.
type Runner struct {
	store    Store
	workflow *Workflow
	lg       *slog.Logger
	sem      chan struct{}
	tasks    *prometheus.CounterVec
	running  prometheus.Gauge
	now      func() time.Time

	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
	// base is cancelled when a shutdown's grace period ends: running tasks
	// stop and are marked failed.
	base   context.Context
	cancel context.CancelFunc
}

// NewRunner returns a runner. reg receives faregate_tasks_total{status}
// and faregate_tasks_running.
func NewRunner(store Store, wf *Workflow, concurrency int, lg *slog.Logger, reg prometheus.Registerer) *Runner {
	base, cancel := context.WithCancel(context.Background())
	r := &Runner{
		store: store, workflow: wf, lg: lg, sem: make(chan struct{}, concurrency), now: time.Now,
		base: base, cancel: cancel,
		tasks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_tasks_total", Help: "Tasks that reached each status.",
		}, []string{"status"}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_tasks_running", Help: "Tasks running now in this process.",
		}),
	}
	if reg != nil {
		reg.MustRegister(r.tasks, r.running)
	}
	return r
}

// Create stores a new queued task for req and returns its record.
func (r *Runner) Create(ctx context.Context, rec task.Record) (task.Record, error) {
	now := r.now().UTC()
	rec.ID = task.NewID()
	rec.Status = task.StatusQueued
	rec.CreatedAt, rec.UpdatedAt = now, now
	rec.Steps = []task.Step{}
	rec.Warnings = []string{}
	if err := r.store.Create(ctx, rec); err != nil {
		return task.Record{}, err
	}
	r.tasks.WithLabelValues(task.StatusQueued).Inc()
	return rec, nil
}

// Launch runs rec in the background. It refuses once shutdown began.
func (r *Runner) Launch(rec task.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return ErrShuttingDown
	}
	r.wg.Add(1)
	go r.execute(rec)
	return nil
}

func (r *Runner) execute(rec task.Record) {
	defer r.wg.Done()
	lg := r.lg.With("task", rec.ID, "request_id", rec.RequestID)
	select {
	case r.sem <- struct{}{}:
		defer func() { <-r.sem }()
	case <-r.base.Done():
		r.fail(&rec, lg, task.CodeAgentFailed, "the server shut down before the task could start")
		return
	}
	r.running.Inc()
	defer r.running.Dec()

	ctx, cancel := context.WithTimeout(r.base, r.workflow.cfg.Timeout)
	defer cancel()

	rec.Status = task.StatusRunning
	rec.UpdatedAt = r.now().UTC()
	status, _ := json.Marshal(map[string]string{"status": task.StatusRunning})
	if err := r.store.Save(ctx, rec, task.Event{Type: task.EventStatus, Data: status}); err != nil {
		lg.Warn("task start not saved", "err", err)
	}
	r.tasks.WithLabelValues(task.StatusRunning).Inc()

	progress := func(cur *task.Record, events ...task.Event) error {
		cur.UpdatedAt = r.now().UTC()
		return r.store.Save(context.WithoutCancel(ctx), *cur, events...)
	}
	started := time.Now()
	err := r.workflow.Run(ctx, &rec, progress)
	if err != nil {
		var f *failure
		switch {
		case errors.As(err, &f):
			r.fail(&rec, lg, f.code, f.msg)
		case r.base.Err() != nil:
			r.fail(&rec, lg, task.CodeAgentFailed, "the server shut down while the task was running")
		case ctx.Err() != nil:
			r.fail(&rec, lg, task.CodeAgentFailed, "the task ran out of time")
		default:
			lg.Error("task failed", "err", err)
			r.fail(&rec, lg, task.CodeAgentFailed, "the planner failed")
		}
		return
	}
	rec.Status = task.StatusSucceeded
	r.finish(&rec, lg)
	lg.Info("task succeeded", "duration_ms", time.Since(started).Milliseconds(),
		"steps", len(rec.Steps), "prompt_tokens", rec.Usage.PromptTokens, "completion_tokens", rec.Usage.CompletionTokens,
		"warnings", rec.Warnings)
}

func (r *Runner) fail(rec *task.Record, lg *slog.Logger, code, msg string) {
	rec.Status = task.StatusFailed
	rec.Result = nil
	rec.Error = &task.TaskError{Code: code, Message: msg}
	lg.Info("task failed", "code", code, "reason", msg)
	r.finish(rec, lg)
}

// finish saves the final record with its status and done events. It uses a
// fresh context: the run's own may be what ended.
func (r *Runner) finish(rec *task.Record, lg *slog.Logger) {
	rec.UpdatedAt = r.now().UTC()
	status, _ := json.Marshal(map[string]string{"status": rec.Status})
	done, _ := json.Marshal(rec.Task)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := r.store.Save(ctx, *rec, task.Event{Type: task.EventStatus, Data: status}, task.Event{Type: task.EventDone, Data: done}); err != nil {
		lg.Error("final task state not saved", "status", rec.Status, "err", err)
	}
	r.tasks.WithLabelValues(rec.Status).Inc()
}

// Shutdown stops accepting tasks and waits for running ones until ctx ends;
// then it cancels them, and they are marked failed before it returns.
func (r *Runner) Shutdown(ctx context.Context) error {
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	done := make(chan struct{})
	go func() { r.wg.Wait(); close(done) }()
	select {
	case <-done:
		r.cancel()
		return nil
	case <-ctx.Done():
		r.cancel()
		<-done
		return ctx.Err()
	}
}
