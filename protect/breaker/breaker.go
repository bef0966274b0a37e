// Package breaker is a circuit breaker around a model provider. It opens
// when, over a rolling window holding at least MinCalls calls, the share of
// failed calls reaches FailureRatio or the share of slow calls reaches
// SlowRatio; after OpenFor it lets HalfOpenProbes probe calls through, and
// closes when they all succeed in time or reopens at the first bad one.
//
// sony/gobreaker/v2 runs the state machine (open timer, half-open probe
// limit, generations that discard results of calls begun in an earlier
// state). Its counts only know success and failure, and it consults
// ReadyToTrip only after a failure, so this package keeps its own rolling
// window of calls, failures and slow calls, bucketed like gobreaker's and
// cleared at the same state changes, and judges each ratio against its own
// threshold there. A slow call that succeeded is reported to gobreaker as a
// failure (errSlow) so that gobreaker asks ReadyToTrip, and so that a slow
// probe reopens the breaker; a success that brings the window over a
// threshold (the MinCalls-th call, say) is reported the same way (errTrip).
package breaker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"

	"faregate/protect/promreg"
)

// ErrOpen is returned, without calling the function, while the breaker is
// open, or half-open with all its probes already in flight.
var ErrOpen = errors.New("breaker: open")

var (
	// errSlow reports a successful but slow call to gobreaker as a failure.
	errSlow = errors.New("breaker: slow call")
	// errTrip reports a successful call after which the window trips.
	errTrip = errors.New("breaker: window over threshold")
	// errExcluded marks a call the caller canceled: gobreaker ignores it.
	errExcluded = errors.New("breaker: canceled by caller")
)

// State is the breaker's state as logs and metrics name it.
type State string

// The three states.
const (
	Closed   State = "closed"
	HalfOpen State = "half-open"
	Open     State = "open"
)

// stateValue is the faregate_breaker_state gauge value of each state.
var stateValue = map[State]float64{Closed: 0, HalfOpen: 1, Open: 2}

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
	return s
}

// Breaker guards calls to one provider. It is safe for concurrent use.
type Breaker struct {
	s  Settings
	cb *gobreaker.TwoStepCircuitBreaker[struct{}]
	lg *slog.Logger

	state       prometheus.Gauge
	transitions *prometheus.CounterVec

	// mu guards the fields below. Lock order: gobreaker's mutex, then mu
	// (gobreaker calls readyToTrip and onStateChange holding its own);
	// so mu is never held while calling into gobreaker.
	mu      sync.Mutex
	gen     uint64 // bumped at every state change, like gobreaker's generation
	current State
	win     *window
}

// New returns a closed Breaker. lg may be nil (no logs); reg may be nil
// (metrics unregistered). Several breakers with different names may share
// one registry.
func New(s Settings, lg *slog.Logger, reg prometheus.Registerer) *Breaker {
	s = s.withDefaults()
	if lg == nil {
		lg = slog.New(slog.DiscardHandler)
	}
	b := &Breaker{s: s, lg: lg, current: Closed, win: newWindow(s.Window, time.Now())}
	gauge := promreg.Register(reg, prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "faregate_breaker_state",
		Help: "Circuit breaker state: 0 closed, 1 half-open, 2 open.",
	}, []string{"name"}))
	b.state = gauge.WithLabelValues(s.Name)
	b.transitions = promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_breaker_transitions_total",
		Help: "Circuit breaker state changes, by the state entered.",
	}, []string{"name", "to"})).MustCurryWith(prometheus.Labels{"name": s.Name})
	for st := range stateValue {
		b.transitions.WithLabelValues(string(st))
	}
	b.state.Set(stateValue[Closed])
	b.cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:          s.Name,
		MaxRequests:   s.HalfOpenProbes,
		Interval:      s.Window,
		BucketPeriod:  s.Window / buckets,
		Timeout:       s.OpenFor,
		ReadyToTrip:   func(gobreaker.Counts) bool { return b.trips() },
		OnStateChange: b.onStateChange,
		IsExcluded:    func(err error) bool { return errors.Is(err, errExcluded) },
	})
	return b
}

