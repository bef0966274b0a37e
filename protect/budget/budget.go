// Package budget caps what model calls may cost, in tokens and in money,
// in five scopes at once: the site's tokens per UTC day, the site's spend
// per UTC day, a tier's share of the site's tokens per day, each
// principal's tokens per day (a visitor or an API key) and each task.
//
// Before a model call the caller reserves the most the call can cost
// (estimated prompt tokens + max_tokens, and what they cost at the model's
// price) in every scope, or is refused. After the call it settles the
// reservation with the usage the provider reported: the hold comes back
// and the actual usage is charged in full, even above the hold; the
// excess is recorded as overage. In every scope, at every instant, Redis
// holds
//
//	settled + outstanding − overage ≤ limit,
//
// and a scope that overage pushed over its limit refuses the next
// reservation at once.
//
// Where the keys live (layout.go). A principal's scope, its tasks' and
// their reservations carry the hash tag of the principal's bucket, so the
// per-call scripts spread over every master of a cluster; the day's
// scopes (site tokens, site money, each tier's share) keep the day's tag.
//
// Leased blocks (lease.go, Options.Lease). A replica does not ask the
// day's slot on every call: it leases a block of each day scope it
// spends from, an amount Redis counts as outstanding (so the invariant
// above holds in Redis at every instant), and admits a call locally only
// within the unspent part of its blocks in every day scope the call
// touches. What its calls spend it reports when it renews or returns the
// lease. A lease expires by Redis's clock; the replica stops using it a
// margin before; a dead replica's lease is charged what it still held
// when it expires, never earlier. Blocks shrink with the headroom, and
// near a limit (headroom below replicas × the largest reservation) a
// scope falls back to a reservation per call in the day's slot, sent at
// once with the principal's. A call's reservation is then one script per
// slot it touches, and its critical path at most two round trips.
//
// Group commit (commit.go). The operations one replica sends to one slot
// while a script of its own is on its way there go together in the next
// script; a settle and its ledger entry are still one atomic step.
//
// Operations are idempotent, because a client may re-send a script whose
// reply was lost: a reservation id is made before the call, a re-sent
// reserve answers the first success again and a re-sent settle answers
// the first settlement again; neither charges twice. A lease report
// carries a sequence number for the same reason.
//
// A reservation that is never settled (the process died) expires after
// Options.ReservationTTL and is given back, exactly once, by the reaper of
// its slot (which runs at most once a second per slot, in the scripts
// that touch it); ReleaseTask gives back a task's open reservations at
// once (its lease lapsed). A settle that arrives after either is charged
// in full, all of it as overage. Reservations expire by the clock passed
// in (Options.Now), so tests can move time on any Redis; leases by
// Redis's.
//
// Provider numbers are hostile input: one call is charged at most
// Options.MaxCallTokens, a report below zero, past it or unreadable is
// charged Conservative(reservation, faregate's own count) instead, and a
// report below faregate's own count of what passed is charged that count
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
	"errors"
	"fmt"
	"maps"
	"strconv"
	"sync"
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
	// Now is the clock that decides a reservation's expiry and
	// RetryAfter; default time.Now. Leases expire by Redis's clock.
	Now func() time.Time
	// Lease configures leased blocks of the day's scopes; the zero value
	// reserves every call in the day's slot.
	Lease LeaseOptions
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
	// Ledger shapes the entries SettleCall writes (its stream's length,
	// export groups) and hears what they did (LedgerOptions.Watch); nil:
	// the default shape, no export groups known.
	Ledger *Ledger
}

// Budget reserves and settles tokens and money in Redis.
type Budget struct {
	rdb     redis.Scripter
	cluster bool // rdb is a cluster client: one committer per slot
	limits  Limits
	// prices is replaced whole by SetPrices (a policy reload); a map in
	// it is never written after it was stored.
	prices  atomic.Pointer[Prices]
	ttl     time.Duration
	maxCall int64
	now     func() time.Time
	m       *metrics
	ledger  *Ledger

	layouts    layouts
	expiries   expiries
	dayUse     dayUse
	commitMu   sync.Mutex
	committers map[string]*committer
	// leases is nil while leasing is off.
	leases *leases
	// open are this replica's open reservations of layout 2: what a settle
	// or withdraw gives back locally, and how.
	open openSet
}

