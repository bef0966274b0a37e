// Package gateway is the model endpoint an operator's own agent calls:
// POST /v1/chat/completions, POST /v1/responses (JSON and SSE),
// POST /v1/embeddings and GET /v1/models, wire-compatible with the official
// OpenAI clients, every call one governed model call of the task the
// request's key belongs to.
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
// reports what passed. Per-task call and parallelism limits are a Limiter
// (RedisLimits across replicas).
//
// Refusals and the code the integrator's error table gives them:
//
//	ErrNoTask                401 invalid_api_key            authentication_error
//	ErrNotFound              404 not_found                  invalid_request_error
//	ErrMethodNotAllowed      405 method_not_allowed         invalid_request_error
//	ErrInvalidRequest        400 invalid_request            invalid_request_error (ParamError names the field)
//	ErrUnsupportedMedia      415 unsupported_media_type     invalid_request_error
//	ErrTooLarge              413 request_too_large          invalid_request_error
//	ErrModelNotAllowed       400 model_not_allowed          invalid_request_error
//	ErrUnsupportedParameter  400 unsupported_parameter      invalid_request_error (ParamError names the field)
//	ErrStepLimit             429 step_limit                 insufficient_quota (x-should-retry: false)
//	ErrTooManyCalls          429 too_many_calls             rate_limit_error, Retry-After 1
//	ErrLimitsUnavailable     503 demo_protection_unavailable api_error
//	ErrCallEnded             409 task_finished              invalid_request_error
//	ErrUpstreamInvalid       400 invalid_request            invalid_request_error
//	ErrUpstream              503 model_unavailable          api_error
package gateway

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"slices"
	"strings"
	"time"
)

// Kinds of governed call.
const (
	KindChat       = "chat"
	KindResponses  = "responses"
	KindEmbeddings = "embeddings"
)

// Governor makes one governed model call: bucket and input spike, reserve,
// pace, breaker and fallback, then attempt (once, or again on the fallback
// while nothing reached the client), settle, ledger, step. Its refusals
// come back from Call as errors the handler passes to the error writer
// unchanged. Call must settle the Outcome the attempt returns even when the
// attempt also returns an error (a cut or broken stream still spent).
//
// When Spec.Hold is set (the task's call and parallelism limits), Call
// takes it before the upstream call, in the same round trip as its own
// bookings if it can, returns its refusal unchanged, and calls its release
// once, with the settle if it can. An attempt made before the hold was
// taken is refused (fail closed), and a release the Governor did not call
// is called when Call returns.
type Governor interface {
	Call(ctx context.Context, spec Spec, attempt func(ctx context.Context, a Attempt) (Outcome, error)) (Outcome, error)
}

// Spec describes a call before it is made.
type Spec struct {
	TaskID, RequestID, Principal, Tier string
	// Kind is KindChat, KindResponses or KindEmbeddings.
	Kind string
	// Model is the model the client asked for.
	Model string
	// PromptTokens is the prompt as counted here (agent/tokens: the
	// model's tokenizer where known, else its conservative bound).
	PromptTokens int64
	// MaxOutput is the output limit the client asked for, raised to
	// MinOutput; 0 = none.
	MaxOutput int64
	// MinOutput is the least output limit the provider takes (16 for a
	// Responses call to an OpenAI model, else 1): the least a call may be
	// reserved and sent with. Sending more than is reserved would let an
	// honest provider bill past the reservation, unseen when the stream is
	// cut; a call that cannot afford its prompt and MinOutput is refused.
	MinOutput int64
	// Stream: the client asked for SSE.
	Stream bool
	// Hold takes the call's slot of the task's limits (nil: none; it is
	// set for chat and responses calls when Options.Limits is): release's
	// used is false when no attempt was made (the call is then not
	// counted); its ctx is the round trip's it rides in. See Governor.
	Hold func(ctx context.Context) (release func(ctx context.Context, used bool), err error)
}

// Upstream is where an attempt goes.
type Upstream struct {
	// BaseURL is the OpenAI-compatible API base ("https://api.openai.com/v1").
	BaseURL string
	APIKey  string
	// Client makes the request (the offline model: an in-process Transport).
	Client *http.Client
}

// Attempt is what the governor grants one try.
type Attempt struct {
	// Model is the name sent upstream (primary or fallback).
	Model    string
	Upstream Upstream
	Fallback bool
	// MaxOutput is the output limit sent upstream and the point a stream is
	// cut at: FAREGATE_LLM_MAX_TOKENS and what the task can still afford.
	// 0 for embeddings.
	MaxOutput int64
}

// Usage is what the provider reported.
type Usage struct {
	Prompt int64
	// Completion includes reasoning tokens.
	Completion int64
	// Reported: the provider sent a usage object. False: Prompt and
	// Completion are this package's estimate.
	Reported bool
	// Unreadable: the provider sent a usage object that does not say in
	// numbers what was used (a string for a count, a count missing). It
	// is Reported, Prompt and Completion are this package's estimate, and
	// the governor charges it as the contract says for an unparseable
	// report: the larger of the reservation and the count, alerted.
	Unreadable bool
	// Raw is the provider's usage JSON as received (bounded by the answer
	// bound), for the ledger.
	Raw string
}

