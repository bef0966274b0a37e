package agent

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"time"

	"faregate/agent/chat"
	"faregate/codes"
	"faregate/principal"
	"faregate/protect/budget"
	"faregate/protect/ratelimit"
	"faregate/protect/repetition"
)

// errBudgetRefused: the token budget cannot afford the next call.
var errBudgetRefused = errors.New("agent: token budget refused the call")

// errCut stops a streaming call from inside its callback.
var errCut = errors.New("agent: stream cut")

// minClosingTokens is the smallest completion worth asking for a final answer.
const minClosingTokens = 256

// modelCall is one model call of a run, from its reservation to its
// settlement, across the attempts Models.Do makes (the primary, then the
// fallback). It holds what the call has booked, so that whichever way the
// call ends, release gives back what no attempt used.
type modelCall struct {
	r       *run
	defs    []chat.ToolDef
	closing bool // no tools: a smaller max_tokens may fit what is left

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
	// paced is the next attempt's turn at the site bucket (nil: none
	// booked, or pacing is off); the attempt settles it.
	paced *bucketTake
	// waited is how long the call waited for tokens, in both buckets.
	waited time.Duration
}

// bucketTake is tokens taken from a bucket (by BeforeCall or Pace): the
// op id and the amount, for the AfterCall that settles them.
type bucketTake struct {
	op     string
	amount int64
}

// call makes one model call: reserve, stream with cut-offs, settle, record.
func (r *run) call(ctx context.Context, offerTools bool, label string) (chat.Reply, error) {
	c := &modelCall{r: r, closing: !offerTools}
	if offerTools {
		c.defs = r.defs
	}
	st := r.startStep("model", label, "")
	reply, used, fellBack, err := c.do(ctx)
	c.release(ctx)
	if err != nil {
		detail := "model call failed"
		var f *failure
		switch {
		case errors.Is(err, errBudgetRefused):
			detail = "token budget exhausted"
			r.warn(codes.BudgetExhausted)
		case errors.As(err, &f):
			detail = f.msg
		case ctx.Err() != nil:
			detail = "stopped: time limit"
		}
		r.endStep(st, "failed", detail)
		if errors.Is(err, errBudgetRefused) || ctx.Err() != nil || f != nil {
			return chat.Reply{}, err
		}
		r.lg.Warn("model call failed", "model", used.Name, "err", err)
		return chat.Reply{}, &failure{codes.ModelUnavailable, "the model provider did not answer; please try again later"}
	}
	if fellBack && !r.lowPrec {
		r.warn(codes.FallbackModel)
	}
	r.lastModel = used
	detail := used.Name
	if c.waited > 0 {
		detail += fmt.Sprintf(" (waited %v for tokens)", c.waited.Round(time.Millisecond))
	}
	if len(reply.ToolCalls) > 0 {
		names := make([]string, 0, len(reply.ToolCalls))
		for _, tc := range reply.ToolCalls {
			names = append(names, tc.Name)
		}
		detail += ": calls " + strings.Join(names, ", ")
	}
	r.endStep(st, "ok", detail)
	return reply, nil
}

// do books the call for the model Do tries first and makes it: the
// principal's tokens per minute (and the input spike check), then the
// budget. Both come before the breaker sees the call: a refusal is not a
// provider failure and must never count towards opening it.
func (c *modelCall) do(ctx context.Context) (reply chat.Reply, used Model, fellBack bool, err error) {
	r := c.r
	first := r.w.d.Models.Next(r.lowPrec)
	c.plan(first.Name)
	if err := c.takeTokens(ctx); err != nil {
		return chat.Reply{}, first, false, err
	}
	if err := c.reserve(ctx, first.Name); err != nil {
		return chat.Reply{}, first, false, err
	}
	// The site's turn is waited for here, outside the breaker, so the wait
	// never makes the call look slow.
	if err := c.pace(ctx); err != nil {
		return chat.Reply{}, first, false, err
	}
	used, fellBack, err = r.w.d.Models.Do(ctx, r.lowPrec, func(ctx context.Context, mdl Model) error {
		if err := c.prepare(ctx, mdl); err != nil {
			return err
		}
		rep, err := c.attempt(ctx, mdl)
		if err != nil {
			return err
		}
		reply = rep
		return nil
	})
	return reply, used, fellBack, err
}

