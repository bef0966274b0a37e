package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/budget"
	"faregate/protect/repetition"
)

// errBudgetRefused: the token budget cannot afford the next call.
var errBudgetRefused = errors.New("agent: token budget refused the call")

// errCut stops a streaming call from inside its callback.
var errCut = errors.New("agent: stream cut")

// call makes one model call: reserve, stream with cut-offs, settle, record.
func (r *run) call(ctx context.Context, offerTools bool, label string) (chat.Reply, error) {
	var defs []chat.ToolDef
	if offerTools {
		defs = r.defs
	}
	prompt := chat.EstimatePrompt(r.msgs, defs)
	maxTokens := int64(r.w.cfg.MaxTokens)

	st := r.startStep("model", label, "")
	// Reserve before the breaker sees the call: a budget refusal is not a
	// provider failure and must never count towards opening it.
	res, err := r.reserve(ctx, prompt, &maxTokens, offerTools)
	var reply chat.Reply
	var used Model
	var fellBack bool
	if err == nil {
		used, fellBack, err = r.w.models.Do(ctx, r.lowPrec, func(ctx context.Context, mdl Model) error {
			cur := res
			if cur.ID == "" {
				// A second attempt (the fallback after a failed primary) needs
				// its own reservation; the first one was settled.
				var rerr error
				if cur, rerr = r.reserve(ctx, prompt, &maxTokens, offerTools); rerr != nil {
					return rerr
				}
			}
			res = budget.Reservation{}
			rep, aerr := r.attempt(ctx, mdl, cur, prompt, maxTokens, defs)
			if aerr != nil {
				return aerr
			}
			reply = rep
			return nil
		})
	}
	if err != nil {
		detail := "model call failed"
		var f *failure
		switch {
		case errors.Is(err, errBudgetRefused):
			detail = "token budget exhausted"
			r.warn(task.WarnBudgetExhausted)
		case ctx.Err() != nil:
			detail = "stopped: time limit"
		case errors.As(err, &f):
			detail = f.msg
		}
		r.endStep(st, "failed", detail)
		if errors.Is(err, errBudgetRefused) || ctx.Err() != nil || f != nil {
			return chat.Reply{}, err
		}
		r.lg.Warn("model call failed", "model", used.Name, "err", err)
		return chat.Reply{}, &failure{task.CodeModelUnavailable, "the model provider did not answer; please try again later"}
	}
	if fellBack && !r.lowPrec {
		r.warn(task.WarnFallbackModel)
	}
	r.lastModel = used
	detail := used.Name
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

// reserve books prompt + max_tokens in every budget scope. When the budget
// cannot afford that, a closing call (no tools) may still go ahead with a
// smaller max_tokens that fits what is left, so a run ends with what it has;
// *maxTokens is lowered accordingly.
func (r *run) reserve(ctx context.Context, prompt int64, maxTokens *int64, offerTools bool) (budget.Reservation, error) {
	req := budget.Request{Day: r.rec.Day, Visitor: r.rec.Visitor, Task: r.rec.ID, Amount: prompt + *maxTokens}
	res, err := r.w.budget.Reserve(ctx, req)
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) && !offerTools && ex.Remaining-prompt >= minClosingTokens {
		*maxTokens = ex.Remaining - prompt
		req.Amount = ex.Remaining
		res, err = r.w.budget.Reserve(ctx, req)
	}
	switch {
	case err == nil:
		return res, nil
	case errors.Is(err, budget.ErrExhausted):
		return res, fmt.Errorf("%w: %v", errBudgetRefused, err)
	}
	// The budget store failing is not the model's fault, and spending
	// without a reservation is not allowed: fail closed.
	return res, &failure{task.CodeAgentFailed, "the token budget could not be checked; please try again later"}
}

// minClosingTokens is the smallest completion worth asking for a final answer.
const minClosingTokens = 256

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

// attempt is one call on one model under reservation res, which it settles.
func (r *run) attempt(ctx context.Context, mdl Model, res budget.Reservation, prompt, maxTokens int64, defs []chat.ToolDef) (chat.Reply, error) {
	reserved := res.Amount

	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := &outputCap{limit: reserved - prompt}
	var cut string
	stop := func(why string) error {
		cut = why
		cancel()
		return errCut
	}
	detector := repetition.New(0, 0, r.w.cfg.LoopThreshold)
	stream := func(c chat.Chunk) error {
		if c.ToolCall != "" && !out.take(c.ToolCall, false) {
			return stop(task.WarnOutputTruncated)
		}
		if c.Text == "" {
			return nil
		}
		if !out.take(c.Text, true) {
			return stop(task.WarnOutputTruncated)
		}
		// Only text is checked for loops: tool-call arguments repeat
		// their own framing by nature.
		if detector.Write([]byte(c.Text)) {
			return stop(task.WarnOutputLoop)
		}
		return nil
	}
	turn := chat.Turn{Messages: r.msgs, Tools: defs, MaxTokens: int(maxTokens), Stream: stream, Request: &r.rec.Request}
	start := time.Now()
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

	// Settle with what the provider reported, else what we counted (a
	// failed or cut call is charged what it streamed).
	promptUsed, completion := prompt, out.count.Tokens()
	if ok && cut == "" {
		if reply.Usage.Reported {
			promptUsed, completion = reply.Usage.PromptTokens, reply.Usage.CompletionTokens
		} else if completion == 0 {
			completion = chat.EstimateTokens(reply.Content) + chat.EstimateToolCalls(reply.ToolCalls)
		}
	}
	charged, serr := r.w.budget.Settle(context.WithoutCancel(ctx), res, promptUsed+completion)
	if serr != nil {
		r.lg.Warn("budget settle failed", "err", serr)
	}
	r.rec.Usage.PromptTokens += promptUsed
	r.rec.Usage.CompletionTokens += completion
	if r.w.ledger != nil {
		entry := budget.Entry{Task: r.rec.ID, Model: mdl.Name, PromptTokens: promptUsed, CompletionTokens: completion,
			Reserved: reserved, LatencyMS: latency.Milliseconds(), Outcome: outcome}
		if lerr := r.w.ledger.Append(context.WithoutCancel(ctx), entry); lerr != nil {
			r.lg.Warn("usage ledger append failed", "err", lerr)
		}
	}
	r.lg.Debug("model call", "model", mdl.Name, "outcome", outcome, "reserved", reserved, "charged", charged, "latency_ms", latency.Milliseconds())
	if !ok {
		if ctx.Err() != nil {
			return chat.Reply{}, ctx.Err()
		}
		return chat.Reply{}, err
	}
	return reply, nil
}
