// Package govern is the governed model call: one implementation of every
// guarantee a model call has, for the built-in planner (agent) and for
// the model endpoint an operator's own agent calls (agent/gateway). A
// caller describes the call (Spec), hands Call an attempt function that
// makes it on the model the governor chooses (Attempt) and reports what
// passed (Outcome); Call returns what the call came to (Result). The
// order of a call is in Governor's doc, the order of its bookings in
// bookings; the rules of what is charged in chargeOf and budget.Charged.
package govern

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/randhex"
	"faregate/protect/kit/redisbatch"
	"faregate/protect/ratelimit"
)

// Governor makes governed model calls. Each Call passes, in this order:
//
//	the caller's hold (the model endpoint's task slot)
//	→ the principal's tokens-per-minute bucket, hourly tokens and
//	  input-spike check
//	→ the reservation (task, principal, tier share, site tokens, money)
//	→ the site's tokens-per-minute pacing
//	→ the breaker and the fallback (Models.Do)
//	→ the attempt (the caller's function, which streams and cuts at
//	  Attempt.MaxOutput)
//	→ the settle, with the ceiling rules of budget.Charged, whose script
//	  also writes the ledger entry (once, idempotently)
//	→ the buckets' settlement with what was charged.
//
// None of the checks before the breaker counts towards opening it, and a
// call refused by any of them spends nothing and leaves no ledger entry.
// The caller writes the call's step (it knows what to say about the
// reply: Spec.After, in the settle's round trip); Result carries what it
// needs.
type Governor struct {
	cfg     Config
	d       Deps // defaults applied
	metrics *metrics
}

// Principal is a task's principal as the budget scopes need it.
type Principal struct {
	// ID is the visitor's (v_<hmac>) or API key's (k_<id>) principal id.
	ID string
	// Day is the UTC day the task was admitted: every scope of its calls
	// is charged to it.
	Day string
	// TokensPerDay is the principal's daily tokens (0: the default);
	// TokensPerMinute its bucket's rate (0: no bucket).
	TokensPerDay, TokensPerMinute int64
	// Tier and TierTokens are the tier's share of the site's tokens
	// (TierTokens 0: no tier scope).
	Tier       string
	TierTokens int64
	// TokensPerHour is the principal's sliding hour of tokens (0: none),
	// and SoftTokens the use from which its calls go to the fallback model
	// first.
	TokensPerHour, SoftTokens int64
}

// PrincipalOf is a task record's principal.
func PrincipalOf(rec *task.Record) Principal {
	return Principal{ID: rec.Principal, Day: rec.Day, TokensPerDay: rec.Limits.TokensPerDay,
		TokensPerMinute: rec.Limits.TokensPerMinute, Tier: rec.Tier, TierTokens: rec.Limits.TierTokens,
		TokensPerHour: rec.Limits.TokensPerHour, SoftTokens: rec.Limits.SoftTokens}
}

// Spec is one governed call. The task scope is Budget's task limit
// (FAREGATE_TASK_TOKEN_LIMIT): an external agent's calls are held to it by
// the same reservation as the planner's.
type Spec struct {
	TaskID, RequestID string
	Principal         Principal
	// PromptCache says the provider may bill the prompt at cache prices
	// (budget.Request.PromptCache).
	PromptCache bool
	// Kind is "chat" (default), "responses" or "embeddings": the span's
	// operation.
	Kind string
	// Model is the model asked for; Models decides which one answers
	// (primary, or the fallback), and Attempt says which.
	Model string
	// PromptTokens is faregate's estimate of the prompt; Estimate, when
	// set, re-counts it for the model an attempt goes to (the fallback may
	// count differently).
	PromptTokens int64
	Estimate     func(model string) int64
	// MaxOutput is the output asked for; 0 or more than Config.MaxTokens
	// is Config.MaxTokens.
	MaxOutput int64
	// NoOutput marks a call that produces no output tokens (embeddings):
	// it reserves its prompt only, and is never shrunk to fit (Closing
	// does not apply).
	NoOutput bool
	// Closing lets a call the budget cannot afford in full go ahead with
	// the output a token scope has left, if that is at least MinOutput
	// (0: 256 tokens): the planner's last call ends a run with what it
	// has; the model endpoint sets MinOutput 1 (a call that cannot afford
	// its prompt and one output token is refused).
	Closing   bool
	MinOutput int64
	// LowPrecision sends the call to the fallback first (degraded AI
	// traffic).
	LowPrecision bool
	// Label names the call in logs (the caller's step).
	Label string
	// Logger, when set, is the call's logger (with the task's attributes).
	Logger *slog.Logger
	// Hold, when set, is the caller's own booking for the call (the model
	// endpoint's per-task call count and parallel slot, its step): the
	// Governor sends it with its own bookings, in the same round trip, and
	// takes its answer first (a refusal is returned as it is, and what was
	// booked beside it is given back). The end it returns is called once:
	// with the settle, in its round trip, when an attempt answered; else
	// with the give-back when the call is refused or fails after the hold.
	// Without a budget that can withdraw a reserve it is asked first, on
	// its own.
	Hold func(ctx context.Context) (end HoldEnd, err error)
	// After, when set, is the caller's own write once the call is over
	// (the model endpoint's step), told how it ended like a HoldEnd: it
	// runs beside the settle, in its round trip, or beside the give-back;
	// never when the Hold refused the call.
	After HoldEnd
}

// HoldEnd ends a Spec.Hold, told how the call ended: out as Call returns
// it (Model, Charged, Waited filled in), err nil when an attempt answered.
// It must not block longer than its own Redis work.
type HoldEnd func(ctx context.Context, res Result, err error)

