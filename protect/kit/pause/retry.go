package pause

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"
)

// Policy is capped exponential backoff with jitter: the first wait is
// First, each next one Factor times the last, never above Max. Jitter
// shortens each wait by a random fraction of at most Jitter, so the many
// followers and workers that met one Redis outage do not all come back
// in the same instant.
//
// Our own and not cenkalti/backoff/v5 (which is in the module graph, not
// a direct dependency): the loops it serves are two shapes, a read loop
// that backs off while failures last and starts over after a success
// (Backoff), and a retry that gives up when the next wait would outlast a
// lease (Retry with Stop); backoff/v5's Retry does not show the next wait
// to the caller, so the second would need its ExponentialBackOff and a
// loop of our own anyway, with defaults (×1.5, 50 % jitter, 15 min total)
// every call would have to undo.
type Policy struct {
	First  time.Duration // the first wait; at least 1 ns
	Max    time.Duration // the longest wait; below First means First
	Factor float64       // growth per wait; 0 (or below 1) means 2
	Jitter float64       // in [0, 1): a wait is drawn from [w·(1−Jitter), w]
	Tries  int           // Retry's most calls; 0 is until success or ctx ends
}

// Backoff is the run of waits of a Policy. Not safe for concurrent use:
// each loop has its own.
type Backoff struct {
	p    Policy
	next time.Duration
}

// Backoff starts p's run of waits.
func (p Policy) Backoff() *Backoff {
	p = p.norm()
	return &Backoff{p: p, next: p.First}
}

// Nth is the run's wait number n+1 (n from 0: First, then First·Factor,
// …, never above Max), jittered: what a Backoff's Next gives the n+1st
// time, for loops that count their own tries.
func (p Policy) Nth(n int) time.Duration {
	p = p.norm()
	w := p.First
	for range n {
		next := p.grow(w)
		if next == w {
			break // at Max, or a Factor that does not grow: it stays
		}
		w = next
	}
	return p.jitter(w)
}

// norm applies the documented meaning of the zero and nonsense values.
func (p Policy) norm() Policy {
	p.First = max(p.First, 1)
	p.Max = max(p.Max, p.First)
	if p.Factor < 1 {
		p.Factor = 2
	}
	p.Jitter = min(max(p.Jitter, 0), 0.99)
	return p
}

// grow is the wait after w: Factor times w, capped at Max.
func (p Policy) grow(w time.Duration) time.Duration {
	// Compared in float64 first: Factor × Max may not fit a Duration.
	if n := float64(w) * p.Factor; n < float64(p.Max) {
		return time.Duration(n)
	}
	return p.Max
}

// jitter shortens w by a random fraction of at most Jitter.
func (p Policy) jitter(w time.Duration) time.Duration {
	if p.Jitter > 0 {
		w -= time.Duration(rand.Float64() * p.Jitter * float64(w))
	}
	return w
}

// Next returns the next wait and advances the run.
func (b *Backoff) Next() time.Duration {
	w := b.next
	b.next = b.p.grow(w)
	return b.p.jitter(w)
}

// Reset starts the run again from First (after a success).
func (b *Backoff) Reset() { b.next = b.p.First }

// Wait waits the next wait, or until ctx ends (then it returns ctx.Err()).
func (b *Backoff) Wait(ctx context.Context) error { return For(ctx, b.Next()) }

// stopError marks an error that another try cannot mend.
type stopError struct{ err error }

func (e *stopError) Error() string { return e.err.Error() }
func (e *stopError) Unwrap() error { return e.err }

// Stop wraps err so that Retry returns it at once, unwrapped.
func Stop(err error) error {
	if err == nil {
		return nil
	}
	return &stopError{err}
}

// Retry calls try until it returns nil, a Stop error (returned unwrapped),
// or p.Tries calls have failed (the last error), waiting p's backoff
// between calls; the wait try is told of is the one that follows if it
// fails, so it can give up instead (a lease that would lapse meanwhile).
// When ctx ends during a wait Retry returns try's last error (the caller
// has ctx.Err() for the rest): the error a caller maps stays the cause.
func Retry(ctx context.Context, p Policy, try func(next time.Duration) error) error {
	b := p.Backoff()
	for n := 1; ; n++ {
		next := b.Next()
		err := try(next)
		if err == nil {
			return nil
		}
		if s, ok := errors.AsType[*stopError](err); ok {
			return s.err
		}
		if p.Tries > 0 && n >= p.Tries {
			return err
		}
		if For(ctx, next) != nil {
			return err
		}
	}
}
