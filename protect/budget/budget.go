// Package budget caps what model calls may cost, in tokens and in money,
// in five scopes at once: the site's tokens per UTC day, the site's spend
// per UTC day, a tier's share of the site's tokens per day, each
// principal's tokens per day (a visitor or an API key) and each task.
//
// Before a model call the caller reserves the most the call can cost
// (estimated prompt tokens + max_tokens, and what they cost at the model's
// price) in every scope in one atomic Redis script, or is refused. After
// the call it settles the reservation with the usage the provider reported:
// the hold comes back and the actual usage is charged in full, even above
// the hold; the excess is recorded as overage. Checking and charging in one
// script is what keeps concurrent requests and replicas from overspending:
// at every instant, in every scope,
//
//	settled + outstanding − overage ≤ limit,
//
// and a scope that overage pushed over its limit refuses the next
// reservation at once.
//
// Scripts are idempotent, because a client may re-send a script whose reply
// was lost: a reservation id is made before the call, a re-sent reserve
// answers the first success again and a re-sent settle answers the first
// settlement again; neither charges twice.
//
// A reservation that is never settled (the process died) expires after
// Options.ReservationTTL and is given back, exactly once, by whichever
// script runs next for that day; ReleaseTask gives back a task's open
// reservations at once (its lease lapsed). A settle that arrives after
// either is charged in full, all of it as overage. Expiry follows the
// clock passed in (Options.Now), not Redis TIME, so tests can move time on
// any Redis.
//
// Provider numbers are hostile input: one call is charged at most
// Options.MaxCallTokens, and a report below zero, past it or unreadable is
// charged Conservative(reservation, faregate's own count) instead
// (Charged). Every amount a script sees is bounded to 2^53 in Go first,
// and the scripts refuse anything past it, so no counter wraps or loses
// precision in Lua's doubles. SettleCall writes the call's ledger entry in
// its own script, once, however often the script is re-sent.
//
// The package raises no alerts: results carry the first 80% crossing of a
// daily budget (Warnings) and the first refusal of a scope in a day
// (ExhaustedError.First), decided atomically in Redis so each happens once
// per scope and day across replicas.
package budget

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

var (
	// ErrExhausted reports that a scope cannot afford the amount asked for.
	// It always comes wrapped in an *ExhaustedError that names the scope.
	ErrExhausted = errors.New("budget: exhausted")
	// ErrUnavailable reports that Redis could not be asked; the caller must
	// treat it as a refusal, never as permission.
	ErrUnavailable = errors.New("budget: unavailable")
	// ErrUnknownReservation reports a settle of a reservation that never
	// existed here (or whose fields were altered). Nothing is charged.
	ErrUnknownReservation = errors.New("budget: unknown reservation")
	// ErrInvalid reports a malformed request (empty or odd identifiers, a
	// day that is not YYYY-MM-DD, a negative amount, a reused reservation id).
	ErrInvalid = errors.New("budget: invalid request")
)

// Scope names one of the budgets a reservation is charged to.
type Scope string

// The scopes, from the widest to the narrowest.
const (
	// ScopeSpend is the site's money per UTC day, in micro-units.
	ScopeSpend Scope = "spend"
	// ScopeSite is the site's tokens per UTC day.
	ScopeSite Scope = "site"
	// ScopeTier is the share of the site's tokens that a tier's principals
	// together may use per UTC day.
	ScopeTier Scope = "tier"
	// ScopePrincipal is one visitor's or API key's tokens per UTC day.
	ScopePrincipal Scope = "principal"
	// ScopeTask is one task's tokens.
	ScopeTask Scope = "task"
)

// scopeByIndex maps the scope numbers the scripts use (their KEYS order).
var scopeByIndex = [...]Scope{1: ScopeSite, 2: ScopeSpend, 3: ScopeTier, 4: ScopePrincipal, 5: ScopeTask}