// Attempt is one try on one model, under a reservation.
type Attempt struct {
	// Model is the model to use now: its chat.Model for the built-in
	// planner, its upstream (BaseURL, APIKey, HTTPClient) for a raw relay.
	Model Model
	// Fallback is true when Model is not the primary.
	Fallback bool
	// PromptTokens is the prompt the reservation holds; MaxOutput the
	// output it covers (clamped to Config.MaxTokens and to what the
	// budget could hold): the attempt cuts its stream there.
	PromptTokens, MaxOutput int64
	// FirstEvent is called when the answer's first event arrives (a
	// stream's first chunk); the breaker judges slowness on the wait for
	// it, never on the answer's length. An attempt whose answer comes
	// whole (JSON) does not call it. Never nil; safe from any goroutine.
	FirstEvent func()
}

// Usage is what a provider reported a call used, or what was counted in
// its place.
type Usage struct {
	// Prompt and Completion are tokens; Completion includes reasoning.
	Prompt, Completion int64
	// Reported: the provider sent a usage object. False: Prompt and
	// Completion are the attempt's own count.
	Reported bool
	// Unreadable: the provider sent a usage object that does not say in
	// numbers what was used (a string for a count, a count missing): it is
	// Reported, its counts are the attempt's own, and it is charged as an
	// unbelievable report is (budget.Charged).
	Unreadable bool
	// Raw is the provider's usage JSON as received (bounded), for the
	// ledger.
	Raw string
	// Reasoning is the part of Completion reported as reasoning;
	// CacheCreation and CacheRead the parts of Prompt reported written to
	// and read from the provider's prompt cache (priced apart),
	// CacheCreation1h the part of CacheCreation cached for an hour. 0
	// where none is reported; the ledger carries them to billing.
	Reasoning, CacheCreation, CacheCreation1h, CacheRead int64
}

// Outcome is what an attempt reports, and what Call returns.
type Outcome struct {
	// Usage is the provider's report (Reported false: none came).
	Usage Usage
	// Counted is faregate's own count of the output (content, tool-call
	// arguments and reasoning alike).
	Counted int64
	// Truncated is true when the attempt cut the stream at MaxOutput; Cut
	// names why a stream was cut (codes.OutputTruncated,
	// codes.OutputLoop), "" when it was not (Truncated alone means
	// WarnOutputTruncated).
	Truncated bool
	Cut       string
	// Started is true once output reached the caller's client: the call
	// is then never retried on the fallback.
	Started bool
	// FirstToken is true once any output came back; a failure after it is
	// charged what was counted, a failure before it nothing.
	FirstToken bool
	// Ended names why a call whose request reached the provider ended
	// before the provider's answer did (budget.OutcomeClientClosed,
	// budget.OutcomeTaskEnded, budget.OutcomeTimeout), "" otherwise. The provider has the
	// prompt and bills for it: such a call is charged what the attempt
	// reports (at least the prompt), whatever error it returns, and the
	// ledger outcome is Ended.
	Ended string
	// PromptCounted is the part of the prompt the caller counted (its
	// text, not allowances held for images or files): a floor the
	// provider's report is judged against (budget.Charged), as Counted is
	// for the output. Exact says both were counted with the model's own
	// tokenizer, not the conservative bound.
	PromptCounted int64
	Exact         bool
	// Sent: the request was written to the provider whole, which then has
	// the prompt and bills for it (Ended says why such a call ended early).
	Sent bool
	// Refused: the provider refused to answer (its content rules): an
	// invalid request of the caller's for the invalid ratio.
	Refused bool
	// Answered is the model the provider said answered ("" when it did
	// not say), bounded.
	Answered string
}

// Result is what Call returns: the outcome of the attempt that answered
// (or the last one), with what the call as a whole came to. Outcome stays
// apart and small because an attempt's stream runs under frames that
// each hold one: an open stream's stack is its memory.
type Result struct {
	Outcome
	// Model is the model that answered (or refused), FellBack whether it
	// was the fallback; Charged what the call was charged in all (every
	// attempt); Waited how long it waited for tokens.
	Model    Model
	FellBack bool
	Charged  Usage
	Waited   time.Duration
	// Throttled: the principal was past the soft share of its hourly
	// tokens; Downgraded: the call went to the fallback model first
	// because of it (throttle).
	Throttled, Downgraded bool
}

// CutBy is why the attempt's answer was cut (codes.OutputTruncated,
// codes.OutputLoop), "" when it was not.
func (o Outcome) CutBy() string {
	if o.Cut == "" && o.Truncated {
		return codes.OutputTruncated
	}
	return o.Cut
}

// ErrBudgetRefused: the token budget cannot afford the next call. It
// wraps the *budget.ExhaustedError (or the hour's refusal) that refused.
var ErrBudgetRefused = errors.New("govern: token budget refused the call")

// errStarted marks a failed attempt whose output had already reached the
// client: Models.Do does not retry it on the fallback.
var errStarted = errors.New("govern: the answer had started")

// MinClosingTokens is the smallest completion worth asking for a
// closing call's final answer (Spec.MinOutput's default).
const MinClosingTokens = 256

// Call makes one governed call; attempt is called once per model tried
// (the primary, then the fallback), each under its own reservation. The
// error is an *ExhaustedError-wrapping refusal (errors.Is
// budget.ErrExhausted), a failure with a task code (FailureCode:
// token_rate_limited, input_spike, agent_failed), the context's end, or
// the last attempt's error. Whatever happens, nothing stays booked.
func (g *Governor) Call(ctx context.Context, spec Spec, attempt func(ctx context.Context, a Attempt) (Outcome, error)) (Result, error) {
	c := &governedCall{g: g, spec: spec, attempt: attempt, lg: spec.Logger,
		alerts: callAlerts{notify: g.d.Alert, task: spec.TaskID, principal: spec.Principal.ID}}
	if c.lg == nil {
		c.lg = g.d.Logger
	}
	err := c.call(ctx)
	return c.out, err
}

