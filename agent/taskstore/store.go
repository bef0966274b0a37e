// Package taskstore keeps tasks in Redis: each task's record and its event
// stream, the queue admitted tasks wait on, the leases that say which
// replica runs a task, and the readers that fan a task's events out to
// every follower in this process.
//
// # Keys
//
// A task's record (a JSON string), its event stream and its lease hash
// share the {id} hash tag, so one Lua script can check the lease and write
// the record and its events atomically, even on Redis Cluster. The queue is
// one stream with one consumer group; its pending entries' idle time is the
// lease clock, the one clock every replica agrees on because Redis keeps it.
//
//	faregate:task:{<id>}         the record
//	faregate:task:{<id>}:events  its events (XADD; followers XREAD)
//	faregate:task:{<id>}:lease   {owner, epoch}: who may write it
//	faregate:task:{<id>}:inbox   what the task key's holder posted (XADD by
//	                             agent/taskkey's scripts; the lease holder XREADs)
//	faregate:tasks:{queue}       admitted tasks (XADD; workers XREADGROUP)
//
// Redis task storage lives here and nowhere else: the runner and the
// remote executor read the queue and the inbox through a Store.
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

// TaskTTL is how long a task, its events and its lease are kept.
const TaskTTL = 7 * 24 * time.Hour

// streamMaxLen caps a task's event stream; a run has a few dozen events.
const streamMaxLen = 1000

var (
	// ErrUnavailable: Redis failed; the caller fails closed.
	ErrUnavailable = errors.New("taskstore: unavailable")
	// ErrExists: Create found the id taken (never by chance: 128 random bits).
	ErrExists = errors.New("taskstore: task exists")
	// ErrLeaseLost: a fenced write found that another replica (or the
	// reaper) took the task's lease; nothing was written.
	ErrLeaseLost = errors.New("taskstore: lease lost")
)

func taskKey(id string) string   { return "faregate:task:{" + id + "}" }
func eventsKey(id string) string { return "faregate:task:{" + id + "}:events" }
func leaseKey(id string) string  { return "faregate:task:{" + id + "}:lease" }
func opKey(id, op string) string { return "faregate:task:{" + id + "}:op:" + op }

// QueueKey is the stream admitted tasks wait on; Group its consumer group.
const (
	QueueKey = "faregate:tasks:{queue}"
	Group    = "workers"
)

// Store reads and writes tasks. It is safe for concurrent use.
type Store struct {
	rdb redis.UniversalClient
	// waits serves the reads that block in Redis (Next, and ReadInbox with
	// a wait); rdb unless WithWaits named a pool of their own.
	waits redis.UniversalClient
}

// New returns a Store on rdb.
func New(rdb redis.UniversalClient) *Store { return &Store{rdb: rdb, waits: rdb} }

// WithWaits returns a Store on the same Redis whose blocking reads (a
// worker's wait for the next task, a run's wait on its inbox) use waits.
// A blocked read holds its connection for as long as it waits, so these
// get a pool of their own, sized for the waiters, and the gate's short
// commands never queue behind them.
func (s *Store) WithWaits(waits redis.UniversalClient) *Store {
	c := *s
	c.waits = waits
	return &c
}

func unavailable(err error) error { return fmt.Errorf("%w: %v", ErrUnavailable, err) }

// createScript stores a new record and its first status event, unless the
// id exists. KEYS record, events. ARGV record, status data, ttl, maxlen.
var createScript = redis.NewScript(`
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[3]) == false then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'type', 'status', 'data', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
`)

// Create stores a new task with its first status event.
func (s *Store) Create(ctx context.Context, rec task.Record) error {
	body, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("taskstore: encode task: %w", err)
	}
	status, _ := json.Marshal(map[string]string{"status": rec.Status})
	n, err := createScript.Run(ctx, s.rdb, []string{taskKey(rec.ID), eventsKey(rec.ID)},
		body, status, int64(TaskTTL/time.Second), streamMaxLen).Int()
	if err != nil {
		return unavailable(err)
	}
	if n == 0 {
		// A re-sent create finds its own record: the first one applied.
		if got, gerr := s.Get(ctx, rec.ID); gerr == nil && got.CreatedAt.Equal(rec.CreatedAt) && got.Status == rec.Status {
			return nil
		}
		return ErrExists
	}
	return nil
}

// finalScript stores a task that is final, with its status and done
// events, so followers end at once. ARGV[6] is NX (a new task) or XX (only
// over a task that exists). KEYS record, events. ARGV record, status data,
// done data, ttl, maxlen, NX|XX.
var finalScript = redis.NewScript(`
if redis.call('SET', KEYS[1], ARGV[1], ARGV[6], 'EX', ARGV[4]) == false then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'type', 'status', 'data', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'type', 'done', 'data', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
`)

// writeFinal runs finalScript for rec with mode NX or XX and reports
// whether it wrote.
func (s *Store) writeFinal(ctx context.Context, rec task.Record, mode string) (bool, error) {
	body, err := json.Marshal(rec)
	if err != nil {
		return false, fmt.Errorf("taskstore: encode task: %w", err)
	}
	status, _ := json.Marshal(map[string]string{"status": rec.Status})
	done, _ := json.Marshal(rec.Task)
	n, err := finalScript.Run(ctx, s.rdb, []string{taskKey(rec.ID), eventsKey(rec.ID)},
		body, status, done, int64(TaskTTL/time.Second), streamMaxLen, mode).Int()
	if err != nil {
		return false, unavailable(err)
	}
	return n == 1, nil
}

// CreateFinal stores a task that is final from the start (a plan served
// from the cache), with its status and done events, so followers end at once.
func (s *Store) CreateFinal(ctx context.Context, rec task.Record) error {
	wrote, err := s.writeFinal(ctx, rec, "NX")
	if err != nil || wrote {
		return err
	}
	if got, gerr := s.Get(ctx, rec.ID); gerr == nil && got.CreatedAt.Equal(rec.CreatedAt) {
		return nil // a re-sent create finds its own record
	}
	return ErrExists
}

// FailUnqueued stores rec, already failed, over a task that was stored but
// could not be put on the queue, with its final events. No worker holds
// such a task (it was never handed out), so no lease fences it; a task
// that no longer exists is left alone.
func (s *Store) FailUnqueued(ctx context.Context, rec task.Record) error {
	_, err := s.writeFinal(ctx, rec, "XX")
	return err
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
		return task.Record{}, unavailable(err)
	}
	var rec task.Record
	if err := json.Unmarshal(raw, &rec); err != nil {
		return task.Record{}, fmt.Errorf("taskstore: decode task %s: %w", id, err)
	}
	return rec, nil
}

// Ping reports whether Redis answers.
func (s *Store) Ping(ctx context.Context) error {
	if err := s.rdb.Ping(ctx).Err(); err != nil {
		return unavailable(err)
	}
	return nil
}
