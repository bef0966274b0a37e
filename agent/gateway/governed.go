package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"sync/atomic"
	"time"

	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/randhex"
	"faregate/protect/principal"
	"faregate/protect/ratelimit"
)

// governed is one call of a route as the Governor is handed it: what the
// route parsed of the request, and its attempt.
type governed struct {
	kind, model string
	// prompt is faregate's count of the prompt, images at their dearest;
	// maxOut the output the client asked for (0: none); minOut the least
	// the provider takes (minOutput).
	prompt, maxOut, minOut int64
	// promptCache: the provider may bill the prompt at cache prices.
	promptCache bool
	// attempt makes one try on the model the governor chose, leaving the
	// answer's end in end (written once the call is settled).
	attempt func(ctx context.Context, a govern.Attempt, end *heldEnd) (govern.Outcome, error)
}

// govern makes one governed call for t's request r and answers what Call
// returned when no answer had started. The call is reserved, paced,
// routed through the breaker and settled by the Governor, in its order;
// the task's call slot (Options.Limits) rides in its first round trip,
// and the call's step on the visitor's page (record) in its settle's.
//
// An external agent's call may shrink its output to what the task can
// still afford, down to the least the provider takes (Closing, MinOutput);
// a call that cannot afford its prompt and that is refused.
func (h *handler) govern(w http.ResponseWriter, r *http.Request, t Task, g governed) {
	terms, err := h.terms(r.Context(), t.ID)
	if err != nil {
		h.o.Errors.WriteError(w, r, err)
		return
	}
	spec := govern.Spec{TaskID: t.ID, Principal: terms.Principal, Kind: g.kind, Model: g.model,
		PromptTokens: g.prompt, MaxOutput: g.maxOut, Closing: true, MinOutput: max(g.minOut, 1),
		LowPrecision: terms.LowPrecision, Label: "v1 " + g.kind, PromptCache: g.promptCache,
		// An embeddings call has no output: its prompt is all it costs
		// (reserving a whole output limit for it, 500 of them in flight
		// at once held a task's 12,000 tokens 40 times over).
		NoOutput: g.kind == KindEmbeddings}
	if h.o.RequestID != nil {
		spec.RequestID = h.o.RequestID(r)
	}
	hold := &heldSlot{}
	var attempted, began atomic.Bool
	if take := h.holdFor(t, g.kind, hold); take != nil {
		spec.Hold = func(ctx context.Context) (govern.HoldEnd, error) {
			if _, err := take(ctx); err != nil {
				return nil, err
			}
			return func(ctx context.Context, _ govern.Result, _ error) { hold.release(ctx, attempted.Load()) }, nil
		}
	}
	// Whether the provider refused to answer the attempt, for record:
	// written before the settle the After rides in.
	var refused bool
	started := time.Now()
	spec.After = func(ctx context.Context, res govern.Result, err error) {
		h.record(ctx, g.kind, terms, res, refused, err, time.Since(started))
	}
	var end heldEnd
	_, err = h.o.Governor.Call(r.Context(), spec, func(ctx context.Context, a govern.Attempt) (out govern.Outcome, err error) {
		if spec.Hold != nil && !hold.taken() {
			return govern.Outcome{}, fmt.Errorf("%w: the governor did not take the call's slot", tasklimits.ErrUnavailable)
		}
		attempted.Store(true)
		if began.Load() {
			// A governor that retries after bytes reached the client
			// would send a second answer into the first.
			return govern.Outcome{Started: true}, fmt.Errorf("%w: attempt after the answer started", ErrUpstream)
		}
		if g.kind == KindEmbeddings {
			// The governor's models are chat models: an embeddings call
			// asks the embedding model (the route checked the request
			// names it) on the primary's upstream, and has no fallback:
			// another provider's vectors are of another space.
			if a.Fallback {
				return govern.Outcome{}, fmt.Errorf("%w: embeddings have no fallback model", ErrUpstream)
			}
			a.Model.Name = g.model
			if e := h.o.Embeddings; e != nil {
				a.Model.BaseURL, a.Model.APIKey, a.Model.HTTPClient = e.BaseURL, e.APIKey, e.Client
			}
		}
		out, err = g.attempt(ctx, a, &end)
		// Anything that reached the client, or was counted, was spent.
		out.FirstToken = out.FirstToken || out.Started || out.Counted > 0 || out.Usage.Reported
		if out.Started {
			began.Store(true)
		}
		refused = out.Refused
		return out, err
	})
	hold.release(r.Context(), attempted.Load())
	// The answer completes for the client only now that the call is
	// settled and its step written (they ride in the Governor's settle
	// round trip): an agent that ends its task on the answer's last byte
	// cannot end it before the call is on the task. It is written whatever
	// Call returned: a settle that failed must not lose the answer.
	end.write()
	h.answerError(w, r, t, governError(err), began.Load())
}