// ExhaustedError names the scope that refused and what it has left.
type ExhaustedError struct {
	Scope Scope
	// Remaining is what the scope can still reserve: tokens, or
	// micro-units for ScopeSpend.
	Remaining int64
	// First is true for the scope's first refusal of the day, once across
	// replicas: the one on which to raise budget_exhausted. The task scope
	// never sets it (a task running out is routine).
	First bool

	retryAfter time.Duration
}

// Error describes the refusal without any identifier of the principal.
func (e *ExhaustedError) Error() string {
	unit := "tokens"
	if e.Scope == ScopeSpend {
		unit = "micro-units"
	}
	return fmt.Sprintf("%s: %s scope has %d %s left", ErrExhausted, e.Scope, e.Remaining, unit)
}

// Unwrap lets errors.Is(err, ErrExhausted) match.
func (e *ExhaustedError) Unwrap() error { return ErrExhausted }

// RetryAfter is how long until the scope admits again: the time to the
// next UTC midnight by the Budget's clock for the daily scopes, 0 for the
// task scope (which never refills; the task has to end).
func (e *ExhaustedError) RetryAfter() time.Duration { return e.retryAfter }

// ScopeEvent reports a daily scope crossing 80% of its limit: the moment
// to raise budget_warning. Name is the principal id or tier name (empty
// for the site scopes); Used and Limit are tokens, or micro-units for
// ScopeSpend. A visitor's principal id must not become a metric label.
type ScopeEvent struct {
	Scope       Scope
	Name        string
	Used, Limit int64
}

// Limits are the ceilings that do not depend on who asks.
type Limits struct {
	// Site is the site's tokens per UTC day (FAREGATE_DAILY_TOKEN_BUDGET).
	Site int64
	// Principal is the daily tokens of a principal whose request names no
	// limit of its own (FAREGATE_IP_DAILY_TOKENS).
	Principal int64
	// Task is one task's tokens (FAREGATE_TASK_TOKEN_LIMIT).
	Task int64
	// SpendMicro is the site's spend per UTC day in micro-units
	// (FAREGATE_DAILY_SPEND_LIMIT); 0 turns the money cap off, though spend
	// is still counted for priced models.
	SpendMicro int64
}

// DefaultLimits are used for any token limit left at zero; they match the
// defaults of FAREGATE_DAILY_TOKEN_BUDGET, FAREGATE_IP_DAILY_TOKENS and
// FAREGATE_TASK_TOKEN_LIMIT. There is no default spend limit.
var DefaultLimits = Limits{Site: 200000, Principal: 40000, Task: 12000}

// DefaultReservationTTL bounds how long an unsettled reservation holds tokens.
const DefaultReservationTTL = 3 * time.Minute

// DefaultMaxCallTokens is the most one call is ever charged, whatever the
// provider reports (FAREGATE_LLM_MAX_CALL_TOKENS's default).
const DefaultMaxCallTokens = 1_000_000

// maxExact is the largest amount a script is ever handed: Lua numbers are
// doubles, exact only up to 2^53. Go bounds every amount to it before a
// script runs, and the scripts refuse anything past it, so no counter can
// lose precision or wrap.
const maxExact = 1<<53 - 1

// dayKeyTTL keeps a day's keys for two days, so a task admitted just before
// midnight can still settle after it, and a settled id is remembered as
// long as a re-sent script could arrive.
const dayKeyTTL = 172800

// releaseRounds bounds ReleaseTask's loop: 256 reservations per script,
// far more than one task ever holds at once.
const releaseRounds = 64

// Options configure a Budget.
type Options struct {
	// Limits; zero token fields take DefaultLimits.
	Limits Limits
	// Prices of the models; a model without one costs nothing, and may not
	// be reserved at all while Limits.SpendMicro is set.
	Prices Prices
	// ReservationTTL is how long a reservation may stay unsettled before it
	// is given back; default DefaultReservationTTL.
	ReservationTTL time.Duration
	// MaxCallTokens is the ceiling of one call's charge
	// (FAREGATE_LLM_MAX_CALL_TOKENS); default DefaultMaxCallTokens.
	MaxCallTokens int64
	// Now is the clock that decides expiry and RetryAfter; default time.Now.
	Now func() time.Time
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
}

