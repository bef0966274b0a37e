// Package breaker is a circuit breaker around a model provider. It opens
// when, over a rolling window holding at least MinCalls calls, the share of
// failed calls reaches FailureRatio or the share of slow calls reaches
// SlowRatio, and those bad calls were made for at least MinPrincipals
// principals; after OpenFor it lets HalfOpenProbes probe calls through,
// and closes when they all succeed in time or reopens at the first bad
// one.
//
// It judges the provider, not the caller. A call's error says whose fault
// it was when it implements Judged (the code that met the provider's
// answer knows its status; StatusFault is the one rule for it): an answer
// refusing the request for what it asked (400, 404, 409, 413, 422) is not
// counted at all, a 429 counts at most once per its Retry-After, anything
// else counts as a failure. Slowness is the time to the answer's first
// event (Call.FirstEvent), never the answer's length: a call that reports
// no first event (a JSON answer, written whole) is slow only when it
// timed out. And one caller alone cannot open it: an agent that sends
// parameters the provider refuses, hammers a throttled provider, or asks
// for long answers judges only itself, while an outage fails the calls of
// everyone.
//
// The package runs one small state machine of its own under one mutex:
// closed → open → half-open → closed or open again. Failures and slow
// calls are counted apart, each against its own ratio. Every change of
// state starts a new generation and an empty window, and the result of a
// call begun in an earlier generation is discarded: it describes a provider
// the breaker has already judged. An open breaker turns half-open when it
// is next asked (State or Do) after OpenFor, so no timer goroutine runs.
//
// All time comes from Settings.Now: the window's buckets, the open timer
// and the duration that makes a call slow. Tests move that clock instead of
// waiting.
package breaker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
)

// ErrOpen is returned, without calling the function, while the breaker is
// open, or half-open with all its probes already in flight.
var ErrOpen = errors.New("breaker: open")

// State is the breaker's state as logs and metrics name it.
type State string

// The three states.
const (
	Closed   State = "closed"
	HalfOpen State = "half-open"
	Open     State = "open"
)

// states lists the states in the order metrics are set up.
var states = []State{Closed, HalfOpen, Open}

// Settings configure a Breaker; zero fields take the defaults noted.
type Settings struct {
	// Window is the rolling window the ratios are computed over (60s).
	Window time.Duration
	// MinCalls is how many calls the window must hold before it can open (10).
	MinCalls uint32
	// FailureRatio opens the breaker when failed/total reaches it (0.2).
	// A value above 1 disables the failure criterion.
	FailureRatio float64
	// SlowRatio opens the breaker when slow/total reaches it (0.1).
	// A value above 1 disables the slow-call criterion.
	SlowRatio float64
	// SlowCall is the wait for an answer's first event above which a call
	// counts as slow (20s).
	SlowCall time.Duration
	// MinPrincipals is how many principals' failed or slow calls the
	// window must hold before it can open (2, at most 8): with 2, one
	// caller alone never opens it, whatever it sends. 1 lets any caller
	// open it.
	MinPrincipals uint32
	// OpenFor is how long the breaker stays open before probing (30s).
	OpenFor time.Duration
	// HalfOpenProbes is how many calls half-open lets through (3).
	HalfOpenProbes uint32
	// Name labels logs and metrics ("model").
	Name string
	// Now is the clock for the window, the open timer and call durations
	// (time.Now).
	Now func() time.Time
	// OnStateChange, if not nil, is told of every state change, for
	// alerts. It runs outside the breaker's lock, after the change's log
	// line, one change at a time and in order; it may call the breaker.
	OnStateChange func(from, to State)
}

func (s Settings) withDefaults() Settings {
	if s.Window <= 0 {
		s.Window = 60 * time.Second
	}
	if s.MinCalls == 0 {
		s.MinCalls = 10
	}
	if s.FailureRatio <= 0 {
		s.FailureRatio = 0.2
	}
	if s.SlowRatio <= 0 {
		s.SlowRatio = 0.1
	}
	if s.SlowCall <= 0 {
		s.SlowCall = 20 * time.Second
	}
	if s.OpenFor <= 0 {
		s.OpenFor = 30 * time.Second
	}
	if s.MinPrincipals == 0 {
		s.MinPrincipals = 2
	}
	s.MinPrincipals = min(s.MinPrincipals, maxPrincipals)
	if s.HalfOpenProbes == 0 {
		s.HalfOpenProbes = 3
	}
	if s.Name == "" {
		s.Name = "model"
	}
	if s.Now == nil {
		s.Now = time.Now
	}
	return s
}

