// Package quota counts task creations per principal and for the whole site
// per UTC day, in Redis, with one Lua script that checks the limits and
// increments the counters atomically. Replicas share the counters, so limits
// hold exactly however many processes serve the site.
//
// A principal is either an anonymous visitor (its keyed IP hash), counted
// against its own daily limit and the site's, or an API key, counted against
// its own daily limit only (the site's limit is the public lane's).
//
// Every counting script carries an attempt id and records its answer under
// it for a few minutes, so a script that Redis applied but whose reply was
// lost, and that the client (go-redis, or the cluster client's own retry
// loop) sends again, is applied once and answered the same.
package quota

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/memo"
	"faregate/protect/kit/randhex"
)

// KeyTTL is how long a day's counters live: long enough to outlast the day
// in every time zone's view of it, short enough that Redis cleans up itself.
const KeyTTL = 48 * time.Hour

// attemptTTL is how long an attempt's answer is kept for a re-sent script.
// A client re-sends within its timeouts, a few seconds.
const attemptTTL = 5 * time.Minute

var (
	// ErrVisitorLimit: the visitor used its daily tasks (429 demo_ip_limit_reached).
	ErrVisitorLimit = errors.New("quota: visitor daily limit reached")
	// ErrGlobalLimit: the site used its daily tasks (429 demo_global_limit_reached).
	ErrGlobalLimit = errors.New("quota: global daily limit reached")
	// ErrKeyLimit: the API key used its daily tasks (429 key_daily_limit_reached).
	ErrKeyLimit = errors.New("quota: key daily limit reached")
	// ErrUnavailable: Redis did not answer; the caller must refuse (503), never admit.
	ErrUnavailable = errors.New("quota: unavailable")
	// ErrInvalid: a subject without a principal or with a limit below 1.
	ErrInvalid = errors.New("quota: invalid subject")
)

// LimitError is a refusal: which daily limit was reached, how many tasks
// that limit allows, and how long until it resets (the next UTC midnight).
type LimitError struct {
	// Err is ErrVisitorLimit, ErrGlobalLimit or ErrKeyLimit.
	Err error
	// Limit is the refusing limit's tasks per day.
	Limit int64
	// After is the time from the refusal to the next UTC midnight.
	After time.Duration
}

// Error names the limit.
func (e *LimitError) Error() string { return e.Err.Error() }

// Unwrap lets errors.Is match the sentinel.
func (e *LimitError) Unwrap() error { return e.Err }

// RetryAfter is the time until the limit resets.
func (e *LimitError) RetryAfter() time.Duration { return e.After }

// takeScript checks the visitor's and the site's limits and counts both, or
// neither. The visitor's limit is checked first so that when both are
// exhausted the visitor's code wins. KEYS: visitor, global, attempt. ARGV:
// visitor limit, global limit, ttl, attempt ttl.
// Replies {decision, visitor_remaining, global_remaining}; decision 0
// admits, 1 refuses for the visitor, 2 for the site.
var takeScript = redis.NewScript(`
local seen = redis.call('GET', KEYS[3])
if seen then
  local a, b, c = string.match(seen, '^(%d+),(%d+),(%d+)$')
  return {tonumber(a), tonumber(b), tonumber(c)}
end
local ip = tonumber(redis.call('GET', KEYS[1]) or '0')
local g = tonumber(redis.call('GET', KEYS[2]) or '0')
local ipl = tonumber(ARGV[1])
local gl = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local function rem(limit, used)
  if used >= limit then return 0 end
  return limit - used
end
local out
if ip >= ipl then
  out = {1, rem(ipl, ip), rem(gl, g)}
elseif g >= gl then
  out = {2, rem(ipl, ip), rem(gl, g)}
else
  ip = redis.call('INCR', KEYS[1])
  if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ttl) end
  g = redis.call('INCR', KEYS[2])
  if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ttl) end
  out = {0, rem(ipl, ip), rem(gl, g)}
end
redis.call('SET', KEYS[3], out[1] .. ',' .. out[2] .. ',' .. out[3], 'EX', ARGV[4])
return out
`)

