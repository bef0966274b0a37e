package ratelimit

import (
	"context"
	"fmt"
	"time"
)

// A token bucket belongs to a scope (a principal's, or SiteScope for the
// site-wide bucket). Its capacity is twice its rate per minute, and it
// refills continuously. The rate is passed on every call rather than
// stored, so a policy reload takes effect at the next call.
//
// A scope's bucket is used either by BeforeCall/AfterCall (a principal's
// bucket, taken from now) or by Pace/AfterCall (the site's, reserved at
// future send times); Peek and Level read either.

// capacityOf is the bucket's capacity in tokens.
func capacityOf(ratePerMin int64) int64 { return 2 * ratePerMin }

// checkBucket validates the common parameters of a bucket operation.
func checkBucket(scope string, ratePerMin int64) error {
	if err := validScope(scope); err != nil {
		return err
	}
	return validRange("tokens per minute", ratePerMin, 1, maxRate)
}

// tooLarge is the error for an amount no bucket of this rate can ever hold.
func tooLarge(amount, ratePerMin int64) error {
	return fmt.Errorf("%w: %d tokens, capacity %d", ErrTooLarge, amount, capacityOf(ratePerMin))
}

// Peek reports whether the bucket could pay need tokens now and, if not,
// the exact time until it can (when nobody takes from it meanwhile). It
// changes nothing. need over the capacity can never be paid: ErrTooLarge.
func (l *Limiter) Peek(ctx context.Context, scope string, ratePerMin, need int64) (ok bool, retryAfter time.Duration, err error) {
	if err := checkBucket(scope, ratePerMin); err != nil {
		return false, 0, err
	}
	if err := validRange("tokens", need, 1, maxTokens); err != nil {
		return false, 0, err
	}
	if need > capacityOf(ratePerMin) {
		return false, 0, tooLarge(need, ratePerMin)
	}
	now := l.now()
	res, err := l.peek(ctx, scope, ratePerMin, need, now)
	if err != nil {
		return false, 0, err
	}
	if res[0] == 1 {
		return true, 0, nil
	}
	return false, until(now, res[1]), nil
}

// Level is what the bucket holds, in tokens (negative while overage is
// being paid back), as the next take will see it: now, or for a paced
// bucket at its last reserved send time. For usage pages and tests.
func (l *Limiter) Level(ctx context.Context, scope string, ratePerMin int64) (float64, error) {
	if err := checkBucket(scope, ratePerMin); err != nil {
		return 0, err
	}
	res, err := l.peek(ctx, scope, ratePerMin, 0, l.now())
	if err != nil {
		return 0, err
	}
	return float64(res[2]) / 1000, nil
}

func (l *Limiter) peek(ctx context.Context, scope string, ratePerMin, need int64, now time.Time) ([]int64, error) {
	res, err := peekScript.Run(ctx, l.rdb, []string{key(scope, "tpm")}, now.UnixMilli(), ratePerMin, need).Int64Slice()
	if err != nil {
		return nil, unavailable("peek", err)
	}
	if err := reply("peek", res, 3); err != nil {
		return nil, err
	}
	return res, nil
}

// CallRequest is one model call of one principal, asked for before it is made.
type CallRequest struct {
	Scope string
	// PromptTokens is the call's estimated prompt size (≥ 1): the input
	// spike check compares it with the principal's EMA.
	PromptTokens int64
	// Amount is what to take from the bucket: prompt + max_tokens.
	Amount int64
	// TokensPerMinute is the principal's bucket rate; 0 means no bucket.
	TokensPerMinute int64
	// TokensPerHour is the principal's hourly quota (0: none), and
	// SoftTokens its soft share (1 to TokensPerHour), as HourRule's.
	TokensPerHour, SoftTokens int64
	// Op is unique per attempt; a call that waits and asks again uses a new one.
	Op string
}

