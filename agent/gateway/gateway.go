// Package gateway is the model endpoint an operator's own agent calls:
// POST /v1/chat/completions, POST /v1/responses (JSON and SSE),
// POST /v1/embeddings and GET /v1/models, wire-compatible with the official
// OpenAI clients, every call one governed model call of the task the
// request's key belongs to.
//
// The gateway routes nothing and reads no request body: New returns one
// handler per route (Handlers), which the router (package api) mounts on
// its method and path after gating the body once (media type and size)
// and checking the task key. Every refusal is written by the error writer
// the router hands New (Options.Errors), in the route's wire shape.
//
// The request is forwarded as received with only the governed fields
// patched (model, the output limit, stream_options); it is never decoded
// into typed structs and re-encoded, so fields other providers understand
// pass untouched. Fields that change the cost in ways a reservation cannot
// see are refused. Streams are relayed event by event as they arrive,
// counted as they pass (content, refusals, tool-call names and arguments,
// reasoning alike) and cut at the attempt's output limit, ending well
// formed for the official clients' stream readers.
//
// A JSON answer is counted before it is relayed, and cut to its
// reservation (or refused) when it passed it, as a stream is (cut.go);
// the repetition cut reads streams and JSON answers alike
// (Options.LoopThreshold). Once a request has been written to the
// provider it is billed whatever happens next: the provider's request is
// a link of its own, not cancelled with the agent's (link.go), so an
// agent that hangs up on a stream has it read on to its usage, and every
// call that ends before the provider's answer reports what it is to be
// charged and why (govern.Outcome.Ended).
//
// An answer completes for the client only once the Governor's Call has
// returned, its settle (and the task's model step) done: a JSON answer is
// written then, whole; a stream's terminator ([DONE], the Responses
// terminal event) is held until then, everything before it relayed as it
// comes. An agent that ends its task on an answer's last byte cannot end
// it before that call is on the task. The cost is the settle's round trip
// on the last byte.
//
// The package owns none of the budget: a Governor (the same governed call
// the built-in agent makes) reserves, paces, picks the primary or fallback
// upstream and settles; this package makes the attempt it is handed and
// reports what passed. Per-task call, embedding-call and parallelism
// limits are a Limiter (agent/tasklimits across replicas).
//
// Refusals and the code the integrator's error table gives them:
//
//	ErrNoTask                   401 invalid_api_key             authentication_error
//	ErrNotFound                 404 not_found                   invalid_request_error
//	ErrInvalidRequest           400 invalid_request             invalid_request_error (ParamError names the field)
//	ErrModelNotAllowed          400 model_not_allowed           invalid_request_error
//	ErrUnsupportedParameter     400 unsupported_parameter       invalid_request_error (ParamError names the field)
//	tasklimits.ErrStepLimit     429 step_limit                  insufficient_quota (x-should-retry: false)
//	tasklimits.ErrTooManyCalls  429 too_many_calls              rate_limit_error, Retry-After 1
//	tasklimits.ErrUnavailable   503 demo_protection_unavailable api_error
//	ErrCallEnded                409 task_finished               invalid_request_error
//	ErrUpstreamInvalid          400 invalid_request             invalid_request_error
//	ErrUpstream                 503 model_unavailable           api_error
//	ErrUpstreamAnswer           502 upstream_invalid            api_error
package gateway

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"time"

	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/protect/kit/memo"
	"faregate/protect/ratelimit"
)

// Kinds of governed call.
const (
	KindChat       = "chat"
	KindResponses  = "responses"
	KindEmbeddings = "embeddings"
)