// prepare makes sure the attempt on mdl has its own reservation, priced for
// mdl, and its turn at the site bucket. The first attempt has what do
// booked; the fallback after an open breaker finds a reservation for
// another model, which it gives back, and an unused turn, which it keeps;
// the fallback after a failed primary finds neither (the primary settled
// both) and books its own. A fallback never runs under the breaker, so
// its wait for a turn cannot count as a slow call either.
func (c *modelCall) prepare(ctx context.Context, mdl Model) error {
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
// the full completion limit.
func (c *modelCall) plan(model string) {
	c.prompt = c.r.w.d.Estimate(model, c.r.msgs, c.defs)
	c.maxTokens = int64(c.r.w.cfg.MaxTokens)
}

// takeTokens asks the limiter whether the call may go ahead: an input
// spike ends the task (the call is not made); a bucket short of prompt +
// max_tokens is waited for, within Config.TokenWait in all, asking again
// with a new op id each time.
func (c *modelCall) takeTokens(ctx context.Context) error {
	r := c.r
	if r.w.d.Limiter == nil {
		return nil
	}
	amount := c.prompt + c.maxTokens
	for {
		op := rand.Text()
		d, err := r.w.d.Limiter.BeforeCall(ctx, ratelimit.CallRequest{Scope: principal.FromAccount(r.rec.Principal).Scope(),
			PromptTokens: max(c.prompt, 1), Amount: amount, TokensPerMinute: r.rec.Limits.TokensPerMinute, Op: op})
		switch {
		case errors.Is(err, ratelimit.ErrTooLarge):
			return &failure{codes.TokenRateLimited, "the next model call needs more tokens than the tokens-per-minute limit allows at once"}
		case err != nil:
			if ctx.Err() != nil {
				return ctx.Err()
			}
			r.lg.Warn("token rate check failed", "err", err)
			return &failure{codes.AgentFailed, "the token rate could not be checked; please try again later"}
		case d.Anomaly:
			r.alertSpike(c.prompt, d)
			return &failure{codes.InputSpike, "the next model call's input was far larger than usual for this client, so it was not made"}
		case d.Taken:
			c.take = &bucketTake{op: op, amount: amount}
			return nil
		}
		// The script answers an exact time; a zero one would spin.
		wait := max(d.RetryAfter, time.Millisecond)
		if c.waited+wait > r.w.cfg.TokenWait {
			return &failure{codes.TokenRateLimited, "the tokens-per-minute limit left no room for the next model call in time; please try again in a minute"}
		}
		if err := r.w.d.Sleep(ctx, wait); err != nil {
			return err
		}
		c.waited += wait
	}
}

// reserve books prompt + max_tokens on model in every budget scope. When
// the budget cannot afford that, a closing call (no tools) may still go
// ahead with a smaller max_tokens that fits what a token scope has left, so
// a run ends with what it has. (A spend refusal is in micro-units, which
// say nothing about tokens.)
func (c *modelCall) reserve(ctx context.Context, model string) error {
	r := c.r
	req := budget.Request{Day: r.rec.Day, Principal: r.rec.Principal, Task: r.rec.ID, Model: model,
		PrincipalLimit: r.rec.Limits.TokensPerDay, PromptTokens: c.prompt, MaxTokens: c.maxTokens}
	if r.rec.Limits.TierTokens > 0 {
		req.Tier, req.TierLimit = r.rec.Tier, r.rec.Limits.TierTokens
	}
	res, err := r.w.d.Budget.Reserve(ctx, req)
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) {
		r.alertExhausted(ex, req)
		if c.closing && ex.Scope != budget.ScopeSpend && ex.Remaining-c.prompt >= minClosingTokens {
			c.maxTokens = ex.Remaining - c.prompt
			req.MaxTokens = c.maxTokens
			res, err = r.w.d.Budget.Reserve(ctx, req)
			if errors.As(err, &ex) {
				r.alertExhausted(ex, req)
			}
		}
	}
	switch {
	case err == nil:
		r.alertWarnings(res.Warnings)
		c.res, c.resOpen = res, true
		return nil
	case errors.Is(err, budget.ErrExhausted):
		return fmt.Errorf("%w: %w", errBudgetRefused, err)
	}
	r.lg.Warn("budget reserve failed", "err", err)
	// The budget store failing is not the model's fault, and spending
	// without a reservation is not allowed: fail closed.
	return &failure{codes.AgentFailed, "the token budget could not be checked; please try again later"}
}

