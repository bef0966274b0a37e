// Package budget caps what model calls may cost, in tokens, in three scopes
// at once: the whole site per UTC day, each visitor per UTC day and each task.
//
// Before a model call the caller reserves the most the call can cost
// (estimated prompt tokens + max_tokens) in all three scopes in one atomic
// Redis script, or is refused. After the call it settles the reservation with
// the usage the provider reported, and the unused part comes back. Checking
// and charging in one script is what keeps concurrent requests and replicas
// from overspending: at every instant, in every scope,
// settled + outstanding reservations ≤ limit.
//
// A reservation that is never settled (the process died) expires after
// Options.ReservationTTL and is given back, exactly once, by whichever
// script runs next for that day. Expiry follows the clock passed in
// (Options.Now), not Redis TIME, so tests can move time on any Redis.
package budget

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strconv"
	"time"

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
	// ErrUnknownReservation reports a settle of a reservation that does not
	// exist, has expired and been given back, or was already settled.
	ErrUnknownReservation = errors.New("budget: unknown reservation")
	// ErrInvalid reports a malformed request (empty or odd identifiers, a
	// day that is not YYYY-MM-DD, an amount ≤ 0, a negative actual).
	ErrInvalid = errors.New("budget: invalid request")
)

// Scope names one of the three budgets.
type Scope string

// The three scopes a reservation is charged to.
const (
	ScopeSite    Scope = "site"
	ScopeVisitor Scope = "visitor"
	ScopeTask    Scope = "task"
)

// scopeByIndex maps the scope numbers the Lua scripts return (KEYS order).
var scopeByIndex = map[int64]Scope{1: ScopeSite, 2: ScopeVisitor, 3: ScopeTask}

// ExhaustedError names the scope that refused and what it has left.
type ExhaustedError struct {
	Scope     Scope
	Remaining int64
}

// Error describes the refusal without any identifier of the visitor.
func (e *ExhaustedError) Error() string {
	return fmt.Sprintf("%s: %s scope has %d tokens left", ErrExhausted, e.Scope, e.Remaining)
}

// Unwrap lets errors.Is(err, ErrExhausted) match.
func (e *ExhaustedError) Unwrap() error { return ErrExhausted }

// Limits are the token ceilings of the three scopes.
type Limits struct{ Site, Visitor, Task int64 }

// DefaultLimits are used for any limit left at zero; they match the defaults
// of FAREGATE_DAILY_TOKEN_BUDGET, FAREGATE_IP_DAILY_TOKENS and
// FAREGATE_TASK_TOKEN_LIMIT.
var DefaultLimits = Limits{Site: 200000, Visitor: 40000, Task: 12000}

// DefaultReservationTTL bounds how long an unsettled reservation holds tokens.
const DefaultReservationTTL = 3 * time.Minute

// dayKeyTTL keeps a day's keys for two days, so a task admitted just before
// midnight can still settle after it.
const dayKeyTTL = 172800

// Options configure a Budget.
type Options struct {
	// Limits of the three scopes; zero fields take DefaultLimits.
	Limits Limits
	// ReservationTTL is how long a reservation may stay unsettled before it
	// is given back; default DefaultReservationTTL.
	ReservationTTL time.Duration
	// Now is the clock that decides expiry; default time.Now.
	Now func() time.Time
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
}

// Budget reserves and settles tokens in Redis.
type Budget struct {
	rdb    redis.Scripter
	limits Limits
	ttl    time.Duration
	now    func() time.Time
	m      *metrics
}