// call is Call's work, its outcome left in c.out. An attempt (a stream,
// for as long as it is open) runs under call's frame and do's, so they
// keep no large locals: what comes after the attempts is finish's.
func (c *governedCall) call(ctx context.Context) error {
	err := c.do(ctx, &c.out)
	c.out.Charged, c.out.Waited = c.usage, c.waited
	c.out.Throttled, c.out.Downgraded = c.throttled, c.downgraded
	c.finish(ctx, err)
	return err
}

// finish gives back what no attempt used, with the hold's end and After.
func (c *governedCall) finish(ctx context.Context, err error) {
	c.release(ctx, c.ends(c.out, err)...)
}

// ends are the hold's end and the caller's after-call write (Spec.After),
// for a round trip of the Governor's, each told out and err: the hold's
// when it was taken and has not ended, After once unless the hold refused
// the call.
func (c *governedCall) ends(out Result, err error) []func(ctx context.Context) {
	var fns []func(ctx context.Context)
	if end := c.held; end != nil {
		c.held = nil
		fns = append(fns, func(ctx context.Context) { end(context.WithoutCancel(ctx), out, err) })
	}
	if after := c.spec.After; after != nil && !c.afterDone && !c.holdRefused {
		c.afterDone = true
		fns = append(fns, func(ctx context.Context) { after(context.WithoutCancel(ctx), out, err) })
	}
	return fns
}

// governedCall is one Call, from its reservation to its settlement,
// across the attempts Models.Do makes. It holds what the call has booked,
// so that whichever way the call ends, release gives back what no attempt
// used.
type governedCall struct {
	g       *Governor
	spec    Spec
	attempt func(ctx context.Context, a Attempt) (Outcome, error)
	lg      *slog.Logger
	alerts  callAlerts

	// prompt and maxTokens are the current attempt's estimate and
	// completion limit.
	prompt, maxTokens int64

	// res is the budget reservation the next attempt uses; open until an
	// attempt settles it or release gives it back.
	res     budget.Reservation
	resOpen bool

	// take is what the principal's bucket gave the call (nil: nothing, or
	// no limiter); charged is what the call's attempts were charged, which
	// release settles the take with.
	take    *bucketTake
	charged int64
	usage   Usage
	// paced is the next attempt's turn at the site bucket (nil: none
	// booked, or pacing is off); the attempt settles it.
	paced *bucketTake
	// withdraw is a reserve sent beside a check that refused the call
	// (bookAtOnce): release withdraws it, as if it had never been sent.
	withdraw *budget.Request
	// repaced: a closing call shrunk at its reservation booked its own
	// turn at the site bucket (reserveBooked); the turn asked beside the
	// larger reservation is not read.
	repaced bool
	// waited is how long the call waited for tokens, in both buckets.
	waited time.Duration
	// held is the end of Spec.Hold's booking (nil: none, or ended);
	// holdRefused is set when the hold refused the call, afterDone once
	// Spec.After ran.
	held                   HoldEnd
	holdRefused, afterDone bool
	// throttled and downgraded are Outcome's (throttle).
	throttled, downgraded bool

	// firstEvent marks the current attempt's first event for the breaker
	// (Attempt.FirstEvent).
	firstEvent func()
	// tryRes, tryPrompt and tryOut are the current attempt's reservation,
	// prompt and outcome, kept here rather than on the stack an attempt
	// (a stream, for as long as it is open) runs under.
	tryRes    budget.Reservation
	tryPrompt int64
	tryOut    Outcome
	// out is what Call returns.
	out Result
}

// bucketTake is tokens taken from a bucket (by BeforeCall or Pace): the
// op id and the amount, and for the principal's the hour's slot they were
// added to (0: none), for the Settle that settles them.
type bucketTake struct {
	op       string
	amount   int64
	hourSlot int64
}

// do books the call for the model Do tries first and makes it: the
// principal's tokens per minute (and the input spike check), then the
// budget. Both come before the breaker sees the call: a refusal is not a
// provider failure and must never count towards opening it.
func (c *governedCall) do(ctx context.Context, out *Result) error {
	g := c.g
	if err := c.bookFirst(ctx, out); err != nil {
		return err
	}
	used, fellBack, err := g.d.Models.Do(ctx, c.spec.Principal.ID, c.spec.LowPrecision, func(ctx context.Context, mdl Model, first func()) error {
		c.firstEvent = first
		return c.tryModel(ctx, &mdl, &out.Outcome)
	})
	out.Model, out.FellBack = used, fellBack
	return err
}

// bookFirst plans and books the call for the model Do tries first; a
// refusal is out's, naming that model.
func (c *governedCall) bookFirst(ctx context.Context, out *Result) error {
	first := c.g.d.Models.Next(c.spec.LowPrecision)
	c.plan(first.Name)
	// The site's turn is waited for here, outside the breaker, so the wait
	// never makes the call look slow.
	if err := c.book(ctx, first.Name); err != nil {
		*out = Result{Model: first}
		return err
	}
	return nil
}

// tryModel is one attempt of Do's on mdl: out is set when it answered.
func (c *governedCall) tryModel(ctx context.Context, mdl *Model, out *Outcome) error {
	if err := c.prepare(ctx, *mdl); err != nil {
		return err
	}
	o := &c.tryOut
	*o = Outcome{}
	if err := c.try(ctx, mdl, o); err != nil {
		if o.Started {
			return startedError(err)
		}
		return err
	}
	*out = *o
	return nil
}

// startedError marks err as an attempt's whose output had reached the
// client (kept out of tryModel's frame, which an attempt runs under).
func startedError(err error) error { return fmt.Errorf("%w: %w", errStarted, err) }