// Governor makes one governed model call (agent/govern.Governor): bucket
// and input spike, reserve, pace, breaker and fallback, then the attempt
// (once, or again on the fallback while nothing reached the client),
// settle, ledger, and govern.Spec.After (the call's step). Its refusals come
// back from Call as errors (governError maps them for the error writer).
// Call settles the govern.Outcome the attempt returns even when the attempt also
// returns an error (a cut or broken stream still spent), takes govern.Spec.Hold
// (the task's call slot) in its first round trip and ends it with the
// settle.
type Governor interface {
	Call(ctx context.Context, spec govern.Spec, attempt func(ctx context.Context, a govern.Attempt) (govern.Outcome, error)) (govern.Result, error)
}

// Upstream is where an attempt goes: the model's upstream as the
// governor names it (govern.Model), or count_tokens' on an Anthropic
// upstream.
type Upstream struct {
	// BaseURL is the API base ("https://api.openai.com/v1").
	BaseURL string
	APIKey  string
	// Client makes the request (the offline model: an in-process Transport).
	Client *http.Client
}

// upstreamOf is where an attempt on m goes.
func upstreamOf(m govern.Model) Upstream {
	return Upstream{BaseURL: m.BaseURL, APIKey: m.APIKey, Client: m.HTTPClient}
}

// Task is the grant the auth middleware puts on a request.
type Task struct {
	ID, Principal, Tier string
	Deadline            time.Time
	// Models are the chat and responses models the key may use.
	Models []string
}

// Limiter bounds the calls of one task (agent/tasklimits.Store): Acquire
// takes a slot for one call of kind (tasklimits.Calls or Embeddings), and
// release ends it, not counted when used is false.
type Limiter interface {
	Acquire(ctx context.Context, t tasklimits.Task, kind tasklimits.Kind) (release func(ctx context.Context, used bool), err error)
}

// Options configure the handler.
type Options struct {
	Governor Governor
	// Limits bounds calls, embedding calls and parallelism per task; nil:
	// no limits (tests).
	Limits Limiter
	// Task reads the task grant off a request.
	Task func(*http.Request) (Task, bool)
	// Records reads a task's record (its principal, limits, precision:
	// Terms), once per task and replica.
	Records func(ctx context.Context, id string) (task.Record, error)
	// Steps posts a call's model step on its task's page through the
	// task's key, as the agent's own events go (nil: none).
	Steps interface {
		Step(ctx context.Context, g taskkey.Grant, raw []byte) error
	}
	// Invalid counts every call in its principal's invalid-ratio window,
	// invalid when the provider refused to answer it (nil: the ratio is
	// off).
	Invalid interface {
		Record(ctx context.Context, n ratelimit.Note) (int64, time.Duration, error)
	}
	// Errors is the /v1 error writer the router hands the gateway when it
	// builds it: the one table, in the shape of the route's wire.
	Errors ErrorWriter
	// RequestID names the request for the ledger; nil: none.
	RequestID func(*http.Request) string
	// EmbeddingModel is the one model /v1/embeddings may use; empty: 404.
	EmbeddingModel string
	// Embeddings is where an embeddings call goes when not to the
	// primary's upstream (FAREGATE_EMBEDDING_BASE_URL: an Anthropic
	// primary has no embeddings); nil: the primary's.
	Embeddings *Upstream
	// Wire is what the Governor's models speak, primary and fallback
	// alike: WireOpenAI (default) or WireAnthropic, with which the chat
	// and Responses routes refuse every call (400 invalid_request): the
	// provider speaks only Messages, and a call translated there would
	// lose what those wires carry.
	Wire string
	// FallbackModels are the models the Governor may send a call to other
	// than the one asked (its fallback): a call is reserved and sent with
	// at least the largest MinOutput of all of them, so a fallback whose
	// provider takes more than the primary's (OpenAI's Responses behind a
	// local model) is never sent more than was reserved.
	FallbackModels []string
	// ReferenceTokens is what a Responses item reference (an earlier
	// call's output item, by id: its content is the provider's) is held
	// at: the most output one call may have, FAREGATE_LLM_MAX_TOKENS;
	// 0: DefaultReferenceTokens.
	ReferenceTokens int64
	// MaxAnswer bounds a non-streamed embeddings answer; 0: 8 MiB. A
	// chat or Responses answer has the bound a stream has, set by its
	// reservation (see overStreamBytes).
	MaxAnswer int64
	// CallTimeout bounds one call, a stream's whole length and every
	// attempt included (FAREGATE_LLM_TIMEOUT); 0: DefaultCallTimeout. The
	// task's deadline bounds it too. A /v1 answer is not bound by the
	// server's write timeout: the handler lifts it to these.
	CallTimeout time.Duration
	// LegacyMaxTokens sends a chat call's output limit as max_tokens too
	// (FAREGATE_LLM_LEGACY_MAX_TOKENS: servers that read no other field).
	LegacyMaxTokens bool
	// LoopThreshold is the repetition cut (FAREGATE_LOOP_THRESHOLD with
	// FAREGATE_LOOP_CUT): an answer whose content or tool-call arguments
	// repeat past it is cut like a budget cut (protect/repetition); 0:
	// no cut.
	LoopThreshold float64
	// MaxEvent bounds one SSE line and one event's data; 0: 1 MiB. A longer
	// one is a malformed stream.
	MaxEvent int
	Logger   *slog.Logger
	// Now is the clock (Responses' created_at of a synthesized response).
	Now func() time.Time
}

