package budget

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"faregate/protect/kit/randhex"
	"faregate/protect/kit/redisbatch"
)

// Reserve holds req's tokens and cost in every scope at once, or in none:
// it returns an *ExhaustedError naming the narrowest scope that cannot
// afford it (task, principal, tier, site tokens, site spend),
// ErrUnavailable, or ErrInvalid. A re-sent reserve (same ID and request)
// answers the first success again without holding twice.
//
// In layout 2 the principal's and the task's part is one operation in the
// principal's slot; the day scopes' part comes from this replica's leased
// blocks when they cover it (no round trip of its own), else it is one
// operation in the day's slot sent at the same time (a lease top-up, or
// per call near a limit). When the two disagree, the granted part is
// given back before Reserve answers.
func (b *Budget) Reserve(ctx context.Context, req Request) (Reservation, error) {
	// The budget batches its own round trips (commit.go): a caller's
	// redisbatch wave must not wait for it.
	ctx = redisbatch.Leave(ctx)
	if err := validate(req.Day, req.Principal, req.Tier, req.Task); err != nil {
		return Reservation{}, err
	}
	if req.ID != "" && !validID(req.ID) {
		return Reservation{}, fmt.Errorf("%w: reservation id must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	// Each part is bounded before they are added, so the sum cannot wrap.
	if req.PromptTokens < 0 || req.MaxTokens < 0 || req.PromptTokens > maxExact/2 || req.MaxTokens > maxExact/2 ||
		req.PromptTokens+req.MaxTokens <= 0 || len(req.Model) > 256 {
		return Reservation{}, fmt.Errorf("%w: reserve %d prompt + %d max tokens of a %d-byte model name",
			ErrInvalid, req.PromptTokens, req.MaxTokens, len(req.Model))
	}
	cost, err := b.Cost(req.Model, req.PromptTokens, req.MaxTokens)
	if err != nil {
		return Reservation{}, err
	}
	if p, ok := b.price(req.Model); ok && req.PromptCache {
		cost = p.ReserveCost(req.PromptTokens, req.MaxTokens)
	}
	r := Reservation{ID: req.ID, Day: req.Day, Principal: req.Principal, Tier: req.Tier, Task: req.Task, Model: req.Model,
		PrincipalLimit: req.PrincipalLimit, TierLimit: max(req.TierLimit, 0),
		Tokens: req.PromptTokens + req.MaxTokens, PromptTokens: req.PromptTokens, CostMicro: min(cost, maxExact)}
	if r.PrincipalLimit <= 0 {
		r.PrincipalLimit = b.limits.Principal
	}
	if r.ID == "" {
		// 128 random bits: a reservation id is never guessed nor reused.
		r.ID = "r" + randhex.New(16)
	}
	layout, err := b.layoutOf(ctx, r.Day)
	if err != nil {
		return Reservation{}, err
	}
	if layout == layoutDay {
		r.how = heldLegacy
		return b.legacyReserve(ctx, r)
	}
	return b.reserveSplit(ctx, r)
}

// dayNeeds is what r asks of the day's scopes: tokens of the site and of
// its tier, money of the site.
func (b *Budget) dayNeeds(r Reservation) []need {
	n := []need{{"site", r.Tokens, b.limits.Site}, {"spend", r.CostMicro, b.limits.SpendMicro}}
	if r.Tier != "" {
		n = append(n, need{"tier:" + r.Tier, r.Tokens, r.TierLimit})
	}
	return n
}

// reserveSplit is Reserve in layout 2.
func (b *Budget) reserveSplit(ctx context.Context, r Reservation) (Reservation, error) {
	now := b.now()
	rec := &openRes{how: heldDirect, day: r.Day, task: r.Task, exp: now.Add(b.ttl)}
	var fl *leaseFlight
	var lop *op
	if b.leases != nil {
		rec.hold, fl, lop, rec.touchedDay, _ = b.leases.take(r.Day, r.ID, b.dayNeeds(r))
	}
	rop := b.reserveOp(r, ms(rec.exp))
	var dop *op
	after := false
	switch {
	case rec.hold == nil && fl == nil && b.cluster && b.dayUse.tight(b.limits, r):
		// Per call near a day scope's limit: the day's part only once the
		// principal's is granted (afterPrincipal).
		after = true
	case rec.hold == nil && fl == nil:
		// Per call: the day's part goes with the principal's.
		dop = b.directOp(r, ms(rec.exp))
		rec.touchedDay = true
	case lop != nil && rec.touchedDay:
		// This call's lease operation: should the scope go per call in
		// it, the call is reserved per call there too.
		b.leases.withCall(fl, b, r, ms(rec.exp))
	}
	b.send(lop, rop, dop)
	var warnDay, usedDay, predone []int64
	switch {
	case rec.hold != nil:
		rec.how = heldLease
	case fl != nil:
		var err error
		if predone, dop, warnDay, usedDay, err = b.afterLease(ctx, r, rec, fl); err != nil {
			return Reservation{}, err
		}
	case after:
		dop = b.afterPrincipal(ctx, r, rec, rop)
	}
	rv, rerr := rop.wait(ctx)
	dv := predone
	var derr error
	if dop != nil {
		dv, derr = dop.wait(ctx)
	}
	if err := errors.Join(rerr, derr); err != nil {
		// Either part may hold (a lost reply): both are withdrawn.
		b.undo(r, rec, true, dop != nil || rec.touchedDay)
		return Reservation{}, fmt.Errorf("%w: reserve: %w", ErrUnavailable, err)
	}
	if dv != nil && dv[0] == 6 {
		// Not tried: the principal's part was refused in the same script.
		dv, rec.touchedDay = nil, false
	}
	if dv != nil {
		warnDay, usedDay = dv[4:7], dv[7:10]
		b.dayUse.note(r.Day, r.Tier, dv[7:10])
		b.m.update(b.limits, dv[7], dv[8])
		if b.leases != nil {
			b.leases.observeAll(r, dv[7:10])
		}
	}
	granted := func(v []int64) bool { return v[0] == 1 || v[0] == 2 }
	if !granted(rv) || (dv != nil && !granted(dv)) {
		return Reservation{}, b.refused(r, rec, rv, dv, now)
	}
	r.how, r.replica = rec.how, b.replicaID()
	b.open.put(r.ID, rec, b.m)
	// Without leases nothing else sweeps the replica's record of what
	// was never settled.
	for _, o := range b.open.expired(now) {
		if o.hold != nil {
			b.leases.giveBack(o.hold)
		}
	}
	flags, used := make([]int64, 4), make([]int64, 4)
	if warnDay != nil {
		copy(flags, warnDay)
		copy(used, usedDay)
	}
	flags[3], used[3] = rv[4], rv[5]
	r.Warnings = b.warnings(flags, used, r)
	return r, nil
}

// afterPrincipal sends the day's part of a per-call reserve once its
// principal's part rop is granted, and returns it (nil when rop was not
// granted, or did not answer: nothing was held in the day's slot then).
// Sent at once, a reserve the principal's or task's limit refuses would
// hold the day's scopes until its withdraw: far from their limits that
// costs nothing, but near one such doomed holds refuse calls the day could
// afford (TestExactSoak's site, 2 replicas and 50 tasks of 10 calls, bound
// 19,650 of its 24,000 tokens so). On a single Redis both parts go in one
// script, whose D skips a call its R refused; on a cluster they go to two
// slots, and near a limit the second round trip keeps the day exact.
func (b *Budget) afterPrincipal(ctx context.Context, r Reservation, rec *openRes, rop *op) *op {
	rv, err := rop.wait(ctx)
	if err != nil || (rv[0] != 1 && rv[0] != 2) {
		return nil
	}
	rec.touchedDay = true
	dop := b.directOp(r, ms(rec.exp))
	b.send(dop)
	return dop
}

// tightCalls is how many reservations of a call's size a day scope's
// headroom must hold for the call's two parts to go at once (reserveSplit).
const tightCalls = 32

// dayUse remembers what the day's slot last answered of its scopes' use,
// to tell a reserve near their limits (tight).
type dayUse struct {
	mu   sync.Mutex
	used map[string]int64 // day|scope → used
}

// note keeps a direct answer's used of day's site, spend and tier.
func (d *dayUse) note(day, tier string, used []int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.used == nil || len(d.used) > 64 {
		d.used = map[string]int64{}
	}
	d.used[day+"|site"], d.used[day+"|spend"] = used[0], used[1]
	if tier != "" {
		d.used[day+"|tier:"+tier] = used[2]
	}
}

// tight reports whether a day scope r touches was last seen with less
// headroom than tightCalls reservations of r's size.
func (d *dayUse) tight(l Limits, r Reservation) bool {
	near := func(used, n, limit int64) bool {
		return limit > 0 && used+min(n, maxExact/tightCalls)*tightCalls > limit
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return near(d.used[r.Day+"|site"], r.Tokens, l.Site) || near(d.used[r.Day+"|spend"], r.CostMicro, l.SpendMicro) ||
		(r.Tier != "" && near(d.used[r.Day+"|tier:"+r.Tier], r.Tokens, r.TierLimit))
}

// afterLease waits for the lease operation fl a reserve found on its way
// (started by this call, or by another one short of the same block),
// then takes the call's part from the block, or reserves it per call: in
// fl itself when this call started it and the scope went per call there
// (direct, its answer), else with a second round trip (dop, sent).
func (b *Budget) afterLease(ctx context.Context, r Reservation, rec *openRes, fl *leaseFlight) (direct []int64, dop *op, warn, used []int64, err error) {
	if err := fl.wait(ctx); err != nil && !errors.Is(err, errLeaseLost) {
		b.undo(r, rec, true, true)
		return nil, nil, nil, nil, fmt.Errorf("%w: lease: %w", ErrUnavailable, err)
	}
	if rec.touchedDay && fl.direct != nil {
		return fl.direct, nil, nil, nil, nil
	}
	if rec.hold = b.leases.retake(r.Day, b.dayNeeds(r)); rec.hold != nil {
		rec.how = heldLease
		if rec.touchedDay {
			warn, used = fl.dayWarnings(r.Tier)
		}
		return nil, nil, warn, used, nil
	}
	// Another call's lease operation, or this one's block taken meanwhile.
	rec.touchedDay = true
	dop = b.directOp(r, ms(rec.exp))
	b.send(dop)
	return nil, dop, nil, nil, nil
}

// refused answers a reserve that one of its parts refused, the narrowest
// refusal named: the task's and principal's before the day's. The other
// part is given back, and a flag it set cleared (so a first refusal's
// alert is raised once, by the refusal named); a part whose id belongs to
// another reservation is left alone.
func (b *Budget) refused(r Reservation, rec *openRes, rv, dv []int64, now time.Time) error {
	granted := func(v []int64) bool { return v[0] == 1 || v[0] == 2 }
	if rv[0] == 3 || (dv != nil && dv[0] == 3) {
		// The id is another reservation's: what it holds is not ours to
		// give back.
		if rec.hold != nil {
			b.leases.giveBack(rec.hold)
		}
		return fmt.Errorf("%w: reservation id %s is taken by another reservation", ErrInvalid, r.ID)
	}
	named := rv[0] != 1 && rv[0] != 2 // the principal's part is the refusal named
	undoR := granted(rv)
	undoD := dv != nil && (granted(dv) || (named && dv[0] == 0 && dv[3] == 1))
	if named && rec.touchedDay {
		undoD = true // this call's lease operation may have set a flag
	}
	b.undo(r, rec, undoR, undoD)
	if !named && rec.touchedDay && !undoD {
		// Refused in the day's slot: a warning this call's lease operation
		// set is cleared; the exhaustion it reports stays.
		b.undoWarnings(r)
	}
	switch {
	case rv[0] == 0:
		return b.refuse(rv[1], rv[2], rv[3] == 1, now)
	case rv[0] == 4 || dv[0] == 4:
		return fmt.Errorf("%w: reserve amounts out of range", ErrInvalid)
	}
	return b.refuse(dv[1], dv[2], dv[3] == 1, now)
}

// undo gives back what a reserve that will not be granted holds: its
// lease hold locally, and (when asked) its part in the principal's slot
// and in the day's, withdrawn as if never sent. It waits (within
// undoTimeout), so a refused reserve leaves nothing behind when it
// answers.
func (b *Budget) undo(r Reservation, rec *openRes, principal, day bool) {
	if rec.hold != nil {
		b.leases.giveBack(rec.hold)
		rec.hold = nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), undoTimeout)
	defer cancel()
	var ops []*op
	if principal {
		ops = append(ops, b.withdrawOp(r.ID, r.Day, r.Principal))
	}
	if day {
		ops = append(ops, b.directUndoOp(r.ID, r.Day, r.Tier, false))
	}
	b.send(ops...)
	for _, o := range ops {
		_, _ = o.wait(ctx)
	}
}

// undoWarnings clears the warning flags r's lease operation set in the
// day's slot (a reserve refused there).
func (b *Budget) undoWarnings(r Reservation) {
	ctx, cancel := context.WithTimeout(context.Background(), undoTimeout)
	defer cancel()
	o := b.directUndoOp(r.ID, r.Day, r.Tier, true)
	b.send(o)
	_, _ = o.wait(ctx)
}

// undoTimeout bounds how long a refused reserve waits for its undoing.
const undoTimeout = 5 * time.Second

// replicaID names this Budget among the replicas ("" without leases).
func (b *Budget) replicaID() string {
	if b.leases == nil {
		return ""
	}
	return b.leases.replica
}

// charge is what SettleCall charges, worked out before any script runs.
type charge struct {
	prompt, completion, cost int64
	implausible              bool
	raw                      string
	entry                    *Entry
}

func (c charge) tokens() int64 { return c.prompt + c.completion }

// SettleCall ends reservation r with what call used and charges it in full
// in every scope, at r.Model's price. What exceeds the hold is overage; if
// the hold was already given back (expired, or released by ReleaseTask)
// everything is overage and Late is set: a late settle charges what was
// used, never nothing. A report below zero, past MaxCallTokens or
// unreadable is not charged as it stands: the call is charged
// Conservative(r.Tokens, call.Counted) and Implausible is set. Settling the
// same reservation again answers the first Settlement and charges (and
// writes) nothing. A reservation never made here (or altered) yields
// ErrUnknownReservation.
//
// In layout 2 the principal's and task's part, with the ledger entry, is
// one operation in the principal's slot; a leased reservation's day part
// is spent from its block (reported with the lease's next operation), a
// direct one's is one more operation in the day's slot, sent at once.
func (b *Budget) SettleCall(ctx context.Context, r Reservation, call Call) (Settlement, error) {
	ctx = redisbatch.Leave(ctx)
	if err := validate(r.Day, r.Principal, r.Tier, r.Task); err != nil {
		return Settlement{}, err
	}
	if !validID(r.ID) || r.Tokens <= 0 || r.Tokens > maxExact || r.CostMicro < 0 || r.CostMicro > maxExact {
		return Settlement{}, fmt.Errorf("%w: settle of reservation %q holding %d tokens", ErrInvalid, r.ID, r.Tokens)
	}
	prompt, completion, implausible := b.Charged(r, call)
	c := charge{prompt: prompt, completion: completion, implausible: implausible, entry: call.Ledger}
	// An unpriced model could only have been reserved with the spend cap
	// off, so it costs nothing here either.
	if p, ok := b.price(r.Model); ok {
		c.cost = min(p.CostOf(call.tokens(prompt, completion)), maxExact)
	}
	if implausible {
		// The raw report is kept only beside a charge that is not it.
		c.raw = clipRaw(call.Raw)
	}
	if r.PrincipalLimit <= 0 {
		r.PrincipalLimit = b.limits.Principal
	}
	how := r.how
	if how == heldUnknown {
		layout, err := b.layoutOf(ctx, r.Day)
		if err != nil {
			return Settlement{}, err
		}
		if layout == layoutDay {
			how = heldLegacy
		}
	}
	if how == heldLegacy {
		return b.legacySettle(ctx, r, c)
	}
	return b.settleSplit(ctx, r, how, c)
}

// settleAttempt sends f again while Redis does not answer, up to
// settleAttempts times: every settle operation is idempotent, so a
// re-send never charges twice, and a settle that gets through gives the
// hold back now rather than when the reservation expires.
func (b *Budget) resend(ctx context.Context, f func() error) error {
	var err error
	for attempt := range settleAttempts {
		if attempt > 0 {
			t := time.NewTimer(time.Duration(25<<(2*attempt)) * time.Millisecond)
			select {
			case <-ctx.Done():
				t.Stop()
				return err
			case <-t.C:
			}
		}
		if err = f(); err == nil || ctx.Err() != nil {
			return err
		}
		b.m.settleRetries.Inc()
	}
	return err
}

// settleSplit is SettleCall in layout 2.
func (b *Budget) settleSplit(ctx context.Context, r Reservation, how holding, c charge) (Settlement, error) {
	rec := b.open.take(r.ID, b.m)
	mine := r.replica != "" && r.replica == b.replicaID()
	// A leased hold is spent locally, once, whatever Redis answers: the
	// call was made. One this replica no longer holds (it outlived its
	// reservation) is charged to the current lease; another replica's is
	// charged in the day's slot directly, all of it as overage.
	if how == heldLease && mine && b.leases != nil {
		if rec != nil && rec.hold != nil {
			b.leases.spend(rec.hold, c.tokens(), c.cost)
		} else {
			b.leases.spendLate(r.Day, b.dayNeeds(r), c.tokens(), c.cost)
		}
	}
	direct := how == heldDirect || how == heldUnknown || (how == heldLease && !mine)
	var sv, ev []int64
	err := b.resend(ctx, func() error {
		sop := b.settleOp(r, c)
		var eop *op
		if direct {
			eop = b.directSettleOp(r, c, how == heldLease)
		}
		b.send(sop, eop)
		var err, eerr error
		sv, err = sop.wait(ctx)
		if eop != nil {
			ev, eerr = eop.wait(ctx)
		}
		return errors.Join(err, eerr)
	})
	if err != nil {
		return Settlement{}, fmt.Errorf("%w: settle: %w", ErrUnavailable, err)
	}
	switch sv[0] {
	case 0:
		return Settlement{}, fmt.Errorf("%w: %s", ErrUnknownReservation, r.ID)
	case 4:
		return Settlement{}, fmt.Errorf("%w: settle amounts out of range", ErrInvalid)
	}
	b.ledger.observe(r.Day, sv[8:11])
	s := Settlement{Tokens: sv[1], CostMicro: sv[2], OverageTokens: sv[3], OverageCostMicro: sv[4], Late: sv[5] == 1}
	flags, used := make([]int64, 4), make([]int64, 4)
	if ev != nil && ev[0] != 0 {
		copy(flags, ev[6:9])
		copy(used, ev[9:12])
		b.dayUse.note(r.Day, r.Tier, ev[9:12])
		b.m.update(b.limits, ev[9], ev[10])
	}
	flags[3], used[3] = sv[6], sv[7]
	s.Warnings = b.warnings(flags, used, r)
	if c.implausible && sv[0] == 1 {
		b.m.implausible.Inc()
	}
	// Counted on every answer, repeats included: a repeat is most often a
	// re-send whose first reply (and so its count) was lost.
	b.m.overage(s.OverageTokens, s.OverageCostMicro, s.Late)
	return s, nil
}

// Withdraw undoes the reserve of req (sent with req.ID set) as if it had
// never been sent: a granted reservation is given back in all its scopes,
// and a budget_warning or budget_exhausted flag that reserve set (a first
// crossing today, Reservation.Warnings or ExhaustedError.First) is
// cleared, so the next operation to cross that line reports it. A caller
// that sends a reserve at once with checks that must come before it (the
// agent's token bucket and input-spike check, on other cluster slots) calls
// it when one of them refused and raises none of the reserve's alerts: the
// day's alert is then still raised once, by the next crossing. It reports
// whether a reservation was given back. A reservation already settled is
// left alone; calling it again finds nothing.
func (b *Budget) Withdraw(ctx context.Context, req Request) (bool, error) {
	ctx = redisbatch.Leave(ctx)
	if err := validate(req.Day, req.Principal, req.Tier, req.Task); err != nil {
		return false, err
	}
	if !validID(req.ID) {
		return false, fmt.Errorf("%w: reservation id must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	layout, err := b.layoutOf(ctx, req.Day)
	if err != nil {
		return false, err
	}
	if layout == layoutDay {
		return b.legacyWithdraw(ctx, req)
	}
	rec := b.open.take(req.ID, b.m)
	if rec != nil && rec.hold != nil {
		b.leases.giveBack(rec.hold)
	}
	wop := b.withdrawOp(req.ID, req.Day, req.Principal)
	var xop *op
	// A reserve this replica does not know (its reply was lost) may hold
	// in the day's slot too.
	if rec == nil || rec.touchedDay {
		xop = b.directUndoOp(req.ID, req.Day, req.Tier, false)
	}
	b.send(wop, xop)
	wv, err := wop.wait(ctx)
	if xop != nil {
		_, xerr := xop.wait(ctx)
		err = errors.Join(err, xerr)
	}
	if err != nil {
		return false, fmt.Errorf("%w: withdraw: %w", ErrUnavailable, err)
	}
	return wv[0] == 1, nil
}

// ReleaseTask gives back every open reservation of task (admitted on day
// by principal) at once, in all its scopes, and returns how many it gave
// back. The reaper calls it when a task's lease lapsed: the replica that
// held them is gone (its leased blocks are charged when they expire).
// Their settles, should they still arrive, are charged as overage. A
// re-sent operation (lost reply) answers the same count; calling
// ReleaseTask again finds nothing open and returns 0.
func (b *Budget) ReleaseTask(ctx context.Context, day, principal, task string) (int64, error) {
	ctx = redisbatch.Leave(ctx)
	if err := validDay(day); err != nil {
		return 0, err
	}
	if !validID(task) || !validID(principal) {
		return 0, fmt.Errorf("%w: principal and task must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	layout, err := b.layoutOf(ctx, day)
	if err != nil {
		return 0, err
	}
	if layout == layoutDay {
		return b.legacyRelease(ctx, day, task)
	}
	for _, rec := range b.open.ofTask(day, task, b.m) {
		if rec.hold != nil {
			b.leases.giveBack(rec.hold)
		}
	}
	var released int64
	for range releaseRounds {
		// A fresh op id per round: a re-send of this round (lost reply)
		// is answered from its record; the next round is new work.
		top, zop := b.releaseOp(randhex.New(16), day, principal, task), b.directFreeOp(randhex.New(16), day, task)
		b.send(top, zop)
		tv, err := top.wait(ctx)
		zv, zerr := zop.wait(ctx)
		if err := errors.Join(err, zerr); err != nil {
			return released, fmt.Errorf("%w: release: %w", ErrUnavailable, err)
		}
		released += tv[0]
		if tv[1] == 0 && zv[0] < 256 {
			break
		}
	}
	return released, nil
}

// CanAfford reports whether the principal, its tier, the site's tokens and
// the site's spend could all hold a reservation of a.Tokens and
// a.CostMicro right now: nil, an *ExhaustedError (same precedence as
// Reserve), ErrUnavailable or ErrInvalid. It holds nothing: the admission
// check uses it to refuse a task that could not pay for even its first
// model call. A refusal sets the scope's once-a-day exhausted flag
// (ExhaustedError.First). Leased blocks count as used: near a limit a
// task may be refused while a replica holds unspent blocks.
func (b *Budget) CanAfford(ctx context.Context, a AffordRequest) error {
	ctx = redisbatch.Leave(ctx)
	if err := validDay(a.Day); err != nil {
		return err
	}
	if !validID(a.Principal) || (a.Tier != "" && !validID(a.Tier)) {
		return fmt.Errorf("%w: principal and tier must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	if a.Tokens <= 0 || a.CostMicro < 0 || a.Tokens > maxExact || a.CostMicro > maxExact {
		return fmt.Errorf("%w: can afford %d tokens costing %d", ErrInvalid, a.Tokens, a.CostMicro)
	}
	if a.PrincipalLimit <= 0 {
		a.PrincipalLimit = b.limits.Principal
	}
	a.TierLimit = max(a.TierLimit, 0)
	layout, err := b.layoutOf(ctx, a.Day)
	if err != nil {
		return err
	}
	if layout == layoutDay {
		return b.legacyCanAfford(ctx, a)
	}
	now := b.now()
	// One id tags both checks' flags, so the day's can be cleared when the
	// principal's refusal is the one named.
	id := "a" + randhex.New(16)
	aop, fop := b.affordOp(id, a), b.dayAffordOp(id, a)
	b.send(aop, fop)
	av, err := aop.wait(ctx)
	fv, ferr := fop.wait(ctx)
	if err := errors.Join(err, ferr); err != nil {
		return fmt.Errorf("%w: can afford: %w", ErrUnavailable, err)
	}
	b.m.update(b.limits, fv[4], fv[5])
	switch {
	case av[0] != 1:
		if fv[0] != 1 && fv[3] == 1 {
			// Only the principal's refusal is named: the day's first
			// refusal is left for the next one to report.
			b.undo(Reservation{ID: id, Day: a.Day, Tier: a.Tier}, &openRes{}, false, true)
		}
		return b.refuse(4, av[1], av[2] == 1, now)
	case fv[0] != 1:
		return b.refuse(fv[1], fv[2], fv[3] == 1, now)
	}
	return nil
}

// Usage reads the scopes of q (for GET /api/usage and operators) after
// reaping expired reservations and leases.
func (b *Budget) Usage(ctx context.Context, q UsageQuery) (UsageReport, error) {
	ctx = redisbatch.Leave(ctx)
	if err := validDay(q.Day); err != nil {
		return UsageReport{}, err
	}
	// Empty names map to keys no Reserve can create, which read as zero.
	for _, id := range []string{q.Principal, q.Tier, q.Task} {
		if id != "" && !validID(id) {
			return UsageReport{}, fmt.Errorf("%w: principal, tier and task must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
		}
	}
	plimit := q.PrincipalLimit
	if plimit <= 0 {
		plimit = b.limits.Principal
	}
	layout, err := b.layoutOf(ctx, q.Day)
	if err != nil {
		return UsageReport{}, err
	}
	var rep UsageReport
	if layout == layoutDay {
		if rep, err = b.legacyUsage(ctx, q); err != nil {
			return UsageReport{}, err
		}
	} else if rep, err = b.usageSplit(ctx, q); err != nil {
		return UsageReport{}, err
	}
	rep.Site.Limit, rep.Spend.Limit, rep.Tier.Limit = b.limits.Site, b.limits.SpendMicro, max(q.TierLimit, 0)
	rep.Principal.Limit, rep.Task.Limit = plimit, b.limits.Task
	if q.Tier == "" {
		rep.Tier.Limit = 0
	}
	return rep, nil
}

// usageSplit is Usage in layout 2: the day's scopes and the principal's
// read at once, each slot in one step.
func (b *Budget) usageSplit(ctx context.Context, q UsageQuery) (UsageReport, error) {
	vop := b.dayUsageOp(q.Day, q.Tier)
	var uop *op
	if q.Principal != "" {
		uop = b.usageOp(q.Day, q.Principal, q.Task)
	}
	b.send(vop, uop)
	vv, err := vop.wait(ctx)
	var uv []int64
	if uop != nil {
		var uerr error
		uv, uerr = uop.wait(ctx)
		err = errors.Join(err, uerr)
	}
	if err != nil {
		return UsageReport{}, fmt.Errorf("%w: usage: %w", ErrUnavailable, err)
	}
	day := func(i int) ScopeUsage {
		return ScopeUsage{Settled: vv[4*i], Outstanding: vv[4*i+1], Overage: vv[4*i+2], Leased: vv[4*i+3]}
	}
	rep := UsageReport{Site: day(0), Spend: day(1), Tier: day(2), Reservations: vv[12], Leases: vv[13], Layout: layoutPrincipals}
	if uv != nil {
		p := func(i int) ScopeUsage { return ScopeUsage{Settled: uv[i], Outstanding: uv[i+1], Overage: uv[i+2]} }
		rep.Principal, rep.PrincipalSpend, rep.Task, rep.TaskSpend = p(0), p(3), p(6), p(9)
		rep.Reservations = uv[12]
	}
	b.m.update(b.limits, rep.Site.Settled+rep.Site.Outstanding, rep.Spend.Settled+rep.Spend.Outstanding)
	return rep, nil
}

// openRes is one of this replica's open reservations of layout 2.
type openRes struct {
	how       holding
	day, task string
	exp       time.Time  // its expiry (Options.Now's clock)
	hold      *leaseHold // its hold in a lease, if leased
	// touchedDay: an operation of its reserve may have set flags (or a
	// hold) in the day's slot, which its withdraw must clear.
	touchedDay bool
}

// openSet is a replica's open reservations by id. A reservation leaves it
// when settled, withdrawn, released, or past its expiry (its lease hold is
// then given back, as Redis gives its other holds back).
type openSet struct {
	mu    sync.Mutex
	m     map[string]*openRes
	swept time.Time
}

func (s *openSet) put(id string, o *openRes, m *metrics) {
	s.mu.Lock()
	s.m[id] = o
	m.outstanding.Set(float64(len(s.m)))
	s.mu.Unlock()
}

func (s *openSet) take(id string, m *metrics) *openRes {
	s.mu.Lock()
	defer s.mu.Unlock()
	o := s.m[id]
	delete(s.m, id)
	m.outstanding.Set(float64(len(s.m)))
	return o
}

// expired takes the reservations past their expiry at now (a sweep at
// most once a second).
func (s *openSet) expired(now time.Time) []*openRes {
	s.mu.Lock()
	defer s.mu.Unlock()
	if now.Sub(s.swept) < time.Second {
		return nil
	}
	s.swept = now
	var out []*openRes
	for id, o := range s.m {
		if !now.Before(o.exp) {
			out = append(out, o)
			delete(s.m, id)
		}
	}
	return out
}

// ofTask takes task's reservations of day.
func (s *openSet) ofTask(day, task string, m *metrics) []*openRes {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*openRes
	for id, o := range s.m {
		if o.day == day && o.task == task {
			out = append(out, o)
			delete(s.m, id)
		}
	}
	m.outstanding.Set(float64(len(s.m)))
	return out
}

// anyLeased: some open reservation holds a lease's amounts.
func (s *openSet) anyLeased() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, o := range s.m {
		if o.hold != nil {
			return true
		}
	}
	return false
}
