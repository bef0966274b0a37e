// Package api is faregate's HTTP surface: the task gate (POST /api/tasks),
// task reads and live events, usage for API keys, the page's config, health
// and metrics.
package api

import (
	"errors"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"faregate/protect/codes"
	"faregate/protect/kit/jsonstr"
)

// Errors that start in this package. Refusals decided elsewhere arrive as
// those packages' sentinels (or typed errors wrapping them) and are mapped
// by the same table.
var (
	ErrUnsupportedMedia = errors.New("api: unsupported media type")
	ErrTooLarge         = errors.New("api: request body too large")
	ErrInvalid          = errors.New("api: invalid request")
	ErrNotFound         = errors.New("api: no such endpoint")
	ErrMethodNotAllowed = errors.New("api: method not allowed")
	ErrTooManyStreams   = errors.New("api: too many event streams for this principal")
	ErrServerBusy       = errors.New("api: server busy")
	ErrPromptRejected   = errors.New("api: prompt rejected")
)

// InvalidError is a 400 with a message per field.
type InvalidError struct{ Fields map[string]string }

func (e *InvalidError) Error() string {
	keys := slices.Sorted(maps.Keys(e.Fields))
	return "api: invalid request: " + strings.Join(keys, ", ")
}

// Unwrap lets errors.Is(err, ErrInvalid) match.
func (e *InvalidError) Unwrap() error { return ErrInvalid }

// invalid is a 400 naming one field.
func invalid(field, msg string) error { return &InvalidError{Fields: map[string]string{field: msg}} }

// PromptRejectedError names the static rule that refused the request text.
type PromptRejectedError struct{ Rule string }

func (e *PromptRejectedError) Error() string { return "api: prompt rejected by rule " + e.Rule }

// Unwrap lets errors.Is(err, ErrPromptRejected) match.
func (e *PromptRejectedError) Unwrap() error { return ErrPromptRejected }

// retryError is a refusal of this package with a fixed Retry-After.
type retryError struct {
	err   error
	after time.Duration
}

func (e *retryError) Error() string             { return e.err.Error() }
func (e *retryError) Unwrap() error             { return e.err }
func (e *retryError) RetryAfter() time.Duration { return e.after }

// retryAfterUnavailable is the Retry-After of a 503 that names none, and
// retryAfterMax503 the longest a 503 may ask for (as documented: a few
// seconds, at most 30).
const (
	retryAfterUnavailable = 5 * time.Second
	retryAfterMax503      = 30 * time.Second
)

// errorSpec is the answer to one kind of error: its status, its code and
// the sentence people read. Clients switch on the code.
type errorSpec struct {
	status  int
	code    string
	message string
	// logged marks errors worth one log line each: 5xx only.
	logged bool
	// body is the envelope up to the request id, pre-encoded once.
	head []byte
}

// errorTable maps each sentinel (after unwrapping typed errors down to it)
// to its answer. It is the one place where an error chooses its code.
type errorTable struct {
	bySentinel map[error]*errorSpec
	byCode     map[string]*errorSpec
	internal   *errorSpec
}

// entry is one row of the table, as newErrorTable takes it.
type entry struct {
	errs    []error
	status  int
	code    string
	message string
}

func newErrorTable(rows []entry) *errorTable {
	t := &errorTable{bySentinel: map[error]*errorSpec{}, byCode: map[string]*errorSpec{}}
	for _, row := range rows {
		spec := t.byCode[row.code]
		if spec == nil {
			spec = &errorSpec{status: row.status, code: row.code, message: row.message, logged: row.status >= 500}
			spec.head = []byte(`{"error":{"code":` + jsonstr.Quote(row.code) + `,"message":` + jsonstr.Quote(row.message))
			t.byCode[row.code] = spec
		}
		for _, e := range row.errs {
			if _, dup := t.bySentinel[e]; dup {
				panic("api: error mapped twice: " + e.Error())
			}
			t.bySentinel[e] = spec
		}
	}
	t.internal = t.byCode[codes.InternalError]
	if t.internal == nil {
		panic("api: error table without " + codes.InternalError)
	}
	return t
}

// defaultErrors is the table of an answer written where no server is at
// hand (writeJSON's own failure): the one table words that too.
var defaultErrors = newErrorTable(errorRows())

// writeBare answers spec where no request is at hand (no request id, no
// state to record): the table's envelope, with its status.
func (t *errorTable) writeBare(w http.ResponseWriter, spec *errorSpec) {
	jsonHeaders(w.Header())
	w.WriteHeader(spec.status)
	b := make([]byte, 0, len(spec.head)+3)
	_, _ = w.Write(append(append(b, spec.head...), "}}\n"...))
}

// lookup walks err's chain (and joined errors) to the first mapped
// sentinel; anything unknown is an internal error.
func (t *errorTable) lookup(err error) *errorSpec {
	for e := err; e != nil; {
		if spec, ok := t.bySentinel[e]; ok {
			return spec
		}
		switch u := e.(type) {
		case interface{ Unwrap() error }:
			e = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, inner := range u.Unwrap() {
				if spec := t.lookup(inner); spec != t.internal {
					return spec
				}
			}
			return t.internal
		default:
			return t.internal
		}
	}
	return t.internal
}

// Codes lists every code the table can answer with, sorted (for the
// OpenAPI enum test and the page's message tables).
func (t *errorTable) Codes() []string { return slices.Sorted(maps.Keys(t.byCode)) }

// retryAfter is the Retry-After of a refusal with spec: the error's own
// RetryAfter when it has one, else the default; 503s stay within 30 s.
// Whole seconds, rounded up: the same rule as the RateLimit fields' t.
func retryAfter(spec *errorSpec, err error) (int64, bool) {
	if spec.status != http.StatusTooManyRequests && spec.status != http.StatusServiceUnavailable {
		return 0, false
	}
	var d time.Duration
	if ra, ok := err.(interface{ RetryAfter() time.Duration }); ok {
		d = ra.RetryAfter()
	} else if errors.As(err, &ra) {
		d = ra.RetryAfter()
	}
	if d <= 0 {
		d = retryAfterUnavailable
	}
	if spec.status == http.StatusServiceUnavailable && d > retryAfterMax503 {
		d = retryAfterMax503
	}
	return ceilSeconds(d), true
}

// ceilSeconds rounds d up to whole seconds, at least 1: the one rounding
// rule for Retry-After and the RateLimit t parameter.
func ceilSeconds(d time.Duration) int64 {
	s := int64((d + time.Second - 1) / time.Second)
	return max(s, 1)
}
