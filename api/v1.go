package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-chi/chi/v5"

	"faregate/agent/gateway"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/policy"
	"faregate/protect/principal"
)

// The /v1 surface is the external agent's (FAREGATE_AGENT_URL): the model
// endpoint (the gateway's handler), its tools and its progress, all on the
// Bearer task key of one running task. It skips the AITF scorer, the
// request window and the event-stream caps: its limits are the task's own.
// Its errors keep the OpenAI shape: ours plus "type".

// ErrFetchRefused: /v1/tools/fetch named no public http(s) address, or
// the page could not be fetched (the Fetcher wraps its reason in it).
var ErrFetchRefused = errors.New("api: fetch refused")

// DefaultV1MaxBody is FAREGATE_V1_MAX_BODY's default.
const DefaultV1MaxBody = 2 << 20

// TaskKeys is what /v1 needs of the task keys (agent/taskkey.Keys).
type TaskKeys interface {
	Authenticate(ctx context.Context, bearer string) (taskkey.Grant, error)
	Watch(ctx context.Context, g taskkey.Grant) (context.Context, context.CancelFunc)
	Event(ctx context.Context, g taskkey.Grant, data []byte) error
	Result(ctx context.Context, g taskkey.Grant, data []byte) error
}

// TaskLimits counts a task's tool calls and progress events against its
// limits (agent/tasklimits.Store, which counts its model calls too).
type TaskLimits interface {
	Take(ctx context.Context, t tasklimits.Task, kind tasklimits.Kind) error
}

// limitsTask is g's task as its limits know it.
func limitsTask(g taskkey.Grant) tasklimits.Task {
	return tasklimits.Task{ID: g.Task, Deadline: g.Deadline}
}

// Fetched is a page as /v1/tools/fetch answers it.
type Fetched struct {
	Status      int    `json:"status"`
	ContentType string `json:"content_type"`
	Text        string `json:"text"`
	Truncated   bool   `json:"truncated"`
}

// Fetcher fetches a page for a task through the outbound client of the
// built-in tools; a refusal wraps ErrFetchRefused.
type Fetcher interface {
	Fetch(ctx context.Context, g taskkey.Grant, url string, maxBytes int64) (Fetched, error)
	// Check refuses (ErrFetchRefused) a URL Fetch would refuse without
	// the network: asked before the tool call is counted.
	Check(url string) error
}

// V1 configures the /v1 surface (nil in Deps: there is none).
type V1 struct {
	Keys TaskKeys
	// Limits counts the fetches and events of a task (required).
	Limits TaskLimits
	Fetch  Fetcher
	// MaxBody is FAREGATE_V1_MAX_BODY (default DefaultV1MaxBody).
	MaxBody int64
	// MaxFetchBytes bounds max_bytes of a fetch (default 1 MiB).
	MaxFetchBytes int64
	// ResultWait bounds how long POST result waits for the lease holder
	// to store the result (default 60 s; at least 4/3 of the lease).
	ResultWait time.Duration
	// Gateway builds the model endpoint (agent/gateway.New), handed the
	// one /v1 error writer; nil: the model routes are not mounted (404).
	// Its handlers run behind the task key: the grant is in the request's
	// context (taskkey.FromContext), and the context ends when the task
	// does.
	Gateway func(errs gateway.ErrorWriter) gateway.Handlers
}

// Bounds of an agent's progress event (code points of the NFKC form).
const (
	eventNameMax   = 64
	eventDetailMax = 500
)