// prepare makes sure the attempt on mdl has its own reservation, priced for
// mdl, and its turn at the site bucket. The first attempt has what do
// booked; the fallback after an open breaker finds a reservation for
// another model, which it gives back, and an unused turn, which it keeps;
// the fallback after a failed primary finds neither (the primary settled
// both) and books its own. A fallback never runs under the breaker, so
// its wait for a turn cannot count as a slow call either.
func (c *governedCall) prepare(ctx context.Context, mdl Model) error {
	if c.resOpen && c.res.Model == mdl.Name {
		return nil
	}
	c.giveBack(ctx)
	c.plan(mdl.Name)
	if err := c.reserve(ctx, mdl.Name); err != nil {
		return err
	}
	if c.paced == nil {
		return c.pace(ctx)
	}
	return nil
}

// plan sizes an attempt on model: its prompt as that model counts it, and
// the completion limit asked for, within Config.MaxTokens.
func (c *governedCall) plan(model string) {
	c.prompt = c.spec.PromptTokens
	if c.spec.Estimate != nil {
		c.prompt = c.spec.Estimate(model)
	}
	c.prompt = max(c.prompt, 0)
	c.maxTokens = int64(c.g.cfg.MaxTokens)
	if m := c.spec.MaxOutput; m > 0 && m < c.maxTokens {
		c.maxTokens = m
	}
	if c.spec.NoOutput {
		c.maxTokens = 0
	}
}

// book makes the call's bookings before the upstream call (bookings: the
// caller's hold, the principal's bucket and input-spike check, the
// reservation, the site's turn). They live in up to four cluster slots, so
// they cannot be one script: they go to Redis at once, one round trip,
// and their answers are read in bookings' order, as if each had been
// asked only once the one before it let the call through. A bucket short
// of prompt + max_tokens is waited for, within Config.TokenWait in all,
// and everything is asked again with new op ids.
func (c *governedCall) book(ctx context.Context, model string) error {
	for {
		wait, err := c.bookAtOnce(ctx, model)
		if err != nil || wait == 0 {
			return err
		}
		if err := c.waitBucket(ctx, wait); err != nil {
			return err
		}
	}
}

// waitBucket waits wait for the principal's bucket, or refuses the call
// when that would pass Config.TokenWait in all.
func (c *governedCall) waitBucket(ctx context.Context, wait time.Duration) error {
	if c.waited+wait > c.g.cfg.TokenWait {
		return task.Fail(codes.TokenRateLimited, "the tokens-per-minute limit left no room for the next model call in time; please try again in a minute")
	}
	if err := c.g.d.Sleep(ctx, wait); err != nil {
		return err
	}
	c.waited += wait
	return nil
}

// booking is one of a call's bookings before the upstream call: ask books
// it (sent beside the others, in one round trip), answer reads what came
// back, in bookings' order: an error ends the call (what was booked goes
// back), a wait > 0 gives everything back and asks again after it.
//
// booked, when set, runs for every booking once the round trip is back,
// before any answer is read: what was booked is the call's from then on,
// so that a refusal read earlier in the order gives it back (release).
type booking struct {
	name   string
	ask    func(ctx context.Context)
	booked func()
	answer func(ctx context.Context) (time.Duration, error)
}

// bookings are a call's bookings in the order their answers are read, the
// order of a governed call:
//
//  1. hold: the caller's own (the model endpoint's task slot): its refusal
//     comes first, and the rest is given back as if never asked (no
//     alert, no spike);
//  2. bucket: the principal's tokens per minute and hour, and the input
//     spike check: a spike or a refusal ends the call, a short bucket
//     waits (the reservation is withdrawn either way, which also clears a
//     warning or exhaustion it was first to see);
//  3. reserve: the budget's reservation in every scope: a refusal raises
//     budget_exhausted and ends the call (the bucket's take and the turn
//     go back); a closing call that fits a smaller output books that;
//  4. pace: the site's turn: too far away ends the call, later than now is
//     waited for.
//
// A booking whose check is off (no hold, no limiter, pacing off) is left
// out.
func (c *governedCall) bookings(req *budget.Request) []booking {
	var out []booking
	if c.spec.Hold != nil && c.held == nil {
		// The hold is taken once per call: a bucket wait asks again for
		// the rest only.
		var held HoldEnd
		var err error
		out = append(out, booking{"hold", func(ctx context.Context) { held, err = c.spec.Hold(ctx) }, nil,
			func(ctx context.Context) (time.Duration, error) { return 0, c.holdAnswer(ctx, req, held, err) }})
	}
	if c.g.d.Limiter != nil {
		var ask bucketAsk
		out = append(out, booking{"bucket", func(ctx context.Context) { ask = c.askBucket(ctx) },
			func() {
				if ask.err == nil && ask.d.Taken {
					c.take = &bucketTake{op: ask.op, amount: ask.amount, hourSlot: ask.d.HourSlot}
				}
			},
			func(ctx context.Context) (time.Duration, error) { return c.bucketBooked(ctx, req, ask) }})
	}
	var res budget.Reservation
	var resErr error
	out = append(out, booking{"reserve", func(ctx context.Context) { res, resErr = c.g.d.Budget.Reserve(ctx, *req) }, nil,
		func(ctx context.Context) (time.Duration, error) { return 0, c.reserveBooked(ctx, req, res, resErr) }})
	if c.g.d.Limiter != nil && c.g.cfg.SiteTokensPerMinute > 0 {
		var turn paceAsk
		out = append(out, booking{"pace", func(ctx context.Context) { turn = c.askPace(ctx) },
			func() {
				if turn.err == nil {
					c.paced = &bucketTake{op: turn.op, amount: turn.amount}
				}
			},
			func(ctx context.Context) (time.Duration, error) { return c.paceBooked(ctx, turn) }})
	}
	return out
}

