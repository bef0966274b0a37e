package gateway

import (
	"errors"
	"fmt"
	"time"
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
	// ErrMethodNotAllowed: a known path with another method. 405
	// method_not_allowed (Allow is set before the writer is called).
	ErrMethodNotAllowed = errors.New("gateway: method not allowed")
	// ErrInvalidRequest: the body is not a JSON object, a field has the
	// wrong type, or a field appears twice. 400 invalid_request.
	ErrInvalidRequest = errors.New("gateway: invalid request")
	// ErrUnsupportedMedia: a Content-Type other than JSON. 415
	// unsupported_media_type.
	ErrUnsupportedMedia = errors.New("gateway: unsupported media type")
	// ErrTooLarge: the body is over Options.MaxBody. 413 request_too_large.
	ErrTooLarge = errors.New("gateway: request body too large")
	// ErrModelNotAllowed: the model is not one GET /v1/models lists for
	// the key. 400 model_not_allowed.
	ErrModelNotAllowed = errors.New("gateway: model not allowed")
	// ErrUnsupportedParameter: a field that changes the cost in a way a
	// reservation cannot see. 400 unsupported_parameter (see ParamError).
	ErrUnsupportedParameter = errors.New("gateway: unsupported parameter")
	// ErrStepLimit: the task has made FAREGATE_AGENT_MAX_CALLS model
	// calls. 429 step_limit, type insufficient_quota (cannot clear before
	// the task ends).
	ErrStepLimit = errors.New("gateway: the task has no model calls left")
	// ErrTooManyCalls: FAREGATE_AGENT_MAX_PARALLEL calls of the task are in
	// flight. 429 too_many_calls, type rate_limit_error, Retry-After 1.
	ErrTooManyCalls = errors.New("gateway: too many model calls of the task in flight")
	// ErrLimitsUnavailable: the per-task limits could not be checked
	// (Redis failed). 503 demo_protection_unavailable: fail closed.
	ErrLimitsUnavailable = errors.New("gateway: per-task limits unavailable")
	// ErrCallEnded: the call's context ended before an answer started —
	// the task ended (its grant is cancelled) or the client left. 409
	// task_finished (a client that left reads nothing).
	ErrCallEnded = errors.New("gateway: the call ended before it was answered")
	// ErrUpstreamInvalid: the model provider refused the request as
	// invalid (400, 404, 413, 422). 400 invalid_request. It is the
	// caller's request, not the provider's health: no breaker failure.
	ErrUpstreamInvalid = errors.New("gateway: the model provider refused the request")
	// ErrUpstream: the model provider failed (connection, 401/403/429,
	// 5xx, an answer that is not what the wire promises). The governor
	// counts it for the breaker and may try the fallback while Started is
	// false; what reaches the writer maps to 503 model_unavailable.
	ErrUpstream = errors.New("gateway: the model provider failed")
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

// retryError carries a Retry-After with its sentinel, in the shape the
// api package's writer reads (Unwrap and RetryAfter).
type retryError struct {
	err   error
	after time.Duration
}

func (e *retryError) Error() string             { return e.err.Error() }
func (e *retryError) Unwrap() error             { return e.err }
func (e *retryError) RetryAfter() time.Duration { return e.after }

// UpstreamError is a provider answer with a status other than 2xx. It
// unwraps to ErrUpstreamInvalid or ErrUpstream.
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
