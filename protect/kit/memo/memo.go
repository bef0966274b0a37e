// Package memo remembers refusals that cannot be undone before a known
// time (a daily limit until midnight, a failed-check throttle until its
// hour has passed), so a flood of them is answered without asking Redis.
//
// It is hashicorp/golang-lru's LRU with an expiry per entry, under one
// lock of its own: the library's expirable cache has one TTL for the
// whole cache, while a refusal's end is its own, and its thread-safe
// Cache locks each call alone, so Put's "keep the longer" check and its
// add could be split by another Put. simplelru under one mutex makes
// every call one step and costs a single lock, as the Cache did. A full memory forgets its least recently used
// entry, so an attacker inventing principals can only make faregate ask
// Redis again, never refuse wrongly or grow without bound.
package memo

import (
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// Memo maps keys to values until each entry's own deadline. Safe for
// concurrent use.
type Memo[K comparable, V any] struct {
	now func() time.Time

	mu sync.Mutex
	c  *simplelru.LRU[K, entry[V]]
}

type entry[V any] struct {
	v     V
	until time.Time
}

// New returns a Memo of at most capacity entries (at least 1) on the clock
// now (nil: time.Now).
func New[K comparable, V any](capacity int, now func() time.Time) *Memo[K, V] {
	if now == nil {
		now = time.Now
	}
	c, err := simplelru.NewLRU[K, entry[V]](max(capacity, 1), nil)
	if err != nil {
		// NewLRU fails only for a size below 1, which max rules out.
		panic(err)
	}
	return &Memo[K, V]{now: now, c: c}
}

// Put remembers v for k until until. An entry already held for longer is
// kept: a refusal is never shortened by a later, shorter one, even when
// the two race.
func (m *Memo[K, V]) Put(k K, v V, until time.Time) {
	if !until.After(m.now()) {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if cur, ok := m.c.Peek(k); ok && cur.until.After(until) {
		return
	}
	m.c.Add(k, entry[V]{v: v, until: until})
}

// Get returns k's value and the time it has left, or ok false when there is
// none or it has expired (an expired entry is dropped).
func (m *Memo[K, V]) Get(k K) (v V, left time.Duration, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.c.Get(k)
	if !ok {
		return v, 0, false
	}
	left = e.until.Sub(m.now())
	if left <= 0 {
		m.c.Remove(k)
		return v, 0, false
	}
	return e.v, left, true
}

// Remove forgets k.
func (m *Memo[K, V]) Remove(k K) {
	m.mu.Lock()
	m.c.Remove(k)
	m.mu.Unlock()
}

// RemoveIf forgets every entry for which drop is true (a policy reload that
// raised a limit clears the refusals it undid).
func (m *Memo[K, V]) RemoveIf(drop func(K, V) bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, k := range m.c.Keys() {
		if e, ok := m.c.Peek(k); ok && drop(k, e.v) {
			m.c.Remove(k)
		}
	}
}

// Purge forgets everything.
func (m *Memo[K, V]) Purge() {
	m.mu.Lock()
	m.c.Purge()
	m.mu.Unlock()
}

// Len is the number of entries held, expired ones not yet dropped included.
func (m *Memo[K, V]) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.c.Len()
}