// Defaults.
const (
	DefaultMaxAnswer = 8 << 20
	DefaultMaxEvent  = 1 << 20
	// DefaultReferenceTokens is FAREGATE_LLM_MAX_TOKENS' default.
	DefaultReferenceTokens = 1024
)

// ErrorWriter answers the gateway's refusals from the one /v1 error table
// (the api package's), in the wire shape of the request's route. The
// router hands it to New; the gateway writes no error envelope of its own.
type ErrorWriter interface {
	// WriteError answers err before any byte of an answer went out.
	WriteError(w http.ResponseWriter, r *http.Request, err error)
	// ErrorEvent is err as an error event's data inside an answer that
	// has already started (a stream the provider broke off).
	ErrorEvent(r *http.Request, err error) []byte
}

// Call serves one model route whose body the router has already gated
// (media type, size) and read: the bytes are the request's, as received.
type Call func(w http.ResponseWriter, r *http.Request, body []byte)

// Handlers are the model endpoint's routes, one per kind. The router
// mounts each on its own method and path (the gateway routes nothing):
//
//	POST /v1/chat/completions  Chat
//	POST /v1/responses         Responses
//	POST /v1/embeddings        Embeddings (404 not_found without an embedding model)
//	GET  /v1/models            Models
//	GET  /v1/models/{model}    Model (the id may hold slashes)
type Handlers struct {
	Chat, Responses, Embeddings Call
	Models, Model               http.Handler
	// Messages are the Messages routes (NewMessages), when the endpoint
	// has them: the router mounts them beside these.
	Messages *MessagesHandlers
}

// errMessagesOnly refuses a chat or Responses call when the provider
// speaks Anthropic's Messages only.
var errMessagesOnly = &ParamError{Err: ErrInvalidRequest, Field: "model",
	Reason: "this faregate's model provider speaks Anthropic's Messages API only: call POST /v1/messages"}

// handler serves the model endpoint.
type handler struct {
	o Options
	// termsMemo holds each task's Terms, read once (terms).
	termsMemo *memo.Memo[string, Terms]
	// memo remembers the messages of earlier calls (seen.go).
	memo *seenMemo
}

// New returns the model endpoint's handlers. It panics when Governor, Task
// or Errors is nil: those are wiring, not configuration.
func New(o Options) Handlers {
	h := newHandler(o)
	h.memo = newSeenMemo()
	return Handlers{
		Chat:       h.call(KindChat),
		Responses:  h.call(KindResponses),
		Embeddings: h.call(KindEmbeddings),
		Models: h.granted(func(w http.ResponseWriter, r *http.Request, t Task) {
			h.serveModels(w, r, t)
		}),
		Model: h.granted(func(w http.ResponseWriter, r *http.Request, t Task) {
			id, _ := strings.CutPrefix(r.URL.Path, "/v1/models/")
			h.serveModel(w, r, t, id)
		}),
	}
}

