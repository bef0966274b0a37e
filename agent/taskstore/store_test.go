package taskstore

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

func newRecord() task.Record {
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	return task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
		Steps: []task.Step{}, Warnings: []string{}}, Principal: "v_aa", Day: "2026-12-01"}
}

// events reads a task's whole event stream.
func events(t *testing.T, rdb redis.Cmdable, id string) []redis.XMessage {
	t.Helper()
	msgs, err := rdb.XRange(context.Background(), eventsKey(id), "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

// TestCreateGet on both backends: a record and its first status event; an
// id is never overwritten; a re-sent create of the same record succeeds.
func TestCreateGet(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(be.Client)
			rec := newRecord()
			if err := s.Create(ctx, rec); err != nil {
				t.Fatal(err)
			}
			if err := s.Create(ctx, rec); err != nil {
				t.Fatalf("re-sent create of the same record: %v", err)
			}
			other := rec
			other.CreatedAt = rec.CreatedAt.Add(time.Second)
			if err := s.Create(ctx, other); !errors.Is(err, ErrExists) {
				t.Fatalf("create over another task: %v, want ErrExists", err)
			}
			got, err := s.Get(ctx, rec.ID)
			if err != nil || got.ID != rec.ID || got.Status != task.StatusQueued || got.Principal != "v_aa" {
				t.Fatalf("get: %+v %v", got, err)
			}
			if ev := events(t, be.Client, rec.ID); len(ev) != 1 || ev[0].Values["type"] != task.EventStatus {
				t.Fatalf("events after create: %+v", ev)
			}
			for _, id := range []string{task.NewID(), "t_nothex!", ""} {
				if _, err := s.Get(ctx, id); !errors.Is(err, task.ErrNotFound) {
					t.Fatalf("get %q: %v, want not found", id, err)
				}
			}
			ttl, _ := be.Client.TTL(ctx, taskKey(rec.ID)).Result()
			if ttl < TaskTTL-time.Minute {
				t.Fatalf("record ttl %v", ttl)
			}
		})
	}
}

// TestQueueAndLeases on both backends: a task is taken once, its lease
// fences writes, renewals keep it, another consumer's claim takes it away.
func TestQueueAndLeases(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(be.Client)
			if err := s.EnsureGroup(ctx); err != nil {
				t.Fatal(err)
			}
			if err := s.EnsureGroup(ctx); err != nil {
				t.Fatalf("second EnsureGroup: %v", err)
			}
			rec := newRecord()
			if err := s.Create(ctx, rec); err != nil {
				t.Fatal(err)
			}
			if err := s.Enqueue(ctx, rec.ID); err != nil {
				t.Fatal(err)
			}
			if n, _ := s.Depth(ctx); n != 1 {
				t.Fatalf("depth %d, want 1", n)
			}
			e, ok, err := s.Next(ctx, "a", 0)
			if err != nil || !ok || e.Task != rec.ID {
				t.Fatalf("next: %+v %v %v", e, ok, err)
			}
			if _, ok, _ := s.Next(ctx, "b", 10*time.Millisecond); ok {
				t.Fatal("a taken task was handed out twice")
			}
			la, got, err := s.Acquire(ctx, e, "a")
			if err != nil || got.Status != task.StatusQueued || la.Epoch != 1 {
				t.Fatalf("acquire: %+v %+v %v", la, got, err)
			}
			got.Status = task.StatusRunning
			if err := s.Save(ctx, la, got, task.Event{Type: task.EventStatus, Data: []byte(`{"status":"running"}`)}); err != nil {
				t.Fatalf("save under the lease: %v", err)
			}
			if lost, err := s.Renew(ctx, "a", []string{e.ID}); err != nil || len(lost) != 0 {
				t.Fatalf("renew: %v %v", lost, err)
			}
			if lost, _ := s.Renew(ctx, "b", []string{e.ID}); len(lost) != 1 {
				t.Fatalf("renew by a consumer that does not hold it: lost %v, want the entry", lost)
			}

			// Another replica takes the lease (as the reaper does after a claim):
			// the first owner's writes are refused from then on.
			lb, cur, err := s.Acquire(ctx, e, "b")
			if err != nil || lb.Epoch != 2 || cur.Status != task.StatusRunning {
				t.Fatalf("second acquire: %+v %+v %v", lb, cur, err)
			}
			before := len(events(t, be.Client, rec.ID))
			got.Status = task.StatusSucceeded
			if err := s.Save(ctx, la, got, task.Event{Type: task.EventDone, Data: []byte(`{}`)}); !errors.Is(err, ErrLeaseLost) {
				t.Fatalf("save by the old owner: %v, want ErrLeaseLost", err)
			}
			if after := len(events(t, be.Client, rec.ID)); after != before {
				t.Fatalf("a fenced save appended events (%d → %d)", before, after)
			}
			if now, _ := s.Get(ctx, rec.ID); now.Status != task.StatusRunning {
				t.Fatalf("a fenced save changed the record: %s", now.Status)
			}
			cur.Status = task.StatusFailed
			if err := s.Save(ctx, lb, cur); err != nil {
				t.Fatalf("save by the new owner: %v", err)
			}
			if err := s.Ack(ctx, e.ID); err != nil {
				t.Fatal(err)
			}
			if n, _ := s.Depth(ctx); n != 0 {
				t.Fatalf("depth after ack %d, want 0", n)
			}
			if _, _, err := s.Acquire(ctx, Entry{ID: "1-1", Task: task.NewID()}, "a"); !errors.Is(err, task.ErrNotFound) {
				t.Fatalf("acquire of a task never stored: %v", err)
			}
		})
	}
}

