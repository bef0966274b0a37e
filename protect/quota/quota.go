// Package quota counts task creations per visitor and for the whole site per
// UTC day, in Redis, with one Lua script that checks both limits and
// increments both atomically. Replicas share the counters, so limits hold
// exactly however many processes serve the site.
package quota

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// KeyTTL is how long a day's counters live: long enough to outlast the day
// in every time zone's view of it, short enough that Redis cleans up itself.
const KeyTTL = 48 * time.Hour

var (
	// ErrVisitorLimit: the visitor used its daily tasks (429 demo_ip_limit_reached).
	ErrVisitorLimit = errors.New("quota: visitor daily limit reached")
	// ErrGlobalLimit: the site used its daily tasks (429 demo_global_limit_reached).
	ErrGlobalLimit = errors.New("quota: global daily limit reached")
	// ErrUnavailable: Redis did not answer; the caller must refuse (503), never admit.
	ErrUnavailable = errors.New("quota: unavailable")
)

// takeScript checks both limits and counts both, or neither. The visitor's
// limit is checked first so that when both are exhausted the visitor's code wins.
// Replies {decision, visitor_remaining, global_remaining}; decision 0 admits,
// 1 refuses for the visitor, 2 for the site.
var takeScript = redis.NewScript(`
local ip = tonumber(redis.call('GET', KEYS[1]) or '0')
local g = tonumber(redis.call('GET', KEYS[2]) or '0')
local ipl = tonumber(ARGV[1])
local gl = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local function rem(limit, used)
  if used >= limit then return 0 end
  return limit - used
end
if ip >= ipl then return {1, rem(ipl, ip), rem(gl, g)} end
if g >= gl then return {2, rem(ipl, ip), rem(gl, g)} end
ip = redis.call('INCR', KEYS[1])
if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ttl) end
g = redis.call('INCR', KEYS[2])
if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ttl) end
return {0, rem(ipl, ip), rem(gl, g)}
`)

// Limits are the daily task limits.
type Limits struct {
	Visitor int64
	Global  int64
}

// Decision is the outcome of a check or a take.
type Decision struct {
	// Err is nil when admitted, else ErrVisitorLimit or ErrGlobalLimit.
	Err              error
	VisitorRemaining int64
	GlobalRemaining  int64
	// Reset is the next UTC midnight, when the counters start again.
	Reset time.Time
}

// Allowed reports whether the decision admits.
func (d Decision) Allowed() bool { return d.Err == nil }

// Quota is safe for concurrent use.
type Quota struct {
	rdb    redis.Scripter
	limits Limits
	now    func() time.Time

	// Denials cannot be undone within their UTC day, so a visitor (or the
	// site) once refused is refused again from memory: cheap under a flood,
	// and it still works while Redis is down. Admissions always ask Redis.
	mu            sync.Mutex
	denialDay     string
	deniedVisitor map[string]struct{}
	deniedGlobal  bool
}

// maxRemembered bounds the denial memory; past it, denials still work, they
// just ask Redis again.
const maxRemembered = 200_000

// New returns a Quota on rdb. now may be nil (time.Now).
func New(rdb redis.Scripter, limits Limits, now func() time.Time) *Quota {
	if now == nil {
		now = time.Now
	}
	return &Quota{rdb: rdb, limits: limits, now: now, deniedVisitor: map[string]struct{}{}}
}

// Limits returns the configured limits.
func (q *Quota) Limits() Limits { return q.limits }

// Day is the UTC date of t as used in keys.
func Day(t time.Time) string { return t.UTC().Format("2006-01-02") }

// VisitorKey and GlobalKey are the contract's key names; {day} is a hash tag
// so one day's keys share a Redis Cluster slot and one script may touch both.
func VisitorKey(day, visitor string) string { return "faregate:quota:{" + day + "}:ip:" + visitor }

// GlobalKey is the site-wide counter of day.
func GlobalKey(day string) string { return "faregate:quota:{" + day + "}:global" }

// UntilReset is the time from now to the next UTC midnight, at least 1s.
func UntilReset(now time.Time) time.Duration {
	d := nextMidnight(now).Sub(now)
	if d < time.Second {
		d = time.Second
	}
	return d
}

func nextMidnight(now time.Time) time.Time {
	u := now.UTC()
	return time.Date(u.Year(), u.Month(), u.Day()+1, 0, 0, 0, 0, time.UTC)
}