// bookAtOnce sends the call's bookings at once (one round trip: on a
// cluster each goes to its own node) and reads their answers in
// bookings' order. What a refusal gives back goes in one round trip
// (release), so a refused call makes two and a call that goes ahead one.
func (c *governedCall) bookAtOnce(ctx context.Context, model string) (time.Duration, error) {
	req := c.request(model)
	// The id is ours, so a refused reserve can be withdrawn too (its
	// exhaustion flag), and a reserve whose reply was lost as well.
	req.ID = "r" + randhex.New(16)
	c.repaced = false
	list := c.bookings(&req)
	// The reservation, the heaviest, runs on this goroutine (redisbatch
	// runs a wave's first there); the order of the asks is no order of
	// the call's: they go in one round trip, and only the answers are
	// read in turn.
	wave := make([]func(context.Context), 0, len(list))
	for _, b := range list {
		if b.name == "reserve" {
			wave = append([]func(context.Context){b.ask}, wave...)
		} else {
			wave = append(wave, b.ask)
		}
	}
	redisbatch.Run(ctx, wave...)
	for _, b := range list {
		if b.booked != nil {
			b.booked()
		}
	}
	for _, b := range list {
		if wait, err := b.answer(ctx); err != nil || wait > 0 {
			return wait, err
		}
	}
	return 0, nil
}

// holdAnswer reads the caller's hold: a refusal gives back the rest of
// the bookings as if they had never been asked.
func (c *governedCall) holdAnswer(ctx context.Context, req *budget.Request, held HoldEnd, err error) error {
	if err != nil {
		c.withdraw = req
		c.holdRefused = true
		c.release(ctx)
		return err
	}
	c.held = held
	return nil
}

// bucketBooked reads the bucket's answer in its turn: a refusal or a wait
// withdraws the reservation (and gives back the turn, by release).
func (c *governedCall) bucketBooked(ctx context.Context, req *budget.Request, ask bucketAsk) (time.Duration, error) {
	c.take = nil // bucketAnswer books it again, in its turn
	wait, err := c.bucketAnswer(ctx, ask)
	if err == nil && wait == 0 {
		return 0, nil
	}
	c.withdraw = req
	if err != nil {
		return 0, err
	}
	c.release(ctx)
	return wait, nil
}

// reserveBooked reads the reservation's answer in its turn: a closing
// call shrunk to what the budget had left gives back the turn booked for
// the larger call and books its own.
func (c *governedCall) reserveBooked(ctx context.Context, req *budget.Request, res budget.Reservation, resErr error) error {
	asked := c.maxTokens
	if err := c.reserveAnswer(ctx, *req, res, resErr); err != nil {
		if !errors.Is(err, ErrBudgetRefused) {
			// The store failed: a reserve whose reply was lost may hold.
			c.withdraw = req
		}
		return err
	}
	if c.maxTokens != asked && c.paced != nil {
		t := c.paced
		c.paced = nil
		c.settleBucket(ctx, ratelimit.SiteScope, c.g.cfg.SiteTokensPerMinute, t, 0)
		c.repaced = true
		return c.pace(ctx)
	}
	return nil
}

// paceBooked reads the site's turn in its turn: too far away ends the
// call (release gives back the rest), later than now is waited for.
func (c *governedCall) paceBooked(ctx context.Context, turn paceAsk) (time.Duration, error) {
	if c.repaced {
		return 0, nil // the shrunk closing call booked its own turn
	}
	wait, err := c.paceAnswer(ctx, turn)
	if err != nil || wait <= 0 {
		return 0, err
	}
	if err := c.g.d.Sleep(ctx, wait); err != nil {
		return 0, err
	}
	c.waited += wait
	return 0, nil
}

// bucketAsk is one question to the principal's bucket and its answer.
type bucketAsk struct {
	op     string
	amount int64
	d      ratelimit.CallDecision
	err    error
}

// askBucket asks the limiter whether the call may go ahead, taking prompt
// + max_tokens if it may. It changes nothing of the call (it runs beside
// the reserve); bucketAnswer reads the answer.
func (c *governedCall) askBucket(ctx context.Context) bucketAsk {
	p := c.spec.Principal
	a := bucketAsk{op: randhex.New(16), amount: c.prompt + c.maxTokens}
	a.d, a.err = c.g.d.Limiter.BeforeCall(ctx, ratelimit.CallRequest{Scope: principalScope(p.ID),
		PromptTokens: max(c.prompt, 1), Amount: a.amount, TokensPerMinute: p.TokensPerMinute,
		TokensPerHour: p.TokensPerHour, SoftTokens: p.SoftTokens, Op: a.op})
	return a
}

// bucketAnswer reads the limiter's answer: an input spike ends the task
// (the call is not made); a bucket short of prompt + max_tokens answers
// how long until it holds them (a wait > 0, nothing taken).
func (c *governedCall) bucketAnswer(ctx context.Context, a bucketAsk) (time.Duration, error) {
	d, err := a.d, a.err
	switch {
	case errors.Is(err, ratelimit.ErrTooLarge):
		return 0, task.Fail(codes.TokenRateLimited, "the next model call needs more tokens than the tokens-per-minute limit allows at once")
	case err != nil:
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		c.lg.Warn("token rate check failed", "err", err)
		return 0, task.Fail(codes.AgentFailed, "the token rate could not be checked; please try again later")
	case d.Anomaly:
		c.alerts.alertSpike(c.prompt, d)
		return 0, task.Fail(codes.InputSpike, "the next model call's input was far larger than usual for this client, so it was not made")
	case d.HourShort:
		// The hour is a token budget: the call is refused as the day's
		// budgets refuse one, with the hour's own time to wait.
		return 0, fmt.Errorf("%w: %w", ErrBudgetRefused,
			&ratelimit.RefusedError{Reason: ratelimit.ReasonHourExhausted, After: d.RetryAfter, Quota: c.spec.Principal.TokensPerHour})
	case d.Taken:
		c.take = &bucketTake{op: a.op, amount: a.amount, hourSlot: d.HourSlot}
		c.throttle(d)
		return 0, nil
	}
	// The script answers an exact time; a zero one would spin.
	return max(d.RetryAfter, time.Millisecond), nil
}

