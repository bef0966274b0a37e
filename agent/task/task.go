// Package task holds what faregate knows about a trip-planning task: the
// request, the steps of its run, its result and its events. Its error and
// warning codes are faregate/codes'. It has no dependencies, so the API,
// the task store and the workflow can share it without importing each
// other.
package task

import (
	"encoding/json"
	"errors"
	"strings"
	"time"

	"faregate/protect/kit/randhex"
)

// Task statuses.
const (
	StatusQueued    = "queued"
	StatusRunning   = "running"
	StatusSucceeded = "succeeded"
	StatusFailed    = "failed"
)

// Model status values, as GET /api/config reports them.
const (
	ModelOK          = "ok"
	ModelDegraded    = "degraded"
	ModelUnavailable = "unavailable"
)

// Languages a plan can be written in (BCP 47 tags, as the page's lang
// attribute takes them).
const (
	LangEnglish = "en"
	LangChinese = "zh-CN"
)

// Request is what the visitor asked for, already validated by the API:
// a trip (Destination, Days, Interests) or, in the prompt form
// (FAREGATE_TASK_INPUT=prompt), a Prompt and nothing else but Language.
type Request struct {
	Destination string   `json:"destination"`
	Days        int      `json:"days"`
	Interests   []string `json:"interests"`
	// Language is the language the plan is to be written in: LangEnglish
	// or LangChinese; empty means LangEnglish.
	Language string `json:"language"`
	// Prompt is the visitor's text in the prompt form (NFKC, 1 to
	// FAREGATE_PROMPT_MAX_CHARS code points); a request with a Prompt is
	// written as {"prompt", "language"} (MarshalJSON).
	Prompt string `json:"prompt,omitempty"`
}

// Lang is the request's language with the default applied.
func (r Request) Lang() string {
	if r.Language == "" {
		return LangEnglish
	}
	return r.Language
}

// Step is one model call or tool call of a run.
type Step struct {
	Seq        int    `json:"seq"`
	Kind       string `json:"kind"` // model | tool
	Name       string `json:"name"`
	Status     string `json:"status"` // started | ok | failed | cached
	DurationMS int64  `json:"duration_ms"`
	Detail     string `json:"detail,omitempty"`
}

// Day is one day of an itinerary.
type Day struct {
	Day   int      `json:"day"`
	Title string   `json:"title"`
	Items []string `json:"items"`
}

// Result is the validated answer of a successful run.
type Result struct {
	Summary string `json:"summary"`
	Days    []Day  `json:"days"`
	// Text and Title are an external agent's answer (Markdown text, at
	// most MaxResultText bytes); a result with Text has no Summary or Days
	// and is written in its own shape (MarshalJSON).
	Text     string   `json:"text,omitempty"`
	Title    string   `json:"title,omitempty"`
	Warnings []string `json:"warnings"`
	// Model names what produced the plan; Offline is true for the built-in
	// deterministic demo planner, so no one mistakes it for an LLM.
	Model   string `json:"model"`
	Offline bool   `json:"offline"`
	// Language is the language the plan is written in, so the page can
	// mark it with a lang attribute.
	Language string `json:"language"`
	// Cached is true when the plan was served from the plan cache for the
	// same request instead of a new run (no tokens spent).
	Cached bool `json:"cached,omitempty"`
}

// Usage is the tokens the run's model calls consumed.
type Usage struct {
	PromptTokens     int64 `json:"prompt_tokens"`
	CompletionTokens int64 `json:"completion_tokens"`
}

// TaskError is why a task failed.
type TaskError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Task is the public view of a task, as GET /api/tasks/{id} returns it.
type Task struct {
	ID        string     `json:"id"`
	Status    string     `json:"status"`
	CreatedAt time.Time  `json:"created_at"`
	UpdatedAt time.Time  `json:"updated_at"`
	Request   Request    `json:"request"`
	Steps     []Step     `json:"steps"`
	Warnings  []string   `json:"warnings"`
	Result    *Result    `json:"result,omitempty"`
	Usage     Usage      `json:"usage"`
	Error     *TaskError `json:"error,omitempty"`
}

// Final reports whether the task will not change again.
func (t Task) Final() bool { return t.Status == StatusSucceeded || t.Status == StatusFailed }

// Record is a task as stored: the public Task plus what the server needs to
// run and account for it.
type Record struct {
	Task
	// Principal is who the task counts against, as budgets and the ledger
	// name it: "v_<visitor hash>" (never an address) or "k_<key id>".
	Principal string `json:"principal"`
	// Tier is the principal's tier when the task was admitted, and Limits
	// that tier's limits then: the run keeps them whatever a reload does.
	Tier      string    `json:"tier"`
	Limits    Limits    `json:"limits"`
	Day       string    `json:"day"`
	RequestID string    `json:"request_id,omitempty"`
	AITF      AITFTrace `json:"aitf"`
	// Trace is the W3C traceparent of the span that queued the task, so
	// its run joins the admitting request's trace on any replica.
	Trace string `json:"trace,omitempty"`
}

// Limits are the token limits a run is held to besides the site's.
type Limits struct {
	// TokensPerDay is the principal's daily tokens.
	TokensPerDay int64 `json:"tokens_per_day"`
	// TokensPerMinute is the principal's token bucket rate (0: none).
	TokensPerMinute int64 `json:"tokens_per_minute"`
	// TierTokens is the tier's share of the site's daily tokens (0: no
	// share is kept; the tier may use the whole site budget).
	TierTokens int64 `json:"tier_tokens"`
	// TokensPerHour is the principal's sliding hour of tokens (0: none),
	// and SoftTokens the use from which it is throttled (its calls go to
	// the fallback model first).
	TokensPerHour int64 `json:"tokens_per_hour,omitempty"`
	SoftTokens    int64 `json:"soft_tokens,omitempty"`
}

// AITFTrace is what the AI-traffic scorer said about the creating request.
type AITFTrace struct {
	Score    float64   `json:"score"`
	Vector   []float64 `json:"vector,omitempty"`
	Degraded bool      `json:"degraded"`
}

// Event types on a task's stream and over SSE.
const (
	EventStep      = "step"
	EventStatus    = "status"
	EventDone      = "done"
	EventKeepAlive = "keepalive" // never stored: produced while following
)

// Event is one entry of a task's event stream.
type Event struct {
	ID   string // the store's id of the event, used as the SSE id for Last-Event-ID
	Type string
	Data json.RawMessage
}

// ErrNotFound: no such task (or a malformed id, which cannot exist).
var ErrNotFound = errors.New("task: not found")

// NewID returns "t_" and 32 hex digits: 128 random bits, unguessable.
func NewID() string { return "t_" + randhex.New(16) }

// ValidID reports whether id has NewID's shape, so malformed ids are
// answered without touching a store.
func ValidID(id string) bool {
	if len(id) != 34 || !strings.HasPrefix(id, "t_") {
		return false
	}
	for _, c := range id[2:] {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}