// CallDecision is the answer to a CallRequest.
type CallDecision struct {
	// Taken reports that the call may be made: Amount was taken from the
	// bucket, or there is no bucket.
	Taken bool
	// RetryAfter, when neither Taken nor Anomaly, is the exact time until
	// the bucket will hold Amount.
	RetryAfter time.Duration
	// Anomaly reports an input spike: the call must not be made, nothing
	// was taken, and the spike was logged against the principal.
	Anomaly bool
	// AnomaliesInHour counts the principal's spikes in the last hour
	// (reported with Anomaly; at most a small cap).
	AnomaliesInHour int64
	// BlockedFor, once AnomaliesInHour reaches AnomalyThreshold, is how
	// long Gate will refuse the principal with anomaly_blocked.
	BlockedFor time.Duration
	// EMA is the principal's average prompt tokens per call and Samples the
	// calls it has learnt from, after this call; for logs and tests.
	EMA     float64
	Samples int64
	// HourShort reports that the principal's hour cannot take Amount:
	// nothing was taken, and RetryAfter is when enough of the hour will
	// have slid (HourWindow when Amount exceeds the quota itself).
	HourShort bool
	// HourUsed is the principal's hour as the call found it (charged and
	// reserved, before this call), and Soft whether that reached its soft
	// share; HourSlot is where the call's Amount was added, for Settle.
	HourUsed int64
	Soft     bool
	HourSlot int64
}

// Err is nil when the call may be made, ErrInputSpike for a spike, a
// *RefusedError with reason demo_budget_exhausted for a short hour, else
// one with reason token_rate_limited.
func (d CallDecision) Err() error {
	switch {
	case d.Taken:
		return nil
	case d.Anomaly:
		return ErrInputSpike
	case d.HourShort:
		return &RefusedError{Reason: ReasonHourExhausted, After: d.RetryAfter}
	}
	return &RefusedError{Reason: ReasonTokenRateLimited, After: d.RetryAfter}
}

// BeforeCall runs the principal's checks before one model call in one
// script on the principal's slot. First the input spike check: once the
// principal's EMA of prompt tokens (α 0.3) has 5 samples, a prompt over 10×
// the EMA is an anomaly: it is logged (Gate reads the log), the EMA does not
// learn from it, nothing is taken, and Anomaly is set. Otherwise, with a
// bucket, Amount is taken if the bucket holds it (never below zero), else
// RetryAfter says when it will; the caller waits within its own bound and
// asks again with a new op. With an hourly quota, Amount is added to the
// principal's hour if it fits (nothing is taken from either otherwise, and
// HourShort says so). The EMA learns from the call when it proceeds.
//
// An Amount over the bucket's capacity returns ErrTooLarge (after the spike
// check, so a huge prompt is still logged as the spike it is).
func (l *Limiter) BeforeCall(ctx context.Context, r CallRequest) (CallDecision, error) {
	if err := validScope(r.Scope); err != nil {
		return CallDecision{}, err
	}
	if err := validOp(r.Op); err != nil {
		return CallDecision{}, err
	}
	if err := validRange("prompt tokens", r.PromptTokens, 1, maxTokens); err != nil {
		return CallDecision{}, err
	}
	if err := validRange("amount", r.Amount, 1, maxTokens); err != nil {
		return CallDecision{}, err
	}
	if err := validRange("tokens per minute", r.TokensPerMinute, 0, maxRate); err != nil {
		return CallDecision{}, err
	}
	if err := validHour(r.TokensPerHour, r.SoftTokens); err != nil {
		return CallDecision{}, err
	}
	now := l.now()
	res, err := beforeCallScript.Run(ctx, l.rdb,
		[]string{key(r.Scope, "ema"), key(r.Scope, "anom"), key(r.Scope, "tpm"), opKey(r.Scope, "call", r.Op), key(r.Scope, "hour")},
		now.UnixMilli(), r.Op, r.PromptTokens, r.Amount, r.TokensPerMinute,
		CheckWindow.Milliseconds(), AnomalyThreshold, anomalyLogCap, emaTTL.Milliseconds(),
		OpTTL.Milliseconds(), expiryGrace.Milliseconds(), spikeFactor, spikeMinSamples,
		r.TokensPerHour, r.SoftTokens, hourSlot.Milliseconds(), HourWindow.Milliseconds(),
	).Int64Slice()
	if err != nil {
		return CallDecision{}, unavailable("before call", err)
	}
	if err := reply("before call", res, 9); err != nil {
		return CallDecision{}, err
	}
	d := CallDecision{EMA: float64(res[3]) / 1000, Samples: res[4], HourUsed: res[5], Soft: res[6] == 1, HourSlot: res[7]}
	fresh := res[8] == 0
	var outErr error
	switch res[0] {
	case 0:
		d.Taken = true
	case 1:
		d.Anomaly = true
		d.AnomaliesInHour = res[1]
		if res[2] > 0 {
			d.BlockedFor = until(now, res[2])
		}
	case 2:
		d.RetryAfter = until(now, res[2])
	case 3:
		outErr = tooLarge(r.Amount, r.TokensPerMinute)
	case 4:
		d.HourShort, d.RetryAfter = true, until(now, res[2])
	case 5:
		d.HourShort, d.RetryAfter = true, HourWindow
	default:
		return CallDecision{}, fmt.Errorf("%w: before call script answered code %d", ErrUnavailable, res[0])
	}
	if fresh {
		l.m.call(res[0])
	}
	return d, outErr
}