// v1Routes mounts /v1 on r: every path once, on its method, behind the one
// body gate (gateBody, with the /v1 limit) and the task key.
func (s *server) v1Routes(r chi.Router) {
	v := s.d.V1
	if v.MaxBody <= 0 {
		v.MaxBody = DefaultV1MaxBody
	}
	if v.MaxFetchBytes <= 0 {
		v.MaxFetchBytes = 1 << 20
	}
	keyed := r.With(gateBody(v.MaxBody, &v1TooLarge{v.MaxBody}, s.WriteV1Error), s.v1Auth)
	keyed.Method(http.MethodPost, "/v1/tasks/{id}/result", s.handleV1Result())
	keyed.Method(http.MethodPost, "/v1/tasks/{id}/events", s.handleV1Event())
	keyed.Method(http.MethodPost, "/v1/tools/fetch", s.handleV1Fetch())
	if v.Gateway == nil {
		return
	}
	g := v.Gateway(v1Errors{s})
	for path, call := range map[string]gateway.Call{
		"/v1/chat/completions": g.Chat,
		"/v1/responses":        g.Responses,
		"/v1/embeddings":       g.Embeddings,
	} {
		keyed.Method(http.MethodPost, path, s.v1Call(call))
	}
	models, model := g.Models, g.Model
	if ms := g.Messages; ms != nil {
		// Claude Code and the Claude Agent SDK add ?beta=true: the router
		// matches the path alone.
		keyed.Method(http.MethodPost, "/v1/messages", s.v1Call(ms.Messages))
		keyed.Method(http.MethodPost, "/v1/messages/count_tokens", s.v1Call(ms.CountTokens))
		models, model = byWire(ms.Models, g.Models), byWire(ms.Model, g.Model)
	}
	keyed.Method(http.MethodGet, "/v1/models", models)
	// A model id may hold slashes ("meta-llama/Llama-3.1-8B").
	keyed.Method(http.MethodGet, "/v1/models/*", model)
}

// byWire serves a request that carries anthropic-version (Anthropic's
// SDKs send it on every call) with anthropic, any other with openai.
func byWire(anthropic, openai http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if anthropicClient(r) {
			anthropic.ServeHTTP(w, r)
			return
		}
		openai.ServeHTTP(w, r)
	})
}

// anthropicClient reports whether r comes from an Anthropic client.
func anthropicClient(r *http.Request) bool { return len(r.Header["Anthropic-Version"]) > 0 }

// v1Call hands a model route the body the gate let through, read once.
func (s *server) v1Call(call gateway.Call) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := s.readV1Body(r)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		call(w, r, body)
	})
}

// isV1 reports whether path is the /v1 surface's.
func isV1(path string) bool { return path == "/v1" || strings.HasPrefix(path, "/v1/") }

// v1TooLarge is a /v1 body over its own limit (the table's sentence names
// /api's).
type v1TooLarge struct{ limit int64 }

func (e *v1TooLarge) Error() string { return "api: /v1 request body too large" }
func (e *v1TooLarge) Unwrap() error { return ErrTooLarge }
func (e *v1TooLarge) publicMessage() string {
	return "The request body is larger than " + strconv.FormatInt(e.limit, 10) + " bytes."
}

// v1Auth admits a request on a valid task key: its own task's paths only,
// only while the task runs. The handler's context carries the grant and
// ends when the task does, on whichever replica it ends.
func (s *server) v1Auth(next http.Handler) http.Handler {
	keys := s.d.V1.Keys
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, err := v1Key(r.Header)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		g, err := keys.Authenticate(r.Context(), token)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		if id := chi.URLParam(r, "id"); id != "" && id != g.Task {
			s.WriteV1Error(w, r, taskkey.ErrInvalid)
			return
		}
		if st := stateOf(r); st != nil {
			st.principal = grantPrincipal(g)
		}
		ctx, done := keys.Watch(r.Context(), g)
		defer done()
		next.ServeHTTP(w, r.WithContext(taskkey.WithGrant(ctx, g)))
	})
}