// answerError answers what Call returned when no answer started: the
// request's own end (the task finished, its key could not be checked) is
// the answer when it came first.
func (h *handler) answerError(w http.ResponseWriter, r *http.Request, t Task, err error, started bool) {
	switch {
	case err == nil:
	case started:
		// The answer went out and was ended well formed; what is left is
		// for the ledger and the breaker, which the governor has.
		h.o.Logger.Debug("gateway: call ended after the answer started", "task", t.ID, "err", err)
	case r.Context().Err() != nil && !errors.Is(err, ErrEndsTask):
		if why := context.Cause(r.Context()); why != nil && !errors.Is(why, context.Canceled) && !errors.Is(why, context.DeadlineExceeded) {
			// The request was ended for a reason of its own (the task's
			// key could not be checked: 503, fail closed; or its task
			// finished: 409): that reason is the answer.
			h.o.Errors.WriteError(w, r, fmt.Errorf("%w: %w", why, err))
			return
		}
		h.o.Errors.WriteError(w, r, fmt.Errorf("%w: %w", ErrCallEnded, err))
	default:
		h.o.Errors.WriteError(w, r, err)
	}
}

// governError is a Governor refusal as the error writer answers it: a
// budget refusal passes as it is (429 demo_budget_exhausted, or the
// hour's); a failure with a task code becomes its rate-limit refusal; a
// model that cannot take the call is the provider's failure (503
// model_unavailable).
func governError(err error) error {
	if code, _, ok := task.FailureOf(err); ok {
		switch code {
		case codes.InputSpike:
			// The step this refusal writes ends the task (record), which
			// cuts this very request: the refusal is still its answer.
			return fmt.Errorf("%w: %w: %w", ratelimit.ErrInputSpike, ErrEndsTask, err)
		case codes.TokenRateLimited:
			return &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: time.Minute}
		}
		return fmt.Errorf("%w: %v", ErrUpstream, err)
	}
	if errors.Is(err, govern.ErrModelUnavailable) {
		return fmt.Errorf("%w: %v", ErrUpstream, err)
	}
	return err
}

// Terms are what a task's record says of its calls: its principal as the
// budget scopes need it (day, limits, tier share) and whether AITF let it
// through at low precision (its calls go to the fallback first).
type Terms struct {
	Principal    govern.Principal
	LowPrecision bool
}

// terms reads a task's Terms from its record once per task and replica: a
// record's limits do not change while it runs, and a task lives a day at
// the most.
func (h *handler) terms(ctx context.Context, id string) (Terms, error) {
	if t, _, ok := h.termsMemo.Get(id); ok {
		return t, nil
	}
	rec, err := h.o.Records(ctx, id)
	if err != nil {
		return Terms{}, err
	}
	t := Terms{Principal: govern.PrincipalOf(&rec), LowPrecision: rec.AITF.Degraded}
	h.termsMemo.Put(id, t, h.o.Now().Add(24*time.Hour))
	return t, nil
}