// TestClaimAfterLapse: an entry not renewed for minIdle is claimed by
// another consumer; one that is renewed is not.
func TestClaimAfterLapse(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(be.Client)
			if err := s.EnsureGroup(ctx); err != nil {
				t.Fatal(err)
			}
			var ids []string
			for i := 0; i < 2; i++ {
				rec := newRecord()
				if err := s.Create(ctx, rec); err != nil {
					t.Fatal(err)
				}
				if err := s.Enqueue(ctx, rec.ID); err != nil {
					t.Fatal(err)
				}
				e, ok, err := s.Next(ctx, "dead", 0)
				if err != nil || !ok {
					t.Fatal(err)
				}
				ids = append(ids, e.ID)
			}
			const minIdle = 200 * time.Millisecond
			var claimed []Entry
			// The entry's idle time is Redis's clock: poll until it lapses.
			clocktest.Poll(10*time.Second, func() bool {
				// The live replica renews the second entry; the first lapses.
				if _, err := s.Renew(ctx, "dead", ids[1:]); err != nil {
					t.Fatal(err)
				}
				if be.Mini != nil {
					be.Mini.FastForward(minIdle / 4)
				}
				c, err := s.Claim(ctx, "live", minIdle, 10)
				if err != nil {
					t.Fatal(err)
				}
				claimed = append(claimed, c...)
				return len(claimed) > 0
			})
			if len(claimed) != 1 || claimed[0].ID != ids[0] {
				t.Fatalf("claimed %+v, want only %s", claimed, ids[0])
			}
			if lost, _ := s.Renew(ctx, "dead", ids[:1]); len(lost) != 1 {
				t.Fatalf("the dead consumer's renewal of a claimed entry: lost %v", lost)
			}
		})
	}
}

// TestSaveLostReplyAppendsOnce: a save whose reply was lost and that the
// client sends again appends its events once.
func TestSaveLostReplyAppendsOnce(t *testing.T) {
	srv := redistest.Start(t)
	f := redistest.NewFaults()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), Dialer: f.Dialer(nil), ReadTimeout: 300 * time.Millisecond, MaxRetries: 2})
	t.Cleanup(func() { _ = rdb.Close() })
	ctx := context.Background()
	s := New(rdb)
	rec := newRecord()
	if err := s.Create(ctx, rec); err != nil {
		t.Fatal(err)
	}
	l, _, err := s.Acquire(ctx, Entry{ID: "1-1", Task: rec.ID}, "a")
	if err != nil {
		t.Fatal(err)
	}
	// The script is loaded by a first save, so the lost reply is an EVALSHA's.
	if err := s.Save(ctx, l, rec); err != nil {
		t.Fatal(err)
	}
	f.LoseNextReply(":events")
	if err := s.Save(ctx, l, rec, task.Event{Type: task.EventStep, Data: []byte(`{"seq":1}`)}); err != nil {
		t.Fatalf("save after a lost reply: %v", err)
	}
	if f.Lost() != 1 {
		t.Fatalf("%d replies lost, want 1", f.Lost())
	}
	if n := len(events(t, rdb, rec.ID)); n != 2 {
		t.Fatalf("%d events, want 2 (create's status and one step)", n)
	}
}

func doneData(t *testing.T, rec task.Record) []byte {
	t.Helper()
	b, err := json.Marshal(rec.Task)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestEnqueueOnce: putting one task on the queue twice (a script re-sent
// after its reply was lost) leaves one entry.
func TestEnqueueOnce(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(be.Client)
			id := task.NewID()
			for i := 0; i < 2; i++ {
				if err := s.Enqueue(ctx, id); err != nil {
					t.Fatal(err)
				}
			}
			if n, _ := s.Depth(ctx); n != 1 {
				t.Fatalf("depth %d after enqueueing one task twice, want 1", n)
			}
		})
	}
}
