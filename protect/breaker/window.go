package breaker

import "time"

// buckets is how many slices a rolling window is cut into; the window
// forgets one slice at a time, so a burst of failures leaves it gradually
// rather than all at once.
const buckets = 10

// counts are the outcomes of calls in a window.
type counts struct{ total, failures, slow uint32 }

// window counts calls, failures and slow calls over the last Window of
// time, in buckets of Window/10 numbered from the start of the current
// breaker state. It holds no clock: every method takes now.
type window struct {
	period time.Duration
	start  time.Time
	slots  [buckets]counts
	age    [buckets]int64 // which bucket number each slot currently holds
}

func newWindow(size time.Duration, now time.Time) *window {
	w := &window{period: max(size/buckets, time.Millisecond)}
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
	}
}

func (w *window) bucket(now time.Time) int64 {
	return max(int64(now.Sub(w.start)/w.period), 0)
}

// add records one call that ended at now.
func (w *window) add(now time.Time, failed, slow bool) {
	n := w.bucket(now)
	i := n % buckets
	if w.age[i] != n {
		w.slots[i], w.age[i] = counts{}, n
	}
	c := &w.slots[i]
	c.total++
	if failed {
		c.failures++
	}
	if slow {
		c.slow++
	}
}

// sum adds up the buckets still inside the window at now.
func (w *window) sum(now time.Time) counts {
	n := w.bucket(now)
	var s counts
	for i, c := range w.slots {
		if a := w.age[i]; a >= 0 && a > n-buckets && a <= n {
			s.total += c.total
			s.failures += c.failures
			s.slow += c.slow
		}
	}
	return s
}