// record writes the call's model step on the task's page, as the
// planner's calls have theirs (the model that answered, what it was
// charged, why it was cut; low precision's fallback), through the task's
// key (Options.Steps, which the lease holder numbers), and counts the
// call in its principal's invalid-ratio window (Options.Invalid), invalid
// when the provider refused to answer it.
func (h *handler) record(ctx context.Context, kind string, terms Terms, out govern.Result, refused bool, err error, took time.Duration) {
	ctx = context.WithoutCancel(ctx)
	if h.o.Invalid != nil {
		n := ratelimit.Note{Scope: principal.FromAccount(terms.Principal.ID).Scope(), Requests: 1, Op: randhex.New(16)}
		if refused && err == nil {
			n.Invalid = 1
		}
		if _, _, err := h.o.Invalid.Record(ctx, n); err != nil {
			// The call was answered either way; the count is best effort.
			h.o.Logger.Debug("gateway: invalid ratio not counted", "err", err)
		}
	}
	g, ok := taskkey.FromContext(ctx)
	if h.o.Steps == nil || !ok {
		return
	}
	raw, jerr := json.Marshal(modelStep(kind, terms, out, err, took))
	if jerr == nil {
		jerr = h.o.Steps.Step(ctx, g, raw)
	}
	if jerr != nil {
		// The task may have ended meanwhile: the step has nowhere to go.
		h.o.Logger.Debug("gateway: model step not recorded", "task", g.Task, "err", jerr)
	}
}

// modelStep is the step of a call of kind that ended with out and err.
func modelStep(kind string, terms Terms, out govern.Result, err error, took time.Duration) taskkey.Posted {
	st := taskkey.Posted{Kind: "model", Name: kind, Status: "ok", DurationMS: took.Milliseconds(),
		PromptTokens: out.Charged.Prompt, CompletionTokens: out.Charged.Completion}
	switch {
	case err != nil:
		st.Status, st.Detail = "failed", "refused or failed: "+refusalWord(err)
		if code, _, ok := task.FailureOf(err); ok && code == codes.InputSpike {
			st.Fail = code // the task ends with it
		}
	default:
		st.Detail = fmt.Sprintf("%s: %d prompt + %d output tokens", out.Model.Name, out.Charged.Prompt, out.Charged.Completion)
		if terms.LowPrecision && out.FellBack {
			st.Detail += " (low precision: the fallback model)"
		}
		st.Detail, st.Warning = cutDetail(st.Detail, out.Outcome)
	}
	if out.Throttled {
		st.Warnings = append(st.Warnings, codes.Throttled)
	}
	if out.Downgraded {
		st.Warnings = append(st.Warnings, codes.Downgraded)
	}
	return st
}

// cutDetail adds to detail why an answer was cut, with the warning the
// task then carries ("" when it was not).
func cutDetail(detail string, out govern.Outcome) (string, string) {
	switch {
	case out.Cut == codes.OutputLoop:
		return detail + " (cut, " + codes.OutputLoop + ": the output repeated itself)", codes.OutputLoop
	case out.Ended == budget.OutcomeTimeout:
		return detail + " (cut, " + codes.OutputTruncated + ": the call's deadline passed)", codes.OutputTruncated
	case out.Ended == budget.OutcomeTaskEnded:
		return detail + " (cut, " + codes.OutputTruncated + ": the task ended)", codes.OutputTruncated
	case out.Truncated:
		return detail + " (cut at the task's budget)", codes.OutputTruncated
	}
	return detail, ""
}

// refusalWord names a refusal for the step's detail (no error text, which
// may carry a provider's words).
func refusalWord(err error) string {
	if code, _, ok := task.FailureOf(err); ok {
		return code
	}
	var re *ratelimit.RefusedError
	switch {
	case errors.As(err, &re):
		return string(re.Reason)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "the call ended"
	case errors.Is(err, govern.ErrModelUnavailable):
		return "model unavailable"
	}
	return "budget or provider"
}