// throttle routes the call of a principal past the soft share of its
// hourly tokens to the fallback model first, as a low-precision call is
// (when there is a fallback): Do then sends it there, and the attempt
// books its own reservation for it. The operator hears of it once per
// principal and hour.
func (c *governedCall) throttle(d ratelimit.CallDecision) {
	if !d.Soft {
		return
	}
	c.throttled = true
	if !c.spec.LowPrecision && c.g.d.Models.Fallback != nil {
		c.spec.LowPrecision, c.downgraded = true, true
	}
	c.alerts.alertThrottled(d.HourUsed, c.spec.Principal)
}

// request is the reservation of an attempt on model: prompt + max_tokens
// in every budget scope.
func (c *governedCall) request(model string) budget.Request {
	p := c.spec.Principal
	req := budget.Request{Day: p.Day, Principal: p.ID, Task: c.spec.TaskID, Model: model,
		PrincipalLimit: p.TokensPerDay, PromptTokens: c.prompt, MaxTokens: c.maxTokens, PromptCache: c.spec.PromptCache}
	if p.TierTokens > 0 {
		req.Tier, req.TierLimit = p.Tier, p.TierTokens
	}
	return req
}

// reserve books prompt + max_tokens on model in every budget scope
// (reserveAnswer).
func (c *governedCall) reserve(ctx context.Context, model string) error {
	req := c.request(model)
	res, err := c.g.d.Budget.Reserve(ctx, req)
	return c.reserveAnswer(ctx, req, res, err)
}

// reserveAnswer reads the budget's answer to req, raising its alerts. When
// the budget cannot afford the call, a closing call may still go ahead
// with a smaller max_tokens that fits what a token scope has left, so a
// run ends with what it has (a new reserve, with a new id). (A spend
// refusal is in micro-units, which say nothing about tokens.)
func (c *governedCall) reserveAnswer(ctx context.Context, req budget.Request, res budget.Reservation, err error) error {
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) {
		c.alerts.alertExhausted(ex, req)
		least := c.spec.MinOutput
		if least <= 0 {
			least = MinClosingTokens
		}
		if c.spec.Closing && !c.spec.NoOutput && ex.Scope != budget.ScopeSpend && ex.Remaining-c.prompt >= least {
			c.maxTokens = ex.Remaining - c.prompt
			req.MaxTokens, req.ID = c.maxTokens, ""
			res, err = c.g.d.Budget.Reserve(ctx, req)
			if errors.As(err, &ex) {
				c.alerts.alertExhausted(ex, req)
			}
		}
	}
	switch {
	case err == nil:
		c.alerts.alertWarnings(res.Warnings)
		c.res, c.resOpen = res, true
		return nil
	case errors.Is(err, budget.ErrExhausted):
		return fmt.Errorf("%w: %w", ErrBudgetRefused, err)
	}
	c.lg.Warn("budget reserve failed", "err", err)
	// The budget store failing is not the model's fault, and spending
	// without a reservation is not allowed: fail closed.
	return task.Fail(codes.AgentFailed, "the token budget could not be checked; please try again later")
}

// settle ends reservation res with what call used, charged in full (the
// excess as overage; the ledger entry, if any, in the same script), and
// returns the settlement: zero when the settle failed even after the
// budget's retries, and the reservation then expires on its own.
func (c *governedCall) settle(ctx context.Context, res budget.Reservation, call budget.Call) budget.Settlement {
	ctx, end := c.g.startSettle(ctx, res)
	// The budget re-sends its idempotent script while Redis does not
	// answer, within Config.SettleTimeout.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.g.cfg.SettleTimeout)
	defer cancel()
	s, err := c.g.d.Budget.SettleCall(sctx, res, call)
	end(s, err)
	if err != nil {
		c.lg.Warn("budget settle failed", "err", err)
		return budget.Settlement{}
	}
	c.alerts.alertWarnings(s.Warnings)
	c.alerts.alertOverage(res, s)
	return s
}

// giveBack settles a reservation no attempt used with nothing.
func (c *governedCall) giveBack(ctx context.Context) {
	if c.resOpen {
		c.resOpen = false
		c.settle(ctx, c.res, budget.Call{})
	}
}

// pace books the attempt's turn at the site bucket and waits for it (the
// fallback's own turn, after the first round).
func (c *governedCall) pace(ctx context.Context) error {
	wait, err := c.bookPace(ctx)
	if err != nil || wait <= 0 {
		return err
	}
	if err := c.g.d.Sleep(ctx, wait); err != nil {
		return err
	}
	c.waited += wait
	return nil
}

// bookPace books the attempt's turn at the site bucket and says how long
// until it (paceAnswer).
func (c *governedCall) bookPace(ctx context.Context) (time.Duration, error) {
	if c.g.d.Limiter == nil || c.g.cfg.SiteTokensPerMinute <= 0 {
		return 0, nil
	}
	return c.paceAnswer(ctx, c.askPace(ctx))
}

// paceAsk is one booking of a turn at the site bucket and its answer.
type paceAsk struct {
	op     string
	amount int64
	wait   time.Duration
	err    error
}

// askPace books a turn for prompt + max_tokens at the site bucket. It
// changes nothing of the call (it runs beside the reserve); paceAnswer
// reads the answer.
func (c *governedCall) askPace(ctx context.Context) paceAsk {
	g := c.g
	a := paceAsk{op: randhex.New(16), amount: c.prompt + c.maxTokens}
	a.wait, a.err = g.d.Limiter.Pace(ctx, ratelimit.SiteScope, g.cfg.SiteTokensPerMinute, a.amount, g.cfg.SitePaceWait, a.op)
	return a
}