// AfterCall settles a call that BeforeCall (or Pace) let through: reserved
// is what was taken, actual what the provider reported. Unused tokens go
// back into the bucket (never above capacity); usage over the reservation
// is charged even below zero and returned as overage: the only way a
// bucket goes below zero, and refills pay it back. With tokensPerMinute 0
// there is no bucket, and only the overage is computed. It is Settle
// without an hour.
func (l *Limiter) AfterCall(ctx context.Context, scope string, tokensPerMinute, reserved, actual int64, op string) (overage int64, err error) {
	return l.Settle(ctx, SettleRequest{Scope: scope, TokensPerMinute: tokensPerMinute, Reserved: reserved, Actual: actual, Op: op})
}

// SettleRequest settles one model call's take (BeforeCall's, or Pace's).
type SettleRequest struct {
	Scope string
	// TokensPerMinute is the bucket's rate (0: no bucket).
	TokensPerMinute int64
	// TokensPerHour is the hourly quota the take was added to (0: none)
	// and HourSlot where (CallDecision.HourSlot).
	TokensPerHour, HourSlot int64
	// Reserved is what was taken, Actual what the call was charged.
	Reserved, Actual int64
	// Op is the take's op id: a settle re-sent is applied once.
	Op string
}

// Settle settles a take with what the call was charged, as AfterCall
// describes for the bucket; in the hour, unused tokens leave the slot the
// take was added to (while it still counts) and an excess is added now, so
// the hour counts what was charged. Without a bucket or an hour only the
// overage is computed.
func (l *Limiter) Settle(ctx context.Context, r SettleRequest) (overage int64, err error) {
	if err := validScope(r.Scope); err != nil {
		return 0, err
	}
	if err := validOp(r.Op); err != nil {
		return 0, err
	}
	if err := validRange("tokens per minute", r.TokensPerMinute, 0, maxRate); err != nil {
		return 0, err
	}
	if err := validRange("reserved tokens", r.Reserved, 0, maxTokens); err != nil {
		return 0, err
	}
	if err := validRange("actual tokens", r.Actual, 0, maxTokens); err != nil {
		return 0, err
	}
	if err := validRange("hourly tokens", r.TokensPerHour, 0, maxTokens); err != nil {
		return 0, err
	}
	if err := validRange("hour slot", r.HourSlot, 0, maxTokens); err != nil {
		return 0, err
	}
	if r.TokensPerMinute == 0 && r.TokensPerHour == 0 {
		return max(r.Actual-r.Reserved, 0), nil
	}
	res, err := afterCallScript.Run(ctx, l.rdb,
		[]string{key(r.Scope, "tpm"), opKey(r.Scope, "settle", r.Op), key(r.Scope, "hour")},
		l.now().UnixMilli(), r.TokensPerMinute, r.Reserved, r.Actual,
		OpTTL.Milliseconds(), expiryGrace.Milliseconds(),
		r.TokensPerHour, r.HourSlot, hourSlot.Milliseconds(), HourWindow.Milliseconds(),
	).Int64Slice()
	if err != nil {
		return 0, unavailable("after call", err)
	}
	if err := reply("after call", res, 2); err != nil {
		return 0, err
	}
	return res[0], nil
}

// validHour checks an hourly quota and its soft share: both 0 (off), or
// a quota with a soft share of 1 to the quota.
func validHour(tokens, soft int64) error {
	if err := validRange("hourly tokens", tokens, 0, maxTokens); err != nil {
		return err
	}
	if tokens == 0 {
		return nil
	}
	return validRange("soft tokens", soft, 1, tokens)
}