// takeKeyScript counts one task against an API key's own daily limit.
// KEYS: key counter, attempt. ARGV: limit, ttl, attempt ttl.
// Replies {decision, remaining}; decision 0 admits, 3 refuses.
var takeKeyScript = redis.NewScript(`
local seen = redis.call('GET', KEYS[2])
if seen then
  local a, b = string.match(seen, '^(%d+),(%d+)$')
  return {tonumber(a), tonumber(b)}
end
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local limit = tonumber(ARGV[1])
local out
if used >= limit then
  out = {3, 0}
else
  used = redis.call('INCR', KEYS[1])
  if redis.call('TTL', KEYS[1]) < 0 then redis.call('EXPIRE', KEYS[1], ARGV[2]) end
  local rem = limit - used
  if rem < 0 then rem = 0 end
  out = {0, rem}
end
redis.call('SET', KEYS[2], out[1] .. ',' .. out[2], 'EX', ARGV[3])
return out
`)

// Subject is who a task is counted against, with the limits in force for it.
type Subject struct {
	// Visitor is the visitor's keyed hash; Key an API key's id. Exactly one is set.
	Visitor, Key string
	// Limit is the principal's tasks per day (the public tier's for
	// visitors, the key's tier's for keys).
	Limit int64
	// Global is the public lane's site-wide tasks per day; keys ignore it.
	Global int64
}

func (s Subject) valid() error {
	if (s.Visitor == "") == (s.Key == "") || s.Limit < 1 || (s.Visitor != "" && s.Global < 1) {
		return ErrInvalid
	}
	return nil
}

// Decision is what a check or a take found: the principal's remaining
// tasks (and the site's, for visitors) after it, and when they reset.
type Decision struct {
	// Remaining is the principal's tasks left today; Limit its daily limit.
	Remaining, Limit int64
	// GlobalRemaining is the site's tasks left today (visitors only).
	GlobalRemaining int64
	// Reset is the next UTC midnight, when the counters start again.
	Reset time.Time
}

// Quota is safe for concurrent use.
type Quota struct {
	rdb redis.Scripter
	now func() time.Time
	// pipe, when set, carries the counting scripts of concurrent admissions
	// in shared pipelines (Pipelined).
	pipe Submitter

	// Denials cannot be undone within their UTC day, so a principal (or the
	// site) once refused is refused again from memory: cheap under a flood,
	// and it still works while Redis is down. Admissions always ask Redis.
	// Each memory holds the limit it was reached at: a limit raised since
	// (a policy reload) makes it stale, and Redis is asked again.
	mu            sync.Mutex
	denialDay     string
	deniedVisitor *memo.Memo[string, int64]
	deniedKey     *memo.Memo[string, int64]
	deniedGlobal  int64 // the global limit the site was refused at; 0: not refused
	dayNum        int64
	dayStr        string
}

// maxRemembered bounds each denial memory; past it the least recently
// refused is forgotten: denials still work, they just ask Redis again.
const maxRemembered = 200_000

// New returns a Quota on rdb. now may be nil (time.Now).
func New(rdb redis.Scripter, now func() time.Time) *Quota {
	if now == nil {
		now = time.Now
	}
	return &Quota{rdb: rdb, now: now,
		deniedVisitor: memo.New[string, int64](maxRemembered, now),
		deniedKey:     memo.New[string, int64](maxRemembered, now)}
}

// Submitter queues a command on a shared pipeline and returns a future to
// wait on: go-redis's deferred autopipeliner (AsyncAutoPipeline), on a
// single node or a cluster.
type Submitter interface {
	Submit(ctx context.Context, cmd redis.Cmder) redis.AutoFuture
}

// Pipelined makes Take send its counting script through p: concurrent
// admissions then share round trips and write calls, which is most of a
// script's cost on the client (issue #20 asks the quota path for 0.7× of
// redis-benchmark with the same EVALSHA). The caller's context is honoured
// after the script is queued: Take stops waiting when it ends and fails
// closed (ErrUnavailable), though the script may still run; what it counted
// is then counted, as when a plain call's reply is lost. A failed pipeline
// (a lost reply, a dropped connection) is retried once on rdb with the same
// attempt id, so a script Redis applied is applied once. Call it before
// the Quota is shared.
func (q *Quota) Pipelined(p Submitter) *Quota {
	q.pipe = p
	return q
}

// Day is the UTC date of t as used in keys.
func Day(t time.Time) string { return t.UTC().Format(time.DateOnly) }

// VisitorKey and GlobalKey are the documented key names; {day} is a hash tag
// so one day's keys share a Redis Cluster slot and one script may touch both.
func VisitorKey(day, visitor string) string { return "faregate:quota:{" + day + "}:ip:" + visitor }

