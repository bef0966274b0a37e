// Package ratelimit keeps the per-principal limits that are not counted
// per day: the sliding windows of /api requests (a minute and a second),
// the sliding hour of failed checks, the sliding ten minutes of invalid
// requests, the anomaly log of input spikes, the EMA of prompt sizes, the
// sliding hour of tokens charged, and the token buckets of principals and
// of the whole site.
//
// All of one principal's state lives under that principal's own hash tag,
// faregate:rl:{<scope>}:…, so every script touches one Redis Cluster slot.
// Windows and buckets belong to the principal, not to a day: nothing resets
// at midnight. Every script is told "now" by the caller's clock (ARGV, never
// Redis TIME), so replicas agree to the millisecond they agree on the time,
// and tests move time on miniredis and real Redis alike.
//
// Every call that changes state carries an op id, unique per attempt. When
// Redis applied a script but the reply was lost and the client sends the
// same command again, the script recognises the op and answers the first
// result again instead of counting twice. A window or log entry is its own
// record (the op id is the member), for as long as the entry counts; other
// answers are remembered for OpTTL.
//
// Numbers in Redis are integers: timestamps in unix milliseconds, bucket
// levels and the EMA in milli-tokens. The scripts decide on the caller's
// clock in whole milliseconds; every duration returned (RetryAfter, a
// pacing wait) is exact to the nanosecond against the caller's own "now":
// at now+RetryAfter the script decides differently, not a moment before.
package ratelimit

import (
	"errors"
	"fmt"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/protect/codes"
)

var (
	// ErrUnavailable reports that Redis could not be asked. Callers fail
	// closed: it is never a permission.
	ErrUnavailable = errors.New("ratelimit: unavailable")
	// ErrInvalid reports a malformed scope, op id or parameter.
	ErrInvalid = errors.New("ratelimit: invalid request")
	// ErrTooLarge reports an amount over the bucket's capacity: it can never
	// be served, however long the caller waits.
	ErrTooLarge = errors.New("ratelimit: amount exceeds the bucket's capacity")
	// ErrRateLimited: the principal's request window is full (429 rate_limited).
	ErrRateLimited = errors.New("ratelimit: rate limited")
	// ErrTooManyFailedChecks: too many 400/403 answers in the last hour
	// (429 too_many_failed_checks).
	ErrTooManyFailedChecks = errors.New("ratelimit: too many failed checks")
	// ErrAnomalyBlocked: too many input spikes in the last hour (429 anomaly_blocked).
	ErrAnomalyBlocked = errors.New("ratelimit: anomaly blocked")
	// ErrTokenRateLimited: a token bucket cannot pay in time (429 token_rate_limited).
	ErrTokenRateLimited = errors.New("ratelimit: token rate limited")
	// ErrInputSpike: a model call's prompt is an input spike (task code input_spike).
	ErrInputSpike = errors.New("ratelimit: input spike")
	// ErrInvalidRatio: too large a share of the principal's requests of the
	// last ten minutes were invalid (429 invalid_ratio).
	ErrInvalidRatio = errors.New("ratelimit: invalid ratio")
	// ErrHourExhausted: the principal's tokens of the last hour leave no
	// room for the amount asked (429 demo_budget_exhausted, policy hour).
	ErrHourExhausted = errors.New("ratelimit: hourly tokens exhausted")
)

// Reason names why a request was refused. Its values are the documented
// error codes (faregate/codes), so logs and metrics name a refusal as the
// client sees it.
type Reason string

// The refusal reasons; an admitted request has the empty Reason.
const (
	ReasonRateLimited         Reason = codes.RateLimited
	ReasonTooManyFailedChecks Reason = codes.TooManyFailedChecks
	ReasonAnomalyBlocked      Reason = codes.AnomalyBlocked
	ReasonTokenRateLimited    Reason = codes.TokenRateLimited
	ReasonInvalidRatio        Reason = codes.InvalidRatio
	ReasonHourExhausted       Reason = codes.DemoBudgetExhausted
)

