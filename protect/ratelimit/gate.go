package ratelimit

import (
	"context"
	"fmt"
	"time"
)

// GateRequest is one /api request of one principal.
type GateRequest struct {
	// Scope names the principal: "v:<64 hex>" for a visitor, "k:<id>" for
	// an API key. It becomes the hash tag of the principal's keys.
	Scope string
	// RequestsPerMinute is the size of the sliding window (≥ 1).
	RequestsPerMinute int64
	// FailedChecksPerHour refuses the principal once it has this many failed
	// checks in the last hour; 0 does not check.
	FailedChecksPerHour int64
	// CheckAnomaly refuses a principal with AnomalyThreshold input spikes in
	// the last hour.
	CheckAnomaly bool
	// RequestsPerSecond is a second window over the same requests (their
	// last second of the minute's log); 0 is off.
	RequestsPerSecond int64
	// Invalid, when its Ratio is above 0, refuses a principal whose share
	// of invalid requests in the last InvalidWindow is over it, and counts
	// an admitted request as one request of that window.
	Invalid InvalidRule
	// Hour, when its Tokens is above 0, reads the principal's hourly
	// tokens (GateDecision.HourUsed, Soft) and, past its soft share, holds
	// the window to its SoftRequestsPerMinute.
	Hour HourRule
	// Op is unique per attempt; a re-sent op is counted once.
	Op string
}

// InvalidRule is the invalid ratio (seed 001's "high ratio of invalid
// requests") as Gate applies it.
type InvalidRule struct {
	// Ratio is the share of invalid requests, in millionths (RatioScale),
	// over which the principal is refused; 0 is off.
	Ratio int64
	// MinRequests is how many requests the window must hold before its
	// share is judged (≥ 1).
	MinRequests int64
}

// HourRule is a principal's hourly token quota and its soft share.
type HourRule struct {
	// Tokens is the quota over the last HourWindow; 0 is off.
	Tokens int64
	// SoftTokens is the use (charged and reserved) from which the
	// principal is throttled: 1 to Tokens.
	SoftTokens int64
	// SoftRequestsPerMinute is the window's size while throttled (≥ 1);
	// the full RequestsPerMinute applies when it is larger.
	SoftRequestsPerMinute int64
}

// GateDecision is the answer to one request, with what the RateLimit
// headers need.
type GateDecision struct {
	Allowed bool
	// Reason is empty when allowed.
	Reason Reason
	// RetryAfter is the exact time until the refusing policy admits again;
	// 0 when allowed.
	RetryAfter time.Duration
	// Limit is the window's size, Remaining the requests it still admits
	// after this one.
	Limit, Remaining int64
	// Reset is the time until the oldest request the window counts leaves
	// it, when Remaining grows again; 0 for an empty window.
	Reset time.Duration
	// Window is the request window that refused, for rate_limited.
	Window Window
	// HourUsed is the principal's tokens of the last hour (charged, and
	// reserved by calls in flight) and Soft whether that reaches its soft
	// share; both 0 without an hourly quota.
	HourUsed int64
	Soft     bool
}

// Err is nil for an admission, else a *RefusedError.
func (d GateDecision) Err() error {
	if d.Allowed {
		return nil
	}
	return &RefusedError{Reason: d.Reason, Window: d.Window, After: d.RetryAfter}
}

