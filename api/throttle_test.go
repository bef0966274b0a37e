package api

import (
	"context"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"faregate/agent/alert"
	"faregate/protect/codes"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// seedLimiter records what the gate asks of the limiter and answers as
// told.
type seedLimiter struct {
	Limiter
	mu     sync.Mutex
	gates  []ratelimit.GateRequest
	notes  []ratelimit.Note
	failed int
	answer ratelimit.GateDecision
	room   bool
	wait   time.Duration
}

func (l *seedLimiter) Gate(_ context.Context, r ratelimit.GateRequest) (ratelimit.GateDecision, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.gates = append(l.gates, r)
	return l.answer, nil
}

func (l *seedLimiter) Record(_ context.Context, n ratelimit.Note) (int64, time.Duration, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.notes = append(l.notes, n)
	return 0, 0, nil
}

func (l *seedLimiter) RecordFailedCheck(context.Context, string, string, int64) (int64, time.Duration, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.failed++
	return 1, 0, nil
}

func (l *seedLimiter) HourRoom(context.Context, string, int64, int64) (bool, time.Duration, int64, error) {
	return l.room, l.wait, 0, nil
}

// TestWindowRules: the request window asks for the tier's second window
// and hour on every request, and for the invalid ratio (and failed checks,
// for visitors) on creations only; a refusal by the invalid ratio is
// remembered and alerted, a throttled principal alerted.
func TestWindowRules(t *testing.T) {
	lim := &seedLimiter{answer: ratelimit.GateDecision{Allowed: true}}
	var alerts []alert.Alert
	s := &server{d: Deps{Now: time.Now, Limiter: lim, Alert: func(a alert.Alert) { alerts = append(alerts, a) },
		Limits: Limits{FailedChecksPerHour: 20, InvalidRatio: 0.5, InvalidMinRequests: 20}},
		errors: newErrorTable(errorRows()), memo: newDenials(10, time.Now), limited: newDenials(10, time.Now), inflight: newInflight(1)}
	tier := principal.Tier{RequestsPerMinute: 120, RequestsPerSecond: 10, TokensPerHour: 10_000, SoftAt: 0.8, SoftRequestsPerMinute: 5}
	visitor := principal.Principal{Kind: principal.KindVisitor, ID: "0123456789abcdef"}
	key := principal.Principal{Kind: principal.KindKey, ID: "acme"}
	check := func(p principal.Principal, creation bool) (*state, error) {
		st := &state{principal: p, tier: tier}
		r := httptest.NewRequest("POST", "/api/tasks", nil)
		return st, s.windowCheck(r, st, creation)
	}
	for _, tc := range []struct {
		name     string
		p        principal.Principal
		creation bool
		want     ratelimit.GateRequest
	}{
		{"a visitor's creation", visitor, true, ratelimit.GateRequest{RequestsPerMinute: 120, RequestsPerSecond: 10, CheckAnomaly: true, FailedChecksPerHour: 20,
			Invalid: ratelimit.InvalidRule{Ratio: ratelimit.RatioScale / 2, MinRequests: 20}}},
		{"a key's creation", key, true, ratelimit.GateRequest{RequestsPerMinute: 120, RequestsPerSecond: 10, CheckAnomaly: true,
			Invalid: ratelimit.InvalidRule{Ratio: ratelimit.RatioScale / 2, MinRequests: 20}}},
		{"a read", visitor, false, ratelimit.GateRequest{RequestsPerMinute: 120, RequestsPerSecond: 10}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lim.gates = nil
			if _, err := check(tc.p, tc.creation); err != nil {
				t.Fatal(err)
			}
			got := lim.gates[0]
			tc.want.Scope, tc.want.Op = tc.p.Scope(), got.Op
			tc.want.Hour = ratelimit.HourRule{Tokens: 10_000, SoftTokens: 8_000, SoftRequestsPerMinute: 5}
			if got != tc.want {
				t.Errorf("gate request %+v, want %+v", got, tc.want)
			}
		})
	}

	// Throttled: alerted once per request here (the notifier deduplicates).
	lim.answer = ratelimit.GateDecision{Allowed: true, Soft: true, HourUsed: 8_100}
	if _, err := check(key, false); err != nil || len(alerts) != 1 || alerts[0].Event != alert.PrincipalThrottled ||
		alerts[0].Scope != "principal:k:acme" || alerts[0].Window != time.Hour {
		t.Fatalf("throttled: %v, alerts %+v", err, alerts)
	}

	// Refused for its invalid ratio: alerted with a ten-minute window, and
	// the next creation is refused from memory without asking Redis.
	alerts = nil
	lim.answer = ratelimit.GateDecision{Reason: ratelimit.ReasonInvalidRatio, RetryAfter: 9 * time.Minute}
	if _, err := check(visitor, true); err == nil || s.errors.lookup(err).code != codes.InvalidRatio {
		t.Fatalf("invalid ratio: %v", err)
	}
	if len(alerts) != 1 || alerts[0].Event != alert.InvalidRatio || alerts[0].Window != 10*time.Minute {
		t.Fatalf("alerts %+v", alerts)
	}
	lim.gates = nil
	if err := s.memo.refusal(visitor); err == nil || s.errors.lookup(err).code != codes.InvalidRatio {
		t.Fatalf("not remembered: %v", err)
	}

}