// HourRoom reports whether the principal's hour could take need more
// tokens now (charged and reserved tokens of the last hour, plus need,
// within perHour), the exact time until it can if not, and the hour's use.
// It takes nothing. need over perHour can never fit: ErrTooLarge.
func (l *Limiter) HourRoom(ctx context.Context, scope string, perHour, need int64) (ok bool, retryAfter time.Duration, used int64, err error) {
	if err := validScope(scope); err != nil {
		return false, 0, 0, err
	}
	if err := validRange("hourly tokens", perHour, 1, maxTokens); err != nil {
		return false, 0, 0, err
	}
	if err := validRange("tokens", need, 0, maxTokens); err != nil {
		return false, 0, 0, err
	}
	if need > perHour {
		return false, 0, 0, fmt.Errorf("%w: %d tokens, %d an hour", ErrTooLarge, need, perHour)
	}
	now := l.now()
	res, err := hourScript.Run(ctx, l.rdb, []string{key(scope, "hour")},
		now.UnixMilli(), perHour, need, hourSlot.Milliseconds(), HourWindow.Milliseconds()).Int64Slice()
	if err != nil {
		return false, 0, 0, unavailable("hour", err)
	}
	if err := reply("hour", res, 3); err != nil {
		return false, 0, 0, err
	}
	if res[0] == 1 {
		return true, 0, res[2], nil
	}
	return false, until(now, res[1]), res[2], nil
}

// Pace reserves amount tokens of a paced bucket (SiteScope's, sized to the
// provider's tokens-per-minute limit, shared by every lane and replica) and
// says how long the caller must wait before sending. Each call gets the
// earliest send time at which the bucket (capacity 2× the rate) can pay
// for it after every earlier reservation, so calls are served in the order
// they asked, and in any span w the tokens sent stay within capacity +
// rate × w. When that time is more than maxWait away, nothing is reserved
// and a *WaitTooLongError (ErrTokenRateLimited) says when to ask again.
// The caller sleeps wait (on its own clock, honouring its context) and sends.
func (l *Limiter) Pace(ctx context.Context, scope string, ratePerMin, amount int64, maxWait time.Duration, op string) (wait time.Duration, err error) {
	if err := checkBucket(scope, ratePerMin); err != nil {
		return 0, err
	}
	if err := validOp(op); err != nil {
		return 0, err
	}
	if err := validRange("amount", amount, 1, maxTokens); err != nil {
		return 0, err
	}
	if maxWait < 0 || maxWait > MaxPaceWait {
		return 0, fmt.Errorf("%w: max wait %v must be 0 to %v", ErrInvalid, maxWait, MaxPaceWait)
	}
	if amount > capacityOf(ratePerMin) {
		l.m.pace(outcomeTooLarge, 0)
		return 0, tooLarge(amount, ratePerMin)
	}
	now := l.now()
	// The script refills the bucket to the millisecond now falls in (never
	// past the instant the caller sends at), books at the latest at
	// now+maxWait rounded down (so wait ≤ maxWait), and moves the queue's
	// end to no earlier than now rounded up (no later call is scheduled
	// from before this one's send). A call whose turn is now so goes at
	// once: booking it at now rounded up made every call on a bucket with
	// room sleep to the next millisecond's edge, and a sleep under a
	// millisecond on an idle Go runtime lasts a millisecond or more, which
	// was most of the model endpoint's added latency for one caller.
	nowMs := now.UnixMilli()
	endMs := nowMs
	if time.UnixMilli(endMs).Before(now) {
		endMs++
	}
	latestMs := now.Add(maxWait).UnixMilli()
	res, err := paceScript.Run(ctx, l.rdb,
		[]string{key(scope, "tpm"), opKey(scope, "pace", op)},
		nowMs, ratePerMin, amount, latestMs,
		OpTTL.Milliseconds(), expiryGrace.Milliseconds(), endMs,
	).Int64Slice()
	if err != nil {
		return 0, unavailable("pace", err)
	}
	if err := reply("pace", res, 3); err != nil {
		return 0, err
	}
	wait = until(now, res[1])
	if res[0] != 1 {
		l.m.pace(outcomeTokenRateLimited, 0)
		// The same call fits once now' + maxWait reaches its send time.
		return 0, &WaitTooLongError{Wait: wait, MaxWait: maxWait, After: wait - maxWait}
	}
	if res[2] == 0 {
		l.m.pace(outcomeAllowed, wait)
	}
	return wait, nil
}
