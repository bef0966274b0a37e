package api

import (
	"context"
	"net/http"

	"faregate/agent/gateway"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/agent/taskstore"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/policy"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
	"faregate/protect/turnstile"
	"slices"
)

// errorRows is the error vocabulary of the whole API: every error a handler
// can meet, by its sentinel, with the status, the stable code and the
// sentence people read. Typed errors unwrap to their sentinel; anything not
// listed is a 500 internal_error (and logged, as every 5xx is).
func errorRows() []entry {
	return []entry{
		{[]error{ErrInvalid, gateway.ErrInvalidRequest, gateway.ErrUpstreamInvalid}, http.StatusBadRequest, codes.InvalidRequest,
			"The request is not valid; see fields for details."},
		{[]error{ErrPromptRejected}, http.StatusBadRequest, codes.PromptRejected,
			"The request text matches a rule this demo does not accept. Please rephrase it."},
		{[]error{policy.ErrInvalidKey, errNoKey, taskkey.ErrInvalid, gateway.ErrNoTask}, http.StatusUnauthorized, codes.InvalidAPIKey,
			"The API key is missing, unknown, disabled or malformed."},
		{[]error{ErrFetchRefused}, http.StatusBadRequest, codes.FetchRefused,
			"The URL is not a public http(s) address, or the page could not be fetched."},
		{[]error{taskkey.ErrFinished, gateway.ErrCallEnded}, http.StatusConflict, codes.TaskFinished,
			"The task has already ended; its key no longer works."},
		{[]error{gateway.ErrModelNotAllowed}, http.StatusBadRequest, codes.ModelNotAllowed,
			"This model is not one the task's key may use; see GET /v1/models."},
		{[]error{gateway.ErrUnsupportedParameter}, http.StatusBadRequest, codes.UnsupportedParameter,
			"A parameter changes the cost in a way the task's budget cannot see, so it is not accepted here."},
		{[]error{tasklimits.ErrStepLimit}, http.StatusTooManyRequests, codes.StepLimit,
			"This task has made all the model calls (or embedding calls) it may make."},
		{[]error{tasklimits.ErrTooManyCalls}, http.StatusTooManyRequests, codes.TooManyCalls,
			"Too many model calls of this task are in flight. Wait for one to end."},
		{[]error{ratelimit.ErrInputSpike}, http.StatusTooManyRequests, codes.InputSpike,
			"This prompt is far larger than this visitor's usual, so the call was not made and the task ends."},
		{[]error{turnstile.ErrRejected}, http.StatusForbidden, codes.TurnstileFailed,
			"The human check failed or expired. Please complete it again."},
		{[]error{task.ErrNotFound}, http.StatusNotFound, codes.TaskNotFound,
			"No such task."},
		{[]error{ErrNotFound, gateway.ErrNotFound}, http.StatusNotFound, codes.NotFound,
			"No such endpoint."},
		{[]error{ErrMethodNotAllowed}, http.StatusMethodNotAllowed, codes.MethodNotAllowed,
			"This method is not allowed here; see the Allow header."},
		{[]error{ErrTooLarge}, http.StatusRequestEntityTooLarge, codes.RequestTooLarge,
			"The request body is too large: /api takes at most 16384 bytes, /v1 at most FAREGATE_V1_MAX_BODY."},
		{[]error{ErrUnsupportedMedia}, http.StatusUnsupportedMediaType, codes.UnsupportedMediaType,
			"Send the request as Content-Type: application/json."},
		{[]error{quota.ErrVisitorLimit}, http.StatusTooManyRequests, codes.DemoIPLimitReached,
			"You have used all of today's demo tasks. They reset at 00:00 UTC."},
		{[]error{quota.ErrGlobalLimit}, http.StatusTooManyRequests, codes.DemoGlobalLimitReached,
			"The demo has reached today's limit for everyone. It resets at 00:00 UTC."},
		{[]error{quota.ErrKeyLimit}, http.StatusTooManyRequests, codes.KeyDailyLimitReached,
			"This API key has used all of today's tasks. They reset at 00:00 UTC."},
		{[]error{budget.ErrExhausted, ratelimit.ErrHourExhausted}, http.StatusTooManyRequests, codes.DemoBudgetExhausted,
			"Today's model budget is used up. It resets at 00:00 UTC."},
		{[]error{ErrTooManyStreams}, http.StatusTooManyRequests, codes.TooManyStreams,
			"Too many live progress streams are open from your address. Close one and try again."},
		{[]error{ratelimit.ErrRateLimited}, http.StatusTooManyRequests, codes.RateLimited,
			"Too many requests in the last minute. Please slow down."},
		{[]error{ratelimit.ErrTooManyFailedChecks}, http.StatusTooManyRequests, codes.TooManyFailedChecks,
			"Too many failed checks in the last hour. Please wait before trying again."},
		{[]error{ratelimit.ErrTokenRateLimited}, http.StatusTooManyRequests, codes.TokenRateLimited,
			"Too many model tokens in the last minute. Please wait before trying again."},
		{[]error{ratelimit.ErrInvalidRatio}, http.StatusTooManyRequests, codes.InvalidRatio,
			"Too many of your requests in the last 10 minutes were invalid. Please wait before trying again."},
		{[]error{ratelimit.ErrAnomalyBlocked}, http.StatusTooManyRequests, codes.AnomalyBlocked,
			"Unusual input was seen from you several times in the last hour. Please wait before trying again."},
		{[]error{tasklimits.ErrEventLimit}, http.StatusTooManyRequests, codes.EventLimit,
			"This task has posted all the progress events it may."},
		{[]error{tasklimits.ErrToolLimit}, http.StatusTooManyRequests, codes.ToolLimit,
			"This task has made all the tool calls it may."},
		{[]error{errPanic}, http.StatusInternalServerError, codes.InternalError,
			"Something went wrong on our side."},
		{[]error{turnstile.ErrUnavailable, quota.ErrUnavailable, budget.ErrUnavailable,
			ratelimit.ErrUnavailable, taskstore.ErrUnavailable, taskkey.ErrUnavailable, tasklimits.ErrUnavailable}, http.StatusServiceUnavailable, codes.DemoProtectionUnavailable,
			"The demo's protection is unavailable, so it is not accepting requests right now. Please try again shortly."},
		{[]error{errModelUnavailable, gateway.ErrUpstream}, http.StatusServiceUnavailable, codes.ModelUnavailable,
			"The model provider is unavailable right now. Please try again shortly."},
		{[]error{gateway.ErrUpstreamAnswer}, http.StatusBadGateway, codes.UpstreamInvalid,
			"The model provider's answer was longer than the call's reservation and could not be cut well formed, so it was not relayed."},
		{[]error{aitf.ErrQueueFull}, http.StatusServiceUnavailable, codes.AITFQueueFull,
			"The server is too busy with automated traffic. Please try again shortly."},
		// A request out of time inside faregate (RequestTimeout) was busy
		// waiting for this replica: its lane or a Redis pool.
		{[]error{ErrServerBusy, context.DeadlineExceeded}, http.StatusServiceUnavailable, codes.ServerBusy,
			"The server is busy. Please try again shortly."},
	}
}