// GlobalKey is the site-wide counter of day.
func GlobalKey(day string) string { return "faregate:quota:{" + day + "}:global" }

// KeyKey is an API key's counter of day.
func KeyKey(day, id string) string { return "faregate:quota:{" + day + "}:key:" + id }

func attemptKey(day, id string) string { return "faregate:quota:{" + day + "}:att:" + id }

// attemptID is 128 random bits in hex.
func attemptID() string { return randhex.New(16) }

// UntilReset is the time from now to the next UTC midnight, at least 1s.
func UntilReset(now time.Time) time.Duration {
	d := NextMidnight(now).Sub(now)
	if d < time.Second {
		d = time.Second
	}
	return d
}

// NextMidnight is the next UTC midnight after now.
func NextMidnight(now time.Time) time.Time {
	u := now.UTC()
	return time.Date(u.Year(), u.Month(), u.Day()+1, 0, 0, 0, 0, time.UTC)
}

func (q *Quota) refusal(sentinel error, limit int64, now time.Time) *LimitError {
	return &LimitError{Err: sentinel, Limit: limit, After: UntilReset(now)}
}

// Remembered answers from the denial memory alone: a *LimitError when the
// principal or (for visitors) the site is already known to be over its
// limit today, else nil. It never admits and needs no Redis.
func (q *Quota) Remembered(s Subject) error {
	now := q.now()
	q.mu.Lock()
	defer q.mu.Unlock()
	q.rollLocked(q.dayLocked(now))
	if s.Key != "" {
		if at, _, ok := q.deniedKey.Get(s.Key); ok && s.Limit <= at {
			return q.refusal(ErrKeyLimit, s.Limit, now)
		}
		return nil
	}
	if at, _, ok := q.deniedVisitor.Get(s.Visitor); ok && s.Limit <= at {
		return q.refusal(ErrVisitorLimit, s.Limit, now)
	}
	if q.deniedGlobal > 0 && s.Global <= q.deniedGlobal {
		// Whatever the visitor's own count, nothing more can start today.
		return q.refusal(ErrGlobalLimit, s.Global, now)
	}
	return nil
}

// Check reads the counters without changing them: the early "already over
// its limit" refusal that runs before costlier checks. It returns the
// decision and a *LimitError when over a limit; an allowed check reserves
// nothing, Take decides.
func (q *Quota) Check(ctx context.Context, s Subject) (Decision, error) {
	if err := s.valid(); err != nil {
		return Decision{}, err
	}
	now := q.now()
	d := Decision{Limit: s.Limit, Reset: NextMidnight(now)}
	if err := q.Remembered(s); err != nil {
		return d, err
	}
	day := Day(now)
	keys := []string{KeyKey(day, s.Key)}
	if s.Visitor != "" {
		// MGET of two keys in one slot works on Redis Cluster too (same hash tag).
		keys = []string{VisitorKey(day, s.Visitor), GlobalKey(day)}
	}
	vals, err := q.mget(ctx, keys...)
	if err != nil {
		return Decision{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	d.Remaining = max(s.Limit-vals[0], 0)
	if s.Key != "" {
		// Only a key over its limit is remembered as refused; one with
		// room must still reach Take.
		code := int64(0)
		if vals[0] >= s.Limit {
			code = 3
		}
		q.remember(day, s, code, d)
		return d, q.decisionErr(code, s, now)
	}
	d.GlobalRemaining = max(s.Global-vals[1], 0)
	code := int64(0)
	switch {
	case vals[0] >= s.Limit:
		code = 1
	case vals[1] >= s.Global:
		code = 2
	}
	q.remember(day, s, code, d)
	return d, q.decisionErr(code, s, now)
}

func (q *Quota) decisionErr(code int64, s Subject, now time.Time) error {
	switch code {
	case 1:
		return q.refusal(ErrVisitorLimit, s.Limit, now)
	case 2:
		return q.refusal(ErrGlobalLimit, s.Global, now)
	case 3:
		return q.refusal(ErrKeyLimit, s.Limit, now)
	}
	return nil
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
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("counter %s: %q", keys[i], s)
		}
		out[i] = n
	}
	return out, nil
}