// v1Key is the task key a /v1 request carries: as a Bearer token (OpenAI's
// clients, Claude Code's ANTHROPIC_AUTH_TOKEN) or in x-api-key (Anthropic's
// SDKs), on every /v1 route. Two different keys are refused, not chosen
// between: which one a proxy on the way would read is not ours to guess.
func v1Key(h http.Header) (string, error) {
	bearer, hasBearer := policy.BearerToken(h)
	keys := h.Values("X-Api-Key")
	switch {
	case len(keys) > 1:
		return "", taskkey.ErrInvalid
	case len(keys) == 1 && hasBearer && keys[0] != bearer:
		return "", taskkey.ErrInvalid
	case len(keys) == 1:
		return keys[0], nil
	case hasBearer:
		return bearer, nil
	}
	return "", errNoKey
}

// grantPrincipal is the principal a task key acts for, for logs.
func grantPrincipal(g taskkey.Grant) principal.Principal {
	p := principal.FromAccount(g.Principal)
	p.Tier = g.Tier
	return p
}

// readV1Body reads a body within the /v1 limit.
func (s *server) readV1Body(r *http.Request) ([]byte, error) {
	return readBody(r, s.v1MaxBody(), &v1TooLarge{s.v1MaxBody()})
}

// v1MaxBody is FAREGATE_V1_MAX_BODY, defaulted.
func (s *server) v1MaxBody() int64 {
	if s.d.V1.MaxBody > 0 {
		return s.d.V1.MaxBody
	}
	return DefaultV1MaxBody
}

// decodeV1Object decodes one JSON object of body into v, read exactly
// as the model routes read theirs: a member name repeated, or one that a
// case-insensitive decoder would read as another ("URL" for "url"), is
// refused, not taken as encoding/json would (the last of two, any case).
func decodeV1Object(body []byte, v any) error {
	if err := exactNames(body); err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if err := dec.Decode(v); err != nil {
		return invalid("body", "must be a JSON object of the documented shape")
	}
	if _, err := dec.Token(); err != io.EOF {
		return invalid("body", "must be a single JSON object")
	}
	return nil
}

// exactNames refuses a body with a member name that two decoders could
// read differently (gateway.AmbiguousName). A body that is not JSON
// passes here and is refused by its decoder.
func exactNames(body []byte) error {
	if name, bad := gateway.AmbiguousName(body); bad {
		return invalid(name, "is repeated or not in lower case; member names here are lower case and appear once")
	}
	return nil
}

// handleV1Result takes the agent's result (or error) for the lease
// holder: 204, once; 409 task_finished after that.
func (s *server) handleV1Result() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g, _ := taskkey.FromContext(r.Context())
		body, err := s.readV1Body(r)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		if err := exactNames(body); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		ans, err := task.ParseAnswer(body)
		if err != nil {
			s.WriteV1Error(w, r, invalid("body", err.Error()))
			return
		}
		if err := s.d.V1.Keys.Result(r.Context(), g, body); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		// 204 means stored: wait until the lease holder has made it the
		// task's result. A holder that died meanwhile never does; the task
		// ends worker_lost and the answer is 409.
		if err := s.awaitResult(w, r, g, ans); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
}

// resultWait bounds how long a posted result waits for the task to end
// with it: a live holder takes it at once; a dead holder's task is failed
// within a lease and a third.
const resultWait = 60 * time.Second

// awaitResult polls the task until it is final: nil when it ended with
// ans, ErrFinished when it ended otherwise (another answer, worker_lost,
// the deadline). The key's end cuts the request's context (the holder
// revokes the key as it takes the result), so the wait does not stop
// with it; it is bounded by ResultWait.
func (s *server) awaitResult(w http.ResponseWriter, r *http.Request, g taskkey.Grant, ans task.Answer) error {
	wait := s.d.V1.ResultWait
	if wait <= 0 {
		wait = resultWait
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), wait)
	defer cancel()
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(wait + 5*time.Second))
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		rec, err := s.d.Store.Get(ctx, g.Task)
		if err == nil && rec.Final() {
			if rec.Status == task.StatusSucceeded && ans.Result != nil && rec.Result != nil && rec.Result.Text == ans.Result.Text {
				return nil
			}
			if rec.Status == task.StatusFailed && ans.Error != nil && rec.Error != nil && rec.Error.Code == codes.AgentFailed {
				return nil
			}
			return taskkey.ErrFinished
		}
		select {
		case <-ctx.Done():
			return nil // taken into the inbox; the holder will save it
		case <-tick.C:
		}
	}
}