// taskErrorCodes are the codes a failed task ends with (error.code of GET
// /api/tasks/{id} and of the final event): what the runs and the task
// runner produce today.
func taskErrorCodes() []string {
	return []string{codes.ModelUnavailable, codes.AgentFailed, codes.WorkerLost, codes.InputSpike, codes.TokenRateLimited,
		codes.AgentUnreachable, codes.AgentTimeout}
}

// warningCodes are the warnings a finished run may carry (warnings and
// result.warnings).
func warningCodes() []string {
	return []string{
		codes.WeatherUnavailable, codes.SearchUnavailable, codes.FetchFailed, codes.DownstreamPushback,
		codes.BudgetExhausted, codes.OutputTruncated, codes.OutputLoop, codes.StepLimit, codes.ToolLimit,
		codes.TimeLimit, codes.ToolLoop, codes.LowPrecision, codes.FallbackModel, codes.Throttled, codes.Downgraded,
	}
}

// Codes lists every error code the API can answer with, sorted.
func Codes() []string { return newErrorTable(errorRows()).Codes() }

// CodeStatus is the HTTP status an error code is answered with (false for
// a code the table does not know).
func CodeStatus(code string) (int, bool) {
	spec, ok := newErrorTable(errorRows()).byCode[code]
	if !ok {
		return 0, false
	}
	return spec.status, true
}

// TaskErrorCodes lists the codes a failed task may end with, sorted.
func TaskErrorCodes() []string { return slices.Sorted(slices.Values(taskErrorCodes())) }

// WarningCodes lists the warnings a finished run may carry, sorted.
func WarningCodes() []string { return slices.Sorted(slices.Values(warningCodes())) }
