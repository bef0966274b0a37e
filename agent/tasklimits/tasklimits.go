// Package tasklimits holds the limits one task of an external agent has
// on every replica at once: the model calls it may make, its embedding
// calls, how many of those may be in flight together, its tool calls and
// its progress events. It is the one place they are counted, with one
// family of Redis scripts, and the one place they are read (Read).
//
// Per task, in the task's own hash slot (the task id is the hash tag, as
// for its key, lease and inbox; one cluster node holds them all):
//
//	faregate:task:{<id>}:limits    hash: calls, embeddings, tools, events
//	faregate:task:{<id>}:inflight  sorted set: calls in flight, by their lease's expiry (ms)
//
// A call takes a slot (Acquire): its count and a place in flight, at once;
// it gives the slot back when it ends, and the count too when no provider
// was asked (the governor refused it). A slot whose process died lapses
// after its lease instead of blocking the task for the rest of its run;
// a live call renews its lease every third of it. Tool calls and events
// are counts alone (Take). Both keys expire a lease after the task's
// deadline. Expiry is judged by the Redis server's clock, the one clock
// the replicas share.
//
// The built-in planner's steps and tool calls are bounded in its own
// process (agent.Config): a run lives in one process.
package tasklimits

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/randhex"
)

// Kind is what a use of a task's limits is, and the hash field counting it.
type Kind string

// The kinds of use. Calls and Embeddings take a slot in flight (Acquire),
// Tools and Events are counted only (Take).
const (
	Calls      Kind = "calls"      // chat and responses model calls
	Embeddings Kind = "embeddings" // embedding calls
	Tools      Kind = "tools"      // /v1/tools/fetch
	Events     Kind = "events"     // progress events
)

var (
	// ErrStepLimit: the task has made all the model calls (or all the
	// embedding calls) it may. 429 step_limit; it cannot clear before the
	// task ends (LimitError).
	ErrStepLimit = errors.New("tasklimits: the task has no calls of this kind left")
	// ErrTooManyCalls: Parallel calls of the task are in flight. 429
	// too_many_calls, Retry-After 1.
	ErrTooManyCalls = errors.New("tasklimits: too many calls of the task in flight")
	// ErrToolLimit and ErrEventLimit: the task made all its tool calls or
	// posted all its events. 429 tool_limit, event_limit (LimitError).
	ErrToolLimit  = errors.New("tasklimits: tool limit")
	ErrEventLimit = errors.New("tasklimits: event limit")
	// ErrUnavailable: Redis failed; the caller fails closed. 503
	// demo_protection_unavailable.
	ErrUnavailable = errors.New("tasklimits: per-task limits unavailable")
)

// LimitError is a refusal by one of the task's own limits, which cannot
// clear before the task ends: it says when that is.
type LimitError struct {
	Err      error // ErrStepLimit, ErrToolLimit or ErrEventLimit
	Kind     Kind
	Max      int64
	Deadline time.Time
	// After is the time left to the deadline when it refused.
	After time.Duration
}

func (e *LimitError) Error() string { return fmt.Sprintf("%v: %s (%d)", e.Err, e.Kind, e.Max) }
func (e *LimitError) Unwrap() error { return e.Err }

// Limit is the limit that refused (the RateLimit policy's quota).
func (e *LimitError) Limit() int64 { return e.Max }

// RetryAfter is the time left to the task's deadline, at least a second.
func (e *LimitError) RetryAfter() time.Duration { return max(e.After, time.Second) }

// TaskDeadline is when the refusal's task ends at the latest.
func (e *LimitError) TaskDeadline() time.Time { return e.Deadline }

// busyError is ErrTooManyCalls with its Retry-After.
type busyError struct{}

func (busyError) Error() string             { return ErrTooManyCalls.Error() }
func (busyError) Unwrap() error             { return ErrTooManyCalls }
func (busyError) RetryAfter() time.Duration { return time.Second }

// Limits are the most of each kind one task may use. A negative limit is
// none; 0 allows none of that kind (FAREGATE_AGENT_MAX_TOOL_CALLS=0: no
// fetches).
type Limits struct {
	Calls      int64 // FAREGATE_AGENT_MAX_CALLS
	Embeddings int64 // FAREGATE_AGENT_MAX_EMBEDDING_CALLS
	// Parallel bounds the calls and embedding calls in flight together
	// (FAREGATE_AGENT_MAX_PARALLEL).
	Parallel int64
	Tools    int64 // FAREGATE_AGENT_MAX_TOOL_CALLS
	Events   int64 // progress events (200)
}

