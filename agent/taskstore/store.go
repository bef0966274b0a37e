// Package taskstore keeps tasks and their event streams in Redis, so every
// replica can answer for any task and clients can follow a run live from
// any of them.
package taskstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
)

// ErrUnavailable: the task store (Redis) failed.
var ErrUnavailable = errors.New("taskstore: unavailable")

// TaskTTL is how long a task and its events are kept.
const TaskTTL = 7 * 24 * time.Hour

// streamMaxLen caps a task's event stream; a run has a few dozen events.
const streamMaxLen = 1000

// Store keeps tasks as JSON strings and their events as Redis Streams.
// Both keys of a task share the {id} hash tag, so one MULTI updates them
// together even on Redis Cluster. Every replica reads the same data.
type Store struct {
	rdb redis.Cmdable
	// Poll is how often a follower looks for new events; KeepAlive how often
	// it emits a keep-alive while nothing happens.
	Poll      time.Duration
	KeepAlive time.Duration
}

// New returns a Store on rdb.
func New(rdb redis.Cmdable) *Store {
	return &Store{rdb: rdb, Poll: 200 * time.Millisecond, KeepAlive: 15 * time.Second}
}

func taskKey(id string) string   { return "faregate:task:{" + id + "}" }
func eventsKey(id string) string { return "faregate:task:{" + id + "}:events" }

// Create stores a new task and its first status event. Ids carry 128
// random bits; SETNX still guarantees an existing task is never overwritten.
func (s *Store) Create(ctx context.Context, rec task.Record) error {
	body, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("taskstore: encode task: %w", err)
	}
	status, _ := json.Marshal(map[string]string{"status": rec.Status})
	_, err = s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.SetNX(ctx, taskKey(rec.ID), body, TaskTTL)
		s.addEvent(ctx, p, rec.ID, task.EventStatus, status)
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

// Save writes the task and appends events in one transaction.
func (s *Store) Save(ctx context.Context, rec task.Record, events ...task.Event) error {
	body, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("taskstore: encode task: %w", err)
	}
	_, err = s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.Set(ctx, taskKey(rec.ID), body, TaskTTL)
		for _, e := range events {
			s.addEvent(ctx, p, rec.ID, e.Type, e.Data)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

func (s *Store) addEvent(ctx context.Context, p redis.Pipeliner, id, typ string, data []byte) {
	p.XAdd(ctx, &redis.XAddArgs{
		Stream: eventsKey(id),
		MaxLen: streamMaxLen,
		Approx: true,
		Values: []any{"type", typ, "data", string(data)},
	})
	p.Expire(ctx, eventsKey(id), TaskTTL)
}

// Get loads a task.
func (s *Store) Get(ctx context.Context, id string) (task.Record, error) {
	if !task.ValidID(id) {
		return task.Record{}, task.ErrNotFound
	}
	raw, err := s.rdb.Get(ctx, taskKey(id)).Bytes()
	if errors.Is(err, redis.Nil) {
		return task.Record{}, task.ErrNotFound
	}
	if err != nil {
		return task.Record{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	var rec task.Record
	if err := json.Unmarshal(raw, &rec); err != nil {
		return task.Record{}, fmt.Errorf("taskstore: decode task %s: %w", id, err)
	}
	return rec, nil
}

// Follow replays the task's events after the stream id after ("" = from the
// first one) and then follows new ones until the done event, calling fn for
// each (and with task.EventKeepAlive while idle). It returns nil after done,
// ctx.Err() when the client leaves, or fn's error.
func (s *Store) Follow(ctx context.Context, id, after string, fn func(task.Event) error) error {
	if _, err := s.Get(ctx, id); err != nil {
		return err
	}
	last := after
	if last == "" {
		last = "0-0"
	}
	idleSince := time.Now()
	finalSeen := false
	for {
		res, err := s.rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{eventsKey(id), last}, Count: 100, Block: -1}).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("%w: %v", ErrUnavailable, err)
		}
		n := 0
		for _, st := range res {
			for _, m := range st.Messages {
				n++
				last = m.ID
				typ, _ := m.Values["type"].(string)
				data, _ := m.Values["data"].(string)
				if err := fn(task.Event{ID: m.ID, Type: typ, Data: json.RawMessage(data)}); err != nil {
					return err
				}
				if typ == task.EventDone {
					return nil
				}
			}
		}
		if n > 0 {
			idleSince = time.Now()
			continue
		}
		// Nothing new. If the task is already final its done event was
		// trimmed or expired; answer from the record so no follower waits forever.
		// The record and its done event are written in one transaction, so
		// one more read settles a race with the final save.
		if rec, err := s.Get(ctx, id); err != nil {
			return err
		} else if rec.Final() {
			if !finalSeen {
				finalSeen = true
				continue
			}
			data, _ := json.Marshal(rec.Task)
			return fn(task.Event{ID: last, Type: task.EventDone, Data: data})
		}
		if time.Since(idleSince) >= s.KeepAlive {
			idleSince = time.Now()
			if err := fn(task.Event{Type: task.EventKeepAlive}); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(s.Poll):
		}
	}
}

// Ping reports whether Redis answers (readiness).
func (s *Store) Ping(ctx context.Context) error {
	if err := s.rdb.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}
