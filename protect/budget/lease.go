package budget

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"time"

	"faregate/protect/kit/randhex"
)

// LeaseOptions configure leased blocks of the day's scopes (site tokens,
// site money, each tier's share). A replica leases a block of each day
// scope its calls spend from and admits a call locally while the unspent
// part of its blocks covers it in every day scope the call touches; the
// block is outstanding in Redis meanwhile, so settled + outstanding −
// overage ≤ limit holds there at every instant.
//
// How big a block is (decided in Redis, batchScript's L): a quarter of
// the scope's headroom shared among the replicas that hold leases of the
// day (the live leases, this one counted), at most Calls × the largest
// reservation the scope has seen, and never so much that another replica
// could not hold its largest call. Below replicas × the largest
// reservation of headroom, the scope goes per call: the replica gives its
// unspent part back at once and reserves each call in the day's slot
// (sent with the principal's reservation, in the same round trip) until
// the headroom is back. So a call near a limit may be refused while
// another replica still holds unspent blocks: never more than replicas ×
// a block, and never past the limit.
type LeaseOptions struct {
	// Calls bounds a block to Calls × the largest reservation seen; 0
	// turns leasing off (every call is reserved in the day's slot).
	Calls int64
	// TTL is a lease's life by Redis's clock, renewed every TTL/3 while it
	// is in use; the replica stops admitting on it TTL/4 before it ends.
	// Default DefaultLeaseTTL.
	TTL time.Duration
	// Idle gives a lease back (what its calls spent reported, its unspent
	// part returned) after this long without a call; default TTL/6.
	Idle time.Duration
}

// DefaultLeaseTTL is LeaseOptions.TTL's default.
const DefaultLeaseTTL = 30 * time.Second

// DefaultLeaseCalls is a block's size in calls that FAREGATE_BUDGET_LEASE_CALLS
// defaults to.
const DefaultLeaseCalls = 64

// errLeaseLost: the lease expired in Redis before this replica renewed
// it; its calls are reserved again under a new one.
var errLeaseLost = errors.New("budget: lease expired before it was renewed")

// leases is one replica's leased blocks, by day.
type leases struct {
	b        *Budget
	replica  string
	ttl      time.Duration
	idle     time.Duration
	calls    int64
	clock    func() time.Time // real time: a lease follows Redis's clock, not Options.Now
	tick     time.Duration
	mu       sync.Mutex
	days     map[string]*dayLease
	retired  []*dayLease // expired in Redis, or of a past generation, until their calls are reported
	gen      int
	running  bool
	closed   bool
	stop     chan struct{}
	loopDone chan struct{}
}

// dayLease is one lease of one day's scopes (a generation: a lease that
// expired in Redis is followed by a new one with a new id).
type dayLease struct {
	id, day  string
	seq      int64
	scopes   []*leaseScope
	flight   *leaseFlight // the lease operation on its way
	stuck    *leaseFlight // sent without an answer: sent again first
	deadline time.Time    // admit before this (Redis's expiry less a margin)
	renewAt  time.Time
	lastUse  time.Time
	dead     bool
	closing  bool // given back; a new call starts a new generation
	replicas int64
}

// leaseScope is what a lease holds in one day scope, in its unit.
type leaseScope struct {
	name  string
	limit int64 // 0: counted, never held
	// g is what the lease holds in Redis (as last answered); held the
	// holds of open calls; spent what settled calls charged, not yet
	// reported; sending the part of spent in the operation on its way;
	// pending the unspent part that operation gives back or may top up.
	g, held, spent, sending, pending int64
	largest                          int64
	fallback                         bool // per call until the headroom is back
}

func (s *leaseScope) avail() int64 { return s.g - s.held - s.spent - s.sending - s.pending }

// leaseFlight is one lease operation on its way.
type leaseFlight struct {
	op     *op
	done   chan struct{}
	err    error
	status int64
	at     time.Time // when it was first sent: Redis's expiry is no later than at + TTL
	tag    string
	close  bool
	scopes []*leaseScope
	sent   []int64
	pend   []int64
	warned []int64 // per scope: 1 when this operation took it past 80% first
	used   []int64
	// call: the operation carries the call that started it; direct is
	// that call's per-call reservation's answer, when one was made in it.
	call   bool
	direct []int64
	tail   int // the header's length before its count of arguments
}

