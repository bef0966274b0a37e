package taskstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/protect/kit/randhex"
)

// Entry is one admitted task on the queue: the stream entry's id and the
// task's id.
type Entry struct {
	ID   string // the queue entry (stream id)
	Task string
}

// Lease is a replica's right to write a task: the owner (the replica's
// consumer name) and the epoch the lease hash held when it was taken. A
// fenced write succeeds only while both still match.
type Lease struct {
	Entry Entry
	Owner string
	Epoch int64
}

// Enqueue puts an admitted task on the queue for any replica's worker.
func (s *Store) Enqueue(ctx context.Context, id string) error {
	if err := enqueueScript.Run(ctx, s.rdb, []string{QueueKey, enqueuedKey(id)}, id).Err(); err != nil {
		return unavailable(err)
	}
	return nil
}

// enqueuedKey marks a task as put on the queue, in the queue's slot.
func enqueuedKey(id string) string { return "faregate:tasks:{queue}:enq:" + id }

// enqueueScript puts a task on the queue once: a re-sent script (its reply
// lost) must not add a second entry, whose claim would fence the worker
// running the first. KEYS queue, marker. ARGV task id.
var enqueueScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'task', ARGV[1])
redis.call('SET', KEYS[2], 1, 'EX', 3600)
return 1
`)

// Depth is how many tasks wait or run: acknowledged entries are deleted,
// so the stream holds exactly the tasks not yet finished.
func (s *Store) Depth(ctx context.Context) (int64, error) {
	n, err := s.rdb.XLen(ctx, QueueKey).Result()
	if err != nil {
		return 0, unavailable(err)
	}
	return n, nil
}

// EnsureGroup creates the consumer group (and the stream) if missing.
func (s *Store) EnsureGroup(ctx context.Context) error {
	err := s.rdb.XGroupCreateMkStream(ctx, QueueKey, Group, "0").Err()
	if err != nil && !strings.Contains(err.Error(), "BUSYGROUP") {
		return unavailable(err)
	}
	return nil
}

// Next waits up to block for a task no worker has taken yet, and takes it
// for consumer: its entry becomes pending under consumer, idle 0. The wait
// holds a connection of the waits pool (WithWaits). It returns ok=false
// when none came.
func (s *Store) Next(ctx context.Context, consumer string, block time.Duration) (Entry, bool, error) {
	res, err := s.waits.XReadGroup(ctx, &redis.XReadGroupArgs{
		Group: Group, Consumer: consumer, Streams: []string{QueueKey, ">"}, Count: 1, Block: block,
	}).Result()
	if errors.Is(err, redis.Nil) {
		return Entry{}, false, nil
	}
	if err != nil {
		if strings.Contains(err.Error(), "NOGROUP") {
			// The queue was lost (a Redis without persistence restarted).
			if gerr := s.EnsureGroup(ctx); gerr != nil {
				return Entry{}, false, gerr
			}
			return Entry{}, false, nil
		}
		return Entry{}, false, unavailable(err)
	}
	for _, st := range res {
		for _, m := range st.Messages {
			id, _ := m.Values["task"].(string)
			return Entry{ID: m.ID, Task: id}, true, nil
		}
	}
	return Entry{}, false, nil
}

// Claim takes up to count entries whose lease lapsed (pending longer than
// minIdle: their replica stopped renewing) for consumer. Each is then
// handled by whoever claimed it: a task not started runs; a started one
// fails with worker_lost.
func (s *Store) Claim(ctx context.Context, consumer string, minIdle time.Duration, count int64) ([]Entry, error) {
	msgs, _, err := s.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{
		Stream: QueueKey, Group: Group, Consumer: consumer, MinIdle: minIdle, Start: "0-0", Count: count,
	}).Result()
	if err != nil {
		if strings.Contains(err.Error(), "NOGROUP") {
			return nil, s.EnsureGroup(ctx)
		}
		return nil, unavailable(err)
	}
	out := make([]Entry, 0, len(msgs))
	for _, m := range msgs {
		id, _ := m.Values["task"].(string)
		out = append(out, Entry{ID: m.ID, Task: id})
	}
	return out, nil
}

// renewScript keeps the given entries' leases: for each, if it is still
// pending under the consumer, XCLAIM it again (JUSTID: idle back to 0,
// delivery count unchanged); otherwise report it lost. KEYS queue. ARGV
// group, consumer, entry ids...
var renewScript = redis.NewScript(`
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 0 or p[1][2] ~= ARGV[2] then
    lost[#lost + 1] = ARGV[i]
  else
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  end
end
return lost
`)

// Renew extends the leases of entries held by consumer and returns the
// entries whose lease was lost (claimed by another replica).
func (s *Store) Renew(ctx context.Context, consumer string, entries []string) (lost []string, err error) {
	if len(entries) == 0 {
		return nil, nil
	}
	args := make([]any, 0, len(entries)+2)
	args = append(args, Group, consumer)
	for _, e := range entries {
		args = append(args, e)
	}
	res, err := renewScript.Run(ctx, s.rdb, []string{QueueKey}, args...).StringSlice()
	if err != nil {
		return nil, unavailable(err)
	}
	return res, nil
}

// Ack removes a finished entry from the queue.
func (s *Store) Ack(ctx context.Context, entry string) error {
	_, err := s.rdb.TxPipelined(ctx, func(p redis.Pipeliner) error {
		p.XAck(ctx, QueueKey, Group, entry)
		p.XDel(ctx, QueueKey, entry)
		return nil
	})
	if err != nil {
		return unavailable(err)
	}
	return nil
}

// acquireScript takes a task's lease for a new owner: the epoch goes up by
// one, so every write of an earlier owner is refused from now on. It
// returns {1, epoch, record} or {0} when the record is gone.
// KEYS record, lease. ARGV owner, ttl.
var acquireScript = redis.NewScript(`
local raw = redis.call('GET', KEYS[1])
if not raw then return {0} end
local epoch = redis.call('HINCRBY', KEYS[2], 'epoch', 1)
redis.call('HSET', KEYS[2], 'owner', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return {1, epoch, raw}
`)

// Acquire takes the lease of entry's task for owner and returns it with
// the task as stored. ErrNotFound: the record is gone (never stored, or
// expired): task.ErrNotFound; the caller acknowledges the entry and moves on.
func (s *Store) Acquire(ctx context.Context, e Entry, owner string) (Lease, task.Record, error) {
	if !task.ValidID(e.Task) {
		return Lease{}, task.Record{}, task.ErrNotFound
	}
	res, err := acquireScript.Run(ctx, s.rdb, []string{taskKey(e.Task), leaseKey(e.Task)},
		owner, int64(TaskTTL/time.Second)).Slice()
	if err != nil {
		return Lease{}, task.Record{}, unavailable(err)
	}
	if len(res) == 0 || res[0] != int64(1) || len(res) != 3 {
		return Lease{}, task.Record{}, task.ErrNotFound
	}
	epoch, _ := res[1].(int64)
	raw, _ := res[2].(string)
	var rec task.Record
	if err := json.Unmarshal([]byte(raw), &rec); err != nil {
		return Lease{}, task.Record{}, fmt.Errorf("taskstore: decode task %s: %w", e.Task, err)
	}
	return Lease{Entry: e, Owner: owner, Epoch: epoch}, rec, nil
}

// saveScript writes the record and appends events, fenced by the lease:
// only the owner of the current epoch may write. An op id, kept 300 s (far
// longer than any client retries), makes a re-sent script (after a lost
// reply) a no-op that answers success.
// KEYS record, events, lease, op. ARGV owner, epoch, record, ttl, maxlen,
// then type/data pairs. Returns 1 written (or already written), 0 fenced.
var saveScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[4]) == 1 then return 1 end
local l = redis.call('HMGET', KEYS[3], 'owner', 'epoch')
if l[1] ~= ARGV[1] or l[2] ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[3], 'EX', ARGV[4])
for i = 6, #ARGV, 2 do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'type', ARGV[i], 'data', ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
redis.call('SET', KEYS[4], 1, 'EX', 300)
return 1
`)

// Save writes rec and appends events under lease l, or returns
// ErrLeaseLost without writing anything when another owner or a newer epoch
// holds the task.
func (s *Store) Save(ctx context.Context, l Lease, rec task.Record, events ...task.Event) error {
	body, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("taskstore: encode task: %w", err)
	}
	args := make([]any, 0, 5+2*len(events))
	args = append(args, l.Owner, l.Epoch, body, int64(TaskTTL/time.Second), streamMaxLen)
	for _, e := range events {
		args = append(args, e.Type, string(e.Data))
	}
	op := randhex.New(16)
	n, err := saveScript.Run(ctx, s.rdb, []string{taskKey(rec.ID), eventsKey(rec.ID), leaseKey(rec.ID), opKey(rec.ID, op)}, args...).Int()
	if err != nil {
		return unavailable(err)
	}
	if n == 0 {
		return ErrLeaseLost
	}
	return nil
}