// Breaker guards calls to one provider. It is safe for concurrent use.
type Breaker struct {
	s       Settings
	lg      *slog.Logger
	refusal error // ErrOpen with the breaker's name, built once

	// stateGauge holds faregate_breaker_state{state=...} of each state: 1
	// for the current one, 0 for the others, so every series always exists.
	stateGauge  map[State]prometheus.Gauge
	transitions *prometheus.CounterVec

	mu      sync.Mutex
	current State
	gen     uint64    // bumped at every state change
	since   time.Time // when current was entered
	win     *window   // calls ended in this generation
	probes  uint32    // half-open: slots taken by probes running or passed
	passed  uint32    // half-open: probes that succeeded in time
	// quietUntil is when the next provider 429 may count again: one
	// throttled burst is one failure, however often it is retried.
	quietUntil time.Time
	pending    []change // state changes not yet announced, oldest first
	// announcing is set while one goroutine announces pending changes, so
	// that changes are announced one at a time and in order, outside mu.
	announcing bool
}

// change is one state change, kept for its log line.
type change struct {
	from, to State
	window   counts // the ended generation's window
}

// New returns a closed Breaker. lg may be nil (no logs); reg may be nil
// (metrics unregistered). Several breakers with different names may share
// one registry.
func New(s Settings, lg *slog.Logger, reg prometheus.Registerer) *Breaker {
	s = s.withDefaults()
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	now := s.Now()
	b := &Breaker{
		s: s, lg: lg, refusal: fmt.Errorf("%w: %s", ErrOpen, s.Name),
		current: Closed, since: now, win: newWindow(s.Window, int(s.MinPrincipals), now),
	}
	gauge := promreg.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "faregate_breaker_state",
		Help: "Circuit breaker state: 1 for the current state, 0 for the others.",
	}, []string{"name", "state"}))
	b.transitions = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_breaker_transitions_total",
		Help: "Circuit breaker state changes, by the state entered.",
	}, []string{"name", "to"})).MustCurryWith(prometheus.Labels{"name": s.Name})
	b.stateGauge = make(map[State]prometheus.Gauge, len(states))
	for _, st := range states {
		b.stateGauge[st] = gauge.WithLabelValues(s.Name, string(st))
		b.transitions.WithLabelValues(string(st))
	}
	b.showLocked(Closed)
	return b
}

// State is the current state; an open breaker whose OpenFor has passed
// reports half-open (and becomes half-open: the change is logged and
// passed to OnStateChange then).
func (b *Breaker) State() State {
	b.mu.Lock()
	b.expireLocked(b.s.Now())
	st := b.current
	b.unlock()
	return st
}

// Do calls fn unless the breaker refuses (ErrOpen), and returns fn's
// error. principal is who the call is made for: the window opens the
// breaker only when its bad calls come from MinPrincipals of them. fn
// reports the first event of its answer through c (Call.FirstEvent).
//
// The call's outcome feeds the window (judge): a success is a success,
// slow when its first event came after SlowCall; an error counts as the
// fault it says it is (Judged; an error that says nothing is the
// provider's); a call the caller canceled (ctx canceled and fn returned an
// error) is not counted at all, because it says nothing about the
// provider: the visitor left, or the repetition detector cut a looping
// stream. A deadline, the caller's or the transport's, is a bound the
// provider failed to meet (a failure, and slow) unless the answer had
// begun: then it is the answer's length that ran out. A panic in fn
// counts as a failure and goes on unrecovered.
func (b *Breaker) Do(ctx context.Context, principal string, fn func(ctx context.Context, c *Call) error) error {
	gen, ok := b.admit()
	if !ok {
		return b.refusal
	}
	c := &Call{now: b.s.Now}
	began := b.s.Now()
	returned := false
	defer func() {
		// fn panicked (or called runtime.Goexit): count a failure, or a
		// half-open probe slot would stay taken forever. Not recovering
		// keeps the panic's own stack trace.
		if !returned {
			b.finish(gen, principal, verdict{counted: true, failed: true})
		}
	}()
	err := fn(ctx, c)
	returned = true
	b.finish(gen, principal, b.judge(ctx, err, began, c.first.Load()))
	return err
}