func (f *leaseFlight) wait(ctx context.Context) error {
	select {
	case <-f.done:
		return f.err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// need is what a call asks of one day scope.
type need struct {
	name          string
	amount, limit int64
}

// leaseHold is a call's hold in a lease's scopes.
type leaseHold struct {
	dl      *dayLease
	scopes  []*leaseScope
	amounts []int64
}

func newLeases(b *Budget, o LeaseOptions) *leases {
	if o.TTL <= 0 {
		o.TTL = DefaultLeaseTTL
	}
	if o.Idle <= 0 {
		o.Idle = o.TTL / 6
	}
	m := &leases{b: b, replica: randhex.New(8), ttl: o.TTL, idle: o.Idle, calls: o.Calls, clock: time.Now,
		days: map[string]*dayLease{}}
	m.tick = max(min(o.TTL/4, o.Idle/2), 5*time.Millisecond)
	return m
}

// current is day's lease of the running generation, made on first use.
func (m *leases) current(day string, now time.Time) *dayLease {
	dl := m.days[day]
	if dl == nil || dl.dead || dl.closing {
		if dl != nil {
			m.retired = append(m.retired, dl)
		}
		m.gen++
		dl = &dayLease{id: m.replica + "-" + strconv.Itoa(m.gen), day: day, lastUse: now}
		m.days[day] = dl
		m.start()
	}
	return dl
}

// scope is dl's scope name, made on first use.
func (dl *dayLease) scope(name string, limit int64) *leaseScope {
	for _, s := range dl.scopes {
		if s.name == name {
			s.limit = limit
			return s
		}
	}
	s := &leaseScope{name: name, limit: limit}
	dl.scopes = append(dl.scopes, s)
	return s
}

// take admits a call's amounts in the day scopes locally, from the
// unspent part of the replica's blocks (a hold), or says what the call
// must do instead: go per call (direct), or wait for fl, a lease
// operation (own: started for this call, its flags tagged with the
// call's id) and try again with retake. An operation take starts is the
// caller's to send (unsent), with the call's own, in one round trip.
func (m *leases) take(day, id string, needs []need) (h *leaseHold, fl *leaseFlight, unsent *op, own, direct bool) {
	now := m.clock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil, nil, nil, false, true
	}
	dl := m.current(day, now)
	h, short, direct := m.admit(dl, needs, now)
	switch {
	case h != nil || direct:
		return h, nil, nil, false, direct
	case dl.flight != nil:
		return nil, dl.flight, nil, false, false
	case dl.stuck != nil:
		fl = m.resend(dl)
		return nil, fl, fl.op, false, false
	}
	fl = m.prepare(dl, now, "r:"+id, short, false)
	return nil, fl, fl.op, true, false
}

// withCall adds the call that started fl to its operation (before it is
// sent): if a scope the call needs goes per call in it, the call is
// reserved per call in the same script (fl.direct).
func (m *leases) withCall(fl *leaseFlight, b *Budget, r Reservation, expiry int64) {
	o := fl.op
	// The header ends with the count of free-text arguments: put the
	// call's fields before it.
	o.hdr.buf = o.hdr.buf[:fl.tail]
	h := &o.hdr
	h.str(r.ID)
	h.num(r.Tokens)
	h.num(r.CostMicro)
	h.str(r.Tier)
	h.num(b.limits.Site)
	h.num(b.limits.SpendMicro)
	h.num(r.TierLimit)
	h.num(expiry)
	h.str(r.Principal)
	h.str(r.Task)
	o.end(r.Model)
	o.n += answerLen[opDirect]
	fl.call = true
}

// retake admits the call after the lease operation it waited for, or
// says it must go per call: it does not wait twice.
func (m *leases) retake(day string, needs []need) *leaseHold {
	now := m.clock()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	h, _, _ := m.admit(m.current(day, now), needs, now)
	return h
}

// admit holds needs in dl when every capped scope has them unspent and
// dl may be used; else it names the short scopes, or direct when one is
// per call.
func (m *leases) admit(dl *dayLease, needs []need, now time.Time) (h *leaseHold, short map[*leaseScope]int64, direct bool) {
	ss := make([]*leaseScope, len(needs))
	ok := now.Before(dl.deadline) && dl.stuck == nil
	for i, n := range needs {
		s := dl.scope(n.name, n.limit)
		ss[i] = s
		s.largest = max(s.largest, n.amount)
		if s.fallback {
			direct = true
		}
		if s.limit > 0 && s.avail() < n.amount {
			ok = false
			if short == nil {
				short = map[*leaseScope]int64{}
			}
			short[s] = n.amount
		}
	}
	if direct || !ok {
		return nil, short, direct
	}
	h = &leaseHold{dl: dl, scopes: ss, amounts: make([]int64, len(needs))}
	for i, n := range needs {
		ss[i].held += n.amount
		h.amounts[i] = n.amount
	}
	dl.lastUse = now
	return h, nil, false
}

// prepare makes a lease operation on dl (m.mu held), to be sent: it
// reports every scope's spent part, tops up the short ones (whose unspent
// part it freezes meanwhile) or, closing, gives back every unspent part,
// and renews the lease. Until it is answered no other goes on dl.
func (m *leases) prepare(dl *dayLease, now time.Time, tag string, short map[*leaseScope]int64, closing bool) *leaseFlight {
	dl.seq++
	fl := &leaseFlight{done: make(chan struct{}), at: now, tag: tag, close: closing, scopes: append([]*leaseScope(nil), dl.scopes...)}
	o := m.b.newOp(opLease, dayPrefix(dl.day)+"leases", dl.day)
	o.day = dl.day
	h := &o.hdr
	h.str(dl.day)
	h.str(dl.id)
	h.num(dl.seq)
	h.num(m.ttl.Milliseconds())
	h.num(int64(flag(closing)))
	h.str(tag)
	h.num(int64(len(fl.scopes)))
	for _, s := range fl.scopes {
		c := s.spent
		s.spent, s.sending = 0, s.sending+c
		var ret, want, unspent int64
		if n, ok := short[s]; ok && s.limit > 0 && !closing {
			want, unspent = n, max(s.avail(), 0)
		} else if closing && s.limit > 0 {
			ret = max(s.avail(), 0)
		}
		s.pending += ret + unspent
		fl.sent = append(fl.sent, c)
		fl.pend = append(fl.pend, ret+unspent)
		h.str(s.name)
		h.num(s.limit)
		h.num(c)
		h.num(ret)
		h.num(want)
		h.num(unspent)
		h.num(s.largest)
		h.num(m.calls)
	}
	o.n = 2 + leaseScopeAns*len(fl.scopes)
	fl.tail = len(h.buf)
	o.end()
	return m.fly(dl, fl, o)
}

// resend prepares dl's unanswered operation again, unchanged (its
// sequence number makes a second arrival a no-op): until it is answered,
// nothing else may be sent on dl, or what it reported could be reported
// twice.
func (m *leases) resend(dl *dayLease) *leaseFlight {
	old := dl.stuck
	dl.stuck = nil
	fl := &leaseFlight{done: make(chan struct{}), at: old.at, tag: old.tag, close: old.close, scopes: old.scopes,
		sent: old.sent, pend: old.pend}
	o := &op{kind: opLease, slot: old.op.slot, key: old.op.key, day: old.op.day, hdr: old.op.hdr, args: old.op.args, n: old.op.n,
		done: make(chan struct{})}
	return m.fly(dl, fl, o)
}

// fly makes fl dl's operation on its way, o its message; land reads its
// answer.
func (m *leases) fly(dl *dayLease, fl *leaseFlight, o *op) *leaseFlight {
	fl.op = o
	dl.flight = fl
	o.then = func(o *op) { m.land(dl, fl, o) }
	return fl
}

// land applies a lease operation's answer to dl.
func (m *leases) land(dl *dayLease, fl *leaseFlight, o *op) {
	m.mu.Lock()
	defer close(fl.done)
	defer m.mu.Unlock()
	dl.flight = nil
	if o.err != nil {
		fl.err = o.err
		dl.stuck = fl
		return
	}
	fl.status = o.res[0]
	dl.replicas = o.res[1]
	if fl.call {
		if d := o.res[2+leaseScopeAns*len(fl.scopes):]; d[0] != 5 {
			fl.direct = d
		}
	}
	fl.warned, fl.used = make([]int64, len(fl.scopes)), make([]int64, len(fl.scopes))
	for i, s := range fl.scopes {
		a := o.res[2+leaseScopeAns*i:]
		s.g, s.sending, s.pending = a[0], s.sending-fl.sent[i], s.pending-fl.pend[i]
		if a[1] == 1 {
			s.fallback = true
		}
		fl.used[i], fl.warned[i] = a[2], a[3]
	}
	switch fl.status {
	case 2:
		dl.dead = true
		for _, s := range dl.scopes {
			s.g = 0
		}
		fl.err = errLeaseLost
	default:
		dl.deadline = fl.at.Add(m.ttl - m.ttl/4)
		dl.renewAt = fl.at.Add(m.ttl / 3)
		if fl.close {
			dl.closing = true
		}
	}
}

// spend ends a call's hold: its amounts leave held, and what it charged
// (tokens in site and tier, micro-units in spend) is spent, reported by
// the lease's next operation.
func (m *leases) spend(h *leaseHold, tokens, micro int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, s := range h.scopes {
		s.held -= h.amounts[i]
		s.spent += charged(s.name, tokens, micro)
	}
}

// spendLate charges a call whose hold was given back already (it
// outlived its reservation) to day's current lease.
func (m *leases) spendLate(day string, needs []need, tokens, micro int64) {
	now := m.clock()
	m.mu.Lock()
	defer m.mu.Unlock()
	dl := m.current(day, now)
	for _, n := range needs {
		s := dl.scope(n.name, n.limit)
		s.spent += charged(s.name, tokens, micro)
	}
}

// charged is what a call charged in scope name.
func charged(name string, tokens, micro int64) int64 {
	if name == "spend" {
		return micro
	}
	return tokens
}

// giveBack ends a call's hold without a charge (withdrawn, or expired).
func (m *leases) giveBack(h *leaseHold) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for i, s := range h.scopes {
		s.held -= h.amounts[i]
	}
}

