package budget

import (
	"fmt"
	"strconv"
	"sync"
	"time"
)

// The operations of layout 2 as batchScript reads them (its ops table
// documents each header and answer).

// principalOp starts an operation in day's slot of principal.
func (b *Budget) principalOp(kind byte, day, principal string) *op {
	bk := bucketHex(bucketOf(principal))
	tag := day + ":b" + bk
	o := b.newOp(kind, "faregate:budget:{"+tag+"}:res", tag)
	return o
}

// dayOp starts an operation in day's slot.
func (b *Budget) dayOp(kind byte, day string) *op {
	o := b.newOp(kind, dayPrefix(day)+"site", day)
	o.day = day
	return o
}

// slotReservation writes the fields that open a reservation's reserve and
// settle in its principal's slot, in the order the script reads them.
func (h *header) slotReservation(r Reservation) {
	h.str(r.ID)
	h.str(r.Day)
	h.str(bucketHex(bucketOf(r.Principal)))
	h.str(r.Principal)
	h.str(r.Task)
	h.str(r.Tier)
	h.num(r.Tokens)
	h.num(r.CostMicro)
}

// dayReservation writes the fields that open a direct reservation's
// reserve and settle in the day's slot, in the order the script reads
// them.
func (h *header) dayReservation(r Reservation) {
	h.str(r.ID)
	h.str(r.Day)
	h.num(r.Tokens)
	h.num(r.CostMicro)
	h.str(r.Tier)
}

func (b *Budget) reserveOp(r Reservation, expiry int64) *op {
	o := b.principalOp(opReserve, r.Day, r.Principal)
	h := &o.hdr
	h.slotReservation(r)
	h.num(r.PrincipalLimit)
	h.num(b.limits.Task)
	h.num(expiry)
	return o.end(r.Model)
}

func (b *Budget) settleOp(r Reservation, c charge) *op {
	o := b.principalOp(opSettle, r.Day, r.Principal)
	h := &o.hdr
	h.slotReservation(r)
	h.num(c.tokens())
	h.num(c.cost)
	e := c.entry
	if e == nil {
		h.num(0)
		h.num(r.PrincipalLimit)
		h.num(0) // no entry: done's expiry is set
		return o.end(r.Model)
	}
	h.num(1)
	h.num(r.PrincipalLimit)
	h.num(int64(flag(b.expiries.known("S" + bucketTag(r.Day, r.Principal)))))
	return o.end(append([]string{r.Model}, argStrings(b.ledger.argv(*e, c.prompt, c.completion, r.Tokens, c.raw, c.implausible))...)...)
}

// argStrings is a script's arguments as the strings an operation carries.
func argStrings(args []any) []string {
	out := make([]string, len(args))
	for i, a := range args {
		switch v := a.(type) {
		case string:
			out[i] = v
		case int64:
			out[i] = strconv.FormatInt(v, 10)
		case int:
			out[i] = strconv.Itoa(v)
		default:
			out[i] = fmt.Sprint(v)
		}
	}
	return out
}

func (b *Budget) withdrawOp(id, day, principal string) *op {
	o := b.principalOp(opWithdraw, day, principal)
	o.hdr.str(id)
	o.hdr.str(day)
	o.hdr.str(bucketHex(bucketOf(principal)))
	o.hdr.str(principal)
	return o.end()
}

func (b *Budget) releaseOp(opID, day, principal, task string) *op {
	o := b.principalOp(opRelease, day, principal)
	o.hdr.str(opID)
	o.hdr.str(day)
	o.hdr.str(bucketHex(bucketOf(principal)))
	o.hdr.str(task)
	return o.end()
}

func (b *Budget) usageOp(day, principal, task string) *op {
	o := b.principalOp(opUsage, day, principal)
	o.hdr.str(day)
	o.hdr.str(bucketHex(bucketOf(principal)))
	o.hdr.str(principal)
	o.hdr.str(task)
	return o.end()
}

func (b *Budget) affordOp(id string, a AffordRequest) *op {
	o := b.principalOp(opAfford, a.Day, a.Principal)
	o.hdr.str("r:" + id)
	o.hdr.str(a.Day)
	o.hdr.str(bucketHex(bucketOf(a.Principal)))
	o.hdr.str(a.Principal)
	o.hdr.num(a.PrincipalLimit)
	o.hdr.num(a.Tokens)
	return o.end()
}

