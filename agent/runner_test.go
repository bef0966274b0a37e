package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"faregate/agent/chat"
	"faregate/agent/task"
)

// newRunner returns a runner of r's workflow on store.
func (r *rig) runner(store Store, concurrency int, reg prometheus.Registerer) *Runner {
	return NewRunner(store, r.workflow(), concurrency, slog.New(slog.NewTextHandler(io.Discard, nil)), reg)
}

// statuses lists the status events a store received, in order.
func statuses(t *testing.T, evs []task.Event) []string {
	t.Helper()
	var out []string
	for _, e := range evs {
		if e.Type != task.EventStatus {
			continue
		}
		var s struct{ Status string }
		if err := json.Unmarshal(e.Data, &s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s.Status)
	}
	return out
}

// TestRunnerRunsATask: created queued, then running, its steps, and the
// final state with a done event carrying the task.
func TestRunnerRunsATask(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	store := &fakeStore{}
	reg := prometheus.NewRegistry()
	run := newRig(m).runner(store, 2, reg)
	rec, err := run.Create(context.Background(), task.Record{Task: task.Task{Request: lisbon}, Visitor: "v1", Day: "2026-08-15"})
	if err != nil {
		t.Fatal(err)
	}
	if !task.ValidID(rec.ID) || rec.Status != task.StatusQueued || rec.CreatedAt.IsZero() {
		t.Fatalf("created %+v", rec)
	}
	if err := run.Launch(rec); err != nil {
		t.Fatal(err)
	}
	if err := run.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	evs := store.Events()
	if got := strings.Join(statuses(t, evs), ","); got != "running,succeeded" {
		t.Fatalf("status events %s", got)
	}
	done := evs[len(evs)-1]
	var final task.Task
	if done.Type != task.EventDone || json.Unmarshal(done.Data, &final) != nil || final.Status != task.StatusSucceeded || final.Result == nil {
		t.Fatalf("done event %+v", done)
	}
	if last := store.Last(); last.Status != task.StatusSucceeded || last.Visitor != "v1" || len(last.Steps) == 0 {
		t.Fatalf("final record %+v", last)
	}
	if n := testutil.ToFloat64(run.tasks.WithLabelValues(task.StatusSucceeded)); n != 1 {
		t.Fatalf("succeeded counter %v", n)
	}
	if err := run.Launch(rec); !errors.Is(err, ErrShuttingDown) {
		t.Fatalf("launch after shutdown: %v", err)
	}
}

// TestRunnerFailures: each way a run ends badly leaves a failed task with
// a stable code and a sentence for the visitor.
func TestRunnerFailures(t *testing.T) {
	tests := []struct {
		name     string
		generate func(context.Context, int, chat.Turn) (chat.Reply, error)
		code     string
		message  string
	}{
		{"provider down", func(context.Context, int, chat.Turn) (chat.Reply, error) { return chat.Reply{}, errors.New("500") },
			task.CodeModelUnavailable, "did not answer"},
		{"out of time", func(ctx context.Context, _ int, _ chat.Turn) (chat.Reply, error) {
			<-ctx.Done()
			return chat.Reply{}, ctx.Err()
		},
			task.CodeAgentFailed, "ran out of time"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				store := &fakeStore{}
				r := newRig(&fakeModel{GenerateFn: tc.generate})
				r.cfg.Timeout = 10 * time.Second
				run := r.runner(store, 1, nil)
				rec, _ := run.Create(context.Background(), task.Record{Task: task.Task{Request: lisbon}})
				if err := run.Launch(rec); err != nil {
					t.Fatal(err)
				}
				if err := run.Shutdown(context.Background()); err != nil {
					t.Fatal(err)
				}
				last := store.Last()
				if last.Status != task.StatusFailed || last.Error == nil || last.Error.Code != tc.code || !strings.Contains(last.Error.Message, tc.message) || last.Result != nil {
					t.Fatalf("final record %+v (error %+v)", last, last.Error)
				}
			})
		})
	}
}

// TestRunnerShutdownGrace: when the grace period ends, the running task is
// cancelled and the one waiting for a slot never starts; both are failed.
func TestRunnerShutdownGrace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := &fakeModel{GenerateFn: func(ctx context.Context, _ int, _ chat.Turn) (chat.Reply, error) {
			<-ctx.Done()
			return chat.Reply{}, ctx.Err()
		}}
		store := &fakeStore{}
		run := newRig(m).runner(store, 1, nil)
		var ids []string
		for range 2 {
			rec, _ := run.Create(context.Background(), task.Record{Task: task.Task{Request: lisbon}})
			ids = append(ids, rec.ID)
			if err := run.Launch(rec); err != nil {
				t.Fatal(err)
			}
		}
		synctest.Wait() // the first runs and hangs, the second waits for its slot
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := run.Shutdown(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("shutdown: %v", err)
		}
		var msgs []string
		for _, id := range ids {
			rec := store.LastOf(id)
			if rec.Status != task.StatusFailed {
				t.Fatalf("task %s: %s", id, rec.Status)
			}
			msgs = append(msgs, rec.Error.Message)
		}
		if !strings.Contains(strings.Join(msgs, "|"), "while the task was running") || !strings.Contains(strings.Join(msgs, "|"), "before the task could start") {
			t.Fatalf("messages %q", msgs)
		}
	})
}

// TestRunnerSavesAreBestEffort: a store that fails to save progress does
// not stop the run; the final save is still attempted.
func TestRunnerSavesAreBestEffort(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	store := &fakeStore{SaveFn: func(context.Context, task.Record, ...task.Event) error { return errors.New("store down") }}
	run := newRig(m).runner(store, 1, nil)
	rec, _ := run.Create(context.Background(), task.Record{Task: task.Task{Request: lisbon}})
	if err := run.Launch(rec); err != nil {
		t.Fatal(err)
	}
	if err := run.Shutdown(context.Background()); err != nil {
		t.Fatal(err)
	}
	if last := store.Last(); last.Status != task.StatusSucceeded || last.Result == nil {
		t.Fatalf("final save %+v", last)
	}
}

// TestRunnerCreateFails: a store failure is the caller's to answer.
func TestRunnerCreateFails(t *testing.T) {
	down := errors.New("store down")
	run := newRig(&fakeModel{}).runner(&fakeStore{CreateFn: func(context.Context, task.Record) error { return down }}, 1, nil)
	if _, err := run.Create(context.Background(), task.Record{}); !errors.Is(err, down) {
		t.Fatalf("err %v", err)
	}
}