// TestFailedCheckCountsInvalid: a refused creation is one invalid request
// of its principal, with the visitor's failed check in the same call (a
// key has none); with the ratio off only the visitor's failed check is
// logged.
func TestFailedCheckCountsInvalid(t *testing.T) {
	lim := &seedLimiter{}
	s := &server{d: Deps{Now: time.Now, Limiter: lim, Limits: Limits{FailedChecksPerHour: 20, InvalidRatio: 0.5, InvalidMinRequests: 20}},
		memo: newDenials(10, time.Now)}
	tier := principal.Tier{RequestsPerMinute: 120}
	visitor := principal.Principal{Kind: principal.KindVisitor, ID: "0123456789abcdef"}
	key := principal.Principal{Kind: principal.KindKey, ID: "acme"}
	for _, p := range []principal.Principal{visitor, key} {
		s.failedCheck(httptest.NewRequest("POST", "/api/tasks", nil), &state{principal: p, tier: tier})
	}
	want := []ratelimit.Note{{Scope: visitor.Scope(), Invalid: 1, FailedChecksPerHour: 20}, {Scope: key.Scope(), Invalid: 1}}
	for i := range want {
		want[i].Op = lim.notes[i].Op
		if lim.notes[i] != want[i] {
			t.Errorf("note %d = %+v, want %+v", i, lim.notes[i], want[i])
		}
	}
	// With the ratio off, only a visitor's failed check is logged.
	s.d.Limits.InvalidRatio = 0
	lim.notes, lim.failed = nil, 0
	for _, p := range []principal.Principal{visitor, key} {
		s.failedCheck(httptest.NewRequest("POST", "/api/tasks", nil), &state{principal: p, tier: tier})
	}
	if len(lim.notes) != 0 || lim.failed != 1 {
		t.Errorf("ratio off: %d notes, %d failed checks; want 0, 1", len(lim.notes), lim.failed)
	}
}

// TestHourRoom: a creation is asked of the hour only when the window's
// reading leaves no room for one minimal run, and then refused for
// exactly as long as the limiter says.
func TestHourRoom(t *testing.T) {
	lim := &seedLimiter{wait: 90 * time.Second}
	s := &server{d: Deps{Limiter: lim}}
	st := &state{principal: principal.Principal{Kind: principal.KindKey, ID: "acme"}, tier: principal.Tier{TokensPerHour: 10_000}}
	st.window.HourUsed = 8_000
	if err := s.hourRoom(context.Background(), st, 2_000); err != nil {
		t.Fatalf("room for exactly one run: %v", err)
	}
	err := s.hourRoom(context.Background(), st, 2_001)
	re := refusedOf(err)
	if re == nil || re.Reason != ratelimit.ReasonHourExhausted || re.After != 90*time.Second {
		t.Fatalf("no room: %v", err)
	}
	lim.room = true
	if err := s.hourRoom(context.Background(), st, 2_001); err != nil {
		t.Fatalf("the hour slid meanwhile: %v", err)
	}
	st.tier.TokensPerHour = 0
	if err := s.hourRoom(context.Background(), st, 1<<40); err != nil {
		t.Fatalf("no hourly quota: %v", err)
	}
}