// errNoRedis is what an operation of a Budget made without Redis answers.
var errNoRedis = errors.New("no Redis client")

// New returns a Budget on rdb: a *redis.Client, or a *redis.ClusterClient
// (whose operations then go to each slot on their own). Call Close when
// the replica stops, to give its leased blocks back.
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
	if o.Ledger == nil {
		o.Ledger = OpenLedger(nil, LedgerOptions{})
	}
	b := &Budget{rdb: rdb, limits: l, ttl: o.ReservationTTL, maxCall: o.MaxCallTokens, now: o.Now,
		m: newMetrics(o.Registerer, l.SpendMicro > 0), ledger: o.Ledger, committers: map[string]*committer{}}
	b.open.m = map[string]*openRes{}
	if _, ok := rdb.(*redis.ClusterClient); ok {
		b.cluster = true
	}
	b.SetPrices(o.Prices)
	if o.Lease.Calls > 0 && rdb != nil {
		b.leases = newLeases(b, o.Lease)
	}
	return b
}

// Close gives back the unspent part of every block this replica leased,
// reporting what its calls spent, and stops its background work; ctx
// bounds how long it tries. A lease it could not give back is charged
// what it holds when it expires. Close of a Budget without leases does
// nothing.
func (b *Budget) Close(ctx context.Context) error {
	if b.leases == nil {
		return nil
	}
	return b.leases.close(ctx)
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
	// PromptCache says the provider may bill the prompt at its cache
	// prices (Anthropic's Messages): its money is reserved at the dearest
	// of them (Price.ReserveCost), so the settle's cache writes never cost
	// more than was held.
	PromptCache bool
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

	// how holds the reservation's part in the day's scopes: in this
	// replica's leased blocks, in the day's slot, or in layout 1.
	how holding
	// replica is the Budget that made it (a leased hold is its own).
	replica string
}

// holding says where a reservation's part in the day's scopes is held.
type holding byte

const (
	heldUnknown holding = iota // not made by Reserve: the day's layout decides
	heldLegacy                 // layout 1: one script holds every scope
	heldLease                  // in the replica's leased blocks
	heldDirect                 // per call, in the day's slot
)

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
	// CountedPrompt and CountedOutput are faregate's own count of what
	// passed to the provider and back (the prompt's text, the output
	// relayed), which a report is judged against (Charged); 0 when it
	// counted nothing. Exact says they were counted with the model's own
	// tokenizer; otherwise they are the conservative bound, which may
	// count up to about twice what the model's tokenizer would.
	CountedPrompt, CountedOutput int64
	Exact                        bool
	// Unreadable says the provider's report, or its whole answer, could
	// not be read as numbers at all; Raw is the report as it came (kept on
	// the ledger entry, at most maxRaw bytes).
	Unreadable bool
	Raw        string
	// CacheWrite, CacheWrite1h and CacheRead are the parts of PromptTokens
	// the provider reported as written to its prompt cache (CacheWrite1h:
	// of them, for an hour) and read from it, priced apart (Price.CostOf);
	// bounded by the prompt charged, the rest of which is input.
	CacheWrite, CacheWrite1h, CacheRead int64
	// Ledger, when set, is written in the same script as the settle, once
	// however often the script is sent: its token, reserve, cost and
	// overage fields are the settlement's (the caller's are ignored).
	Ledger *Entry
}

// tokens is what the charge of prompt and completion tokens is priced as:
// the cache parts of the report, each bounded by what is left of the
// prompt (a report's cache may not exceed the prompt it is part of), the
// rest input.
func (c Call) tokens(prompt, completion int64) Tokens {
	cw := min(max(c.CacheWrite, 0), max(prompt, 0))
	cr := min(max(c.CacheRead, 0), max(prompt, 0)-cw)
	return Tokens{Input: max(prompt, 0) - cw - cr, CacheWrite: cw, CacheWrite1h: min(max(c.CacheWrite1h, 0), cw),
		CacheRead: cr, Output: completion}
}

