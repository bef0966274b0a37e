package breaker

import (
	"slices"
	"time"
)

// maxPrincipals bounds Settings.MinPrincipals, and so the names a bucket
// keeps.
const maxPrincipals = 8

// buckets is how many slices a rolling window is cut into; the window
// forgets one slice at a time, so a burst of failures leaves it gradually
// rather than all at once.
const buckets = 10

// counts are the outcomes of calls in a window, and how many principals
// (up to the window's cap) the failed or slow ones were made for.
type counts struct{ total, failures, slow, principals uint32 }

// window counts calls, failures and slow calls over the last Window of
// time, in buckets of Window/10 numbered from the start of the current
// breaker state. It holds no clock: every method takes now.
//
// Beside the counts each bucket keeps the principals whose calls failed
// or were slow, at most most of them: the breaker asks only whether there
// are at least that many, so a bucket never holds more names than that
// however many callers fail.
type window struct {
	period time.Duration
	start  time.Time
	most   int // principals kept per bucket (Settings.MinPrincipals)
	slots  [buckets]counts
	bad    [buckets][]string // principals of the bucket's bad calls, distinct
	age    [buckets]int64    // which bucket number each slot currently holds
}

func newWindow(size time.Duration, most int, now time.Time) *window {
	w := &window{period: max(size/buckets, time.Millisecond), most: min(max(most, 1), maxPrincipals)}
	w.reset(now)
	return w
}

// reset forgets everything; called on every state change, which starts a
// new generation whose outcomes are judged afresh.
func (w *window) reset(now time.Time) {
	w.start = now
	w.slots = [buckets]counts{}
	for i := range w.age {
		w.age[i] = -1
		w.bad[i] = w.bad[i][:0]
	}
}

func (w *window) bucket(now time.Time) int64 {
	return max(int64(now.Sub(w.start)/w.period), 0)
}

// add records one call that ended at now, made for principal.
func (w *window) add(now time.Time, failed, slow bool, principal string) {
	n := w.bucket(now)
	i := n % buckets
	if w.age[i] != n {
		w.slots[i], w.age[i] = counts{}, n
		w.bad[i] = w.bad[i][:0]
	}
	c := &w.slots[i]
	c.total++
	if failed {
		c.failures++
	}
	if slow {
		c.slow++
	}
	if (failed || slow) && len(w.bad[i]) < w.most && !slices.Contains(w.bad[i], principal) {
		w.bad[i] = append(w.bad[i], principal)
	}
}

// sum adds up the buckets still inside the window at now; principals is
// the number of distinct principals of their bad calls, at most w.most.
func (w *window) sum(now time.Time) counts {
	n := w.bucket(now)
	var s counts
	// most is at most maxPrincipals: the names stay on the stack.
	var buf [maxPrincipals]string
	seen := buf[:0]
	for i, c := range w.slots {
		if a := w.age[i]; a >= 0 && a > n-buckets && a <= n {
			s.total += c.total
			s.failures += c.failures
			s.slow += c.slow
			for _, p := range w.bad[i] {
				if len(seen) < w.most && !slices.Contains(seen, p) {
					seen = append(seen, p)
				}
			}
		}
	}
	s.principals = uint32(len(seen))
	return s
}