// Budget reserves and settles tokens and money in Redis.
type Budget struct {
	rdb    redis.Scripter
	limits Limits
	// prices is replaced whole by SetPrices (a policy reload); a map in
	// it is never written after it was stored.
	prices  atomic.Pointer[Prices]
	ttl     time.Duration
	maxCall int64
	now     func() time.Time
	m       *metrics
}

// New returns a Budget on rdb. redis.Scripter is the narrowest go-redis
// interface that runs scripts, and both *redis.Client and
// *redis.ClusterClient satisfy it.
func New(rdb redis.Scripter, o Options) *Budget {
	l := o.Limits
	if l.Site <= 0 {
		l.Site = DefaultLimits.Site
	}
	if l.Principal <= 0 {
		l.Principal = DefaultLimits.Principal
	}
	if l.Task <= 0 {
		l.Task = DefaultLimits.Task
	}
	l.SpendMicro = max(l.SpendMicro, 0)
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = DefaultReservationTTL
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.MaxCallTokens <= 0 || o.MaxCallTokens > maxExact {
		o.MaxCallTokens = DefaultMaxCallTokens
	}
	b := &Budget{rdb: rdb, limits: l, ttl: o.ReservationTTL, maxCall: o.MaxCallTokens, now: o.Now,
		m: newMetrics(o.Registerer, l.SpendMicro > 0)}
	b.SetPrices(o.Prices)
	return b
}

// SetPrices replaces the prices from the next Reserve, Settle or Cost on
// (a policy reload). A reservation made before is settled at the new price:
// the provider bills at the price of the moment it answers.
func (b *Budget) SetPrices(ps Prices) {
	ps = maps.Clone(ps)
	b.prices.Store(&ps)
}

// price is model's price in force, if it has one.
func (b *Budget) price(model string) (Price, bool) {
	p, ok := (*b.prices.Load())[model]
	return p, ok
}

// MaxCallTokens is the ceiling of one call's charge in force.
func (b *Budget) MaxCallTokens() int64 { return b.maxCall }

// Plausible reports whether a provider's report of prompt and completion
// tokens can be charged as it stands: neither below zero, and together at
// most the ceiling (summed without overflow).
func (b *Budget) Plausible(prompt, completion int64) bool {
	return prompt >= 0 && completion >= 0 && prompt <= b.maxCall && completion <= b.maxCall-prompt
}

// Conservative is what a call whose report cannot be believed is charged:
// the larger of what was reserved and what faregate counted itself, never
// above the ceiling.
func (b *Budget) Conservative(reserved, counted int64) int64 {
	return min(max(reserved, counted, 0), b.maxCall)
}

// Limits returns the limits in force, defaults applied.
func (b *Budget) Limits() Limits { return b.limits }

// Cost is what prompt and completion tokens of model cost in micro-units:
// 0 for a model without a price, or an error wrapping ErrUnpriced when a
// spend limit is set (such a call must not be made). The admission check
// uses it to fill AffordRequest.CostMicro.
func (b *Budget) Cost(model string, prompt, completion int64) (int64, error) {
	p, ok := b.price(model)
	if !ok {
		if b.limits.SpendMicro > 0 {
			return 0, fmt.Errorf("%w: %q while a daily spend limit is set", ErrUnpriced, model)
		}
		return 0, nil
	}
	return p.Cost(prompt, completion), nil
}

// Day is the UTC date of t as YYYY-MM-DD, the form every key uses.
func Day(t time.Time) string { return t.UTC().Format(time.DateOnly) }

// untilMidnight is the time from t to the next UTC midnight, when every
// daily scope starts afresh.
func untilMidnight(t time.Time) time.Duration {
	t = t.UTC()
	y, m, d := t.Date()
	return time.Date(y, m, d+1, 0, 0, 0, 0, time.UTC).Sub(t)
}

