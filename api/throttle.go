package api

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"faregate/agent/alert"
	"faregate/protect/ratelimit"
)

// The graduated response (seed 003) and the invalid ratio (seed 001) as
// the gate meets them: the request window reads a principal's hourly
// tokens and its invalid share in its one round trip (gate.go); what is
// here turns those readings into the hour's refusal of a creation, the
// operator's alerts, and the words of a refusal.

// hourRoom refuses a creation whose principal's sliding hour cannot hold
// need more tokens (one minimal run): 429 demo_budget_exhausted, policy
// "hour", with the exact time until enough of the hour has slid. The
// window's reading of the hour decides whether Redis is asked at all: a
// principal well inside its hour costs no round trip here. (Every model
// call checks the hour again, with its own reservation, in the Governor.)
func (s *server) hourRoom(ctx context.Context, st *state, need int64) error {
	hourly := st.tier.TokensPerHour
	if hourly <= 0 || st.window.HourUsed+need <= hourly {
		return nil
	}
	ok, wait, _, err := s.d.Limiter.HourRoom(ctx, st.principal.Scope(), hourly, need)
	switch {
	case errors.Is(err, ratelimit.ErrTooLarge):
		// Configuration refuses an hour smaller than a minimal run; a
		// request whose own prompt makes it larger waits out the hour.
		return &ratelimit.RefusedError{Reason: ratelimit.ReasonHourExhausted, After: ratelimit.HourWindow}
	case err != nil:
		return err
	case !ok:
		return &ratelimit.RefusedError{Reason: ratelimit.ReasonHourExhausted, After: wait}
	}
	return nil
}

// refusedOf is the rate limiter's refusal in err's chain, found without
// errors.As (whose target escapes: one allocation per refusal, and a
// flood of refusals answered from memory must cost none).
func refusedOf(err error) *ratelimit.RefusedError {
	for err != nil {
		if re, ok := err.(*ratelimit.RefusedError); ok {
			return re
		}
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return nil
		}
		err = u.Unwrap()
	}
	return nil
}

// hourMessage is the message of a refusal by the hourly quota, which
// the table's demo_budget_exhausted sentence (a day's budget) would
// misstate.
const hourMessage = "This principal's model tokens for the last hour are used up. They free up as the hour slides; Retry-After says when."

// windowMessage is the message of a rate_limited refusal by the second
// window or the soft one ("" for the minute's: the table's sentence).
func windowMessage(err error) string {
	if re := refusedOf(err); re != nil {
		switch re.Window {
		case ratelimit.WindowSecond:
			return "Too many requests in the last second. Please slow down."
		case ratelimit.WindowSoft:
			return "Most of this principal's model tokens for the hour are used, so it may send only a few requests a minute for now. Please slow down."
		}
	}
	return ""
}

// isHourRefusal reports whether err is the hourly quota's refusal.
func isHourRefusal(err error) bool {
	re := refusedOf(err)
	return re != nil && re.Reason == ratelimit.ReasonHourExhausted
}

// alert hands a to the operator's notifier, if there is one.
func (s *server) alert(a alert.Alert) {
	if s.d.Alert != nil {
		s.d.Alert(a)
	}
}

// alertInvalid raises invalid_ratio for a principal the gate refused
// for it: once per principal and window (the notifier deduplicates on
// the scope, across replicas).
func (s *server) alertInvalid(st *state, after time.Duration) {
	who := st.principal.String()
	ratio := s.d.Limits.InvalidRatio
	s.alert(alert.Alert{Event: alert.InvalidRatio, Scope: "principal:" + who, Severity: alert.Warning, Window: ratelimit.InvalidWindow,
		Text: fmt.Sprintf("%s: more than %s of its requests in the last 10 minutes were invalid (refused as invalid, or refused by the model); its new tasks are refused for %s",
			who, percent(ratio), after.Round(time.Second)),
		Details: map[string]any{"principal": who, "ratio": ratio, "retry_after_s": ceilSeconds(after)}})
}

// alertThrottled raises principal_throttled for a principal the gate
// found past the soft share of its hourly tokens: once per principal and
// hour.
func (s *server) alertThrottled(st *state) {
	who := st.principal.String()
	t := st.tier
	s.alert(alert.Alert{Event: alert.PrincipalThrottled, Scope: "principal:" + who, Severity: alert.Warning, Window: ratelimit.HourWindow,
		Text: fmt.Sprintf("%s has used %d of its %d tokens an hour (held back from %d): held to %d requests a minute, its model calls go to the fallback model first",
			who, st.window.HourUsed, t.TokensPerHour, t.SoftTokens(), t.SoftRequests()),
		Details: map[string]any{"principal": who, "used": st.window.HourUsed, "limit": t.TokensPerHour, "soft": t.SoftTokens()}})
}

// percent shows a share as a whole percentage ("50%").
func percent(share float64) string { return fmt.Sprintf("%.0f%%", math.Round(share*100)) }
