package gateway

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptrace"
	"sync/atomic"
	"time"

	"faregate/agent/govern"
	"faregate/protect/budget"
)

// DefaultCallTimeout is FAREGATE_LLM_TIMEOUT's default: how long one call
// may take, a stream's whole length included.
const DefaultCallTimeout = 60 * time.Second

// errCallTimeout is the cause of a call's end at its own deadline
// (Options.CallTimeout), errTaskDeadline at its task's, when that comes
// first.
var (
	errCallTimeout  = errors.New("gateway: the call's deadline passed")
	errTaskDeadline = errors.New("gateway: the task's deadline passed")
)

// endedError is why a provider's request was cut before its answer was
// whole: the ledger outcome that says so (budget.OutcomeClientClosed,
// budget.OutcomeTaskEnded, budget.OutcomeTimeout) and the cause behind it.
type endedError struct {
	outcome string
	cause   error
}

func (e *endedError) Error() string {
	return "gateway: the call ended (" + e.outcome + "): " + e.cause.Error()
}
func (e *endedError) Unwrap() error { return e.cause }

// Timeout says the call's own deadline ended it: the breaker counts a
// call that timed out before its first event as a slow failure, the
// provider's.
func (e *endedError) Timeout() bool { return e.outcome == budget.OutcomeTimeout }

// link is one attempt's request to the provider, tied to the agent's own
// request but not cancelled with it: once a request has been written to
// the provider, the provider has the prompt and bills for it, so how the
// call ends decides what it is charged.
//
//   - The agent hanging up (its request's context cancelled, no cause of
//     faregate's own) before the request was written cuts it: nothing
//     reached the provider. After the write, a stream is read on to its
//     usage (gone), within the reservation, the stream byte bound and the
//     deadline, and charged as it ends; a JSON call is cut and charged its
//     whole reservation.
//   - The task ending (the agent's request cancelled with a cause: its
//     result posted, its key no longer valid, its deadline) cuts the
//     request, and so does the call's own deadline: a stream ends well
//     formed with what passed, and is charged that and the prompt; a JSON
//     call is charged its whole reservation.
//
// Whether the request was written is httptrace's WroteRequest, or the
// provider's answer having begun (the transport may call WroteRequest
// after the answer's headers were read): a request cut before either never
// reached a provider whole.
type link struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	// agent is the agent's request's context, which the relays also look
	// at between events (check): the watch on it runs apart, later.
	agent context.Context
	// stopDeadline releases the deadline's timer; unwatch the watch on
	// the agent's request.
	stopDeadline context.CancelFunc
	unwatch      func() bool
	stream       bool
	// sent: the request was written whole. gone: the agent hung up on a
	// stream after that, which is read on without being relayed.
	sent, gone atomic.Bool
}

// newLink ties a provider request to agent (the agent's request's
// context), ending by the call's deadline at the latest (or the task's,
// when taskFirst: it comes first).
func newLink(agent context.Context, deadline time.Time, taskFirst, stream bool) *link {
	l := &link{stream: stream, agent: agent}
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(agent))
	why := &endedError{budget.OutcomeTimeout, errCallTimeout}
	if taskFirst {
		why = &endedError{budget.OutcomeTaskEnded, errTaskDeadline}
	}
	l.ctx, l.stopDeadline = context.WithDeadlineCause(ctx, deadline, why)
	l.cancel = cancel
	l.unwatch = context.AfterFunc(agent, func() { l.agentEnded(context.Cause(agent)) })
	return l
}

// agentEnded reacts to the agent's request ending for why.
func (l *link) agentEnded(why error) {
	if errors.Is(why, context.Canceled) {
		// The agent hung up: nothing of ours ended the call.
		if l.stream && l.sent.Load() {
			l.gone.Store(true)
			return
		}
		l.cancel(&endedError{budget.OutcomeClientClosed, why})
		return
	}
	l.cancel(&endedError{budget.OutcomeTaskEnded, why})
}

// check looks at the agent's request between events: a relay sees its end
// at the next event, whenever the watch's own goroutine runs.
func (l *link) check() {
	if l.agent.Err() != nil && !l.gone.Load() && l.ctx.Err() == nil {
		l.agentEnded(context.Cause(l.agent))
	}
}

// trace marks the link sent once the request has been written whole.
func (l *link) trace() *httptrace.ClientTrace {
	return &httptrace.ClientTrace{WroteRequest: func(i httptrace.WroteRequestInfo) {
		if i.Err == nil {
			l.sent.Store(true)
		}
	}}
}

// stop releases the link once the attempt is over.
func (l *link) stop() {
	l.unwatch()
	l.stopDeadline()
	l.cancel(nil)
}

// ended is why the call ended before the provider's answer did ("" while
// it runs, or when the provider answered whole): the ledger's outcome.
func (l *link) ended() string {
	if l.gone.Load() {
		return budget.OutcomeClientClosed
	}
	var e *endedError
	if l.ctx.Err() != nil && errors.As(context.Cause(l.ctx), &e) {
		return e.outcome
	}
	return ""
}

// err is the error a call the link ended returns: past its deadline the
// provider's failure (503 model_unavailable before the first byte), ended
// with the agent or the task ErrCallEnded (the handler answers by the
// agent's request's own cause).
func (l *link) err() error {
	why := context.Cause(l.ctx)
	if l.ended() == budget.OutcomeTimeout {
		return fmt.Errorf("%w: %w", ErrUpstream, why)
	}
	return fmt.Errorf("%w: %w", ErrCallEnded, why)
}

// unanswered is what an attempt that got no answer from the provider
// reports: nothing when its request never reached the provider, or the
// provider answered (an error answer is billed nothing); once it reached,
// ended by the agent, the task or the deadline, its prompt, and its whole
// reservation for a JSON call (nothing of the answer was read to count)
// and for a stream the agent had left (it was waited for, to its usage,
// and never came).
func (l *link) unanswered(prompt int64, a govern.Attempt) govern.Outcome {
	why := l.ended()
	if why == "" || !l.sent.Load() {
		return govern.Outcome{}
	}
	out := govern.Outcome{Sent: true, Ended: why, Usage: govern.Usage{Prompt: prompt}}
	if !l.stream || l.gone.Load() {
		out.Counted, out.Usage.Completion = max(a.MaxOutput, 0), max(a.MaxOutput, 0)
	}
	return out
}
