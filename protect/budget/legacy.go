package budget

import (
	"context"
	"fmt"

	"faregate/protect/kit/randhex"
)

// Layout 1: every key of a day under the {<day>} hash tag, one script per
// reserve and per settle holding every scope at once (legacy_scripts.go).
// A day that a faregate of this layout began stays in it (layoutOf), so
// replicas of both layouts running side by side on the day of an upgrade
// share every counter; nothing here leases.

// keys are the Redis keys of one day, principal, tier and task.
type keys struct{ site, spend, tier, principal, task, taskres, res, resinfo, done string }

func keysFor(day, principal, tier, task string) keys {
	p := "faregate:budget:{" + day + "}:"
	return keys{site: p + "site", spend: p + "spend", tier: p + "tier:" + tier, principal: p + "p:" + principal,
		task: p + "task:" + task, taskres: p + "taskres:" + task, res: p + "res", resinfo: p + "resinfo", done: p + "done"}
}

// scopeKeys is the KEYS list of the reserve and settle scripts.
func (k keys) scopeKeys() []string {
	return []string{k.site, k.spend, k.tier, k.principal, k.task, k.taskres, k.res, k.resinfo, k.done}
}

// legacyReserve is Reserve on a day of layout 1; r is checked and priced.
func (b *Budget) legacyReserve(ctx context.Context, r Reservation) (Reservation, error) {
	now := b.now()
	v, err := reserveScript.Run(ctx, b.rdb, keysFor(r.Day, r.Principal, r.Tier, r.Task).scopeKeys(),
		ms(now), ms(now.Add(b.ttl)), r.ID, r.Tokens, r.CostMicro,
		b.limits.Site, b.limits.SpendMicro, r.TierLimit, r.PrincipalLimit, b.limits.Task,
		dayKeyTTL, info(r), flag(r.Tier != ""),
	).Int64Slice()
	if err != nil {
		return Reservation{}, fmt.Errorf("%w: reserve: %w", ErrUnavailable, err)
	}
	if len(v) != 15 {
		return Reservation{}, fmt.Errorf("%w: reserve script returned %d values", ErrUnavailable, len(v))
	}
	b.legacyGauges(v[4], v[5], v[6])
	switch v[0] {
	case 1, 2:
		r.Warnings = b.warnings(v[7:11], v[11:15], r)
		return r, nil
	case 0:
		return Reservation{}, b.refuse(v[1], v[2], v[3] == 1, now)
	default:
		return Reservation{}, fmt.Errorf("%w: reservation id %s is taken by another reservation", ErrInvalid, r.ID)
	}
}

// legacySettle is SettleCall on a day of layout 1: c is what to charge.
func (b *Budget) legacySettle(ctx context.Context, r Reservation, c charge) (Settlement, error) {
	k := keysFor(r.Day, r.Principal, r.Tier, r.Task)
	args := []any{ms(b.now()), r.ID, c.tokens(), c.cost, info(r), dayKeyTTL,
		b.limits.Site, b.limits.SpendMicro, max(r.TierLimit, 0), r.PrincipalLimit, flag(r.Tier != ""), 0}
	if e := c.entry; e != nil {
		args[11] = 1
		args = append(args, b.ledger.argv(*e, c.prompt, c.completion, r.Tokens, c.raw, c.implausible)...)
	}
	stream := UsageKey(r.Day)
	var v []int64
	err := b.resend(ctx, func() (err error) {
		v, err = settleScript.Run(ctx, b.rdb, append(k.scopeKeys(), stream, sumsKey(stream)), args...).Int64Slice()
		return err
	})
	if err != nil {
		return Settlement{}, fmt.Errorf("%w: settle: %w", ErrUnavailable, err)
	}
	if len(v) != 20 {
		return Settlement{}, fmt.Errorf("%w: settle script returned %d values", ErrUnavailable, len(v))
	}
	b.ledger.observe(r.Day, v[17:20])
	b.legacyGauges(v[6], v[7], v[8])
	if v[0] == 0 {
		return Settlement{}, fmt.Errorf("%w: %s", ErrUnknownReservation, r.ID)
	}
	s := Settlement{Tokens: v[1], CostMicro: v[2], OverageTokens: v[3], OverageCostMicro: v[4], Late: v[5] == 1}
	s.Warnings = b.warnings(v[9:13], v[13:17], r)
	if c.implausible && v[0] == 1 {
		b.m.implausible.Inc()
	}
	b.m.overage(s.OverageTokens, s.OverageCostMicro, s.Late)
	return s, nil
}