// farBelowTokens is how far a report may fall under faregate's own count
// before it is doubted, beside falling under half of it: a cached prompt a
// provider does not bill, or a tokenizer that counts a little differently,
// stays believable; a stream of 2,000 tokens reported as 0 does not.
const farBelowTokens = 1000

// Charged is what SettleCall charges r for call, split into prompt and
// completion tokens (what the task's usage and the ledger record), and
// whether the report was implausible. The rules, for the prompt and the
// output each:
//
//   - a report below zero, past MaxCallTokens (the two summed) or
//     unreadable is not charged at all: the call is charged
//     Conservative(r.Tokens, call.Counted), its prompt part at most the
//     reserved prompt;
//   - counted with the model's own tokenizer (Exact), the larger of the
//     report and the count is charged: a provider cannot bill less than
//     what faregate saw pass;
//   - counted with the conservative bound only, the report is believed
//     unless it is under half the count and more than farBelowTokens
//     under it; then the count is charged.
//
// Either way a report under half the count and more than farBelowTokens
// under it is implausible: the caller keeps the raw report on the ledger
// and raises usage_implausible (the provider's doing, not the visitor's).
// The charge never passes MaxCallTokens.
func (b *Budget) Charged(r Reservation, call Call) (prompt, completion int64, implausible bool) {
	prompt, completion = call.PromptTokens, call.CompletionTokens
	if call.Unreadable || !b.Plausible(prompt, completion) {
		total := b.Conservative(r.Tokens, call.Counted)
		prompt = min(max(r.PromptTokens, 0), total)
		return prompt, total - prompt, true
	}
	prompt, lowPrompt := judgeReport(prompt, call.CountedPrompt, call.Exact)
	completion, lowOutput := judgeReport(completion, call.CountedOutput, call.Exact)
	prompt = min(prompt, b.maxCall)
	completion = min(completion, b.maxCall-prompt)
	return prompt, completion, lowPrompt || lowOutput
}

// judgeReport is what one part of a call is charged given the provider's
// report and faregate's count (Charged's rules), and whether the report
// was far below the count. Both are at least 0 here.
func judgeReport(report, counted int64, exact bool) (int64, bool) {
	counted = max(counted, 0)
	far := report < counted-report && counted-report > farBelowTokens
	switch {
	case exact:
		return max(report, counted), far
	case far:
		return counted, true
	}
	return report, false
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

// AffordRequest asks whether a principal could reserve Tokens costing
// CostMicro right now; fields mean what they mean in Request.
type AffordRequest struct {
	Day, Principal    string
	PrincipalLimit    int64
	Tier              string
	TierLimit         int64
	Tokens, CostMicro int64
}

// ScopeUsage is one scope's state: settled (overage included); held by
// outstanding reservations and leased blocks; the part of outstanding
// that leased blocks hold (spent but not yet reported by their replica, or
// unspent); the overage part of settled; and the limit (0 = none). Tokens,
// or micro-units for money.
type ScopeUsage struct{ Settled, Outstanding, Leased, Overage, Limit int64 }

// UsageQuery names the scopes Usage reads; empty Principal, Tier or Task
// read as zero. The limits mean what they mean in Request.
type UsageQuery struct {
	Day, Principal, Tier, Task string
	PrincipalLimit, TierLimit  int64
}

// UsageReport is every scope of a UsageQuery. The day's scopes are read
// in one atomic step and the principal's and task's in another (on a
// cluster they live on different masters). PrincipalSpend and TaskSpend
// are their money, counted from layout 2 on. Reservations counts the
// principal's open reservations (with no principal named, the day's open
// direct ones); Leases the live leases of the day's scopes; Layout is the
// day's key layout (layout.go).
type UsageReport struct {
	Site, Spend, Tier, Principal, Task ScopeUsage
	PrincipalSpend, TaskSpend          ScopeUsage
	Reservations, Leases               int64
	Layout                             int
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