// v1Event is a progress event as the agent posts it.
type v1Event struct {
	Name   *string `json:"name"`
	Status *string `json:"status"`
	Detail *string `json:"detail"`
}

// handleV1Event puts an agent's progress event on the visitor's stream
// (through the lease holder): a step of kind agent; 204.
func (s *server) handleV1Event() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g, _ := taskkey.FromContext(r.Context())
		body, err := s.readV1Body(r)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		var ev v1Event
		if err := decodeV1Object(body, &ev); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		fields := map[string]string{}
		p := taskkey.Posted{Kind: task.KindAgent}
		if ev.Name == nil {
			fields["name"] = "is required"
		} else if p.Name, err = plainText(*ev.Name, eventNameMax, false); err != nil {
			fields["name"] = err.Error()
		} else if p.Name == "" {
			fields["name"] = "is required"
		}
		switch {
		case ev.Status == nil:
			fields["status"] = "is required: started, ok or failed"
		case *ev.Status == "started" || *ev.Status == "ok" || *ev.Status == "failed":
			p.Status = *ev.Status
		default:
			fields["status"] = "must be started, ok or failed"
		}
		if ev.Detail != nil {
			if p.Detail, err = plainText(*ev.Detail, eventDetailMax, true); err != nil {
				fields["detail"] = err.Error()
			}
		}
		if len(fields) > 0 {
			s.WriteV1Error(w, r, &InvalidError{Fields: fields})
			return
		}
		if err := s.d.V1.Limits.Take(r.Context(), limitsTask(g), tasklimits.Events); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		data, _ := json.Marshal(p)
		if err := s.d.V1.Keys.Event(r.Context(), g, data); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
}

// v1Fetch is a fetch request.
type v1Fetch struct {
	URL *string `json:"url"`
	// MaxBytes is read raw: a json.Number field would also take a
	// number written as a string ("100").
	MaxBytes json.RawMessage `json:"max_bytes"`
}

// handleV1Fetch fetches a public page for the agent, counted against the
// task's tool calls.
func (s *server) handleV1Fetch() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g, _ := taskkey.FromContext(r.Context())
		body, err := s.readV1Body(r)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		var req v1Fetch
		if err := decodeV1Object(body, &req); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		fields := map[string]string{}
		if req.URL == nil || strings.TrimSpace(*req.URL) == "" {
			fields["url"] = "is required: an absolute http(s) URL"
		} else if len(*req.URL) > 2048 {
			fields["url"] = "must be at most 2048 bytes"
		}
		var limit int64
		if len(req.MaxBytes) > 0 && string(req.MaxBytes) != "null" {
			n, err := jsonInt(req.MaxBytes)
			if err != nil || n < 1 || n > s.d.V1.MaxFetchBytes {
				fields["max_bytes"] = "must be a whole number from 1 to " + strconv.FormatInt(s.d.V1.MaxFetchBytes, 10)
			}
			limit = n
		}
		if len(fields) > 0 {
			s.WriteV1Error(w, r, &InvalidError{Fields: fields})
			return
		}
		raw := strings.TrimSpace(*req.URL)
		// Refused on its face (not http(s), credentials, a private
		// literal address): answered before it costs one of the task's
		// tool calls.
		if err := s.d.V1.Fetch.Check(raw); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		if err := s.d.V1.Limits.Take(r.Context(), limitsTask(g), tasklimits.Tools); err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		page, err := s.d.V1.Fetch.Fetch(r.Context(), g, raw, limit)
		if err != nil {
			s.WriteV1Error(w, r, err)
			return
		}
		writeJSON(w, http.StatusOK, page)
	})
}

