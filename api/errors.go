// Package api is faregate's HTTP surface: the task gate (POST /api/tasks),
// task reads and live events, the page's config, health and metrics.
package api

import (
	"encoding/json"
	"net/http"
	"strconv"
	"time"
)

// Stable error codes, as ../shared/CONTRACT.md fixes them. The page maps
// each to a message; never rename one.
const (
	CodeInvalidRequest   = "invalid_request"
	CodeTurnstileFailed  = "turnstile_failed"
	CodeTaskNotFound     = "task_not_found"
	CodeRequestTooLarge  = "request_too_large"
	CodeUnsupportedMedia = "unsupported_media_type"
	CodeIPLimit          = "demo_ip_limit_reached"
	CodeGlobalLimit      = "demo_global_limit_reached"
	CodeBudgetExhausted  = "demo_budget_exhausted"
	CodeInternal         = "internal_error"
	CodeProtectionDown   = "demo_protection_unavailable"
	CodeModelUnavailable = "model_unavailable"
	CodeAITFQueueFull    = "aitf_queue_full"
	CodeMethodNotAllowed = "method_not_allowed"
	CodeNotFound         = "not_found"
)

// retryAfterUnavailable is the Retry-After (seconds) of a 503 that names none.
const retryAfterUnavailable = 5

// errorSpec is the status and public message of a code. The message is for
// people; clients switch on the code.
type errorSpec struct {
	status  int
	message string
}

var errorTable = map[string]errorSpec{
	CodeInvalidRequest:   {http.StatusBadRequest, "The request is not valid; see fields for details."},
	CodeTurnstileFailed:  {http.StatusForbidden, "The human check failed or expired. Please complete it again."},
	CodeTaskNotFound:     {http.StatusNotFound, "No such task."},
	CodeRequestTooLarge:  {http.StatusRequestEntityTooLarge, "The request body is larger than 16384 bytes."},
	CodeUnsupportedMedia: {http.StatusUnsupportedMediaType, "Send the request as Content-Type: application/json."},
	CodeIPLimit:          {http.StatusTooManyRequests, "You have used all of today's demo tasks. They reset at 00:00 UTC."},
	CodeGlobalLimit:      {http.StatusTooManyRequests, "The demo has reached today's limit for everyone. It resets at 00:00 UTC."},
	CodeBudgetExhausted:  {http.StatusTooManyRequests, "Today's model token budget is used up. It resets at 00:00 UTC."},
	CodeInternal:         {http.StatusInternalServerError, "Something went wrong on our side."},
	CodeProtectionDown:   {http.StatusServiceUnavailable, "The demo's protection is unavailable, so it is not accepting tasks right now. Please try again shortly."},
	CodeModelUnavailable: {http.StatusServiceUnavailable, "The model provider is unavailable right now. Please try again shortly."},
	CodeAITFQueueFull:    {http.StatusServiceUnavailable, "The server is too busy with automated traffic. Please try again shortly."},
	CodeMethodNotAllowed: {http.StatusMethodNotAllowed, "This method is not allowed here."},
	CodeNotFound:         {http.StatusNotFound, "No such endpoint."},
}

type errorBody struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code      string            `json:"code"`
	Message   string            `json:"message"`
	RequestID string            `json:"request_id,omitempty"`
	Fields    map[string]string `json:"fields,omitempty"`
}

// writeError writes the contract's error envelope for code. retryAfter is
// sent on 429 and 503 (0 picks the default for 503s). Only 5xx are logged,
// and never with a client-visible err text.
func writeError(w http.ResponseWriter, r *http.Request, code string, retryAfter time.Duration, fields map[string]string) {
	spec, ok := errorTable[code]
	if !ok {
		code, spec = CodeInternal, errorTable[CodeInternal]
	}
	switch spec.status {
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		secs := int64((retryAfter + time.Second - 1) / time.Second)
		if secs <= 0 {
			secs = retryAfterUnavailable
		}
		if spec.status == http.StatusServiceUnavailable && secs > 30 {
			secs = 30
		}
		w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
	}
	writeJSON(w, spec.status, errorBody{Error: errorDetail{
		Code: code, Message: spec.message, RequestID: RequestID(r.Context()), Fields: fields,
	}})
}

// writeJSON writes v as JSON with status; API answers are never cached.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	// Once the header is out an encoding or write error cannot reach the
	// client; the access log records the status that was sent.
	_ = json.NewEncoder(w).Encode(v)
}
