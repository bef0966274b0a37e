package alert

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// ErrUnavailable wraps a Redis failure of the shared Deduper. The Notifier
// then relies on its own memory and sends the alert.
var ErrUnavailable = errors.New("alert: deduplication store unavailable")

// A Deduper decides whether an alert is the first of its event and scope
// within window, for every process that shares it.
type Deduper interface {
	First(ctx context.Context, event, scope string, window time.Duration) (bool, error)
}

// RedisDeduper shares deduplication between replicas through Redis: the
// first replica to SET faregate:alert:{<event>}:<scope> 1 NX with the window
// as its TTL (go-redis sends PX, or EX for whole seconds) sends the alert.
// The window runs on Redis's clock, not the Notifier's.
func RedisDeduper(rdb redis.Cmdable) Deduper { return redisDeduper{rdb} }

type redisDeduper struct{ rdb redis.Cmdable }

func (d redisDeduper) First(ctx context.Context, event, scope string, window time.Duration) (bool, error) {
	ok, err := d.rdb.SetNX(ctx, redisKey(event, scope), 1, window).Result()
	if err != nil {
		return false, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return ok, nil
}

// redisKey tags the event so one event's keys share a cluster slot.
func redisKey(event, scope string) string {
	return "faregate:alert:{" + event + "}:" + scope
}

// memory deduplicates within this process.
type memory struct {
	now func() time.Time

	mu    sync.Mutex
	until map[memKey]time.Time
}

type memKey struct{ event, scope string }

// memSweep is the size above which expired entries are swept on insert, so
// the map stays as small as the number of live windows.
const memSweep = 1024

func newMemory(now func() time.Time) *memory {
	return &memory{now: now, until: make(map[memKey]time.Time)}
}

// first reports whether event and scope were not raised within window, and
// if so marks them raised.
func (m *memory) first(event, scope string, window time.Duration) bool {
	now := m.now()
	k := memKey{event, scope}
	m.mu.Lock()
	defer m.mu.Unlock()
	if t, ok := m.until[k]; ok && now.Before(t) {
		return false
	}
	if len(m.until) >= memSweep {
		for k, t := range m.until {
			if !now.Before(t) {
				delete(m.until, k)
			}
		}
	}
	m.until[k] = now.Add(window)
	return true
}

// forget clears a mark, for an alert that was not queued after all.
func (m *memory) forget(event, scope string) {
	m.mu.Lock()
	delete(m.until, memKey{event, scope})
	m.mu.Unlock()
}