// taskScoped are the refusals that cannot clear before the task ends:
// the official clients must not retry them (x-should-retry: false), and
// their Retry-After is the time to the task's deadline (policy "task").
var taskScoped = map[string]bool{
	codes.DemoBudgetExhausted: true, codes.EventLimit: true, codes.ToolLimit: true,
	// The model endpoint's (the gateway's rows):
	codes.StepLimit: true, codes.InputSpike: true,
}

// policyTask is the RateLimit policy of a task's own limits: its window
// is the rest of the task.
const policyTask = "task"

// limitOf is the limit a refusal names (0 when it names none).
func limitOf(err error) int64 {
	var lim interface{ Limit() int64 }
	if errors.As(err, &lim) {
		return lim.Limit()
	}
	return 0
}

// v1Type is the OpenAI error type of a status and code.
func v1Type(status int, code string) string {
	switch {
	case status == http.StatusUnauthorized:
		return "authentication_error"
	case status == http.StatusTooManyRequests && taskScoped[code]:
		return "insufficient_quota"
	case status == http.StatusTooManyRequests:
		return "rate_limit_error"
	case status >= 500:
		return "api_error"
	}
	return "invalid_request_error"
}

// v1Errors is the /v1 error writer the gateway is handed (gateway.ErrorWriter):
// the one error table, in the OpenAI shape.
type v1Errors struct{ s *server }

func (e v1Errors) WriteError(w http.ResponseWriter, r *http.Request, err error) {
	e.s.WriteV1Error(w, r, err)
}

func (e v1Errors) ErrorEvent(r *http.Request, err error) []byte {
	return e.s.v1ErrorBody(r, e.s.errors.lookup(err), err)
}

// WriteV1Error answers err on /v1 from the one error table, in the OpenAI
// shape {"error":{"code","message","type"}}, with the headers its status
// and code call for.
func (s *server) WriteV1Error(w http.ResponseWriter, r *http.Request, err error) {
	spec := s.errors.lookup(err)
	st := stateOf(r)
	if st != nil {
		st.code, st.err = spec.code, err
	}
	h := w.Header()
	jsonHeaders(h)
	if st != nil && st.id != "" && anthropicRoute(r) {
		h["Request-Id"] = []string{st.id} // where Anthropic's SDKs read it
	}
	// The hour's refusal clears as the hour slides, within the task or not:
	// it is answered with its own wait, as a rate limit.
	hour := isHourRefusal(err)
	if taskScoped[spec.code] && spec.status == http.StatusTooManyRequests && !hour {
		left := time.Second
		var td interface{ TaskDeadline() time.Time }
		if errors.As(err, &td) {
			left = td.TaskDeadline().Sub(s.d.Now())
		} else if g, ok := taskkey.FromContext(r.Context()); ok {
			left = g.Deadline.Sub(s.d.Now())
		}
		secs := ceilSeconds(left)
		h["X-Should-Retry"] = []string{"false"}
		setRetryAfter(h, secs)
		setRateLimit(h, rlItem{name: policyTask, q: limitOf(err), w: secs, t: secs})
	} else if secs, ok := retryAfter(spec, err); ok {
		setRetryAfter(h, secs)
		if spec.status == http.StatusTooManyRequests {
			s.rateLimitHeaders(h, st, spec.code, err, secs)
		}
	}
	if spec.status == http.StatusRequestEntityTooLarge {
		h["Connection"] = hdrCloseConn // the rest of the body is never read
	}
	w.WriteHeader(spec.status)
	_, _ = w.Write(s.v1ErrorBody(r, spec, err))
}