// sentinel is the error a refusal with reason r unwraps to.
func (r Reason) sentinel() error {
	switch r {
	case ReasonRateLimited:
		return ErrRateLimited
	case ReasonTooManyFailedChecks:
		return ErrTooManyFailedChecks
	case ReasonAnomalyBlocked:
		return ErrAnomalyBlocked
	case ReasonTokenRateLimited:
		return ErrTokenRateLimited
	case ReasonInvalidRatio:
		return ErrInvalidRatio
	case ReasonHourExhausted:
		return ErrHourExhausted
	}
	return nil
}

// Window names the request window behind a rate_limited refusal: the
// RateLimit policy a client is told about.
type Window uint8

// The request windows.
const (
	// WindowMinute is the requests per minute.
	WindowMinute Window = iota
	// WindowSecond is the requests per second.
	WindowSecond
	// WindowSoft is the requests per minute a principal past the soft share
	// of its hourly tokens is held to.
	WindowSoft
)

// RefusedError is a refusal that will lift after a known time.
type RefusedError struct {
	Reason Reason
	// Window is the request window that refused, for rate_limited.
	Window Window
	// After is the exact time until the refusing policy admits again.
	After time.Duration
	// Quota is the refusing policy's quota when the refusal is not
	// answered where the principal's tier is known (the hour's, refusing
	// a model call); 0 otherwise.
	Quota int64
}

// Error names the reason and the wait; it carries no principal.
func (e *RefusedError) Error() string {
	return fmt.Sprintf("ratelimit: %s, retry after %v", e.Reason, e.After)
}

// RetryAfter is the exact time until the refusing policy admits again.
func (e *RefusedError) RetryAfter() time.Duration { return e.After }

// Unwrap lets errors.Is match the reason's sentinel (ErrRateLimited, …).
func (e *RefusedError) Unwrap() error { return e.Reason.sentinel() }

// WaitTooLongError refuses a paced model call whose turn at the site bucket
// is further away than the caller's bound. Nothing was reserved for it.
type WaitTooLongError struct {
	// Wait is when the call's turn would have come; MaxWait the caller's bound.
	Wait, MaxWait time.Duration
	// After is the exact time until the same call would be given a turn
	// within MaxWait, if nobody else reserved meanwhile.
	After time.Duration
}

// Error names the wait and the bound.
func (e *WaitTooLongError) Error() string {
	return fmt.Sprintf("ratelimit: site token rate: turn in %v, over the bound of %v", e.Wait, e.MaxWait)
}

// RetryAfter is the exact time until the call would fit within MaxWait.
func (e *WaitTooLongError) RetryAfter() time.Duration { return e.After }

// Unwrap lets errors.Is(err, ErrTokenRateLimited) match.
func (e *WaitTooLongError) Unwrap() error { return ErrTokenRateLimited }

const (
	// RequestWindow is the span of the sliding request window.
	RequestWindow = time.Minute
	// CheckWindow is the span over which failed checks and anomalies count.
	CheckWindow = time.Hour
	// AnomalyThreshold anomalies within CheckWindow block a principal.
	AnomalyThreshold = 3
	// OpTTL is how long a script remembers an op id and its answer: longer
	// than any client's retries of one command, short enough to cost little.
	OpTTL = 5 * time.Minute
	// SiteScope is the scope of the site-wide token bucket that Pace serves.
	SiteScope = "site"
	// MaxPaceWait bounds the maxWait of Pace: a model call is never told to
	// wait longer than a day, and the arithmetic stays far from overflow.
	MaxPaceWait = 24 * time.Hour
	// SecondWindow is the span of the per-second request window.
	SecondWindow = time.Second
	// InvalidWindow is the span over which the invalid ratio is taken, and
	// invalidSlot the width of the counters it is kept in: a request
	// counts from its slot's start until InvalidWindow after the slot's
	// end, so the window is never shorter than InvalidWindow.
	InvalidWindow = 10 * time.Minute
	invalidSlot   = 30 * time.Second
	// HourWindow is the span of the hourly token quota, and hourSlot the
	// width of its counters (tokens count until an hour after their
	// minute ends).
	HourWindow = time.Hour
	hourSlot   = time.Minute
	// RatioScale is the denominator of an invalid ratio in millionths.
	RatioScale = 1_000_000

	// spikeFactor and spikeMinSamples define an input spike: a prompt over
	// spikeFactor × the EMA, once the EMA has spikeMinSamples samples.
	spikeFactor     = 10
	spikeMinSamples = 5
	// emaTTL forgets the EMA of a principal idle this long; it then needs
	// spikeMinSamples calls again before spikes are detected.
	emaTTL = 24 * time.Hour
	// anomalyLogCap bounds the anomaly log; only the newest
	// AnomalyThreshold entries ever decide a block.
	anomalyLogCap = 16
	// expiryGrace is added to every TTL that follows from the state: a key
	// is never dropped by Redis's clock before the callers' clocks, which
	// may lag a little (or stand still in a test), are done with it.
	expiryGrace = time.Minute

	// maxCount bounds requests per minute and failed checks per hour.
	maxCount = 1_000_000
	// maxRate (tokens per minute) and maxTokens keep every milli-token
	// product in the scripts below 2^53, where Lua numbers are exact.
	maxRate   = 1_000_000_000
	maxTokens = 1 << 40
	// maxScope and maxOp bound the parts of key names callers choose.
	maxScope = 140
	maxOp    = 128
)