// paceAnswer reads the site bucket's answer. A turn further away than
// Config.SitePaceWait is refused by the limiter (it books nothing then)
// and ends the task with token_rate_limited.
func (c *governedCall) paceAnswer(ctx context.Context, a paceAsk) (time.Duration, error) {
	var tooLong *ratelimit.WaitTooLongError
	switch err := a.err; {
	case errors.As(err, &tooLong):
		return 0, task.Fail(codes.TokenRateLimited, "the site is at its model provider's token rate and the next model call could not get a turn in time; please try again in a minute")
	case errors.Is(err, ratelimit.ErrTooLarge):
		return 0, task.Fail(codes.TokenRateLimited, "the next model call needs more tokens than the site's token rate allows at once")
	case err != nil:
		if ctx.Err() != nil {
			return 0, ctx.Err()
		}
		c.lg.Warn("site token rate check failed", "err", err)
		return 0, task.Fail(codes.AgentFailed, "the site's token rate could not be checked; please try again later")
	}
	c.paced = &bucketTake{op: a.op, amount: a.amount}
	return a.wait, nil
}

// settleBucket settles tokens taken from scope's bucket (and the hour they
// were added to) with what was used: the rest goes back, an excess is
// recorded as overage.
func (c *governedCall) settleBucket(ctx context.Context, scope string, rate int64, t *bucketTake, used int64) {
	r := ratelimit.SettleRequest{Scope: scope, TokensPerMinute: rate, Reserved: t.amount, Actual: used, Op: t.op}
	if t.hourSlot > 0 {
		r.TokensPerHour, r.HourSlot = c.spec.Principal.TokensPerHour, t.hourSlot
	}
	if _, err := c.g.d.Limiter.Settle(context.WithoutCancel(ctx), r); err != nil {
		c.lg.Warn("token bucket settle failed", "scope", bucketName(scope), "err", err)
	}
}

// bucketName names a bucket in logs without a visitor's hash.
func bucketName(scope string) string {
	if scope == ratelimit.SiteScope {
		return scope
	}
	return "principal"
}

// release gives back whatever the call booked and no attempt used: a
// budget reservation and a site turn left by a call the breaker refused
// outright, or by an attempt that never began; and it settles the
// principal's bucket with what the attempts were charged (all of the take
// back when nothing reached a model, the excess recorded as overage when
// more did). also run in the same round trip (the hold's end, After).
func (c *governedCall) release(ctx context.Context, also ...func(ctx context.Context)) {
	// Independent scripts on up to six slots: sent at once, one round
	// trip (one pipeline, on a client with redisbatch's hook).
	wave := also
	if req := c.withdraw; req != nil {
		c.withdraw = nil
		w := c.g.d.Budget
		wave = append(wave, func(ctx context.Context) {
			wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.g.cfg.SettleTimeout)
			defer cancel()
			if _, err := w.Withdraw(wctx, *req); err != nil {
				c.lg.Warn("budget withdraw failed", "err", err)
			}
		})
	}
	if t := c.paced; t != nil {
		c.paced = nil
		wave = append(wave, func(ctx context.Context) { c.settleBucket(ctx, ratelimit.SiteScope, c.g.cfg.SiteTokensPerMinute, t, 0) })
	}
	if t := c.take; t != nil {
		c.take = nil
		charged := c.charged
		wave = append(wave, func(ctx context.Context) {
			c.settleBucket(ctx, principalScope(c.spec.Principal.ID), c.spec.Principal.TokensPerMinute, t, charged)
		})
	}
	if c.resOpen {
		// The give-back's settle is the only one that raises alerts.
		wave = append(wave, c.giveBack)
	}
	redisbatch.Run(ctx, wave...)
}

// try is one attempt on model mdl under the call's open reservation,
// which it settles (the ledger entry riding in the settle's script).
//
// The attempt runs under try's frame for as long as it streams (the model
// endpoint's open streams, each a goroutine): try is kept small, and what
// follows the attempt (the settle's locals, the ledger entry, the log
// line) lives in settleTry's frame, which the attempt never runs under.
func (c *governedCall) try(ctx context.Context, mdl *Model, out *Outcome) error {
	g := c.g
	res := &c.tryRes
	*res, c.tryPrompt = c.res, c.prompt
	c.resOpen = false
	ctx, span := g.startModel(ctx, c.spec.Kind, mdl.Name, res.Tokens)
	start := time.Now()
	err := c.runAttempt(ctx, mdl, out)
	return c.settleTry(ctx, mdl, span, out, err, time.Since(start))
}

// runAttempt calls the attempt on mdl under the reservation try took.
func (c *governedCall) runAttempt(ctx context.Context, mdl *Model, out *Outcome) error {
	var err error
	*out, err = c.attempt(ctx, Attempt{Model: *mdl, Fallback: mdl.Name != c.g.d.Models.Primary.Name,
		PromptTokens: c.tryPrompt, MaxOutput: c.tryRes.Tokens - c.tryPrompt, FirstEvent: c.firstEvent})
	return err
}