// settle ends reservation res with what was used, charged in full (the
// excess as overage), and returns the settlement: zero when the settle
// failed, and the reservation then expires on its own.
func (c *modelCall) settle(ctx context.Context, res budget.Reservation, prompt, completion int64) budget.Settlement {
	ctx, end := c.r.w.startSettle(ctx, res)
	s, err := c.r.w.d.Budget.Settle(context.WithoutCancel(ctx), res, prompt, completion)
	end(s, err)
	if err != nil {
		c.r.lg.Warn("budget settle failed", "err", err)
		return budget.Settlement{}
	}
	c.r.alertWarnings(s.Warnings)
	c.r.alertOverage(res, s)
	return s
}

// giveBack settles a reservation no attempt used with nothing.
func (c *modelCall) giveBack(ctx context.Context) {
	if c.resOpen {
		c.resOpen = false
		c.settle(ctx, c.res, 0, 0)
	}
}

// pace books the attempt's turn at the site bucket and waits for it. A turn
// further away than Config.SitePaceWait is refused by the limiter (it
// books nothing then) and ends the task with token_rate_limited.
func (c *modelCall) pace(ctx context.Context) error {
	r := c.r
	rate := r.w.cfg.SiteTokensPerMinute
	if r.w.d.Limiter == nil || rate <= 0 {
		return nil
	}
	amount := c.prompt + c.maxTokens
	op := rand.Text()
	wait, err := r.w.d.Limiter.Pace(ctx, ratelimit.SiteScope, rate, amount, r.w.cfg.SitePaceWait, op)
	var tooLong *ratelimit.WaitTooLongError
	switch {
	case errors.As(err, &tooLong):
		return &failure{codes.TokenRateLimited, "the site is at its model provider's token rate and the next model call could not get a turn in time; please try again in a minute"}
	case errors.Is(err, ratelimit.ErrTooLarge):
		return &failure{codes.TokenRateLimited, "the next model call needs more tokens than the site's token rate allows at once"}
	case err != nil:
		if ctx.Err() != nil {
			return ctx.Err()
		}
		r.lg.Warn("site token rate check failed", "err", err)
		return &failure{codes.AgentFailed, "the site's token rate could not be checked; please try again later"}
	}
	c.paced = &bucketTake{op: op, amount: amount}
	if wait > 0 {
		if err := r.w.d.Sleep(ctx, wait); err != nil {
			return err
		}
		c.waited += wait
	}
	return nil
}

