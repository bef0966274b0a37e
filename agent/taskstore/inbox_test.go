package taskstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/taskstore"
	"faregate/protect/kit/testkit/redistest"
)

// TestInboxReadsWhatTheKeyWrites: what the holder of a task's key posts
// through agent/taskkey (which writes the inbox in its own scripts) is
// what ReadInbox returns, in order and by type, waiting or not: the two
// packages name one stream and its fields alike.
func TestInboxReadsWhatTheKeyWrites(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			s := taskstore.New(be.Client)
			now := time.Now().UTC()
			rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
				Steps: []task.Step{}, Warnings: []string{}}, Principal: "v_aa", Tier: "public"}
			if err := s.Create(ctx, rec); err != nil {
				t.Fatal(err)
			}
			l, _, err := s.Acquire(ctx, taskstore.Entry{ID: "1-1", Task: rec.ID}, "me")
			if err != nil {
				t.Fatal(err)
			}
			keys := taskkey.New(be.Client, taskkey.Options{})
			key, err := keys.Mint(ctx, l, rec, now.Add(time.Minute))
			if err != nil {
				t.Fatal(err)
			}
			g, err := keys.Authenticate(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			if got, err := s.ReadInbox(ctx, rec.ID, "0", 0); err != nil || len(got) != 0 {
				t.Fatalf("a new task's inbox: %v %v", got, err)
			}
			// A waiting read from the start: it wakes at the first post, or
			// finds it there if it comes late.
			woke := make(chan []taskstore.Message, 1)
			go func() {
				m, _ := s.ReadInbox(ctx, rec.ID, "0", 5*time.Second)
				woke <- m
			}()
			if err := keys.Event(ctx, g, []byte(`{"name":"a","status":"started"}`)); err != nil {
				t.Fatal(err)
			}
			if err := keys.Step(ctx, g, []byte(`{"kind":"model","name":"b","status":"ok"}`)); err != nil {
				t.Fatal(err)
			}
			if err := keys.Result(ctx, g, []byte(`{"result":{"text":"done"}}`)); err != nil {
				t.Fatal(err)
			}
			msgs, err := s.ReadInbox(ctx, rec.ID, "0", 0)
			if err != nil {
				t.Fatal(err)
			}
			want := []taskstore.Message{
				{Type: taskkey.TypeEvent, Data: []byte(`{"name":"a","status":"started"}`)},
				{Type: taskkey.TypeStep, Data: []byte(`{"kind":"model","name":"b","status":"ok"}`)},
				{Type: taskkey.TypeResult, Data: []byte(`{"result":{"text":"done"}}`)},
			}
			if len(msgs) != len(want) {
				t.Fatalf("inbox %+v, want %d entries", msgs, len(want))
			}
			for i, m := range msgs {
				if m.ID == "" || m.Type != want[i].Type || string(m.Data) != string(want[i].Data) {
					t.Fatalf("entry %d: %+v, want %s %s", i, m, want[i].Type, want[i].Data)
				}
			}
			if rest, err := s.ReadInbox(ctx, rec.ID, msgs[0].ID, 0); err != nil || len(rest) != 2 || rest[0].ID != msgs[1].ID {
				t.Fatalf("after the first entry: %+v %v", rest, err)
			}
			select {
			case m := <-woke:
				if len(m) == 0 || m[0].ID != msgs[0].ID || m[0].Type != taskkey.TypeEvent {
					t.Fatalf("the waiting read woke with %+v", m)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the waiting read did not wake")
			}
		})
	}
}

// TestWaitsUseTheirOwnPool: a Store WithWaits blocks in Next and in a
// waiting ReadInbox on the waits pool, and sends everything else on its
// own: with the waits pool down, the waits fail and nothing else does.
func TestWaitsUseTheirOwnPool(t *testing.T) {
	be := redistest.Mini(t)
	ctx := context.Background()
	down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = down.Close() })
	s := taskstore.New(be.Client).WithWaits(down)
	now := time.Now().UTC()
	rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
		Steps: []task.Step{}, Warnings: []string{}}}
	if err := s.Create(ctx, rec); err != nil {
		t.Fatalf("create on the main pool: %v", err)
	}
	if err := s.EnsureGroup(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Enqueue(ctx, rec.ID); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.Next(ctx, "w", 10*time.Millisecond); !errors.Is(err, taskstore.ErrUnavailable) {
		t.Fatalf("Next on a waits pool that is down: %v, want ErrUnavailable", err)
	}
	if _, err := s.ReadInbox(ctx, rec.ID, "0", 10*time.Millisecond); !errors.Is(err, taskstore.ErrUnavailable) {
		t.Fatalf("a waiting ReadInbox on a waits pool that is down: %v, want ErrUnavailable", err)
	}
	if _, err := s.ReadInbox(ctx, rec.ID, "0", 0); err != nil {
		t.Fatalf("a ReadInbox that does not wait: %v", err)
	}
	e, ok, err := taskstore.New(be.Client).Next(ctx, "w", 10*time.Millisecond)
	if err != nil || !ok || e.Task != rec.ID {
		t.Fatalf("Next without a waits pool of its own: %+v %v %v", e, ok, err)
	}
}
