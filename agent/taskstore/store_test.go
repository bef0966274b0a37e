package taskstore

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"faregate/agent/task"
	"faregate/protect/redistest"
)

// TestStoreFollow on both backends: replay, live events written while a
// follower reads, resume after an id, done ends it, keep-alives while idle.
func TestStoreFollow(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			st := New(be.Client)
			st.Poll = 5 * time.Millisecond
			rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued}}
			if err := st.Create(ctx, rec); err != nil {
				t.Fatal(err)
			}
			// The rest of the run is written once the follower has read the
			// first event, so what follows arrives while it follows.
			var got []task.Event
			err := st.Follow(ctx, rec.ID, "", func(e task.Event) error {
				got = append(got, e)
				if len(got) == 1 {
					rec.Status = task.StatusSucceeded
					done, _ := json.Marshal(rec.Task)
					return st.Save(ctx, rec, task.Event{Type: task.EventStep, Data: []byte(`{"seq":1}`)}, task.Event{Type: task.EventDone, Data: done})
				}
				return nil
			})
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != 3 || got[1].Type != task.EventStep || got[2].Type != task.EventDone {
				t.Fatalf("events: %+v", got)
			}
			var resumed []task.Event
			if err := st.Follow(ctx, rec.ID, got[0].ID, func(e task.Event) error { resumed = append(resumed, e); return nil }); err != nil {
				t.Fatal(err)
			}
			if len(resumed) != len(got)-1 || resumed[0].ID == got[0].ID {
				t.Fatalf("resume after %s: %+v", got[0].ID, resumed)
			}
			// While nothing happens, followers get keep-alives: the follower
			// stops itself after two, the deadline only guards against none.
			idle := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusRunning}}
			if err := st.Create(ctx, idle); err != nil {
				t.Fatal(err)
			}
			st.KeepAlive = 20 * time.Millisecond
			fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			errEnough := errors.New("two keep-alives")
			keepalives := 0
			err = st.Follow(fctx, idle.ID, "", func(e task.Event) error {
				if e.Type == task.EventKeepAlive {
					if keepalives++; keepalives == 2 {
						return errEnough
					}
				}
				return nil
			})
			if !errors.Is(err, errEnough) {
				t.Fatalf("idle follower ended with %v after %d keep-alives", err, keepalives)
			}
			if err := st.Follow(ctx, task.NewID(), "", func(task.Event) error { return nil }); err != task.ErrNotFound {
				t.Fatalf("unknown task: %v", err)
			}
			if _, err := st.Get(ctx, "t_nothex!"); err != task.ErrNotFound {
				t.Fatalf("malformed id: %v", err)
			}
		})
	}
}