// observe takes a scope out of per-call fallback once a direct
// reservation's answer shows headroom for twice what the fallback needs.
func (m *leases) observe(day, name string, used int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	dl := m.days[day]
	if dl == nil {
		return
	}
	for _, s := range dl.scopes {
		if s.name == name && s.fallback && s.limit-used >= 2*max(dl.replicas, 1)*s.largest {
			s.fallback = false
		}
	}
}

// start runs the background loop if it is not running (m.mu held).
func (m *leases) start() {
	if m.running || m.closed {
		return
	}
	m.running = true
	m.stop, m.loopDone = make(chan struct{}), make(chan struct{})
	go m.loop(m.stop, m.loopDone)
}

// loop renews leases in use, gives back idle ones, reports what retired
// ones' calls spent and gives back holds of reservations that expired
// unsettled; it ends when nothing is left to do.
func (m *leases) loop(stop, done chan struct{}) {
	defer close(done)
	t := time.NewTicker(m.tick)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		for _, o := range m.b.open.expired(m.b.now()) {
			if o.hold != nil {
				m.giveBack(o.hold)
			}
		}
		if !m.tend(m.clock()) {
			return
		}
	}
}

// tend sends what each lease needs now; false when no lease is left.
func (m *leases) tend(now time.Time) bool {
	var out []*op
	defer func() { m.b.send(out...) }()
	m.mu.Lock()
	defer m.mu.Unlock()
	for day, dl := range m.days {
		switch {
		case dl.flight != nil:
		case dl.stuck != nil:
			out = append(out, m.resend(dl).op)
		case dl.closing && dl.idle():
			delete(m.days, day)
		case dl.dead:
			m.retired = append(m.retired, dl)
			delete(m.days, day)
		case now.Sub(dl.lastUse) >= m.idle && dl.heldNone():
			out = append(out, m.prepare(dl, now, "l:"+dl.id, nil, true).op)
		case !now.Before(dl.renewAt):
			out = append(out, m.prepare(dl, now, "l:"+dl.id, nil, false).op)
		}
	}
	kept := m.retired[:0]
	for _, dl := range m.retired {
		switch {
		case dl.flight != nil:
		case dl.stuck != nil:
			out = append(out, m.resend(dl).op)
		case dl.idle():
			continue
		case dl.heldNone():
			out = append(out, m.prepare(dl, now, "l:"+dl.id, nil, true).op)
		}
		kept = append(kept, dl)
	}
	clear(m.retired[len(kept):])
	m.retired = kept
	if len(m.days) == 0 && len(m.retired) == 0 && !m.b.open.anyLeased() {
		m.running = false
		return false
	}
	return true
}