// State is the current state; an open breaker whose OpenFor has passed
// reports half-open.
func (b *Breaker) State() State { return fromGobreaker(b.cb.State()) }

// Do calls fn unless the breaker refuses (ErrOpen), and returns fn's error.
// The call's outcome feeds the window: an error is a failure; a call that
// took longer than SlowCall is slow even if it succeeded; a call the caller
// canceled (ctx canceled and fn returned an error) is not counted at all,
// because it says nothing about the provider: the visitor left, or the
// repetition detector cut a looping stream. A caller's deadline, by
// contrast, is a bound the provider failed to meet and counts as a failure.
func (b *Breaker) Do(ctx context.Context, fn func(ctx context.Context) error) (err error) {
	b.mu.Lock()
	gen := b.gen
	b.mu.Unlock()
	done, refused := b.cb.Allow()
	if refused != nil {
		return fmt.Errorf("%w: %s", ErrOpen, b.s.Name)
	}
	// A state change between reading gen and Allow means the call may
	// belong to either generation: it is left out of the window, as
	// gobreaker leaves out results from a generation that has ended.
	b.mu.Lock()
	counted := b.gen == gen
	b.mu.Unlock()

	began := time.Now()
	defer func() {
		// A panic is a failure too; without a report a half-open probe
		// slot would stay taken forever.
		if p := recover(); p != nil {
			done(b.record(ctx, gen, counted, fmt.Errorf("breaker: panic: %v", p), time.Since(began)))
			panic(p)
		}
	}()
	err = fn(ctx)
	done(b.record(ctx, gen, counted, err, time.Since(began)))
	return err
}

// record puts the call's outcome in the window and returns what gobreaker
// must be told: nil for a success, an error for anything it must count as a
// failure, errExcluded for a call it must ignore.
func (b *Breaker) record(ctx context.Context, gen uint64, counted bool, err error, took time.Duration) error {
	if err != nil && errors.Is(ctx.Err(), context.Canceled) {
		return errExcluded
	}
	slow := took > b.s.SlowCall
	b.mu.Lock()
	trips := false
	if counted && b.gen == gen {
		b.win.add(time.Now(), err != nil, slow)
		trips = b.current == Closed && b.tripsLocked()
	}
	b.mu.Unlock()
	switch {
	case err != nil:
		return err
	case slow:
		return errSlow
	case trips:
		return errTrip
	}
	return nil
}

// trips is gobreaker's ReadyToTrip: the decision comes from this package's
// window, not from gobreaker's success/failure counts.
func (b *Breaker) trips() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.tripsLocked()
}

func (b *Breaker) tripsLocked() bool {
	c := b.win.sum(time.Now())
	if c.total == 0 || c.total < b.s.MinCalls {
		return false
	}
	t := float64(c.total)
	return float64(c.failures)/t >= b.s.FailureRatio || float64(c.slow)/t >= b.s.SlowRatio
}

// onStateChange runs inside gobreaker at every transition: it starts a new
// window generation, logs one line and moves the metrics.
func (b *Breaker) onStateChange(_ string, from, to gobreaker.State) {
	now := time.Now()
	b.mu.Lock()
	c := b.win.sum(now)
	b.gen++
	b.current = fromGobreaker(to)
	b.win.reset(now)
	b.mu.Unlock()
	st := fromGobreaker(to)
	b.state.Set(stateValue[st])
	b.transitions.WithLabelValues(string(st)).Inc()
	b.lg.Info("breaker state changed", "breaker", b.s.Name,
		"from", string(fromGobreaker(from)), "to", string(st),
		"window_calls", c.total, "window_failures", c.failures, "window_slow", c.slow)
}

func fromGobreaker(s gobreaker.State) State {
	switch s {
	case gobreaker.StateOpen:
		return Open
	case gobreaker.StateHalfOpen:
		return HalfOpen
	}
	return Closed
}