// of is the limit of kind.
func (l Limits) of(k Kind) int64 {
	switch k {
	case Calls:
		return l.Calls
	case Embeddings:
		return l.Embeddings
	case Tools:
		return l.Tools
	case Events:
		return l.Events
	}
	return 0
}

// refusal is the sentinel a count past its limit of kind is refused with.
func refusal(k Kind) error {
	switch k {
	case Tools:
		return ErrToolLimit
	case Events:
		return ErrEventLimit
	}
	return ErrStepLimit
}

// Task is what the limits need of a task: its id, and its deadline, after
// which its keys are of no use.
type Task struct {
	ID       string
	Deadline time.Time
}

// Options configure a Store.
type Options struct {
	Limits Limits
	// Lease is how long a slot outlives a process that died holding it;
	// 0: 15 s.
	Lease  time.Duration
	Logger *slog.Logger
	// Now is the clock for the keys' lifetime and Retry-After.
	Now func() time.Time
}

const defaultLease = 15 * time.Second

// Store counts the limits of every task in Redis. It is safe for
// concurrent use.
type Store struct {
	rdb redis.Scripter
	o   Options
}

// New returns a Store on rdb.
func New(rdb redis.Scripter, o Options) *Store {
	if o.Lease <= 0 {
		o.Lease = defaultLease
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Store{rdb: rdb, o: o}
}

// LimitsKey is the hash of task id's counts.
func LimitsKey(id string) string { return "faregate:task:{" + id + "}:limits" }

// InflightKey is the sorted set of task id's calls in flight, scored by
// their lease's expiry (ms).
func InflightKey(id string) string { return "faregate:task:{" + id + "}:inflight" }

// The scripts. Each one's answer {0, n} is admitted (n the new count), {1,
// n} past the kind's limit, {2, n} too many in flight. A limit below 0 is
// none. Redis's own TIME is the clock of the leases.

// acquireScript takes a slot. KEYS limits, inflight; ARGV kind, limit,
// parallel, lease ms, slot, ttl ms.
var acquireScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local used = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local most = tonumber(ARGV[2])
if most >= 0 and used >= most then return {1, used} end
local inflight = redis.call('ZCARD', KEYS[2])
local par = tonumber(ARGV[3])
if par >= 0 and inflight >= par then return {2, inflight} end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[6])
return {0, used + 1}
`)

// takeScript counts one use. KEYS limits; ARGV kind, limit, ttl ms.
var takeScript = redis.NewScript(`
local used = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local most = tonumber(ARGV[2])
if most >= 0 and used >= most then return {1, used} end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {0, used + 1}
`)

// releaseScript gives a slot back. KEYS limits, inflight; ARGV slot, the
// kind to refund ("": none). A slot already gone (lapsed, or released
// before) is not refunded twice.
var releaseScript = redis.NewScript(`
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 and ARGV[2] ~= '' then
  local c = tonumber(redis.call('HGET', KEYS[1], ARGV[2]) or '0')
  if c > 0 then redis.call('HINCRBY', KEYS[1], ARGV[2], -1) end
