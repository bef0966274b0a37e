package govern

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/breaker"
)

// ErrModelUnavailable: no model can take the call (primary failing or its
// breaker open, and no fallback).
var ErrModelUnavailable = errors.New("govern: model unavailable")

// Model is one model source with the name the ledger and the result record.
type Model struct {
	chat.Model
	// Name is the model's name as the ledger and the result show it.
	Name string
	// Offline marks the built-in deterministic demo planner.
	Offline bool
	// BaseURL, APIKey and HTTPClient are the model's upstream, for a
	// caller that relays raw HTTP to it (the model endpoint); empty for the
	// offline model, which has no upstream.
	BaseURL    string
	APIKey     string
	HTTPClient *http.Client
}

// Models routes calls to the primary model through its circuit breaker,
// and to the fallback (when configured) while the breaker is open, when the
// primary fails, or for runs marked low-precision.
type Models struct {
	Primary  Model
	Fallback *Model
	// Breaker guards Primary; nil means no breaker (the offline model cannot
	// fail like a provider does).
	Breaker *breaker.Breaker
}

// Status is ok, degraded (the breaker is not closed and calls may go to the
// fallback) or unavailable (open with no fallback).
func (m *Models) Status() string {
	if m.Breaker == nil {
		return task.ModelOK
	}
	switch m.Breaker.State() {
	case breaker.Open:
		if m.Fallback != nil {
			return task.ModelDegraded
		}
		return task.ModelUnavailable
	case breaker.HalfOpen:
		if m.Fallback != nil {
			return task.ModelDegraded
		}
		return task.ModelOK
	}
	return task.ModelOK
}

// Offline reports whether runs are planned by the built-in demo planner.
func (m *Models) Offline() bool { return m.Primary.Offline }

// Next is the model Do tries first for a call: the fallback for a
// low-precision run that has one, else the primary (whatever the breaker's
// state: Do asks the breaker, and only a refusal or a failure moves the
// call on). A caller reserves for it before calling Do, and again inside
// the call when the model in hand turns out to be another.
func (m *Models) Next(lowPrecision bool) Model {
	if lowPrecision && m.Fallback != nil {
		return *m.Fallback
	}
	return m.Primary
}

// Do runs call on the model this call should use, for principal (the
// breaker opens only on the failures of several). It reports which model
// answered and whether that was the fallback. call's error decides the
// breaker's verdict (protect/breaker judges it: a provider's refusal of
// the request is the caller's, a cancelled caller nobody's), and call
// marks its answer's first event with firstEvent, on which the breaker
// judges slowness; never nil.
func (m *Models) Do(ctx context.Context, principal string, lowPrecision bool, call func(ctx context.Context, mdl Model, firstEvent func()) error) (used Model, fellBack bool, err error) {
	if lowPrecision && m.Fallback != nil {
		return *m.Fallback, true, call(ctx, *m.Fallback, noEvent)
	}
	if m.Breaker == nil {
		return m.Primary, false, call(ctx, m.Primary, noEvent)
	}
	err = m.Breaker.Do(ctx, principal, func(ctx context.Context, bc *breaker.Call) error {
		return call(ctx, m.Primary, bc.FirstEvent)
	})
	if err == nil {
		return m.Primary, false, nil
	}
	if ctx.Err() != nil {
		return m.Primary, false, err
	}
	if m.Fallback == nil || errors.Is(err, errStarted) {
		// An answer that had reached the client cannot start over on
		// another model.
		if errors.Is(err, breaker.ErrOpen) {
			return m.Primary, false, fmt.Errorf("%w: %v", ErrModelUnavailable, err)
		}
		return m.Primary, false, err
	}
	return *m.Fallback, true, call(ctx, *m.Fallback, noEvent)
}

// noEvent is the first-event mark of a call no breaker judges.
func noEvent() {}