// settleTry settles the attempt try made (out, err, after latency).
func (c *governedCall) settleTry(ctx context.Context, mdl *Model, span modelSpan, out *Outcome, err error, latency time.Duration) error {
	g := c.g
	res, prompt := c.tryRes, c.tryPrompt
	usage := out.Usage
	unreadable := errors.Is(err, chat.ErrUnreadable)

	outcome, ok, err := attemptOutcome(out, err)
	g.metrics.duration.WithLabelValues(mdl.Name, outcome).Observe(latency.Seconds())
	call := chargeOf(out, prompt, unreadable, ok)
	promptUsed, completion, implausible := g.d.Budget.Charged(res, call)
	reported := usage.Reported && !implausible && promptUsed == usage.Prompt && completion == usage.Completion
	var entry budget.Entry
	if g.d.Ledger != nil {
		entry = budget.Entry{Task: c.spec.TaskID, Model: c.ledgerModel(*mdl), Principal: c.spec.Principal.ID,
			Tier: c.spec.Principal.Tier, RequestID: c.spec.RequestID,
			PromptTokens: promptUsed, CompletionTokens: completion, Reserved: res.Tokens, LatencyMS: latency.Milliseconds(),
			Outcome: outcome, Status: providerStatus(ok || out.FirstToken || out.Started || out.Counted > 0 || unreadable, err), Estimated: !reported, Implausible: implausible}
		if reported {
			entry.ReasoningTokens, entry.CacheCreationTokens, entry.CacheReadTokens =
				usage.Reasoning, usage.CacheCreation, usage.CacheRead
		}
		call.Ledger = &entry
	}
	// After the call everything is settled in one round trip's time: the
	// budget (its script writes the ledger line), the site's turn and, when
	// no fallback can follow (this attempt answered), the principal's
	// bucket go to Redis at once; they are independent, and each script is
	// idempotent.
	charge := promptUsed + completion
	c.charged += charge
	c.usage.Prompt += promptUsed
	c.usage.Completion += completion
	var s budget.Settlement
	wave := []func(context.Context){func(ctx context.Context) { s = c.settle(ctx, res, call) }}
	if t := c.paced; t != nil {
		c.paced = nil
		wave = append(wave, func(ctx context.Context) {
			c.settleBucket(ctx, ratelimit.SiteScope, g.cfg.SiteTokensPerMinute, t, charge)
		})
	}
	if t := c.take; t != nil && ok {
		c.take = nil
		total := c.charged
		wave = append(wave, func(ctx context.Context) {
			c.settleBucket(ctx, principalScope(c.spec.Principal.ID), c.spec.Principal.TokensPerMinute, t, total)
		})
	}
	if ok {
		// The attempt answered: no fallback follows, and the hold and the
		// caller's after-call write end with the settle. Their Outcome is
		// the one Call returns.
		o := Result{Outcome: *out, Model: *mdl, FellBack: mdl.Name != g.d.Models.Primary.Name, Charged: c.usage, Waited: c.waited,
			Throttled: c.throttled, Downgraded: c.downgraded}
		wave = append(wave, c.ends(o, nil)...)
	}
	redisbatch.Run(ctx, wave...)
	if g.d.Ledger != nil {
		entry.CostMicro, entry.OverageTokens, entry.OverageCostMicro = s.CostMicro, s.OverageTokens, s.OverageCostMicro
		g.d.Ledger.Count(entry)
	}
	if implausible {
		c.alerts.alertImplausible(mdl.Name, res, call, charge)
	}
	c.lg.Debug("model call", "model", mdl.Name, "label", c.spec.Label, "outcome", outcome, "reserved", res.Tokens,
		"charged", s.Tokens, "cost_micro", s.CostMicro, "latency_ms", latency.Milliseconds())
	span.end(outcome, promptUsed, completion, !reported, c.waited.Milliseconds())
	if !ok {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return err
	}
	return nil
}

// providerStatus is the provider's HTTP status as a ledger entry records
// it: 200 when the provider answered (a stream cut or broken after its
// first token too), the status of an error answer when the attempt's
// error carries one (an HTTPStatus method), 0 when no answer came.
func providerStatus(answered bool, err error) int {
	if answered {
		return http.StatusOK
	}
	var s interface{ HTTPStatus() int }
	if errors.As(err, &s) {
		return s.HTTPStatus()
	}
	return 0
}

// attemptOutcome is the ledger outcome of an attempt that returned out and
// err, whether it answered (ok: no fallback follows), and the error the
// call goes on with: a stream the attempt cut was ours to stop, and what
// passed is the answer; a call that ended before the provider's answer
// (Ended) says why.
func attemptOutcome(out *Outcome, err error) (string, bool, error) {
	outcome, ok := "ok", true
	switch cut := out.CutBy(); {
	case cut != "":
		outcome, err = cut, nil
	case err != nil:
		outcome, ok = "error", false
	}
	if out.Ended != "" {
		outcome = out.Ended
	}
	return outcome, ok, err
}

// chargeOf is what the attempt that returned out is charged for, before
// budget.Charged judges the report: what the provider reported, else what
// was counted (a cut call is charged what it streamed, a call that ended
// before the provider's answer what the attempt reports, at least the
// prompt). A call that failed before a single token came back (refused at
// connect, a provider's error answer) consumed nothing any provider bills:
// it is charged nothing, and counts no tokens. An answer that could not
// be read, or a report the budget cannot believe (below zero, past the
// ceiling, not integers), is charged at least the reservation; a report
// below what was counted is judged against the count (budget.Charged).
func chargeOf(out *Outcome, prompt int64, unreadable, ok bool) budget.Call {
	usage := out.Usage
	counted := max(out.Counted, 0)
	first := out.FirstToken || out.Started || counted > 0 || out.Ended != ""
	call := budget.Call{PromptTokens: prompt, CompletionTokens: counted, Counted: prompt + counted, Raw: usage.Raw,
		CountedPrompt: min(max(out.PromptCounted, 0), prompt), CountedOutput: counted, Exact: out.Exact}
	switch {
	case unreadable:
		call.Unreadable = true
		if call.Raw == "" {
			call.Raw = "unreadable answer"
		}
	case usage.Reported && usage.Unreadable:
		call.Unreadable = true
	case usage.Reported:
		call.PromptTokens, call.CompletionTokens = usage.Prompt, usage.Completion
		call.CacheWrite, call.CacheWrite1h, call.CacheRead = usage.CacheCreation, usage.CacheCreation1h, usage.CacheRead
	case !ok && !first:
		call = budget.Call{Raw: usage.Raw}
	}
	return call
}

// ledgerModel is the model a ledger entry names: the one that answered.
// For embeddings that is the embedding model the call asked for, which
// Models (chat models) does not know. Its tokens are priced as the chat
// model's the reservation was made under (no embedding prices are
// configured; an embedding model's are lower where providers publish both).
func (c *governedCall) ledgerModel(mdl Model) string {
	if c.spec.Kind == "embeddings" && c.spec.Model != "" {
		return c.spec.Model
	}
	return mdl.Name
}
