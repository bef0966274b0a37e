package main

import (
	"context"
	"time"
)

// windowClockKey carries, in the context run is given, the clock of the
// per-principal windows: the rate limiter's (request windows, token
// buckets, the invalid ratio, the hourly tokens) and the gate's memory of
// their refusals. Only tests hand it to run, to watch a window slide
// without waiting for it; the day's quotas and budgets keep the real
// clock whatever it says.
type windowClockKey struct{}

// windowClock is the windows' clock: the one ctx carries, else time.Now.
func windowClock(ctx context.Context) func() time.Time {
	if now, ok := ctx.Value(windowClockKey{}).(func() time.Time); ok {
		return now
	}
	return time.Now
}