// legacyWithdraw is Withdraw on a day of layout 1.
func (b *Budget) legacyWithdraw(ctx context.Context, req Request) (bool, error) {
	v, err := withdrawScript.Run(ctx, b.rdb, keysFor(req.Day, req.Principal, req.Tier, req.Task).scopeKeys(),
		ms(b.now()), dayKeyTTL, req.ID).Int64Slice()
	if err != nil {
		return false, fmt.Errorf("%w: withdraw: %w", ErrUnavailable, err)
	}
	if len(v) != 5 {
		return false, fmt.Errorf("%w: withdraw script returned %d values", ErrUnavailable, len(v))
	}
	b.legacyGauges(v[2], v[3], v[4])
	return v[0] == 1, nil
}

// legacyRelease is ReleaseTask on a day of layout 1.
func (b *Budget) legacyRelease(ctx context.Context, day, task string) (int64, error) {
	k := keysFor(day, "", "", task)
	var released int64
	for range releaseRounds {
		// A fresh op id per round: a re-send of this round (lost reply)
		// is answered from its record; the next round is new work.
		v, err := releaseScript.Run(ctx, b.rdb, []string{k.site, k.taskres, k.res, k.resinfo, k.done},
			ms(b.now()), dayKeyTTL, randhex.New(16)).Int64Slice()
		if err != nil {
			return released, fmt.Errorf("%w: release: %w", ErrUnavailable, err)
		}
		if len(v) != 5 {
			return released, fmt.Errorf("%w: release script returned %d values", ErrUnavailable, len(v))
		}
		released += v[0]
		b.legacyGauges(v[2], v[3], v[4])
		if v[1] == 0 {
			break
		}
	}
	return released, nil
}

// legacyCanAfford is CanAfford on a day of layout 1.
func (b *Budget) legacyCanAfford(ctx context.Context, a AffordRequest) error {
	k := keysFor(a.Day, a.Principal, a.Tier, "")
	now := b.now()
	v, err := canAffordScript.Run(ctx, b.rdb, []string{k.site, k.spend, k.tier, k.principal, k.res, k.resinfo, k.done},
		ms(now), dayKeyTTL, a.Tokens, a.CostMicro, b.limits.Site, b.limits.SpendMicro, max(a.TierLimit, 0), a.PrincipalLimit,
		flag(a.Tier != ""),
	).Int64Slice()
	if err != nil {
		return fmt.Errorf("%w: can afford: %w", ErrUnavailable, err)
	}
	if len(v) != 7 {
		return fmt.Errorf("%w: can afford script returned %d values", ErrUnavailable, len(v))
	}
	b.legacyGauges(v[4], v[5], v[6])
	if v[0] != 1 {
		return b.refuse(v[1], v[2], v[3] == 1, now)
	}
	return nil
}

// legacyUsage is Usage on a day of layout 1 (money is counted for the
// site only).
func (b *Budget) legacyUsage(ctx context.Context, q UsageQuery) (UsageReport, error) {
	k := keysFor(q.Day, q.Principal, q.Tier, q.Task)
	v, err := usageScript.Run(ctx, b.rdb, []string{k.site, k.spend, k.tier, k.principal, k.task, k.res, k.resinfo, k.done},
		ms(b.now()), dayKeyTTL).Int64Slice()
	if err != nil {
		return UsageReport{}, fmt.Errorf("%w: usage: %w", ErrUnavailable, err)
	}
	if len(v) != 16 {
		return UsageReport{}, fmt.Errorf("%w: usage script returned %d values", ErrUnavailable, len(v))
	}
	su := func(i int) ScopeUsage { return ScopeUsage{Settled: v[3*i], Outstanding: v[3*i+1], Overage: v[3*i+2]} }
	rep := UsageReport{Site: su(0), Spend: su(1), Tier: su(2), Principal: su(3), Task: su(4), Reservations: v[15], Layout: layoutDay}
	b.legacyGauges(rep.Site.Settled+rep.Site.Outstanding, rep.Spend.Settled+rep.Spend.Outstanding, rep.Reservations)
	return rep, nil
}

// legacyGauges refreshes the gauges from a layout-1 script's view of the
// site scopes and the day's open reservations.
func (b *Budget) legacyGauges(siteUsed, spendUsed, reservations int64) {
	b.m.update(b.limits, siteUsed, spendUsed)
	b.m.outstanding.Set(float64(reservations))
}