// Call is one call Do let through, for fn to tell the breaker what its
// error cannot: when the answer began.
type Call struct {
	now   func() time.Time
	first atomic.Pointer[time.Time]
}

// FirstEvent marks that the answer's first event arrived now: a stream's
// first bytes. Only the first mark counts; it is safe from any goroutine
// and does nothing on a nil Call. A call that never marks one is judged
// as an answer written whole, whose wait is its length.
func (c *Call) FirstEvent() {
	if c == nil {
		return
	}
	t := c.now()
	c.first.CompareAndSwap(nil, &t)
}

// Fault says whose fault a failed call was.
type Fault uint8

// The faults a Judged error may name.
const (
	// ProviderFault: the provider failed (a 5xx, faregate's own upstream
	// credentials refused with 401 or 403, a 408, a refused connection,
	// an answer that is not what its wire promises). A failure. An error
	// that does not say otherwise is one.
	ProviderFault Fault = iota
	// CallerFault: the provider refused the request for what it asked
	// (400, 404, 409, 413, 422: a parameter it does not take, a prompt
	// too long). It says nothing of the provider's health and is not
	// counted at all.
	CallerFault
	// RateLimitFault: the provider throttled the call (429). A failure at
	// most once per the error's RetryAfter (interface{ RetryAfter()
	// time.Duration }; a second without one, the window at most), and not
	// counted otherwise: a caller that retries a throttled call at once
	// must not count each retry.
	RateLimitFault
)

// Judged is an error that knows whose fault it is: the code that met the
// provider's answer says so, and Do finds it with errors.As.
type Judged interface {
	error
	BreakerFault() Fault
}

// StatusFault is whose fault a provider's HTTP answer of status (not 2xx)
// is: the one rule for every caller that speaks HTTP to a provider.
func StatusFault(status int) Fault {
	switch status {
	case http.StatusBadRequest, http.StatusNotFound, http.StatusConflict,
		http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		return CallerFault
	case http.StatusTooManyRequests:
		return RateLimitFault
	}
	return ProviderFault
}

// verdict is how one ended call counts: not at all, or as a call that
// failed or was slow or neither. throttled marks a 429, which counts only
// outside the quiet time it starts (quiet long).
type verdict struct {
	counted, failed, slow bool
	throttled             bool
	quiet                 time.Duration
}

// judge is the verdict on a call that began at began, whose answer's
// first event came at first (nil: none was marked), and that returned err.
func (b *Breaker) judge(ctx context.Context, err error, began time.Time, first *time.Time) verdict {
	late := first != nil && first.Sub(began) > b.s.SlowCall
	if err == nil {
		return verdict{counted: true, slow: late}
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return verdict{}
	}
	if timedOut(ctx, err) {
		if first != nil {
			return verdict{counted: true, slow: late}
		}
		return verdict{counted: true, failed: true, slow: true}
	}
	fault := ProviderFault
	var j Judged
	if errors.As(err, &j) {
		fault = j.BreakerFault()
	}
	switch fault {
	case CallerFault:
		return verdict{}
	case RateLimitFault:
		quiet := time.Second
		var ra interface{ RetryAfter() time.Duration }
		if errors.As(err, &ra) && ra.RetryAfter() > 0 {
			quiet = ra.RetryAfter()
		}
		return verdict{counted: true, failed: true, slow: late, throttled: true, quiet: min(quiet, b.s.Window)}
	}
	return verdict{counted: true, failed: true, slow: late}
}

// timedOut reports whether err is a deadline's: the caller's context, or
// a transport's timeout (net.Error and http.Client's both say Timeout).
func timedOut(ctx context.Context, err error) bool {
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return true
	}
	var t interface{ Timeout() bool }
	return errors.As(err, &t) && t.Timeout()
}

// admit decides whether a call may run and returns the generation it
// belongs to.
func (b *Breaker) admit() (gen uint64, ok bool) {
	b.mu.Lock()
	b.expireLocked(b.s.Now())
	switch b.current {
	case Open:
		ok = false
	case HalfOpen:
		ok = b.probes < b.s.HalfOpenProbes
		if ok {
			b.probes++
		}
	default:
		ok = true
	}
	gen = b.gen
	b.unlock()
	return gen, ok
}

