// Package clocktest provides a settable clock for tests of code that takes
// a Now func: safe to read from many goroutines, and shareable by every
// replica a test starts so they agree on the day and the window. It also
// holds the tests' one wait on clocks they cannot fake (Poll, Eventually).
package clocktest

import (
	"sync/atomic"
	"time"
)

// Clock is a settable clock. Its times are in UTC, as faregate's keys are.
type Clock struct{ ns atomic.Int64 }

// New returns a clock standing at t.
func New(t time.Time) *Clock {
	c := &Clock{}
	c.Set(t)
	return c
}

// Now is the clock's time; pass c.Now where a Now func is wanted.
func (c *Clock) Now() time.Time { return time.Unix(0, c.ns.Load()).UTC() }

// Set moves the clock to t.
func (c *Clock) Set(t time.Time) { c.ns.Store(t.UnixNano()) }

// Advance moves the clock on by d.
func (c *Clock) Advance(d time.Duration) { c.ns.Add(int64(d)) }