// v1ErrorBody is the OpenAI-shaped envelope of err (its table row spec),
// ending in a newline.
func (s *server) v1ErrorBody(r *http.Request, spec *errorSpec, err error) []byte {
	msg := spec.message
	var pm interface{ publicMessage() string }
	if errors.As(err, &pm) {
		msg = pm.publicMessage()
	}
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) {
		msg = v1BudgetMessage(ex, msg)
	} else if isHourRefusal(err) {
		msg = hourMessage
	}
	body := map[string]any{"code": spec.code, "message": msg, "type": v1Type(spec.status, spec.code)}
	if isHourRefusal(err) {
		body["type"] = "rate_limit_error"
	}
	if st := stateOf(r); st != nil && st.id != "" {
		body["request_id"] = st.id
	}
	// A refused or invalid parameter of the model endpoint is named, as
	// OpenAI's errors name theirs ("param").
	var pe *gateway.ParamError
	if errors.As(err, &pe) {
		body["param"] = pe.Field
		body["message"] = clipMessage(pe.Field + ": " + pe.Reason)
	}
	var ie *InvalidError
	if spec.code == codes.InvalidRequest && errors.As(err, &ie) {
		body["fields"] = ie.Fields
	}
	envelope := map[string]any{"error": body}
	if anthropicRoute(r) {
		// Anthropic's shape: the type by status as its SDKs read it,
		// faregate's code beside it, the request id beside the error.
		body["type"] = anthropicType(spec.status)
		delete(body, "param")
		delete(body, "fields")
		envelope = map[string]any{"type": "error", "error": body}
		if id, ok := body["request_id"]; ok {
			delete(body, "request_id")
			envelope["request_id"] = id
		}
	}
	raw, _ := json.Marshal(envelope)
	return append(raw, '\n')
}

// anthropicRoute reports whether r is a Messages route (/v1/messages and
// its count_tokens), or an Anthropic client's models list, whose errors
// are in Anthropic's shape.
func anthropicRoute(r *http.Request) bool {
	p := r.URL.Path
	return p == "/v1/messages" || strings.HasPrefix(p, "/v1/messages/") ||
		((p == "/v1/models" || strings.HasPrefix(p, "/v1/models/")) && anthropicClient(r))
}

// anthropicType is the error type Anthropic's API gives an answer of
// status: its SDKs tell errors apart by it.
func anthropicType(status int) string {
	switch status {
	case http.StatusUnauthorized:
		return "authentication_error"
	case http.StatusForbidden:
		return "permission_error"
	case http.StatusNotFound:
		return "not_found_error"
	case http.StatusRequestEntityTooLarge:
		return codes.RequestTooLarge // Anthropic's type has our code's name
	case http.StatusTooManyRequests:
		return "rate_limit_error"
	case http.StatusServiceUnavailable:
		return "overloaded_error"
	}
	if status >= 500 {
		return "api_error"
	}
	return "invalid_request_error"
}

// v1BudgetMessage says which budget refused a model call, for the agent's
// developer: the task's own (it never refills: the agent must finish with
// what it has) reads differently from the day's ("resets at 00:00 UTC",
// def). Only the task's shows a number; it is the agent's own.
func v1BudgetMessage(ex *budget.ExhaustedError, def string) string {
	switch ex.Scope {
	case budget.ScopeTask:
		return "This task's token budget cannot afford the call: it has " + strconv.FormatInt(ex.Remaining, 10) +
			" tokens left, fewer than the prompt (as faregate counts it, images at their worst case) and one output token. A task's budget does not refill."
	case budget.ScopePrincipal:
		return "This visitor's model budget for today is used up. It resets at 00:00 UTC."
	}
	return def
}

// clipMessage bounds a message built from a request's own words (a field
// name, a reason) to 300 bytes, at a rune boundary.
func clipMessage(s string) string {
	const max = 300
	if len(s) <= max {
		return s
	}
	i := max
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	return s[:i]
}

// jsonInt reads raw as a JSON number that is a whole int64: a string, a
// fraction or an exponent is refused.
func jsonInt(raw json.RawMessage) (int64, error) {
	if len(raw) == 0 || (raw[0] != '-' && (raw[0] < '0' || raw[0] > '9')) {
		return 0, errors.New("not a JSON number")
	}
	return strconv.ParseInt(string(raw), 10, 64)
}