// Request asks to hold what one model call can cost. Day is the UTC day
// the task was admitted (see Day): a task's spending is always charged to
// that day, so all its keys share one cluster slot even when it runs past
// midnight.
type Request struct {
	// ID names the reservation; empty: 128 random bits are drawn. A caller
	// that retries a reserve itself passes the same ID, so the retry is
	// answered, not charged again.
	ID string
	// Day, Principal and Task name the scopes; identifiers are 1–128
	// characters of [A-Za-z0-9_-] (e.g. v_<hmac-hex>, k_<key id>, t_…).
	Day, Principal, Task string
	// PrincipalLimit is the principal's daily tokens (its tier's
	// tokens_per_day); 0 takes Limits.Principal.
	PrincipalLimit int64
	// Tier, when set, also charges the tier's scope; TierLimit is its cap
	// (max_site_share × site tokens), 0 = counted but not capped.
	Tier      string
	TierLimit int64
	// Model picks the price.
	Model string
	// PromptTokens (estimated) and MaxTokens (the completion cap) make the
	// hold: tokens = prompt + max, cost = prompt×input + max×output.
	PromptTokens, MaxTokens int64
}

// Reservation is a granted Request; hand it back to Settle unchanged.
type Reservation struct {
	ID, Day, Principal, Tier, Task, Model string
	// PrincipalLimit and TierLimit are the limits the reservation was
	// checked against; Settle uses them to spot an 80% crossing.
	PrincipalLimit, TierLimit int64
	// Tokens and CostMicro are what is held; PromptTokens is the prompt
	// part of Tokens (the estimate), which splits a conservative charge.
	Tokens, CostMicro int64
	PromptTokens      int64
	// Warnings lists the daily scopes this reservation took past 80%
	// first today (site, spend, tier, principal).
	Warnings []ScopeEvent
}

// Settlement is what a settle charged. Tokens and CostMicro are charged in
// every scope; the overage is the part beyond the hold (all of it when the
// hold had been given back before the settle: Late), recorded in every
// scope and counted in faregate_budget_overage_tokens_total. OverageTokens
// or OverageCostMicro > 0 is the caller's cue to raise an `overage` alert.
type Settlement struct {
	Tokens, CostMicro               int64
	OverageTokens, OverageCostMicro int64

	// Late is true when the reservation had expired or been released
	// before this settle, which then charged everything as overage.
	Late bool
	// Warnings lists the daily scopes this settle took past 80% first today.
	Warnings []ScopeEvent
}

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

