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
	// Op is unique per attempt; a re-sent op is counted once.
	Op string
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
}

// Err is nil for an admission, else a *RefusedError.
func (d GateDecision) Err() error {
	if d.Allowed {
		return nil
	}
	return &RefusedError{Reason: d.Reason, After: d.RetryAfter}
}

// Gate decides one /api request in one round trip, in this order:
//  1. with CheckAnomaly, AnomalyThreshold input spikes in the last hour
//     refuse with anomaly_blocked until the oldest of them is an hour old;
//  2. with FailedChecksPerHour > 0, that many failed checks in the last hour
//     refuse with too_many_failed_checks until enough have slid out;
//  3. the sliding window: RequestsPerMinute requests in the last minute
//     refuse with rate_limited until one fits; else this request counts.
//
// Refusals count nothing. Exactly RequestsPerMinute requests pass in any
// minute, however many replicas share the Redis. A re-sent admitted Op is
// found in the window and admitted again without counting; a re-sent
// refusal is simply decided again (refusals store nothing, so a flood of
// them costs no memory).
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
	anomaly := 0
	if r.CheckAnomaly {
		anomaly = 1
	}
	now := l.now()
	res, err := gateScript.Run(ctx, l.rdb,
		[]string{key(r.Scope, "win"), key(r.Scope, "fail"), key(r.Scope, "anom")},
		now.UnixMilli(), r.Op, r.RequestsPerMinute, r.FailedChecksPerHour, anomaly,
		RequestWindow.Milliseconds(), CheckWindow.Milliseconds(), AnomalyThreshold,
		expiryGrace.Milliseconds(),
	).Int64Slice()
	if err != nil {
		return GateDecision{}, unavailable("gate", err)
	}
	if err := reply("gate", res, 5); err != nil {
		return GateDecision{}, err
	}
	d := GateDecision{Limit: r.RequestsPerMinute, Remaining: res[2]}
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
	default:
		return GateDecision{}, fmt.Errorf("%w: gate script answered code %d", ErrUnavailable, res[0])
	}
	if !d.Allowed {
		d.RetryAfter = until(now, res[1])
	}
	if res[4] == 0 {
		l.m.gate(d)
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
