// Package breaker is a circuit breaker around a model provider. It opens
// when, over a rolling window holding at least MinCalls calls, the share of
// failed calls reaches FailureRatio or the share of slow calls reaches
// SlowRatio; after OpenFor it lets HalfOpenProbes probe calls through, and
// closes when they all succeed in time or reopens at the first bad one.
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
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/promreg"
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
	// SlowCall is the duration above which a call counts as slow (20s).
	SlowCall time.Duration
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
	pending []change  // state changes not yet announced, oldest first
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
		current: Closed, since: now, win: newWindow(s.Window, now),
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

// Do calls fn unless the breaker refuses (ErrOpen), and returns fn's error.
// The call's outcome feeds the window: an error is a failure; a call that
// took longer than SlowCall is slow even if it succeeded; a call the caller
// canceled (ctx canceled and fn returned an error) is not counted at all,
// because it says nothing about the provider: the visitor left, or the
// repetition detector cut a looping stream. A caller's deadline, by
// contrast, is a bound the provider failed to meet and counts as a failure.
// A panic in fn counts as a failure and goes on unrecovered.
func (b *Breaker) Do(ctx context.Context, fn func(ctx context.Context) error) error {
	gen, ok := b.admit()
	if !ok {
		return b.refusal
	}
	began := b.s.Now()
	returned := false
	defer func() {
		// fn panicked (or called runtime.Goexit): count a failure, or a
		// half-open probe slot would stay taken forever. Not recovering
		// keeps the panic's own stack trace.
		if !returned {
			b.finish(gen, true, false, b.s.Now().Sub(began))
		}
	}()
	err := fn(ctx)
	returned = true
	canceled := err != nil && errors.Is(ctx.Err(), context.Canceled)
	b.finish(gen, err != nil, canceled, b.s.Now().Sub(began))
	return err
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

// finish records the outcome of a call admitted in generation gen and
// moves the state if the outcome decides it.
func (b *Breaker) finish(gen uint64, failed, canceled bool, took time.Duration) {
	slow := took > b.s.SlowCall
	b.mu.Lock()
	// A result from an earlier generation is dropped; since every state
	// change bumps gen, a current one was admitted in the current state,
	// closed or half-open (open admits nothing).
	if gen != b.gen {
		b.mu.Unlock()
		return
	}
	if canceled {
		// Not counted; a probe's slot goes to the next caller.
		if b.current == HalfOpen {
			b.probes--
		}
		b.mu.Unlock()
		return
	}
	now := b.s.Now()
	b.win.add(now, failed, slow)
	switch b.current {
	case Closed:
		if b.tripsLocked(now) {
			b.setLocked(Open, now)
		}
	case HalfOpen:
		if failed || slow {
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

// tripsLocked judges the window: both ratios, once it holds MinCalls calls.
func (b *Breaker) tripsLocked(now time.Time) bool {
	c := b.win.sum(now)
	if c.total < b.s.MinCalls { // MinCalls is at least 1
		return false
	}
	t := float64(c.total)
	return float64(c.failures)/t >= b.s.FailureRatio || float64(c.slow)/t >= b.s.SlowRatio
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
					"window_slow", c.window.slow)
				if b.s.OnStateChange != nil {
					b.s.OnStateChange(c.from, c.to)
				}
			}
		}()
	}
}
