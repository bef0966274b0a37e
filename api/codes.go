package api

import (
	"context"
	"net/http"

	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/taskstore"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/policy"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
	"faregate/protect/turnstile"
)

// errorRows is the error vocabulary of the whole API: every error a handler
// can meet, by its sentinel, with the status, the stable code and the
// sentence people read. Typed errors unwrap to their sentinel; anything not
// listed is a 500 internal_error (and logged, as every 5xx is).
func errorRows() []entry {
	return []entry{
		{[]error{ErrInvalid}, http.StatusBadRequest, CodeInvalidRequest,
			"The request is not valid; see fields for details."},
		{[]error{ErrPromptRejected}, http.StatusBadRequest, CodePromptRejected,
			"The request text matches a rule this demo does not accept. Please rephrase it."},
		{[]error{policy.ErrInvalidKey, errNoKey, taskkey.ErrInvalid}, http.StatusUnauthorized, CodeInvalidAPIKey,
			"The API key is missing, unknown, disabled or malformed."},
		{[]error{ErrFetchRefused}, http.StatusBadRequest, CodeFetchRefused,
			"The URL is not a public http(s) address, or the page could not be fetched."},
		{[]error{taskkey.ErrFinished}, http.StatusConflict, CodeTaskFinished,
			"The task has already ended; its result was taken."},
		{[]error{turnstile.ErrRejected}, http.StatusForbidden, CodeTurnstileFailed,
			"The human check failed or expired. Please complete it again."},
		{[]error{task.ErrNotFound}, http.StatusNotFound, CodeTaskNotFound,
			"No such task."},
		{[]error{ErrNotFound}, http.StatusNotFound, CodeNotFound,
			"No such endpoint."},
		{[]error{ErrMethodNotAllowed}, http.StatusMethodNotAllowed, CodeMethodNotAllowed,
			"This method is not allowed here; see the Allow header."},
		{[]error{ErrTooLarge}, http.StatusRequestEntityTooLarge, CodeRequestTooLarge,
			"The request body is larger than 16384 bytes."},
		{[]error{ErrUnsupportedMedia}, http.StatusUnsupportedMediaType, CodeUnsupportedMedia,
			"Send the request as Content-Type: application/json."},
		{[]error{quota.ErrVisitorLimit}, http.StatusTooManyRequests, CodeIPLimit,
			"You have used all of today's demo tasks. They reset at 00:00 UTC."},
		{[]error{quota.ErrGlobalLimit}, http.StatusTooManyRequests, CodeGlobalLimit,
			"The demo has reached today's limit for everyone. It resets at 00:00 UTC."},
		{[]error{quota.ErrKeyLimit}, http.StatusTooManyRequests, CodeKeyDailyLimit,
			"This API key has used all of today's tasks. They reset at 00:00 UTC."},
		{[]error{budget.ErrExhausted}, http.StatusTooManyRequests, CodeBudgetExhausted,
			"Today's model budget is used up. It resets at 00:00 UTC."},
		{[]error{ErrTooManyStreams}, http.StatusTooManyRequests, CodeTooManyStreams,
			"Too many live progress streams are open from your address. Close one and try again."},
		{[]error{ratelimit.ErrRateLimited}, http.StatusTooManyRequests, CodeRateLimited,
			"Too many requests in the last minute. Please slow down."},
		{[]error{ratelimit.ErrTooManyFailedChecks}, http.StatusTooManyRequests, CodeTooManyFailedChecks,
			"Too many failed checks in the last hour. Please wait before trying again."},
		{[]error{ratelimit.ErrTokenRateLimited}, http.StatusTooManyRequests, CodeTokenRateLimited,
			"Too many model tokens in the last minute. Please wait before trying again."},
		{[]error{ratelimit.ErrAnomalyBlocked}, http.StatusTooManyRequests, CodeAnomalyBlocked,
			"Unusual input was seen from you several times in the last hour. Please wait before trying again."},
		{[]error{taskkey.ErrEventLimit}, http.StatusTooManyRequests, CodeEventLimit,
			"This task has posted all the progress events it may."},
		{[]error{taskkey.ErrToolLimit}, http.StatusTooManyRequests, CodeToolLimit,
			"This task has made all the tool calls it may."},
		{[]error{errPanic}, http.StatusInternalServerError, CodeInternal,
			"Something went wrong on our side."},
		{[]error{turnstile.ErrUnavailable, quota.ErrUnavailable, budget.ErrUnavailable,
			ratelimit.ErrUnavailable, taskstore.ErrUnavailable, taskkey.ErrUnavailable}, http.StatusServiceUnavailable, CodeProtectionDown,
			"The demo's protection is unavailable, so it is not accepting requests right now. Please try again shortly."},
		{[]error{errModelUnavailable}, http.StatusServiceUnavailable, CodeModelUnavailable,
			"The model provider is unavailable right now. Please try again shortly."},
		{[]error{aitf.ErrQueueFull}, http.StatusServiceUnavailable, CodeAITFQueueFull,
			"The server is too busy with automated traffic. Please try again shortly."},
		// A request out of time inside faregate (RequestTimeout) was busy
		// waiting for this replica: its lane or a Redis pool.
		{[]error{ErrServerBusy, context.DeadlineExceeded}, http.StatusServiceUnavailable, CodeServerBusy,
			"The server is busy. Please try again shortly."},
	}
}
