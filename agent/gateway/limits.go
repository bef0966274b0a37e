package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Limiter bounds the model calls of one task: how many it may make in all
// and how many may be in flight at once.
type Limiter interface {
	// Acquire takes a slot for one chat or responses call of the task
	// (ErrStepLimit, ErrTooManyCalls, ErrLimitsUnavailable). release ends
	// it, on ctx (the values of the round trip it rides in; its
	// cancellation is ignored); with used false (the governor refused
	// before any provider was asked) the call is not counted either.
	// release is safe to call more than once: the first call counts.
	Acquire(ctx context.Context, t Task) (release func(ctx context.Context, used bool), err error)
}

// RedisLimits is the Limiter shared by every replica. The call count is a
// counter; the calls in flight are a sorted set of slots scored by their
// lease's expiry, so a slot whose process died lapses after Lease instead
// of blocking the task for the rest of its run. A live call renews its
// lease every third of it. Both keys carry the task id as their hash tag
// (the task's own slot on a cluster) and expire after the task's deadline.
// Expiry is judged by the Redis server's clock, the one clock the replicas
// share.
type RedisLimits struct {
	Client      redis.Scripter
	MaxCalls    int // FAREGATE_AGENT_MAX_CALLS; 0: no limit
	MaxParallel int // FAREGATE_AGENT_MAX_PARALLEL; 0: no limit
	// Lease is how long a slot outlives a process that died holding it;
	// 0: 15 s.
	Lease  time.Duration
	Logger *slog.Logger
	// Now is the clock for the keys' lifetime and Retry-After.
	Now func() time.Time
}

// CallsKey is the counter of a task's model calls.
func CallsKey(taskID string) string { return "faregate:task:{" + taskID + "}:v1:calls" }

// InflightKey is the sorted set of a task's calls in flight, scored by
// their lease's expiry (ms).
func InflightKey(taskID string) string { return "faregate:task:{" + taskID + "}:v1:inflight" }

// limitsAcquire: KEYS calls, inflight; ARGV lease ms, max calls, max
// parallel, slot, key ttl ms. Returns {0, calls} admitted, {1, calls} out
// of calls, {2, in flight} too many in flight.
var limitsAcquire = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local calls = tonumber(redis.call('GET', KEYS[1]) or '0')
local maxCalls = tonumber(ARGV[2])
if maxCalls > 0 and calls >= maxCalls then return {1, calls} end
local inflight = redis.call('ZCARD', KEYS[2])
local maxPar = tonumber(ARGV[3])
if maxPar > 0 and inflight >= maxPar then return {2, inflight} end
redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[1]), ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return {0, calls + 1}
`)

// limitsRelease: KEYS calls, inflight; ARGV slot, refund (1: the call
// is not counted). A slot already gone (lapsed, or released before) is
// not refunded twice.
var limitsRelease = redis.NewScript(`
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
if removed == 1 and ARGV[2] == '1' then
  local c = tonumber(redis.call('GET', KEYS[1]) or '0')
  if c > 0 then redis.call('DECR', KEYS[1]) end
end
return removed
`)

// limitsRenew: KEYS inflight; ARGV slot, lease ms. Moves a live slot's
// expiry on; a lapsed one stays gone.
var limitsRenew = redis.NewScript(`
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
`)

const defaultLease = 15 * time.Second

// Acquire implements Limiter: one round trip.
func (l *RedisLimits) Acquire(ctx context.Context, t Task) (func(context.Context, bool), error) {
	lease := l.Lease
	if lease <= 0 {
		lease = defaultLease
	}
	now := time.Now
	if l.Now != nil {
		now = l.Now
	}
	var id [16]byte
	_, _ = rand.Read(id[:])
	slot := hex.EncodeToString(id[:])
	// The keys live until the task cannot call any more, plus a lease.
	ttl := 24 * time.Hour
	if !t.Deadline.IsZero() {
		ttl = max(t.Deadline.Sub(now())+lease, lease)
	}
	keys := []string{CallsKey(t.ID), InflightKey(t.ID)}
	res, err := limitsAcquire.Run(ctx, l.Client, keys,
		lease.Milliseconds(), l.MaxCalls, l.MaxParallel, slot, ttl.Milliseconds()).Int64Slice()
	if err != nil || len(res) != 2 {
		return nil, fmt.Errorf("%w: %v", ErrLimitsUnavailable, err)
	}
	switch res[0] {
	case 1:
		return nil, &retryError{ErrStepLimit, untilDeadline(t, now())}
	case 2:
		return nil, &retryError{ErrTooManyCalls, time.Second}
	}
	r := &renewal{l: l, key: keys[1], slot: slot, lease: lease}
	r.schedule()
	var once sync.Once
	return func(ctx context.Context, used bool) {
		once.Do(func() {
			r.stop()
			refund := "0"
			if !used {
				refund = "1"
			}
			// The slot is returned even when the call's context is gone
			// (the client left, the task ended); a failure here only
			// leaves it to lapse with its lease.
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			defer cancel()
			if err := limitsRelease.Run(ctx, l.Client, keys, slot, refund).Err(); err != nil {
				l.log().Warn("gateway: releasing a call slot failed; it lapses with its lease", "task", t.ID, "err", err)
			}
		})
	}, nil
}

// renewal keeps a live call's slot from lapsing: every third of the lease
// a timer moves its expiry on. It is a timer, not a goroutine of its own
// waiting on a ticker: a stream held open for minutes then costs its slot
// a few hundred bytes instead of a goroutine's stack (the model endpoint's
// memory per open stream, BenchmarkGovernedOpenStreams), and a renewal runs
// on a goroutine only while its round trip is under way.
type renewal struct {
	l         *RedisLimits
	key, slot string
	lease     time.Duration
	mu        sync.Mutex
	timer     *time.Timer
	stopped   bool
}

func (r *renewal) schedule() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.stopped {
		r.timer = time.AfterFunc(r.lease/3, r.renew)
	}
}

// renew runs on the timer's goroutine, one at a time: the next is
// scheduled only when this one is done.
func (r *renewal) renew() {
	ctx, cancel := context.WithTimeout(context.Background(), r.lease/3)
	n, err := limitsRenew.Run(ctx, r.l.Client, []string{r.key}, r.slot, r.lease.Milliseconds()).Int()
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

func (l *RedisLimits) log() *slog.Logger {
	if l.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l.Logger
}

// untilDeadline is the Retry-After of a refusal that cannot clear before
// the task ends.
func untilDeadline(t Task, now time.Time) time.Duration {
	if t.Deadline.IsZero() {
		return time.Hour
	}
	return max(t.Deadline.Sub(now), time.Second)
}