// newHandler is a handler on o, its defaults applied (New, NewMessages).
// It panics when Governor, Task or Errors is nil: those are wiring.
func newHandler(o Options) *handler {
	if o.Governor == nil || o.Task == nil || o.Errors == nil || o.Records == nil {
		panic("gateway: Governor, Task, Records and Errors are required")
	}
	if o.MaxAnswer <= 0 {
		o.MaxAnswer = DefaultMaxAnswer
	}
	if o.MaxEvent <= 0 {
		o.MaxEvent = DefaultMaxEvent
	}
	if o.CallTimeout <= 0 {
		o.CallTimeout = DefaultCallTimeout
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &handler{o: o, termsMemo: memo.New[string, Terms](10_000, nil)}
}

// call is the route of one kind of governed call.
func (h *handler) call(kind string) Call {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		t, ok := h.o.Task(r)
		if !ok {
			h.o.Errors.WriteError(w, r, ErrNoTask)
			return
		}
		if kind == KindEmbeddings && h.o.EmbeddingModel == "" {
			h.o.Errors.WriteError(w, r, ErrNotFound)
			return
		}
		if kind != KindEmbeddings && h.o.Wire == WireAnthropic {
			h.o.Errors.WriteError(w, r, errMessagesOnly)
			return
		}
		h.serveCall(w, r, t, kind, body)
	}
}

// granted serves a route that reads no body, for the request's task.
func (h *handler) granted(serve func(http.ResponseWriter, *http.Request, Task)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t, ok := h.o.Task(r)
		if !ok {
			h.o.Errors.WriteError(w, r, ErrNoTask)
			return
		}
		serve(w, r, t)
	})
}

// serveModels lists the models the key may use, in OpenAI's list shape.
func (h *handler) serveModels(w http.ResponseWriter, r *http.Request, t Task) {
	b := []byte(`{"object":"list","data":[`)
	for i, m := range h.models(t) {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendModel(b, m)
	}
	b = append(b, "]}"...)
	writeJSON(w, b)
}

// serveModel answers one model of serveModels' list as OpenAI's model
// object, and any other id 404 naming the parameter.
func (h *handler) serveModel(w http.ResponseWriter, r *http.Request, t Task, id string) {
	if slices.Contains(h.models(t), id) {
		writeJSON(w, appendModel(nil, id))
		return
	}
	h.o.Errors.WriteError(w, r, &ParamError{Err: ErrNotFound, Field: "model",
		Reason: "not a model this key may use (GET /v1/models lists them)"})
}

// models are the models the key may use: the task's, then the embedding
// model, each once.
func (h *handler) models(t Task) []string {
	out := make([]string, 0, len(t.Models)+1)
	for _, m := range slices.Concat(t.Models, []string{h.o.EmbeddingModel}) {
		if m != "" && !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	return out
}

// appendModel appends model m as OpenAI's model object.
func appendModel(b []byte, m string) []byte {
	b = append(b, `{"id":`...)
	b = appendJSONString(b, m)
	return append(b, `,"object":"model","created":0,"owned_by":"faregate"}`...)
}

var errTooLong = errors.New("gateway: too long")

// readAtMost reads all of rd into a buffer sized for hint bytes, failing
// with errTooLong past max.
func readAtMost(rd io.Reader, hint, max int64) ([]byte, error) {
	if hint > max+1 {
		hint = max + 1
	}
	if hint < 512 {
		hint = 512
	}
	buf := make([]byte, 0, hint)
	lr := io.LimitReader(rd, max+1)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := lr.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > max {
			return nil, errTooLong
		}
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return nil, err
		}
	}
}

func writeJSON(w http.ResponseWriter, b []byte) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", itoa(int64(len(b))))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}
