// Package pause waits a while unless the context ends first: the wait
// between retries of a webhook, of an outbound fetch, of a model call.
package pause

import (
	"context"
	"time"
)

// For waits d, or until ctx ends, whichever comes first, and returns
// ctx's error in the second case. A d of zero or less returns at once
// (with ctx's error if it has already ended).
func For(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