// finish records the verdict on a call of principal admitted in
// generation gen and moves the state if the verdict decides it.
func (b *Breaker) finish(gen uint64, principal string, v verdict) {
	b.mu.Lock()
	// A result from an earlier generation is dropped; since every state
	// change bumps gen, a current one was admitted in the current state,
	// closed or half-open (open admits nothing).
	if gen != b.gen {
		b.mu.Unlock()
		return
	}
	now := b.s.Now()
	if v.throttled {
		if now.Before(b.quietUntil) {
			v = verdict{}
		} else {
			b.quietUntil = now.Add(v.quiet)
		}
	}
	if !v.counted {
		// Not counted; a probe's slot goes to the next caller.
		if b.current == HalfOpen {
			b.probes--
		}
		b.mu.Unlock()
		return
	}
	b.win.add(now, v.failed, v.slow, principal)
	switch b.current {
	case Closed:
		if b.tripsLocked(now) {
			b.setLocked(Open, now)
		}
	case HalfOpen:
		if v.failed || v.slow {
			b.setLocked(Open, now)
			break
		}
		b.passed++
		if b.passed >= b.s.HalfOpenProbes {
			b.setLocked(Closed, now)
		}
	}
	b.unlock()
}

// tripsLocked judges the window: both ratios, once it holds MinCalls
// calls, and only when its bad calls were made for MinPrincipals
// principals.
func (b *Breaker) tripsLocked(now time.Time) bool {
	c := b.win.sum(now)
	if c.total < b.s.MinCalls { // MinCalls is at least 1
		return false
	}
	t := float64(c.total)
	bad := float64(c.failures)/t >= b.s.FailureRatio || float64(c.slow)/t >= b.s.SlowRatio
	return bad && c.principals >= b.s.MinPrincipals
}

// expireLocked turns an open breaker whose OpenFor has passed half-open.
// It runs whenever the state is read, so no timer is needed.
func (b *Breaker) expireLocked(now time.Time) {
	if b.current == Open && now.Sub(b.since) >= b.s.OpenFor {
		b.setLocked(HalfOpen, now)
	}
}

// setLocked enters state to: a new generation with an empty window and no
// probes, the metrics moved, and the change queued for announce.
func (b *Breaker) setLocked(to State, now time.Time) {
	b.pending = append(b.pending, change{from: b.current, to: to, window: b.win.sum(now)})
	b.current, b.since = to, now
	b.gen++
	b.probes, b.passed = 0, 0
	b.win.reset(now)
	// The metrics move under mu so that they always show the latest state.
	b.showLocked(to)
	b.transitions.WithLabelValues(string(to)).Inc()
}

// showLocked sets the state gauge to st.
func (b *Breaker) showLocked(st State) {
	for s, g := range b.stateGauge {
		if s == st {
			g.Set(1)
		} else {
			g.Set(0)
		}
	}
}

// unlock releases mu and announces the state changes queued meanwhile;
// with none queued (nearly every call) it costs no second lock.
func (b *Breaker) unlock() {
	queued := len(b.pending) > 0
	b.mu.Unlock()
	if queued {
		b.announce()
	}
}

// announce logs queued state changes and passes them to OnStateChange,
// outside mu. Only one goroutine announces at a time, draining the queue,
// so changes come out in the order they happened even when two callers
// cause changes at once; a change caused from inside OnStateChange is
// queued and announced after the current one returns.
func (b *Breaker) announce() {
	for {
		b.mu.Lock()
		if b.announcing || len(b.pending) == 0 {
			b.mu.Unlock()
			return
		}
		batch := b.pending
		b.pending, b.announcing = nil, true
		b.mu.Unlock()
		func() {
			// Cleared even if a log handler or OnStateChange panics, or
			// no change would ever be announced again.
			defer func() {
				b.mu.Lock()
				b.announcing = false
				b.mu.Unlock()
			}()
			for _, c := range batch {
				b.lg.Info("breaker state changed", "breaker", b.s.Name,
					"from", string(c.from), "to", string(c.to),
					"window_calls", c.window.total, "window_failures", c.window.failures,
					"window_slow", c.window.slow, "window_principals", c.window.principals)
				if b.s.OnStateChange != nil {
					b.s.OnStateChange(c.from, c.to)
				}
			}
		}()
	}
}
