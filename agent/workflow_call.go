package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/codes"
	"faregate/protect/repetition"
)

// errCut stops a streaming call from inside its callback.
var errCut = errors.New("agent: stream cut")

// call makes one model call of the run through the workflow's Governor
// (bucket, reservation, pacing, breaker and fallback, settle, ledger) and
// writes its step: the attempt streams the model's answer under the
// reservation's output cap and the repetition cut.
func (r *run) call(ctx context.Context, offerTools bool, label string) (chat.Reply, error) {
	var defs []chat.ToolDef
	if offerTools {
		defs = r.defs
	}
	st := r.startStep("model", label, "")
	spec := govern.Spec{TaskID: r.rec.ID, RequestID: r.rec.RequestID, Principal: govern.PrincipalOf(r.rec), Kind: "chat",
		Closing: !offerTools, LowPrecision: r.lowPrec, Label: label, Logger: r.lg,
		Estimate: func(model string) int64 { return r.w.d.Estimate(model, r.msgs, defs) }}
	// The attempt that answered leaves its reply here (a failed primary's
	// never reaches the run: the fallback's replaces it).
	var reply chat.Reply
	out, err := r.w.gov.Call(ctx, spec, func(ctx context.Context, a govern.Attempt) (govern.Outcome, error) {
		return r.attempt(ctx, a, defs, &reply)
	})
	r.rec.Usage.PromptTokens += out.Charged.Prompt
	r.rec.Usage.CompletionTokens += out.Charged.Completion
	if cut := out.CutBy(); cut != "" && err == nil {
		r.warn(cut)
	}
	if out.Throttled {
		r.warn(codes.Throttled)
	}
	if out.Downgraded {
		r.warn(codes.Downgraded)
	}
	if err != nil {
		detail := "model call failed"
		var f *task.Failure
		switch {
		case errors.Is(err, govern.ErrBudgetRefused):
			detail = "token budget exhausted"
			r.warn(codes.BudgetExhausted)
		case errors.As(err, &f):
			detail = f.Message
		case ctx.Err() != nil:
			detail = "stopped: time limit"
		}
		r.endStep(st, "failed", detail)
		if errors.Is(err, govern.ErrBudgetRefused) || ctx.Err() != nil || f != nil {
			return chat.Reply{}, err
		}
		r.lg.Warn("model call failed", "model", out.Model.Name, "err", err)
		return chat.Reply{}, task.Fail(codes.ModelUnavailable, "the model provider did not answer; please try again later")
	}
	if out.FellBack && !r.lowPrec && !out.Downgraded {
		// A downgraded call went to the fallback by design; its warning says so.
		r.warn(codes.FallbackModel)
	}
	r.lastModel = out.Model
	detail := out.Model.Name
	if out.Waited > 0 {
		detail += fmt.Sprintf(" (waited %v for tokens)", out.Waited.Round(time.Millisecond))
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

// outputCap holds a call's streamed output to what its reservation covers.
// It counts as it goes (time linear in the output, however it is chunked),
// and it keeps exactly what it counted: a piece that does not fit whole is
// taken up to the last code point that fits, so what is settled is what was
// kept. Tool-call output and reasoning are counted like text but not kept:
// a partial tool call cannot be run, and reasoning is not the answer.
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

// attempt is the planner's attempt on a.Model: one streamed Generate,
// held to a.MaxOutput by an outputCap and stopped by the repetition
// detector; the Governor settles what it reports.
func (r *run) attempt(ctx context.Context, a govern.Attempt, defs []chat.ToolDef, kept *chat.Reply) (govern.Outcome, error) {
	mdl := a.Model
	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := &outputCap{limit: a.MaxOutput}
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
		if !first && (ch.Text != "" || ch.ToolCall != "" || ch.Reasoning != "") {
			first = true
			a.FirstEvent()
			r.w.metrics.ttft.WithLabelValues(mdl.Name).Observe(time.Since(start).Seconds())
		}
		// Reasoning is output like any other: counted, cut, not kept.
		if ch.Reasoning != "" && !out.take(ch.Reasoning, false) {
			return stop(codes.OutputTruncated)
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
	turn := chat.Turn{Messages: r.msgs, Tools: defs, MaxTokens: int(a.MaxOutput), Stream: stream, Request: &r.rec.Request}
	reply, err := mdl.Generate(callCtx, turn)
	counted := out.count.Tokens()
	if counted == 0 {
		// An answer that came whole, not streamed: counted as it is.
		counted = chat.EstimateTokens(reply.Content) + chat.EstimateToolCalls(reply.ToolCalls)
	}
	o := govern.Outcome{Usage: usageOf(reply.Usage), Counted: counted, Cut: cut, FirstToken: first}
	*kept = reply
	if cut != "" {
		// Keep the partial text; the stream was ours to stop.
		*kept = chat.Reply{Content: out.text.String(), StopReason: cut}
		return o, nil
	}
	return o, err
}

// usageOf is a model adapter's usage report as the governor reads it.
func usageOf(u chat.Usage) govern.Usage {
	return govern.Usage{Prompt: u.PromptTokens, Completion: u.CompletionTokens, Reported: u.Reported,
		Unreadable: u.Unreadable, Raw: u.Raw, Reasoning: u.ReasoningTokens,
		CacheCreation: u.CacheCreationTokens, CacheRead: u.CacheReadTokens}
}