// New returns a Budget on rdb. redis.Scripter is the narrowest go-redis
// interface that runs scripts, and both *redis.Client and
// *redis.ClusterClient satisfy it.
func New(rdb redis.Scripter, o Options) *Budget {
	l := o.Limits
	if l.Site <= 0 {
		l.Site = DefaultLimits.Site
	}
	if l.Visitor <= 0 {
		l.Visitor = DefaultLimits.Visitor
	}
	if l.Task <= 0 {
		l.Task = DefaultLimits.Task
	}
	if o.ReservationTTL <= 0 {
		o.ReservationTTL = DefaultReservationTTL
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Budget{rdb: rdb, limits: l, ttl: o.ReservationTTL, now: o.Now, m: newMetrics(o.Registerer)}
}

// Limits returns the limits in force, defaults applied.
func (b *Budget) Limits() Limits { return b.limits }

// Day is the UTC date of t as YYYY-MM-DD, the form every key uses.
func Day(t time.Time) string { return t.UTC().Format(time.DateOnly) }

// Request asks for Amount tokens for one model call. Day is the UTC day the
// task was admitted (see Day): a task's spending is always charged to that
// day, so all its keys share one cluster slot even when it runs past midnight.
type Request struct {
	Day, Visitor, Task string
	Amount             int64
}

// Reservation is a granted Request; hand it back to Settle unchanged.
type Reservation struct {
	ID, Day, Visitor, Task string
	Amount                 int64
}

// ScopeUsage is one scope's state: settled tokens, tokens held by
// outstanding reservations, and its limit.
type ScopeUsage struct{ Settled, Outstanding, Limit int64 }

// keys are the Redis keys of one day, visitor and task.
type keys struct{ site, visitor, task, res, resinfo string }

func keysFor(day, visitor, task string) keys {
	p := "faregate:budget:{" + day + "}:"
	return keys{site: p + "site", visitor: p + "ip:" + visitor, task: p + "task:" + task, res: p + "res", resinfo: p + "resinfo"}
}

// Reserve holds req.Amount tokens in the site, visitor and task scopes at
// once, or in none: it returns an *ExhaustedError (wrapping ErrExhausted)
// naming the narrowest scope that cannot afford it, or ErrUnavailable.
func (b *Budget) Reserve(ctx context.Context, req Request) (Reservation, error) {
	if err := validate(req.Day, req.Visitor, req.Task); err != nil {
		return Reservation{}, err
	}
	if req.Amount <= 0 {
		return Reservation{}, fmt.Errorf("%w: amount %d must be positive", ErrInvalid, req.Amount)
	}
	// 128 random bits: a reservation id is never guessed nor reused.
	id := "r" + rand.Text()
	k := keysFor(req.Day, req.Visitor, req.Task)
	now := b.now()
	res, err := reserveScript.Run(ctx, b.rdb,
		[]string{k.site, k.visitor, k.task, k.res, k.resinfo},
		ms(now), ms(now.Add(b.ttl)), id, req.Amount,
		b.limits.Site, b.limits.Visitor, b.limits.Task, dayKeyTTL,
		info(req.Amount, req.Visitor, req.Task),
	).Int64Slice()
	if err != nil {
		return Reservation{}, fmt.Errorf("%w: reserve: %w", ErrUnavailable, err)
	}
	r, err := b.observe(res)
	if err != nil {
		return Reservation{}, err
	}
	if r.ok != 1 {
		return Reservation{}, b.refuse(r)
	}
	return Reservation{ID: id, Day: req.Day, Visitor: req.Visitor, Task: req.Task, Amount: req.Amount}, nil
}

// Settle ends a reservation with the usage the provider reported and
// returns what was charged: min(actual, reserved). The reservation is the
// hard cap by design: charging more than was reserved could push a scope
// over its limit after the fact, which the invariant forbids; the caller
// records the real usage, overage included, in the Ledger instead.
// A reservation that is unknown, expired (already given back) or already
// settled yields ErrUnknownReservation and charges nothing.
func (b *Budget) Settle(ctx context.Context, r Reservation, actual int64) (int64, error) {
	if err := validate(r.Day, r.Visitor, r.Task); err != nil {
		return 0, err
	}
	if r.ID == "" || r.Amount <= 0 || actual < 0 {
		return 0, fmt.Errorf("%w: settle of reservation %q with actual %d", ErrInvalid, r.ID, actual)
	}
	k := keysFor(r.Day, r.Visitor, r.Task)
	res, err := settleScript.Run(ctx, b.rdb,
		[]string{k.site, k.visitor, k.task, k.res, k.resinfo},
		ms(b.now()), r.ID, actual, info(r.Amount, r.Visitor, r.Task), dayKeyTTL,
	).Int64Slice()
	if err != nil {
		return 0, fmt.Errorf("%w: settle: %w", ErrUnavailable, err)
	}
	o, err := b.observe(res)
	if err != nil {
		return 0, err
	}
	if o.ok != 1 {
		return 0, fmt.Errorf("%w: %s", ErrUnknownReservation, r.ID)
	}
	return o.value, nil
}

// CanAfford reports whether the site and the visitor could both reserve
// amount right now: nil, an *ExhaustedError (visitor named first) or
// ErrUnavailable. It reserves nothing; the admission check uses it to refuse
// a task that could not pay for even its first model call.
func (b *Budget) CanAfford(ctx context.Context, day, visitor string, amount int64) error {
	if err := validDay(day); err != nil {
		return err
	}
	if !validID(visitor) {
		return fmt.Errorf("%w: visitor identifier", ErrInvalid)
	}
	if amount <= 0 {
		return fmt.Errorf("%w: amount %d must be positive", ErrInvalid, amount)
	}
	k := keysFor(day, visitor, "")
	res, err := canAffordScript.Run(ctx, b.rdb,
		[]string{k.site, k.visitor, k.res, k.resinfo},
		ms(b.now()), amount, b.limits.Site, b.limits.Visitor,
	).Int64Slice()
	if err != nil {
		return fmt.Errorf("%w: can afford: %w", ErrUnavailable, err)
	}
	r, err := b.observe(res)
	if err != nil {
		return err
	}
	if r.ok != 1 {
		return b.refuse(r)
	}
	return nil
}

// Usage reads the three scopes and the number of outstanding reservations
// of the day in one atomic step. An empty visitor or task reads as zero.
func (b *Budget) Usage(ctx context.Context, day, visitor, task string) (site, vis, tsk ScopeUsage, outstandingReservations int64, err error) {
	if err := validDay(day); err != nil {
		return site, vis, tsk, 0, err
	}
	// Empty names map to keys no Reserve can create, which read as zero.
	if (visitor != "" && !validID(visitor)) || (task != "" && !validID(task)) {
		return site, vis, tsk, 0, fmt.Errorf("%w: visitor or task identifier", ErrInvalid)
	}
	k := keysFor(day, visitor, task)
	res, err := usageScript.Run(ctx, b.rdb,
		[]string{k.site, k.visitor, k.task, k.res, k.resinfo}, ms(b.now()),
	).Int64Slice()
	if err != nil {
		return site, vis, tsk, 0, fmt.Errorf("%w: usage: %w", ErrUnavailable, err)
	}
	if len(res) != 7 {
		return site, vis, tsk, 0, fmt.Errorf("%w: usage script returned %d values", ErrUnavailable, len(res))
	}
	site = ScopeUsage{Settled: res[0], Outstanding: res[1], Limit: b.limits.Site}
	vis = ScopeUsage{Settled: res[2], Outstanding: res[3], Limit: b.limits.Visitor}
	tsk = ScopeUsage{Settled: res[4], Outstanding: res[5], Limit: b.limits.Task}
	b.m.update(b.limits.Site-res[0]-res[1], res[6])
	return site, vis, tsk, res[6], nil
}

// result is the common shape the reserve, settle and can-afford scripts return.
type result struct{ ok, scope, value, siteSettled, siteOutstanding, reservations int64 }

// observe decodes a script result and refreshes the gauges from it, so the
// metrics follow every operation without extra round trips.
func (b *Budget) observe(v []int64) (result, error) {
	if len(v) != 6 {
		return result{}, fmt.Errorf("%w: script returned %d values", ErrUnavailable, len(v))
	}
	r := result{ok: v[0], scope: v[1], value: v[2], siteSettled: v[3], siteOutstanding: v[4], reservations: v[5]}
	b.m.update(b.limits.Site-r.siteSettled-r.siteOutstanding, r.reservations)
	return r, nil
}

// refuse turns a refusal result into an *ExhaustedError and counts it.
func (b *Budget) refuse(r result) error {
	s, ok := scopeByIndex[r.scope]
	if !ok {
		return fmt.Errorf("%w: script named scope %d", ErrUnavailable, r.scope)
	}
	b.m.refusals.WithLabelValues(string(s)).Inc()
	return &ExhaustedError{Scope: s, Remaining: r.value}
}

// validate checks the identifiers that become parts of Redis keys.
func validate(day, visitor, task string) error {
	if err := validDay(day); err != nil {
		return err
	}
	if !validID(visitor) || !validID(task) {
		return fmt.Errorf("%w: visitor and task must be 1-128 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	return nil
}

func validDay(day string) error {
	if t, err := time.Parse(time.DateOnly, day); err != nil || t.Format(time.DateOnly) != day {
		return fmt.Errorf("%w: day %q is not YYYY-MM-DD", ErrInvalid, day)
	}
	return nil
}

// validID admits what visitor HMACs and task ids look like. Keeping "|" and
// ":" out matters: resinfo stores "amount|visitor|task" and the reaper
// splits on "|", and a colon could forge another key's name. Refusing dots
// and colons also keeps a raw IP address (instead of its HMAC) out of Redis.
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
// exactly its own three scopes.
func info(amount int64, visitor, task string) string {
	return strconv.FormatInt(amount, 10) + "|" + visitor + "|" + task
}

func ms(t time.Time) int64 { return t.UnixMilli() }
