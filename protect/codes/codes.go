// Package codes is faregate's stable vocabulary: every error code an HTTP
// answer carries, every code a failed task ends with and every warning a
// finished run reports, each defined once here. The operator's manual fixes the
// strings; clients switch on them, so never rename one.
//
// The package imports nothing, so every floor can name a code without
// importing another's package: api maps the error codes to statuses in its
// one table (api/codes.go), agent/task and agent/tools end runs with the
// task and warning codes, protect/ratelimit names its refusals with them.
// Which codes the API documents, and with which status, is api's table's
// business; the page's messages, client.d.ts and openapi.json are tested
// against that table. A constant's name is its code in CamelCase (a test
// keeps it so), and a string that is both an error and a task or warning
// code (token_rate_limited, step_limit) is one constant of both.
package codes

// Error codes of HTTP answers (`{"error": {"code": …}}`).
const (
	InvalidRequest            = "invalid_request"
	PromptRejected            = "prompt_rejected"
	InvalidAPIKey             = "invalid_api_key"
	TurnstileFailed           = "turnstile_failed"
	TaskNotFound              = "task_not_found"
	NotFound                  = "not_found"
	MethodNotAllowed          = "method_not_allowed"
	RequestTooLarge           = "request_too_large"
	UnsupportedMediaType      = "unsupported_media_type"
	DemoIPLimitReached        = "demo_ip_limit_reached"
	DemoGlobalLimitReached    = "demo_global_limit_reached"
	KeyDailyLimitReached      = "key_daily_limit_reached"
	DemoBudgetExhausted       = "demo_budget_exhausted"
	TooManyStreams            = "too_many_streams"
	RateLimited               = "rate_limited"
	TooManyFailedChecks       = "too_many_failed_checks"
	TokenRateLimited          = "token_rate_limited"
	AnomalyBlocked            = "anomaly_blocked"
	InvalidRatio              = "invalid_ratio"
	InternalError             = "internal_error"
	DemoProtectionUnavailable = "demo_protection_unavailable"
	ModelUnavailable          = "model_unavailable"
	AITFQueueFull             = "aitf_queue_full"
	ServerBusy                = "server_busy"
)

// Error codes of the /v1 surface an operator's own agent calls (the
// manual's "bring your own agent"). StepLimit and ToolLimit are also
// warnings, InputSpike also a task code.
const (
	ModelNotAllowed      = "model_not_allowed"     // 400: a model GET /v1/models does not list
	UnsupportedParameter = "unsupported_parameter" // 400: a field that changes the cost unseen
	FetchRefused         = "fetch_refused"         // 400: /v1/tools/fetch to a non-public address
	TaskFinished         = "task_finished"         // 409: a result for a task that has ended
	StepLimit            = "step_limit"            // 429: the task's model calls are used
	ToolLimit            = "tool_limit"            // 429: the task's tool calls are used
	EventLimit           = "event_limit"           // 429: the task's progress events are used
	TooManyCalls         = "too_many_calls"        // 429: the task's parallel calls are in flight
	InputSpike           = "input_spike"           // 429: a prompt over 10× the principal's average
	UpstreamInvalid      = "upstream_invalid"      // 502: a provider's answer past its reservation that cannot be cut well formed
)

// Task error codes: why an admitted task failed (its quota slot stays
// used). ModelUnavailable, InputSpike and TokenRateLimited, above, are task
// codes too, of the same meaning as the HTTP answers.
const (
	// AgentFailed: the planner, or the operator's agent, could not finish
	// (a non-2xx answer, an invalid body, or an error it posted).
	AgentFailed = "agent_failed"
	// WorkerLost: the replica running the task stopped (its lease lapsed);
	// the task is not run twice, since it may have spent tokens.
	WorkerLost = "worker_lost"
	// AgentUnreachable: the operator's agent could not be reached
	// (connection refused, TLS failure, no answer before the deadline).
	AgentUnreachable = "agent_unreachable"
	// AgentTimeout: the operator's agent accepted the task (202) but posted
	// no result before the deadline.
	AgentTimeout = "agent_timeout"
)

// Warning codes a finished run may carry (the plan is still usable).
// StepLimit and ToolLimit, above, are warnings too.
const (
	WeatherUnavailable = "weather_unavailable"
	SearchUnavailable  = "search_unavailable"
	FetchFailed        = "fetch_failed"
	DownstreamPushback = "downstream_pushback"
	BudgetExhausted    = "budget_exhausted"
	OutputTruncated    = "output_truncated"
	OutputLoop         = "output_loop"
	TimeLimit          = "time_limit"
	ToolLoop           = "tool_loop"
	LowPrecision       = "low_precision"
	FallbackModel      = "fallback_model"
	// Throttled: the principal was past the soft share of its hourly
	// token quota while the task ran; Downgraded: its model calls went to
	// the fallback model first because of it.
	Throttled  = "throttled"
	Downgraded = "downgraded"
)
