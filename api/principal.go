package api

import (
	"context"
	"sync"
	"time"

	"faregate/protect/kit/memo"
	"faregate/protect/principal"
)

// denials remembers refusals that cannot be undone before a known time (a
// principal over its failed-check limit, or blocked for anomalies), so a
// flood of such requests is answered without a Redis call. It is
// protect/kit/memo, the one refusal memory (quota's daily limits use it too):
// bounded, past its capacity it forgets the least recently used refusal,
// which is then only asked of Redis again.
type denials struct {
	now func() time.Time
	m   *memo.Memo[memoKey, error]
}

// memoKey is a principal without its tier: a refusal belongs to who was
// refused, whatever a reload makes of its tier. A struct key costs no
// allocation per lookup.
type memoKey struct{ kind, id string }

func keyOf(p principal.Principal) memoKey { return memoKey{p.Kind, p.ID} }

func newDenials(capacity int, now func() time.Time) *denials {
	if now == nil {
		now = time.Now
	}
	return &denials{now: now, m: memo.New[memoKey, error](capacity, now)}
}

// remember refuses p with err for after; a refusal already remembered for
// longer is kept.
func (d *denials) remember(p principal.Principal, err error, after time.Duration) {
	if after <= 0 {
		return
	}
	d.m.Put(keyOf(p), err, d.now().Add(after))
}

// refusal returns the remembered refusal of p with the time left, or nil.
func (d *denials) refusal(p principal.Principal) error {
	err, left, ok := d.m.Get(keyOf(p))
	if !ok {
		return nil
	}
	return &retryError{err: err, after: left}
}

// forget drops the remembered refusals of the principals match selects.
func (d *denials) forget(match func(memoKey) bool) {
	d.m.RemoveIf(func(k memoKey, _ error) bool { return match(k) })
}

// ForgetDenials forgets the request-window refusals (rate_limited) a policy
// reload made wrong, for policy.Store's OnChange: every visitor's when
// visitors is set (the public tier was raised), and those of the keys
// named (policy.RaisedKeys). The other refusals remembered here do not
// depend on the policy: the failed-check and anomaly blocks are the
// environment's, and the daily task limits' memory (protect/quota) is
// kept with the limit it refused at, so a raise already admits.
func (srv *Server) ForgetDenials(visitors bool, keys []string) {
	ids := make(map[string]bool, len(keys))
	for _, id := range keys {
		ids[id] = true
	}
	srv.s.limited.forget(func(k memoKey) bool {
		return (visitors && k.kind == principal.KindVisitor) || (k.kind == principal.KindKey && ids[k.id])
	})
}

// inflight bounds the window checks one principal has in flight in this
// process. The rest wait for a place, in memory: they would only wait in
// line for the gate's Redis connections, in front of other principals'.
// Waiting, not refusing, keeps the window exact under a burst.
type inflight struct {
	max int

	mu sync.Mutex
	m  map[memoKey]*lane
}

// lane is one principal's places; refs counts holders and waiters, so the
// entry goes when the last one leaves.
type lane struct {
	places chan struct{}
	refs   int
}

// inflightPerPrincipal is that bound: above what a page or a script
// needs at once, far below the pool.
const inflightPerPrincipal = 8

func newInflight(max int) *inflight { return &inflight{max: max, m: map[memoKey]*lane{}} }

// acquire waits for a place for p, or until ctx ends.
func (f *inflight) acquire(ctx context.Context, p principal.Principal) (release func(), err error) {
	k := keyOf(p)
	f.mu.Lock()
	l := f.m[k]
	if l == nil {
		l = &lane{places: make(chan struct{}, f.max)}
		f.m[k] = l
	}
	l.refs++
	f.mu.Unlock()
	leave := func() {
		f.mu.Lock()
		if l.refs--; l.refs == 0 {
			delete(f.m, k)
		}
		f.mu.Unlock()
	}
	select {
	case l.places <- struct{}{}:
		return func() { <-l.places; leave() }, nil
	case <-ctx.Done():
		leave()
		return nil, ctx.Err()
	}
}