// Gate decides one /api request in one round trip, in this order:
//  1. with CheckAnomaly, AnomalyThreshold input spikes in the last hour
//     refuse with anomaly_blocked until the oldest of them is an hour old;
//  2. with FailedChecksPerHour > 0, that many failed checks in the last hour
//     refuse with too_many_failed_checks until enough have slid out;
//  3. with an Invalid rule, a share of invalid requests in the last
//     InvalidWindow over its Ratio (with at least MinRequests requests)
//     refuses with invalid_ratio until enough have slid out for the share
//     to fall to the ratio (or the count below the minimum);
//  4. the sliding window: RequestsPerMinute requests in the last minute
//     (SoftRequestsPerMinute while the hour is past its soft share)
//     refuse with rate_limited (WindowMinute, or WindowSoft) until one
//     fits;
//  5. with RequestsPerSecond > 0, that many in the last second refuse with
//     rate_limited (WindowSecond) until one fits; else this request
//     counts.
//
// Refusals count nothing. Exactly RequestsPerMinute requests pass in any
// minute, and RequestsPerSecond in any second, however many replicas share
// the Redis. A re-sent admitted Op is found in the window and admitted
// again without counting; a re-sent refusal is simply decided again
// (refusals store nothing, so a flood of them costs no memory).
func (l *Limiter) Gate(ctx context.Context, r GateRequest) (GateDecision, error) {
	if err := validScope(r.Scope); err != nil {
		return GateDecision{}, err
	}
	if err := validOp(r.Op); err != nil {
		return GateDecision{}, err
	}
	if err := validRange("requests per minute", r.RequestsPerMinute, 1, maxCount); err != nil {
		return GateDecision{}, err
	}
	if err := validRange("failed checks per hour", r.FailedChecksPerHour, 0, maxCount); err != nil {
		return GateDecision{}, err
	}
	if err := r.validRules(); err != nil {
		return GateDecision{}, err
	}
	anomaly := 0
	if r.CheckAnomaly {
		anomaly = 1
	}
	now := l.now()
	res, err := gateScript.Run(ctx, l.rdb,
		[]string{key(r.Scope, "win"), key(r.Scope, "fail"), key(r.Scope, "anom"), key(r.Scope, "inv"), key(r.Scope, "hour")},
		now.UnixMilli(), r.Op, r.RequestsPerMinute, r.FailedChecksPerHour, anomaly,
		RequestWindow.Milliseconds(), CheckWindow.Milliseconds(), AnomalyThreshold,
		expiryGrace.Milliseconds(), r.RequestsPerSecond,
		r.Invalid.Ratio, r.Invalid.MinRequests, invalidSlot.Milliseconds(), InvalidWindow.Milliseconds(),
		r.Hour.Tokens, r.Hour.SoftTokens, r.Hour.SoftRequestsPerMinute, hourSlot.Milliseconds(), HourWindow.Milliseconds(),
		SecondWindow.Milliseconds(),
	).Int64Slice()
	if err != nil {
		return GateDecision{}, unavailable("gate", err)
	}
	if err := reply("gate", res, 7); err != nil {
		return GateDecision{}, err
	}
	d, err := gateDecision(r, now, res)
	if err != nil {
		return GateDecision{}, err
	}
	if res[4] == 0 {
		l.m.gate(d)
	}
	return d, nil
}

// validRules checks the optional rules of a GateRequest: each is off at 0,
// and bounded when on.
func (r GateRequest) validRules() error {
	if err := validRange("requests per second", r.RequestsPerSecond, 0, maxCount); err != nil {
		return err
	}
	if err := validRange("invalid ratio", r.Invalid.Ratio, 0, RatioScale); err != nil {
		return err
	}
	if r.Invalid.Ratio > 0 {
		if err := validRange("invalid minimum requests", r.Invalid.MinRequests, 1, maxCount); err != nil {
			return err
		}
	}
	if err := validRange("hourly tokens", r.Hour.Tokens, 0, maxTokens); err != nil {
		return err
	}
	if r.Hour.Tokens > 0 {
		if err := validRange("soft tokens", r.Hour.SoftTokens, 1, r.Hour.Tokens); err != nil {
			return err
		}
		if err := validRange("soft requests per minute", r.Hour.SoftRequestsPerMinute, 1, maxCount); err != nil {
			return err
		}
	}
	return nil
}

// gateDecision reads the gate script's answer res to r, asked at now.
func gateDecision(r GateRequest, now time.Time, res []int64) (GateDecision, error) {
	d := GateDecision{Limit: r.RequestsPerMinute, Remaining: res[2], HourUsed: res[5], Soft: res[6] == 1}
	if d.Soft && r.Hour.SoftRequestsPerMinute < d.Limit {
		d.Limit = r.Hour.SoftRequestsPerMinute
	}
	if res[3] > 0 {
		d.Reset = until(now, res[3])
	}
	switch res[0] {
	case 0:
		d.Allowed = true
	case 1:
		d.Reason = ReasonRateLimited
	case 2:
		d.Reason = ReasonTooManyFailedChecks
	case 3:
		d.Reason = ReasonAnomalyBlocked
	case 4:
		d.Reason, d.Window = ReasonRateLimited, WindowSecond
	case 5:
		d.Reason, d.Window = ReasonRateLimited, WindowSoft
	case 6:
		d.Reason = ReasonInvalidRatio
	default:
		return GateDecision{}, fmt.Errorf("%w: gate script answered code %d", ErrUnavailable, res[0])
	}
	if !d.Allowed {
		d.RetryAfter = until(now, res[1])
	}
	return d, nil
}