// Options configure a Limiter.
type Options struct {
	// Now is the clock every script is told; default time.Now.
	Now func() time.Time
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
}

// Limiter runs the rate-limit scripts. It keeps no state of its own, so any
// number of Limiters (replicas) on one Redis act as one. Safe for concurrent use.
type Limiter struct {
	rdb redis.Scripter
	now func() time.Time
	m   *metrics
}

// New returns a Limiter on rdb. redis.Scripter is the narrowest go-redis
// interface that runs scripts; *redis.Client and *redis.ClusterClient have it.
func New(rdb redis.Scripter, o Options) *Limiter {
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Limiter{rdb: rdb, now: o.Now, m: newMetrics(o.Registerer)}
}

// key is the Redis key of one part of a principal's state. The scope is the
// hash tag, so all of a principal's keys share a cluster slot.
func key(scope, part string) string { return "faregate:rl:{" + scope + "}:" + part }

// opKey remembers one op of one kind; kinds keep a caller that reuses an op
// id across BeforeCall and AfterCall from being answered the wrong reply.
func opKey(scope, kind, op string) string { return key(scope, "op:"+kind+":"+op) }

// validScope admits 1–140 characters of valid UTF-8 without braces (they
// would change the hash tag), whitespace or control characters.
func validScope(s string) error {
	if s == "" || !utf8.ValidString(s) || utf8.RuneCountInString(s) > maxScope {
		return fmt.Errorf("%w: scope must be 1-%d characters of UTF-8", ErrInvalid, maxScope)
	}
	for _, r := range s {
		if r == '{' || r == '}' || unicode.IsSpace(r) || unicode.IsControl(r) {
			return fmt.Errorf("%w: scope may not contain braces, whitespace or control characters", ErrInvalid)
		}
	}
	return nil
}

// validOp admits what UUIDs, rand.Text and "request:attempt" ids look like.
func validOp(s string) error {
	if s == "" || len(s) > maxOp {
		return fmt.Errorf("%w: op must be 1-%d characters", ErrInvalid, maxOp)
	}
	for _, c := range []byte(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-', c == '.', c == ':':
		default:
			return fmt.Errorf("%w: op may hold only [A-Za-z0-9_.:-]", ErrInvalid)
		}
	}
	return nil
}

// validRange checks that a named parameter lies in [lo, hi].
func validRange(name string, v, lo, hi int64) error {
	if v < lo || v > hi {
		return fmt.Errorf("%w: %s %d must be %d to %d", ErrInvalid, name, v, lo, hi)
	}
	return nil
}

// until is the exact time from now to the unix millisecond at. The scripts
// decide on now truncated to the millisecond, so at now+until(now, at) they
// see exactly at: the answer is neither early nor late.
func until(now time.Time, atMs int64) time.Duration {
	return max(time.UnixMilli(atMs).Sub(now), 0)
}

// unavailable wraps a Redis failure; the cause stays matchable (a context
// deadline, say) next to ErrUnavailable.
func unavailable(what string, err error) error {
	return fmt.Errorf("%w: %s: %w", ErrUnavailable, what, err)
}

// reply checks the length of a script's answer before it is read.
func reply(what string, v []int64, n int) error {
	if len(v) != n {
		return fmt.Errorf("%w: %s script answered %d values, want %d", ErrUnavailable, what, len(v), n)
	}
	return nil
}