end
return removed
`)

// renewScript moves a live slot's expiry on; a lapsed one stays gone.
// KEYS inflight; ARGV slot, lease ms.
var renewScript = redis.NewScript(`
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
`)

// ttl is how long t's keys live: until it cannot use them, plus a lease.
func (s *Store) ttl(t Task) time.Duration {
	if t.Deadline.IsZero() {
		return 24 * time.Hour
	}
	return max(t.Deadline.Sub(s.o.Now())+s.o.Lease, s.o.Lease)
}

// refused turns a script's answer into its refusal (nil when admitted).
func (s *Store) refused(res []int64, t Task, k Kind) error {
	switch res[0] {
	case 1:
		now := s.o.Now()
		after := time.Hour
		if !t.Deadline.IsZero() {
			after = max(t.Deadline.Sub(now), time.Second)
		}
		return &LimitError{Err: refusal(k), Kind: k, Max: s.o.Limits.of(k), Deadline: t.Deadline, After: after}
	case 2:
		return busyError{}
	}
	return nil
}

// Take counts one use of kind (Tools, Events) by task t against its
// limit: one round trip. A refusal is a *LimitError.
func (s *Store) Take(ctx context.Context, t Task, k Kind) error {
	res, err := takeScript.Run(ctx, s.rdb, []string{LimitsKey(t.ID)}, string(k), s.o.Limits.of(k), s.ttl(t).Milliseconds()).Int64Slice()
	if err != nil || len(res) != 2 {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return s.refused(res, t, k)
}

// Acquire takes a slot for one call of kind (Calls, Embeddings) of task
// t: counted against its kind's limit and, while it runs, against
// Parallel. One round trip. release ends it, on ctx (the values of the
// round trip it rides in; its cancellation is ignored); with used false
// (no provider was asked) the call is not counted either. release is safe
// to call more than once: the first call counts. A refusal is a
// *LimitError, or ErrTooManyCalls with Retry-After 1.
func (s *Store) Acquire(ctx context.Context, t Task, k Kind) (release func(ctx context.Context, used bool), err error) {
	slot := randhex.New(16)
	keys := []string{LimitsKey(t.ID), InflightKey(t.ID)}
	res, err := acquireScript.Run(ctx, s.rdb, keys, string(k), s.o.Limits.of(k), s.o.Limits.Parallel,
		s.o.Lease.Milliseconds(), slot, s.ttl(t).Milliseconds()).Int64Slice()
	if err != nil || len(res) != 2 {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := s.refused(res, t, k); err != nil {
		return nil, err
	}
	r := &renewal{s: s, key: keys[1], slot: slot}
	r.schedule()
	var once sync.Once
	return func(ctx context.Context, used bool) {
		once.Do(func() {
			r.stop()
			refund := string(k)
			if used {
				refund = ""
			}
			// The slot is returned even when the call's context is gone
			// (the client left, the task ended); a failure here only
			// leaves it to lapse with its lease.
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			if err := releaseScript.Run(ctx, s.rdb, keys, slot, refund).Err(); err != nil {
				s.o.Logger.Warn("tasklimits: releasing a call slot failed; it lapses with its lease", "task", t.ID, "err", err)
			}
		})
	}, nil
}

// Counts is a task's use of its limits.
type Counts struct {
	Calls, Embeddings, Tools, Events int64
	// InFlight are its calls in flight whose lease has not lapsed.
	InFlight int64
}

// readScript reads the counts and the live slots. KEYS limits, inflight.
var readScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local c = redis.call('HMGET', KEYS[1], 'calls', 'embeddings', 'tools', 'events')
return {tonumber(c[1] or '0'), tonumber(c[2] or '0'), tonumber(c[3] or '0'), tonumber(c[4] or '0'),
  redis.call('ZCOUNT', KEYS[2], '(' .. now, '+inf')}
`)

// Read returns task id's counts: one round trip.
func (s *Store) Read(ctx context.Context, id string) (Counts, error) {
	n, err := readScript.Run(ctx, s.rdb, []string{LimitsKey(id), InflightKey(id)}).Int64Slice()
	if err != nil || len(n) != 5 {
		return Counts{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return Counts{Calls: n[0], Embeddings: n[1], Tools: n[2], Events: n[3], InFlight: n[4]}, nil
}

// renewal keeps a live call's slot from lapsing: every third of the lease
// a timer moves its expiry on. It is a timer, not a goroutine of its own
// waiting on a ticker: a stream held open for minutes then costs its slot
// a few hundred bytes instead of a goroutine's stack (the model endpoint's
// memory per open stream, BenchmarkGovernedOpenStreams), and a renewal runs
// on a goroutine only while its round trip is under way.
type renewal struct {
	s         *Store
	key, slot string
	mu        sync.Mutex
	timer     *time.Timer
	stopped   bool
}

func (r *renewal) schedule() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.stopped {
		r.timer = time.AfterFunc(r.s.o.Lease/3, r.renew)
	}
}

// renew runs on the timer's goroutine, one at a time: the next is
// scheduled only when this one is done.
func (r *renewal) renew() {
	ctx, cancel := context.WithTimeout(context.Background(), r.s.o.Lease/3)
	n, err := renewScript.Run(ctx, r.s.rdb, []string{r.key}, r.slot, r.s.o.Lease.Milliseconds()).Int()
	cancel()
	if err == nil && n == 0 {
		return // lapsed: nothing to keep
	}
	r.schedule()
}

// stop ends the renewals; one under way may still finish, and finds the
// slot gone once it is released (the script renews only a live slot).
func (r *renewal) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = true
	if r.timer != nil {
		r.timer.Stop()
	}
}
