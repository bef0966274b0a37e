package aitf

import (
	"bytes"
	"hash/maphash"
	"sync"
	"time"

	"github.com/hashicorp/golang-lru/v2/simplelru"
)

// lru is a size-capped least-recently-used table of per-key state, on
// hashicorp/golang-lru's simplelru (the caller holds the lock). State lives
// behind a pointer so touch can hand it out for updating in place, and the
// state of an evicted key is recycled for the next new key, so a full table
// allocates only the library's list entry per new key.
type lru[K comparable, V any] struct {
	l     *simplelru.LRU[K, *V]
	spare *V // the last evicted state, zeroed and reused by touch
}

// newLRU returns an empty table holding at most capacity entries.
func newLRU[K comparable, V any](capacity int) *lru[K, V] {
	t := &lru[K, V]{}
	// NewLRU fails only for a size below 1, which max rules out.
	t.l, _ = simplelru.NewLRU(max(capacity, 1), func(_ K, v *V) { t.spare = v })
	return t
}

// Len returns the number of entries held.
func (t *lru[K, V]) Len() int { return t.l.Len() }

// touch returns the entry for key, marked most recently used. A new entry is
// zeroed (evicting the least recently used one when full); existed says which.
func (t *lru[K, V]) touch(key K) (v *V, existed bool) {
	if v, ok := t.l.Get(key); ok {
		return v, true
	}
	v, t.spare = t.spare, nil
	if v == nil {
		v = new(V)
	} else {
		var zero V
		*v = zero
	}
	t.l.Add(key, v)
	return v, false
}

// Behaviour thresholds.
const (
	burstWindow      = time.Second      // "many requests in about one second"
	quietSpell       = 5 * time.Second  // a burst counts fully only after this much silence
	burstFloor       = 4                // requests per window a person's page load may make
	burstSpan        = 8                // requests above the floor that make a full burst
	repeatWindow     = 60 * time.Second // identical bodies count within this span
	repeatSpan       = 4                // repeats that make a full signal
	enumMaxStep      = 32               // doc_78901 → doc_78912 is a step of 11
	enumSpan         = 4                // consecutive steps that make a full signal
	enumForget       = 10 * time.Minute // an enumeration paused this long starts over
	rememberedBodies = 4                // distinct recent bodies remembered per visitor
)

// visitorState is what the behaviour memory keeps per visitor: about 150
// bytes, so the default cap of 100,000 visitors stays near 20 MB.
type visitorState struct {
	lastSeen int64 // unix nanoseconds of the previous request
	winStart int64 // start of the current burst window
	winCount int32
	winQuiet bool // the window opened after a quiet spell

	enumSet    bool
	enumHits   int32
	enumPrefix uint64
	enumLast   int64

	bodies [rememberedBodies]bodySeen
}

// bodySeen is one recently seen body: its hash, when it was last seen, and
// how many times in a row within repeatWindow.
type bodySeen struct {
	hash uint64
	last int64
	n    int32
}

// memory is the per-visitor behaviour store.
type memory struct {
	mu       sync.Mutex
	visitors *lru[string, visitorState]
}

func newMemory(capacity int) *memory {
	return &memory{visitors: newLRU[string, visitorState](capacity)}
}

// Len returns how many visitors are remembered.
func (m *memory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.visitors.Len()
}

// behaviour records one request of visitor at now (its body, its scan and
// its URL path) and fills vec's behaviour dimensions. The Guard and the
// score command's session replay both go through here.
func (m *memory) behaviour(vec *Vector, sr scanResult, visitor string, now time.Time, seed maphash.Seed, body []byte, path string) {
	cand := sr.enum
	if !cand.ok {
		cand = enumOf(lastSegment(path))
	}
	hasBody := len(bytes.TrimSpace(body)) > 0
	vec[dimEnumeration], vec[dimRepeat], vec[dimBurst] = m.observe(visitor, now, maphash.Bytes(seed, body), hasBody, cand)
}

// observe records one request of a visitor and returns its behaviour
// dimensions: enumeration, repeat and burst.
func (m *memory) observe(key string, now time.Time, bodyHash uint64, hasBody bool, cand enumCand) (enum, repeat, burst float64) {
	t := now.UnixNano()
	m.mu.Lock()
	defer m.mu.Unlock()
	st, existed := m.visitors.touch(key)

	// Burst: count requests in a window of about one second. A new visitor
	// arrives after an (infinite) quiet spell.
	if !existed || t-st.winStart >= int64(burstWindow) {
		st.winQuiet = !existed || t-st.lastSeen >= int64(quietSpell)
		st.winStart, st.winCount = t, 0
	}
	st.winCount++
	burst = float64(st.winCount-burstFloor) / burstSpan
	if !st.winQuiet {
		// A steady flood is suspicious too, but less characteristic than
		// a burst out of silence.
		burst /= 2
	}

	// Enumeration: the same prefix with a small numeric step, request after
	// request. Asking for the same id again neither extends nor breaks it.
	if cand.ok {
		step := cand.n - st.enumLast
		switch {
		case !st.enumSet || st.enumPrefix != cand.prefix || t-st.lastSeen > int64(enumForget):
			st.enumHits = 0
		case step != 0 && step >= -enumMaxStep && step <= enumMaxStep:
			st.enumHits++
		case step != 0:
			st.enumHits = 0
		}
		st.enumSet, st.enumPrefix, st.enumLast = true, cand.prefix, cand.n
		enum = float64(st.enumHits) / enumSpan
	}

	// Repeat: the same body again within repeatWindow of its last sighting.
	// Empty bodies (GET polling) are not bodies a client chose to repeat.
	if hasBody {
		oldest := 0
		found := false
		for i := range st.bodies {
			b := &st.bodies[i]
			if b.n > 0 && b.hash == bodyHash {
				if t-b.last > int64(repeatWindow) {
					b.n = 0 // seen, but too long ago to be a repeat
				}
				b.n++
				b.last = t
				repeat = float64(b.n-1) / repeatSpan
				found = true
				break
			}
			if b.last < st.bodies[oldest].last {
				oldest = i
			}
		}
		if !found {
			st.bodies[oldest] = bodySeen{hash: bodyHash, last: t, n: 1}
		}
	}

	st.lastSeen = t
	return clamp01(enum), clamp01(repeat), clamp01(burst)
}