// Outcome is what one attempt spent.
type Outcome struct {
	Usage Usage
	// Counted is this package's own count of the output tokens that passed
	// to the client: with the model's tokenizer (agent/tokens; its bound
	// where the tokenizer is unknown) for streams and report-less answers,
	// with the bound, which never counts lower, beside a usage report.
	Counted int64
	// Truncated: the stream was cut here (output limit, or the task ended).
	Truncated bool
	// Started: bytes reached the client, or the answer is committed to it
	// (held until Call returns); the governor must not retry.
	Started bool
	// Model is the model the provider said answered ("" when unknown).
	Model string
}

// Task is the grant the auth middleware puts on a request.
type Task struct {
	ID, Principal, Tier string
	Deadline            time.Time
	// Models are the chat and responses models the key may use.
	Models []string
}

// Options configure the handler.
type Options struct {
	Governor Governor
	// Limits bounds calls and parallelism per task; nil: no limits (tests).
	Limits Limiter
	// Task reads the task grant off a request.
	Task func(*http.Request) (Task, bool)
	// WriteError answers a refusal (OpenAI error shape, the api error table).
	WriteError func(http.ResponseWriter, *http.Request, error)
	// RequestID names the request for the ledger; nil: none.
	RequestID func(*http.Request) string
	// EmbeddingModel is the one model /v1/embeddings may use; empty: 404.
	EmbeddingModel string
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
	// MaxBody bounds a request body (FAREGATE_V1_MAX_BODY); 0: 2097152.
	MaxBody int64
	// MaxAnswer bounds a non-streamed provider answer; 0: 8 MiB.
	MaxAnswer int64
	// MaxEvent bounds one SSE line and one event's data; 0: 1 MiB. A longer
	// one is a malformed stream.
	MaxEvent int
	Logger   *slog.Logger
	// Now is the clock (Responses' created_at of a synthesized response).
	Now func() time.Time
}

// Defaults.
const (
	DefaultMaxBody   = 2097152
	DefaultMaxAnswer = 8 << 20
	DefaultMaxEvent  = 1 << 20
	// DefaultReferenceTokens is FAREGATE_LLM_MAX_TOKENS' default.
	DefaultReferenceTokens = 1024
)

// handler serves the model endpoint.
type handler struct {
	o Options
}

// New returns the handler for the /v1 model routes (paths as the client
// sends them: /v1/chat/completions, /v1/responses, /v1/embeddings,
// /v1/models). It panics when Governor, Task or WriteError is nil: those
// are wiring, not configuration.
func New(o Options) http.Handler {
	if o.Governor == nil || o.Task == nil || o.WriteError == nil {
		panic("gateway: Governor, Task and WriteError are required")
	}
	if o.MaxBody <= 0 {
		o.MaxBody = DefaultMaxBody
	}
	if o.MaxAnswer <= 0 {
		o.MaxAnswer = DefaultMaxAnswer
	}
	if o.MaxEvent <= 0 {
		o.MaxEvent = DefaultMaxEvent
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &handler{o: o}
}

// ServeHTTP routes by path and method.
func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var kind string
	method := http.MethodPost
	switch r.URL.Path {
	case "/v1/chat/completions":
		kind = KindChat
	case "/v1/responses":
		kind = KindResponses
	case "/v1/embeddings":
		kind = KindEmbeddings
	case "/v1/models":
		method = http.MethodGet
	default:
		// GET /v1/models/{model}: the official clients' models.retrieve
		// (a model id may hold slashes: "meta-llama/Llama-3.1-8B").
		if !strings.HasPrefix(r.URL.Path, "/v1/models/") {
			h.o.WriteError(w, r, ErrNotFound)
			return
		}
		method = http.MethodGet
	}
	if r.Method != method && !(method == http.MethodGet && r.Method == http.MethodHead) {
		w.Header().Set("Allow", method)
		h.o.WriteError(w, r, ErrMethodNotAllowed)
		return
	}
	t, ok := h.o.Task(r)
	if !ok {
		h.o.WriteError(w, r, ErrNoTask)
		return
	}
	if kind == "" {
		if id, one := strings.CutPrefix(r.URL.Path, "/v1/models/"); one {
			h.serveModel(w, r, t, id)
			return
		}
		h.serveModels(w, r, t)
		return
	}
	if kind == KindEmbeddings && h.o.EmbeddingModel == "" {
		h.o.WriteError(w, r, ErrNotFound)
		return
	}
	h.serveCall(w, r, t, kind)
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
	h.o.WriteError(w, r, &ParamError{Err: ErrNotFound, Field: "model",
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

// readBody reads a JSON body of at most MaxBody bytes: refused from the
// headers when Content-Length says more, by a bounded read otherwise.
func (h *handler) readBody(r *http.Request) ([]byte, error) {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || (mt != "application/json" && !strings.HasSuffix(mt, "+json")) {
			return nil, ErrUnsupportedMedia
		}
	}
	if r.ContentLength > h.o.MaxBody {
		return nil, ErrTooLarge
	}
	// A chunked body starts small and grows as it comes: the bound is
	// on what is sent, not an allocation every request makes up front.
	size := int64(16 << 10)
	if r.ContentLength >= 0 {
		size = r.ContentLength + 1
	}
	body, err := readAtMost(r.Body, size, h.o.MaxBody)
	if errors.Is(err, errTooLong) {
		return nil, ErrTooLarge
	}
	if err != nil {
		return nil, invalid("body", "could not be read")
	}
	return body, nil
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