// RecordFailedCheck counts one failed check (a 400 or 403 answer) of the
// principal in its sliding hour. count is the number in the hour, at most
// perHour (older ones no longer matter). Once count reaches perHour,
// blockedFor is how long Gate will refuse the principal with
// too_many_failed_checks: the caller may refuse it from memory until then.
func (l *Limiter) RecordFailedCheck(ctx context.Context, scope, op string, perHour int64) (count int64, blockedFor time.Duration, err error) {
	if err := validScope(scope); err != nil {
		return 0, 0, err
	}
	if err := validOp(op); err != nil {
		return 0, 0, err
	}
	if err := validRange("failed checks per hour", perHour, 1, maxCount); err != nil {
		return 0, 0, err
	}
	now := l.now()
	res, err := failScript.Run(ctx, l.rdb, []string{key(scope, "fail")},
		now.UnixMilli(), op, perHour, CheckWindow.Milliseconds(), expiryGrace.Milliseconds(),
	).Int64Slice()
	if err != nil {
		return 0, 0, unavailable("record failed check", err)
	}
	if err := reply("record failed check", res, 3); err != nil {
		return 0, 0, err
	}
	if res[1] > 0 {
		blockedFor = until(now, res[1])
	}
	return res[0], blockedFor, nil
}

// Note is one outcome counted in a principal's invalid-request window,
// with (for a visitor's failed check) its entry in the failed-check log.
type Note struct {
	Scope string
	// Requests is added to the window's requests and Invalid to its
	// invalid ones: a refused creation adds 1 invalid (Gate counted its
	// request), an external agent's model call 1 request, and 1 invalid
	// when the provider refused to answer it.
	Requests, Invalid int64
	// FailedChecksPerHour, above 0, also logs a failed check, as
	// RecordFailedCheck does.
	FailedChecksPerHour int64
	// Op is unique per attempt; a re-sent op is counted once.
	Op string
}

// maxNote bounds what one Note adds: one outcome adds one.
const maxNote = 1000

// Record counts n in one round trip. count and blockedFor are
// RecordFailedCheck's (0 when no failed check was logged).
func (l *Limiter) Record(ctx context.Context, n Note) (count int64, blockedFor time.Duration, err error) {
	if err := validScope(n.Scope); err != nil {
		return 0, 0, err
	}
	if err := validOp(n.Op); err != nil {
		return 0, 0, err
	}
	if err := validRange("requests", n.Requests, 0, maxNote); err != nil {
		return 0, 0, err
	}
	if err := validRange("invalid", n.Invalid, 0, maxNote); err != nil {
		return 0, 0, err
	}
	if err := validRange("failed checks per hour", n.FailedChecksPerHour, 0, maxCount); err != nil {
		return 0, 0, err
	}
	now := l.now()
	res, err := noteScript.Run(ctx, l.rdb,
		[]string{key(n.Scope, "fail"), key(n.Scope, "inv"), opKey(n.Scope, "note", n.Op)},
		now.UnixMilli(), n.Op, n.FailedChecksPerHour, CheckWindow.Milliseconds(), expiryGrace.Milliseconds(),
		n.Requests, n.Invalid, invalidSlot.Milliseconds(), InvalidWindow.Milliseconds(), OpTTL.Milliseconds(),
	).Int64Slice()
	if err != nil {
		return 0, 0, unavailable("record", err)
	}
	if err := reply("record", res, 3); err != nil {
		return 0, 0, err
	}
	if res[1] > 0 {
		blockedFor = until(now, res[1])
	}
	return res[0], blockedFor, nil
}
