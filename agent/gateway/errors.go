package gateway

import (
	"errors"
	"fmt"
	"time"

	"faregate/protect/breaker"
)

// Refusals of the model endpoint. The integrator's error table maps each to
// a status, a stable code and an OpenAI error type (see the package doc);
// typed errors below unwrap to one of these.
var (
	// ErrNoTask: the request carries no task grant (the auth middleware did
	// not run, or let it through without one). 401 invalid_api_key.
	ErrNoTask = errors.New("gateway: no task on the request")
	// ErrNotFound: no such /v1 route, or /v1/embeddings with no embedding
	// model configured. 404 not_found.
	ErrNotFound = errors.New("gateway: no such endpoint")
	// ErrInvalidRequest: the body is not a JSON object, a field has the
	// wrong type, or a field appears twice. 400 invalid_request.
	ErrInvalidRequest = errors.New("gateway: invalid request")
	// ErrModelNotAllowed: the model is not one GET /v1/models lists for
	// the key. 400 model_not_allowed.
	ErrModelNotAllowed = errors.New("gateway: model not allowed")
	// ErrUnsupportedParameter: a field that changes the cost in a way a
	// reservation cannot see. 400 unsupported_parameter (see ParamError).
	ErrUnsupportedParameter = errors.New("gateway: unsupported parameter")
	// ErrCallEnded: the call's context ended before an answer started —
	// the task ended (its grant is cancelled) or the client left. 409
	// task_finished (a client that left reads nothing).
	ErrCallEnded = errors.New("gateway: the call ended before it was answered")
	// ErrUpstreamInvalid: the model provider refused the request as
	// invalid (400, 404, 409, 413, 422). 400 invalid_request. It is the
	// caller's request, not the provider's health: its UpstreamError
	// tells the breaker so (breaker.CallerFault), and it is not counted.
	ErrUpstreamInvalid = errors.New("gateway: the model provider refused the request")
	// ErrUpstream: the model provider failed (connection, 401/403/408/429,
	// 5xx, an answer that is not what the wire promises). The breaker
	// counts it (a 429 at most once per its Retry-After) and the governor
	// may try the fallback while Started is false; what reaches the writer
	// maps to 503 model_unavailable.
	ErrUpstream = errors.New("gateway: the model provider failed")
	// ErrUpstreamAnswer: the model provider's answer passed its
	// reservation (or the answer bound) and cannot be cut well formed
	// (several choices, texts that are not strings, an answer too large to
	// read whole). 502 upstream_invalid. The call is charged what the
	// provider produced.
	ErrUpstreamAnswer = errors.New("gateway: the model provider's answer cannot be relayed within its reservation")
	// ErrEndsTask marks a refusal that ends the task itself (an input
	// spike): the task's end then cuts the call's request while its answer
	// is being written, and the refusal, not that cut (409 task_finished),
	// is the answer. It joins the refusal's own error, which the table
	// maps.
	ErrEndsTask = errors.New("gateway: the refusal ends the task")
)

// ParamError names the request field behind a refusal. It unwraps to its
// sentinel (ErrUnsupportedParameter or ErrInvalidRequest); Param is the
// OpenAI error's "param".
type ParamError struct {
	Err    error
	Field  string
	Reason string
}

func (e *ParamError) Error() string {
	return fmt.Sprintf("%v: %s: %s", e.Err, e.Field, e.Reason)
}

// Unwrap returns the sentinel.
func (e *ParamError) Unwrap() error { return e.Err }

// Param is the offending field, in the dotted form OpenAI uses
// ("tools[2].type").
func (e *ParamError) Param() string { return e.Field }

func unsupported(field, reason string) error {
	return &ParamError{Err: ErrUnsupportedParameter, Field: field, Reason: reason}
}

func invalid(field, reason string) error {
	return &ParamError{Err: ErrInvalidRequest, Field: field, Reason: reason}
}

// UpstreamError is a provider answer with a status other than 2xx. It
// unwraps to ErrUpstreamInvalid or ErrUpstream, and tells the breaker
// whose fault it is (breaker.Judged).
type UpstreamError struct {
	Status int
	// RetryAfter is the provider's Retry-After, if it sent one (bounded).
	After time.Duration
	err   error
}

func (e *UpstreamError) Error() string {
	return fmt.Sprintf("%v: status %d", e.err, e.Status)
}

// Unwrap returns the sentinel.
func (e *UpstreamError) Unwrap() error { return e.err }

// RetryAfter is the provider's Retry-After (0 when none).
func (e *UpstreamError) RetryAfter() time.Duration { return e.After }

// BreakerFault implements breaker.Judged: the status decides.
func (e *UpstreamError) BreakerFault() breaker.Fault { return breaker.StatusFault(e.Status) }

var _ breaker.Judged = (*UpstreamError)(nil)

// HTTPStatus is the provider's status, for the ledger.
func (e *UpstreamError) HTTPStatus() int { return e.Status }
