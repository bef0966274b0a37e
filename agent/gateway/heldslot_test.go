package gateway

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
)

// countingLimiter counts its acquisitions and releases.
type countingLimiter struct{ acquired, released atomic.Int64 }

func (l *countingLimiter) Acquire(context.Context, Task) (func(context.Context, bool), error) {
	l.acquired.Add(1)
	return func(context.Context, bool) { l.released.Add(1) }, nil
}

// TestHeldSlotOnce: a call's slot is acquired once however many takes race
// for it, given back once, and a take after the give-back acquires
// nothing (it would be a slot no one releases).
func TestHeldSlotOnce(t *testing.T) {
	l := &countingLimiter{}
	var s heldSlot
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			if _, err := s.take(context.Background(), l, limitTask("t_held")); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if got := l.acquired.Load(); got != 1 {
		t.Fatalf("16 racing takes acquired %d slots, want 1", got)
	}
	s.release(context.Background(), true)
	s.release(context.Background(), true)
	if got := l.released.Load(); got != 1 {
		t.Fatalf("released %d times, want 1", got)
	}
	if _, err := s.take(context.Background(), l, limitTask("t_held")); !errors.Is(err, ErrLimitsUnavailable) {
		t.Fatalf("a take after the release: %v, want ErrLimitsUnavailable", err)
	}
	if got := l.acquired.Load(); got != 1 {
		t.Fatalf("a take after the release acquired again (%d)", got)
	}

	// Released before any take (the governor refused first): nothing to
	// give back, and nothing taken afterwards.
	var early heldSlot
	early.release(context.Background(), false)
	if _, err := early.take(context.Background(), l, limitTask("t_held2")); err == nil || l.acquired.Load() != 1 {
		t.Fatalf("a take after an early release: %v, %d acquired", err, l.acquired.Load())
	}
}