// Take checks the limits and, when they allow, counts the task, in one
// atomic script. It returns the decision and a *LimitError when refused.
// Any Redis failure is ErrUnavailable: never an admission.
func (q *Quota) Take(ctx context.Context, s Subject) (Decision, error) {
	if err := s.valid(); err != nil {
		return Decision{}, err
	}
	now := q.now()
	d := Decision{Limit: s.Limit, Reset: NextMidnight(now)}
	if err := q.Remembered(s); err != nil {
		return d, err
	}
	q.mu.Lock()
	day := q.dayLocked(now)
	q.mu.Unlock()
	// The attempt id is fixed before the call, so every re-send of this
	// script (by any retry loop below us) carries the same one. It only has
	// to be unique, not secret: 128 bits of the fast generator.
	att := attemptKey(day, attemptID())
	var res []int64
	var err error
	if s.Key != "" {
		res, err = q.run(ctx, takeKeyScript, []string{KeyKey(day, s.Key), att},
			s.Limit, int64(KeyTTL/time.Second), int64(attemptTTL/time.Second))
		if err == nil && len(res) == 2 {
			res = []int64{res[0], res[1], 0}
		}
	} else {
		res, err = q.run(ctx, takeScript, []string{VisitorKey(day, s.Visitor), GlobalKey(day), att},
			s.Limit, s.Global, int64(KeyTTL/time.Second), int64(attemptTTL/time.Second))
	}
	if err != nil {
		return Decision{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if len(res) != 3 {
		return Decision{}, fmt.Errorf("%w: script answered %v", ErrUnavailable, res)
	}
	d.Remaining, d.GlobalRemaining = res[1], res[2]
	q.remember(day, s, res[0], d)
	return d, q.decisionErr(res[0], s, now)
}

// run sends a counting script: on the shared pipeline when there is one,
// else on its own. The script's attempt id (in keys) makes every re-send
// below answer what the first run counted.
func (q *Quota) run(ctx context.Context, sc *redis.Script, keys []string, args ...any) ([]int64, error) {
	if q.pipe == nil {
		return sc.Run(ctx, q.rdb, keys, args...).Int64Slice()
	}
	cmdArgs := make([]any, 0, 3+len(keys)+len(args))
	cmdArgs = append(cmdArgs, "evalsha", sc.Hash(), len(keys))
	for _, k := range keys {
		cmdArgs = append(cmdArgs, k)
	}
	cmdArgs = append(cmdArgs, args...)
	cmd := redis.NewCmd(ctx, cmdArgs...)
	if err := q.pipe.Submit(ctx, cmd).WaitContext(ctx); err != nil {
		if ctx.Err() != nil {
			// Out of time while queued or in flight: fail closed now.
			return nil, ctx.Err()
		}
		// NOSCRIPT (the server lost its script cache), a lost reply or a
		// dropped pipeline: once more on the plain path, which loads the
		// script if it must and has the client's own retries.
		return sc.Run(ctx, q.rdb, keys, args...).Int64Slice()
	}
	return cmd.Int64Slice()
}

// remember records refusals, and admissions that used the last slot, so the
// next request is refused from memory.
func (q *Quota) remember(day string, s Subject, code int64, d Decision) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.rollLocked(day)
	switch {
	case s.Key != "":
		if code == 3 || (code == 0 && d.Remaining == 0) {
			q.deniedKey.Put(s.Key, s.Limit, d.Reset)
		}
		return
	case code == 1 || (code == 0 && d.Remaining == 0):
		q.deniedVisitor.Put(s.Visitor, s.Limit, d.Reset)
	}
	if code == 2 || (code == 0 && d.GlobalRemaining == 0) {
		q.deniedGlobal = s.Global
	}
}

// dayLocked is Day(now), formatted once per UTC day: the refusal path asks
// for it on every request.
func (q *Quota) dayLocked(now time.Time) string {
	n := now.Unix() / 86400
	if now.Unix() < 0 || n != q.dayNum || q.dayStr == "" {
		q.dayNum, q.dayStr = n, Day(now)
	}
	return q.dayStr
}

func (q *Quota) rollLocked(day string) {
	if q.denialDay != day {
		q.denialDay = day
		// The memories' entries end at midnight anyway; a clock that
		// moved to another day any other way must not keep them either.
		q.deniedVisitor.Purge()
		q.deniedKey.Purge()
		q.deniedGlobal = 0
	}
}