// Remembered answers from the denial memory alone: a refusal when the
// visitor or the site is already known to be over its limit today, or false.
// It never admits; it needs no Redis.
func (q *Quota) Remembered(visitor string) (Decision, bool) {
	now := q.now()
	day := Day(now)
	q.mu.Lock()
	defer q.mu.Unlock()
	q.rollLocked(day)
	if _, ok := q.deniedVisitor[visitor]; ok {
		return Decision{Err: ErrVisitorLimit, Reset: nextMidnight(now)}, true
	}
	if q.deniedGlobal {
		// Whatever the visitor's own count, nothing more can start today.
		return Decision{Err: ErrGlobalLimit, Reset: nextMidnight(now)}, true
	}
	return Decision{}, false
}

// Check reads both counters without changing them: the early "already over
// its limit" refusal that runs before costlier checks. A nil error with an
// allowed decision does not reserve anything; Take decides.
func (q *Quota) Check(ctx context.Context, visitor string) (Decision, error) {
	if d, ok := q.Remembered(visitor); ok {
		return d, nil
	}
	now := q.now()
	day := Day(now)
	// MGET of two keys in one slot works on Redis Cluster too (same hash tag).
	vals, err := q.mget(ctx, VisitorKey(day, visitor), GlobalKey(day))
	if err != nil {
		return Decision{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	d := Decision{
		VisitorRemaining: max(q.limits.Visitor-vals[0], 0),
		GlobalRemaining:  max(q.limits.Global-vals[1], 0),
		Reset:            nextMidnight(now),
	}
	switch {
	case vals[0] >= q.limits.Visitor:
		d.Err = ErrVisitorLimit
	case vals[1] >= q.limits.Global:
		d.Err = ErrGlobalLimit
	}
	q.remember(day, visitor, d)
	return d, nil
}

func (q *Quota) mget(ctx context.Context, keys ...string) ([]int64, error) {
	c, ok := q.rdb.(redis.Cmdable)
	if !ok {
		return nil, errors.New("client cannot MGET")
	}
	raw, err := c.MGet(ctx, keys...).Result()
	if err != nil {
		return nil, err
	}
	out := make([]int64, len(keys))
	for i, v := range raw {
		if v == nil {
			continue
		}
		s, _ := v.(string)
		var n int64
		if _, err := fmt.Sscan(s, &n); err != nil {
			return nil, fmt.Errorf("counter %s: %q", keys[i], s)
		}
		out[i] = n
	}
	return out, nil
}

// Take checks both limits and, when both allow, counts the task against both,
// in one atomic script. Any Redis failure is ErrUnavailable: never an admission.
func (q *Quota) Take(ctx context.Context, visitor string) (Decision, error) {
	if d, ok := q.Remembered(visitor); ok {
		return d, nil
	}
	now := q.now()
	day := Day(now)
	keys := []string{VisitorKey(day, visitor), GlobalKey(day)}
	res, err := takeScript.Run(ctx, q.rdb, keys, q.limits.Visitor, q.limits.Global, int64(KeyTTL/time.Second)).Int64Slice()
	if err != nil {
		return Decision{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if len(res) != 3 {
		return Decision{}, fmt.Errorf("%w: script answered %v", ErrUnavailable, res)
	}
	d := Decision{VisitorRemaining: res[1], GlobalRemaining: res[2], Reset: nextMidnight(now)}
	switch res[0] {
	case 1:
		d.Err = ErrVisitorLimit
	case 2:
		d.Err = ErrGlobalLimit
	}
	q.remember(day, visitor, d)
	return d, nil
}

// remember records refusals, and admissions that used the last slot, so the
// next request is refused from memory.
func (q *Quota) remember(day, visitor string, d Decision) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.rollLocked(day)
	if d.Err == ErrVisitorLimit || (d.Err == nil && d.VisitorRemaining == 0) {
		if len(q.deniedVisitor) < maxRemembered {
			q.deniedVisitor[visitor] = struct{}{}
		}
	}
	if d.Err == ErrGlobalLimit || (d.Err == nil && d.GlobalRemaining == 0) {
		q.deniedGlobal = true
	}
}

func (q *Quota) rollLocked(day string) {
	if q.denialDay != day {
		q.denialDay = day
		q.deniedVisitor = map[string]struct{}{}
		q.deniedGlobal = false
	}
}