// Reserve holds req's tokens and cost in every scope at once, or in none:
// it returns an *ExhaustedError naming the narrowest scope that cannot
// afford it (task, principal, tier, site tokens, site spend),
// ErrUnavailable, or ErrInvalid. A re-sent reserve (same ID and request)
// answers the first success again without holding twice.
func (b *Budget) Reserve(ctx context.Context, req Request) (Reservation, error) {
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
	r := Reservation{ID: req.ID, Day: req.Day, Principal: req.Principal, Tier: req.Tier, Task: req.Task, Model: req.Model,
		PrincipalLimit: req.PrincipalLimit, TierLimit: max(req.TierLimit, 0),
		Tokens: req.PromptTokens + req.MaxTokens, PromptTokens: req.PromptTokens, CostMicro: min(cost, maxExact)}
	if r.PrincipalLimit <= 0 {
		r.PrincipalLimit = b.limits.Principal
	}
	if r.ID == "" {
		// 128 random bits: a reservation id is never guessed nor reused.
		r.ID = "r" + rand.Text()
	}
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
	b.m.update(b.limits, v[4], v[5], v[6])
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

// Settle ends reservation r with the usage the provider reported (or the
// caller's estimate) and charges it in full in every scope, at r.Model's
// price: SettleCall with nothing but the two numbers.
func (b *Budget) Settle(ctx context.Context, r Reservation, prompt, completion int64) (Settlement, error) {
	return b.SettleCall(ctx, r, Call{PromptTokens: prompt, CompletionTokens: completion})
}

// Call is what one model call used, for SettleCall.
type Call struct {
	// PromptTokens and CompletionTokens are the provider's report, or
	// faregate's own count when the provider reported nothing.
	PromptTokens, CompletionTokens int64
	// Counted is faregate's own count of the call (its prompt estimate and
	// the output it counted): the floor of a conservative charge.
	Counted int64
	// Unreadable says the provider's report, or its whole answer, could
	// not be read as numbers at all; Raw is the report as it came (kept on
	// the ledger entry, at most maxRaw bytes).
	Unreadable bool
	Raw        string
	// Ledger, when set, is written in the same script as the settle, once
	// however often the script is sent: its token, reserve, cost and
	// overage fields are the settlement's (the caller's are ignored).
	Ledger *Entry
}

// Charged is what SettleCall charges r for call, split into prompt and
// completion tokens (what the task's usage and the ledger record), and
// whether the report was implausible: below zero, past MaxCallTokens, or
// unreadable. An implausible call is charged Conservative(r.Tokens,
// call.Counted), its prompt part at most the reserved prompt; the caller
// raises usage_implausible for it (the provider's doing, not the
// visitor's).
func (b *Budget) Charged(r Reservation, call Call) (prompt, completion int64, implausible bool) {
	prompt, completion = call.PromptTokens, call.CompletionTokens
	if !call.Unreadable && b.Plausible(prompt, completion) {
		return prompt, completion, false
	}
	total := b.Conservative(r.Tokens, call.Counted)
	prompt = min(max(r.PromptTokens, 0), total)
	return prompt, total - prompt, true
}

// maxRaw bounds the raw report a ledger entry keeps.
const maxRaw = 512

// clipRaw cuts a raw report to maxRaw bytes, at a UTF-8 boundary.
func clipRaw(s string) string {
	if len(s) <= maxRaw {
		return s
	}
	s = s[:maxRaw]
	for len(s) > 0 && !utf8.ValidString(s) {
		s = s[:len(s)-1]
	}
	return s
}

// settleAttempts is how often SettleCall sends its script when Redis does
// not answer: the script is idempotent, so a re-send never charges twice,
// and a settle that gets through gives the hold back now rather than when
// the reservation expires.
const settleAttempts = 3

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
func (b *Budget) SettleCall(ctx context.Context, r Reservation, call Call) (Settlement, error) {
	if err := validate(r.Day, r.Principal, r.Tier, r.Task); err != nil {
		return Settlement{}, err
	}
	if !validID(r.ID) || r.Tokens <= 0 || r.Tokens > maxExact || r.CostMicro < 0 || r.CostMicro > maxExact {
		return Settlement{}, fmt.Errorf("%w: settle of reservation %q holding %d tokens", ErrInvalid, r.ID, r.Tokens)
	}
	prompt, completion, implausible := b.Charged(r, call)
	// An unpriced model could only have been reserved with the spend cap
	// off, so it costs nothing here either.
	var cost int64
	if p, ok := b.price(r.Model); ok {
		cost = min(p.Cost(prompt, completion), maxExact)
	}
	plimit := r.PrincipalLimit
	if plimit <= 0 {
		plimit = b.limits.Principal
	}
	k := keysFor(r.Day, r.Principal, r.Tier, r.Task)
	args := []any{ms(b.now()), r.ID, prompt + completion, cost, info(r), dayKeyTTL,
		b.limits.Site, b.limits.SpendMicro, max(r.TierLimit, 0), plimit, flag(r.Tier != ""), 0}
	if e := call.Ledger; e != nil {
		// The raw report is kept only beside a charge that is not it.
		raw := ""
		if implausible {
			raw = clipRaw(call.Raw)
		}
		args[11] = 1
		args = append(args, ledgerMaxLen, int64(ledgerTTL/time.Second), prompt, completion, r.Tokens,
			e.Task, e.Model, e.Principal, e.RequestID, max(e.LatencyMS, 0), e.Outcome, flag(e.Estimated),
			raw, flag(implausible))
	}
	var v []int64
	var err error
	for attempt := range settleAttempts {
		if attempt > 0 {
			t := time.NewTimer(time.Duration(25<<(2*attempt)) * time.Millisecond)
			select {
			case <-ctx.Done():
				t.Stop()
				return Settlement{}, fmt.Errorf("%w: settle: %w", ErrUnavailable, err)
			case <-t.C:
			}
		}
		v, err = settleScript.Run(ctx, b.rdb, append(k.scopeKeys(), UsageKey(r.Day)), args...).Int64Slice()
		if err == nil || ctx.Err() != nil {
			break
		}
		b.m.settleRetries.Inc()
	}
	if err != nil {
		return Settlement{}, fmt.Errorf("%w: settle: %w", ErrUnavailable, err)
	}
	if len(v) != 17 {
		return Settlement{}, fmt.Errorf("%w: settle script returned %d values", ErrUnavailable, len(v))
	}
	b.m.update(b.limits, v[6], v[7], v[8])
	if v[0] == 0 {
		return Settlement{}, fmt.Errorf("%w: %s", ErrUnknownReservation, r.ID)
	}
	s := Settlement{Tokens: v[1], CostMicro: v[2], OverageTokens: v[3], OverageCostMicro: v[4], Late: v[5] == 1}
	r.PrincipalLimit = plimit
	s.Warnings = b.warnings(v[9:13], v[13:17], r)
	if implausible && v[0] == 1 {
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
	if err := validate(req.Day, req.Principal, req.Tier, req.Task); err != nil {
		return false, err
	}
	if !validID(req.ID) {
		return false, fmt.Errorf("%w: reservation id must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	v, err := withdrawScript.Run(ctx, b.rdb, keysFor(req.Day, req.Principal, req.Tier, req.Task).scopeKeys(),
		ms(b.now()), dayKeyTTL, req.ID).Int64Slice()
	if err != nil {
		return false, fmt.Errorf("%w: withdraw: %w", ErrUnavailable, err)
	}
	if len(v) != 5 {
		return false, fmt.Errorf("%w: withdraw script returned %d values", ErrUnavailable, len(v))
	}
	b.m.update(b.limits, v[2], v[3], v[4])
	return v[0] == 1, nil
}

// ReleaseTask gives back every open reservation of task (admitted on day)
// at once, in all its scopes, and returns how many it gave back. The
// reaper calls it when a task's lease lapsed: the replica that held them is
// gone. Their settles, should they still arrive, are charged as overage.
// A re-sent script (lost reply) answers the same count; calling
// ReleaseTask again finds nothing open and returns 0.
func (b *Budget) ReleaseTask(ctx context.Context, day, task string) (int64, error) {
	if err := validDay(day); err != nil {
		return 0, err
	}
	if !validID(task) {
		return 0, fmt.Errorf("%w: task must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	k := keysFor(day, "", "", task)
	var released int64
	for range releaseRounds {
		// A fresh op id per round: a re-send of this round (lost reply)
		// is answered from its record; the next round is new work.
		v, err := releaseScript.Run(ctx, b.rdb, []string{k.site, k.taskres, k.res, k.resinfo, k.done},
			ms(b.now()), dayKeyTTL, rand.Text()).Int64Slice()
		if err != nil {
			return released, fmt.Errorf("%w: release: %w", ErrUnavailable, err)
		}
		if len(v) != 5 {
			return released, fmt.Errorf("%w: release script returned %d values", ErrUnavailable, len(v))
		}
		released += v[0]
		b.m.update(b.limits, v[2], v[3], v[4])
		if v[1] == 0 {
			break
		}
	}
	return released, nil
}

// AffordRequest asks whether a principal could reserve Tokens costing
// CostMicro right now; fields mean what they mean in Request.
type AffordRequest struct {
	Day, Principal    string
	PrincipalLimit    int64
	Tier              string
	TierLimit         int64
	Tokens, CostMicro int64
}

// CanAfford reports whether the principal, its tier, the site's tokens and
// the site's spend could all hold a reservation of a.Tokens and
// a.CostMicro right now: nil, an *ExhaustedError (same precedence as
// Reserve), ErrUnavailable or ErrInvalid. It holds nothing: the admission
// check uses it to refuse a task that could not pay for even its first
// model call. It reaps expired reservations first, and a refusal sets the
// scope's once-a-day exhausted flag (ExhaustedError.First).
func (b *Budget) CanAfford(ctx context.Context, a AffordRequest) error {
	if err := validDay(a.Day); err != nil {
		return err
	}
	if !validID(a.Principal) || (a.Tier != "" && !validID(a.Tier)) {
		return fmt.Errorf("%w: principal and tier must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	if a.Tokens <= 0 || a.CostMicro < 0 {
		return fmt.Errorf("%w: can afford %d tokens costing %d", ErrInvalid, a.Tokens, a.CostMicro)
	}
	plimit := a.PrincipalLimit
	if plimit <= 0 {
		plimit = b.limits.Principal
	}
	k := keysFor(a.Day, a.Principal, a.Tier, "")
	now := b.now()
	v, err := canAffordScript.Run(ctx, b.rdb, []string{k.site, k.spend, k.tier, k.principal, k.res, k.resinfo, k.done},
		ms(now), dayKeyTTL, a.Tokens, a.CostMicro, b.limits.Site, b.limits.SpendMicro, max(a.TierLimit, 0), plimit,
		flag(a.Tier != ""),
	).Int64Slice()
	if err != nil {
		return fmt.Errorf("%w: can afford: %w", ErrUnavailable, err)
	}
	if len(v) != 7 {
		return fmt.Errorf("%w: can afford script returned %d values", ErrUnavailable, len(v))
	}
	b.m.update(b.limits, v[4], v[5], v[6])
	if v[0] != 1 {
		return b.refuse(v[1], v[2], v[3] == 1, now)
	}
	return nil
}

// ScopeUsage is one scope's state: settled (overage included), held by
// outstanding reservations, the overage part of settled, and the limit
// (0 = none). Tokens, or micro-units for the spend scope.
type ScopeUsage struct{ Settled, Outstanding, Overage, Limit int64 }

// UsageQuery names the scopes Usage reads; empty Principal, Tier or Task
// read as zero. The limits mean what they mean in Request.
type UsageQuery struct {
	Day, Principal, Tier, Task string
	PrincipalLimit, TierLimit  int64
}

// UsageReport is every scope of a UsageQuery read in one atomic step, and
// the number of the day's outstanding reservations.
type UsageReport struct {
	Site, Spend, Tier, Principal, Task ScopeUsage
	Reservations                       int64
}

// Usage reads the scopes of q (for GET /api/usage and operators) after
// reaping expired reservations.
func (b *Budget) Usage(ctx context.Context, q UsageQuery) (UsageReport, error) {
	if err := validDay(q.Day); err != nil {
		return UsageReport{}, err
	}
	// Empty names map to keys no Reserve can create, which read as zero.
	for _, id := range []string{q.Principal, q.Tier, q.Task} {
		if id != "" && !validID(id) {
			return UsageReport{}, fmt.Errorf("%w: principal, tier and task must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
		}
	}
	k := keysFor(q.Day, q.Principal, q.Tier, q.Task)
	v, err := usageScript.Run(ctx, b.rdb, []string{k.site, k.spend, k.tier, k.principal, k.task, k.res, k.resinfo, k.done},
		ms(b.now()), dayKeyTTL).Int64Slice()
	if err != nil {
		return UsageReport{}, fmt.Errorf("%w: usage: %w", ErrUnavailable, err)
	}
	if len(v) != 16 {
		return UsageReport{}, fmt.Errorf("%w: usage script returned %d values", ErrUnavailable, len(v))
	}
	plimit := q.PrincipalLimit
	if plimit <= 0 {
		plimit = b.limits.Principal
	}
	su := func(i int, limit int64) ScopeUsage {
		return ScopeUsage{Settled: v[3*i], Outstanding: v[3*i+1], Overage: v[3*i+2], Limit: limit}
	}
	rep := UsageReport{Site: su(0, b.limits.Site), Spend: su(1, b.limits.SpendMicro), Tier: su(2, max(q.TierLimit, 0)),
		Principal: su(3, plimit), Task: su(4, b.limits.Task), Reservations: v[15]}
	if q.Tier == "" {
		rep.Tier.Limit = 0
	}
	b.m.update(b.limits, rep.Site.Settled+rep.Site.Outstanding, rep.Spend.Settled+rep.Spend.Outstanding, rep.Reservations)
	return rep, nil
}

// refuse turns a refusal into an *ExhaustedError and counts it.
func (b *Budget) refuse(scope, remaining int64, first bool, now time.Time) error {
	if scope < 1 || scope >= int64(len(scopeByIndex)) {
		return fmt.Errorf("%w: script named scope %d", ErrUnavailable, scope)
	}
	s := scopeByIndex[scope]
	b.m.refusals.WithLabelValues(string(s)).Inc()
	e := &ExhaustedError{Scope: s, Remaining: remaining, First: first}
	if s != ScopeTask {
		e.retryAfter = untilMidnight(now)
	}
	return e
}

// warnings turns the scripts' four warning flags (site, spend, tier,
// principal) and used values into events.
func (b *Budget) warnings(flags, used []int64, r Reservation) []ScopeEvent {
	var out []ScopeEvent
	for i, f := range flags {
		if f != 1 {
			continue
		}
		e := ScopeEvent{Scope: scopeByIndex[i+1], Used: used[i]}
		switch e.Scope {
		case ScopeSite:
			e.Limit = b.limits.Site
		case ScopeSpend:
			e.Limit = b.limits.SpendMicro
		case ScopeTier:
			e.Name, e.Limit = r.Tier, r.TierLimit
		case ScopePrincipal:
			e.Name, e.Limit = r.Principal, r.PrincipalLimit
		}
		out = append(out, e)
	}
	return out
}

// validate checks the identifiers that become parts of Redis keys; tier
// may be empty (no tier scope).
func validate(day, principal, tier, task string) error {
	if err := validDay(day); err != nil {
		return err
	}
	if !validID(principal) || !validID(task) || (tier != "" && !validID(tier)) {
		return fmt.Errorf("%w: principal, tier and task must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	return nil
}

func validDay(day string) error {
	if t, err := time.Parse(time.DateOnly, day); err != nil || t.Format(time.DateOnly) != day {
		return fmt.Errorf("%w: day %q is not YYYY-MM-DD", ErrInvalid, day)
	}
	return nil
}

// validID admits what principal ids, tier names, task and reservation ids
// look like. Keeping "|" and ":" out matters: resinfo stores
// "tokens|cost|principal|tier|task|model" and the reaper splits on "|",
// and a colon could forge another key's name. Refusing dots and colons
// also keeps a raw IP address (instead of its HMAC) out of Redis.
func validID(s string) bool {
	if s == "" || len(s) > 128 {
		return false
	}
	for _, c := range []byte(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// info is what resinfo stores for a reservation: enough to give it back to
// exactly its own scopes, and to recognise the same reservation when a
// reserve or settle is re-sent. The model comes last, so it may contain
// any character.
func info(r Reservation) string {
	return strconv.FormatInt(r.Tokens, 10) + "|" + strconv.FormatInt(r.CostMicro, 10) + "|" +
		r.Principal + "|" + r.Tier + "|" + r.Task + "|" + r.Model
}

func flag(b bool) int {
	if b {
		return 1
	}
	return 0
}

func ms(t time.Time) int64 { return t.UnixMilli() }