// heldNone: no open call holds anything in dl.
func (dl *dayLease) heldNone() bool {
	for _, s := range dl.scopes {
		if s.held != 0 {
			return false
		}
	}
	return true
}

// idle: dl holds nothing in Redis and owes no report.
func (dl *dayLease) idle() bool {
	for _, s := range dl.scopes {
		if s.g != 0 || s.held != 0 || s.spent != 0 || s.sending != 0 || s.pending != 0 {
			return false
		}
	}
	return dl.flight == nil && dl.stuck == nil
}

// close gives every lease back (Budget.Close).
func (m *leases) close(ctx context.Context) error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	stop, done := m.stop, m.loopDone
	m.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
	var errs []error
	// Twice: an operation already on its way (or unanswered) first, then
	// the giving back.
	for range 2 {
		var flights []*leaseFlight
		m.mu.Lock()
		now := m.clock()
		all := append([]*dayLease(nil), m.retired...)
		for _, dl := range m.days {
			all = append(all, dl)
		}
		var out []*op
		for _, dl := range all {
			switch {
			case dl.flight != nil:
				flights = append(flights, dl.flight)
			case dl.stuck != nil:
				fl := m.resend(dl)
				flights, out = append(flights, fl), append(out, fl.op)
			case !dl.idle() && !dl.closing:
				fl := m.prepare(dl, now, "l:"+dl.id, nil, true)
				flights, out = append(flights, fl), append(out, fl.op)
			}
		}
		m.mu.Unlock()
		m.b.send(out...)
		for _, fl := range flights {
			if err := fl.wait(ctx); err != nil && !errors.Is(err, errLeaseLost) {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}