// settleBucket settles tokens taken from scope's bucket with what was
// used: the rest goes back, an excess is recorded as overage.
func (c *modelCall) settleBucket(ctx context.Context, scope string, rate int64, t *bucketTake, used int64) {
	if _, err := c.r.w.d.Limiter.AfterCall(context.WithoutCancel(ctx), scope, rate, t.amount, used, t.op); err != nil {
		c.r.lg.Warn("token bucket settle failed", "scope", bucketName(scope), "err", err)
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
// more did).
func (c *modelCall) release(ctx context.Context) {
	c.giveBack(ctx)
	if c.paced != nil {
		c.settleBucket(ctx, ratelimit.SiteScope, c.r.w.cfg.SiteTokensPerMinute, c.paced, 0)
		c.paced = nil
	}
	if c.take != nil {
		c.settleBucket(ctx, principal.FromAccount(c.r.rec.Principal).Scope(), c.r.rec.Limits.TokensPerMinute, c.take, c.charged)
		c.take = nil
	}
}

// outputCap holds a call's streamed output to what its reservation covers.
// It counts as it goes (time linear in the output, however it is chunked),
// and it keeps exactly what it counted: a piece that does not fit whole is
// taken up to the last code point that fits, so what is settled is what was
// kept. Tool-call output is counted like text but not kept: a partial tool
// call cannot be run.
type outputCap struct {
	limit int64 // completion tokens the reservation covers
	count chat.Counter
	text  strings.Builder
}

// take adds piece (reply text when keep, else tool-call output) and reports
// whether the stream may go on: false once the limit is reached.
func (c *outputCap) take(piece string, keep bool) bool {
	whole := c.count
	whole.Add(piece)
	if whole.Tokens() <= c.limit {
		c.count = whole
		if keep {
			c.text.WriteString(piece)
		}
		return whole.Tokens() < c.limit
	}
	for _, ch := range piece {
		if c.count.With(ch) > c.limit {
			break
		}
		c.count.AddRune(ch)
		if keep {
			c.text.WriteRune(ch)
		}
	}
	return false
}

// attempt is one call on model mdl under the call's open reservation,
// which it settles, and records in the ledger.
func (c *modelCall) attempt(ctx context.Context, mdl Model) (chat.Reply, error) {
	r := c.r
	res, prompt := c.res, c.prompt
	c.resOpen = false
	ctx, span := r.startModel(ctx, mdl.Name, res.Tokens)

	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := &outputCap{limit: res.Tokens - prompt}
	var cut string
	stop := func(why string) error {
		cut = why
		cancel()
		return errCut
	}
	detector := repetition.New(0, 0, r.w.cfg.LoopThreshold)
	start := time.Now()
	first := false
	stream := func(ch chat.Chunk) error {
		if !first && (ch.Text != "" || ch.ToolCall != "") {
			first = true
			r.w.metrics.ttft.WithLabelValues(mdl.Name).Observe(time.Since(start).Seconds())
		}
		if ch.ToolCall != "" && !out.take(ch.ToolCall, false) {
			return stop(codes.OutputTruncated)
		}
		if ch.Text == "" {
			return nil
		}
		if !out.take(ch.Text, true) {
			return stop(codes.OutputTruncated)
		}
		// Only text is checked for loops: tool-call arguments repeat
		// their own framing by nature.
		if detector.Write([]byte(ch.Text)) {
			return stop(codes.OutputLoop)
		}
		return nil
	}
	turn := chat.Turn{Messages: r.msgs, Tools: c.defs, MaxTokens: int(c.maxTokens), Stream: stream, Request: &r.rec.Request}
	reply, err := mdl.Generate(callCtx, turn)
	latency := time.Since(start)

	outcome := "ok"
	ok := true
	switch {
	case cut != "":
		// Keep the partial text; the stream was ours to stop.
		r.warn(cut)
		outcome = cut
		reply = chat.Reply{Content: out.text.String(), StopReason: cut}
	case err != nil:
		outcome = "error"
		ok = false
	}

	r.w.metrics.duration.WithLabelValues(mdl.Name, outcome).Observe(latency.Seconds())

	// Settle with what the provider reported, else what we counted (a cut
	// call is charged what it streamed). A call that failed before a single
	// token came back (refused at connect, a 5xx) consumed nothing that any
	// provider bills: it is charged nothing, and counts no tokens.
	promptUsed, completion := prompt, out.count.Tokens()
	reported := ok && cut == "" && reply.Usage.Reported
	switch {
	case reported:
		promptUsed, completion = reply.Usage.PromptTokens, reply.Usage.CompletionTokens
	case !ok && !first:
		promptUsed, completion = 0, 0
	case ok && cut == "" && completion == 0:
		completion = chat.EstimateTokens(reply.Content) + chat.EstimateToolCalls(reply.ToolCalls)
	}
	s := c.settle(ctx, res, promptUsed, completion)
	if c.paced != nil {
		c.settleBucket(ctx, ratelimit.SiteScope, r.w.cfg.SiteTokensPerMinute, c.paced, promptUsed+completion)
		c.paced = nil
	}
	c.charged += promptUsed + completion
	r.rec.Usage.PromptTokens += promptUsed
	r.rec.Usage.CompletionTokens += completion
	if r.w.d.Ledger != nil {
		entry := budget.Entry{Task: r.rec.ID, Model: mdl.Name, Principal: r.rec.Principal, RequestID: r.rec.RequestID,
			PromptTokens: promptUsed, CompletionTokens: completion, Reserved: res.Tokens, LatencyMS: latency.Milliseconds(),
			CostMicro: s.CostMicro, OverageTokens: s.OverageTokens, OverageCostMicro: s.OverageCostMicro,
			Outcome: outcome, Estimated: !reported}
		if lerr := r.w.d.Ledger.Append(context.WithoutCancel(ctx), entry); lerr != nil {
			r.lg.Warn("usage ledger append failed", "err", lerr)
		}
	}
	r.lg.Debug("model call", "model", mdl.Name, "outcome", outcome, "reserved", res.Tokens,
		"charged", s.Tokens, "cost_micro", s.CostMicro, "latency_ms", latency.Milliseconds())
	span.end(outcome, promptUsed, completion, !reported, c.waited.Milliseconds())
	if !ok {
		if ctx.Err() != nil {
			return chat.Reply{}, ctx.Err()
		}
		return chat.Reply{}, err
	}
	return reply, nil
}