func (b *Budget) directOp(r Reservation, expiry int64) *op {
	o := b.dayOp(opDirect, r.Day)
	h := &o.hdr
	h.dayReservation(r)
	h.num(b.limits.Site)
	h.num(b.limits.SpendMicro)
	h.num(r.TierLimit)
	h.num(expiry)
	h.str(r.Principal)
	h.str(r.Task)
	return o.end(r.Model)
}

// directSettleOp settles r's direct reservation; force charges one the
// day's slot never held (a leased reservation another replica made).
func (b *Budget) directSettleOp(r Reservation, c charge, force bool) *op {
	o := b.dayOp(opDirectEnd, r.Day)
	h := &o.hdr
	h.dayReservation(r)
	h.num(c.tokens())
	h.num(c.cost)
	h.str(r.Principal)
	h.str(r.Task)
	h.num(b.limits.Site)
	h.num(b.limits.SpendMicro)
	h.num(r.TierLimit)
	h.num(int64(flag(force)))
	h.num(int64(flag(b.expiries.known("E" + r.Day))))
	return o.end(r.Model)
}

// directUndoOp withdraws id in the day's slot; warnedOnly keeps an
// exhaustion flag it set (the refusal a reserve reports).
func (b *Budget) directUndoOp(id, day, tier string, warnedOnly bool) *op {
	o := b.dayOp(opDirectUndo, day)
	o.hdr.str(id)
	o.hdr.str(day)
	o.hdr.str(tier)
	if warnedOnly {
		o.hdr.str("w")
	} else {
		o.hdr.str("we")
	}
	return o.end()
}

func (b *Budget) directFreeOp(opID, day, task string) *op {
	o := b.dayOp(opDirectFree, day)
	o.hdr.str(opID)
	o.hdr.str(day)
	o.hdr.str(task)
	return o.end()
}

func (b *Budget) dayUsageOp(day, tier string) *op {
	o := b.dayOp(opDayUsage, day)
	o.hdr.str(day)
	o.hdr.str(tier)
	return o.end()
}

func (b *Budget) dayAffordOp(id string, a AffordRequest) *op {
	o := b.dayOp(opDayAfford, a.Day)
	h := &o.hdr
	h.str("r:" + id)
	h.str(a.Day)
	h.num(a.Tokens)
	h.num(a.CostMicro)
	h.str(a.Tier)
	h.num(b.limits.Site)
	h.num(b.limits.SpendMicro)
	h.num(a.TierLimit)
	return o.end()
}

// dayWarnings are the flags and used values (site, spend, tier) the lease
// operation fl answered for the scopes of a call of tier.
func (fl *leaseFlight) dayWarnings(tier string) (flags, used []int64) {
	flags, used = make([]int64, 3), make([]int64, 3)
	for i, s := range fl.scopes {
		j := -1
		switch {
		case s.name == "site":
			j = 0
		case s.name == "spend":
			j = 1
		case tier != "" && s.name == "tier:"+tier:
			j = 2
		}
		if j >= 0 && i < len(fl.warned) {
			flags[j], used[j] = fl.warned[i], fl.used[i]
		}
	}
	return flags, used
}

// observeAll passes a direct answer's used values of r's day scopes
// (site, spend, tier) to the lease's fallback.
func (m *leases) observeAll(r Reservation, used []int64) {
	m.observe(r.Day, "site", used[0])
	m.observe(r.Day, "spend", used[1])
	if r.Tier != "" {
		m.observe(r.Day, "tier:"+r.Tier, used[2])
	}
}

// expiries remembers, per slot, when this replica last had the expiry of
// its settled records and its ledger stream set: those keys are never
// deleted before their expiry, so a settle within a minute of it need not
// set it again (two commands a call fewer). Should Redis lose the keys
// meanwhile, the ones written again get their expiry within the minute.
type expiries struct {
	mu   sync.Mutex
	last map[string]time.Time
}

// known reports whether the expiry of slot's keys was set less than a
// minute ago; if not, the operation being built sets it, and it is
// remembered from now.
func (e *expiries) known(slot string) bool {
	now := time.Now()
	e.mu.Lock()
	defer e.mu.Unlock()
	if t, ok := e.last[slot]; ok && now.Sub(t) < time.Minute {
		return true
	}
	if e.last == nil || len(e.last) > 4*buckets {
		e.last = map[string]time.Time{}
	}
	e.last[slot] = now
	return false
}
