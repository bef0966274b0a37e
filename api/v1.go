package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/go-chi/chi/v5"

	"faregate/agent/gateway"
	"faregate/agent/task"
	"faregate/agent/taskkey"
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
	Tool(ctx context.Context, g taskkey.Grant) error
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

// V1Handler serves part of /v1 (the model endpoint) behind the task key:
// the grant is in the request's context (taskkey.FromContext), and the
// context ends when the task does. An error it returns before writing
// anything is answered from the one error table, in the OpenAI shape.
type V1Handler func(w http.ResponseWriter, r *http.Request) error

// V1 configures the /v1 surface (nil in Deps: there is none).
type V1 struct {
	Keys  TaskKeys
	Fetch Fetcher
	// MaxBody is FAREGATE_V1_MAX_BODY (default DefaultV1MaxBody).
	MaxBody int64
	// MaxFetchBytes bounds max_bytes of a fetch (default 1 MiB).
	MaxFetchBytes int64
	// ResultWait bounds how long POST result waits for the lease holder
	// to store the result (default 60 s; at least 4/3 of the lease).
	ResultWait time.Duration
	// Models serves /v1/chat/completions, /v1/responses, /v1/embeddings
	// and GET /v1/models (nil: those paths answer 404).
	Models V1Handler
}

// Bounds of an agent's progress event (code points of the NFKC form).
const (
	eventNameMax   = 64
	eventDetailMax = 500
)

// v1Routes mounts /v1 on r.
func (s *server) v1Routes(r chi.Router) {
	v := s.d.V1
	if v.MaxBody <= 0 {
		v.MaxBody = DefaultV1MaxBody
	}
	if v.MaxFetchBytes <= 0 {
		v.MaxFetchBytes = 1 << 20
	}
	keyed := r.With(s.v1Body, s.v1Auth)
	keyed.Method(http.MethodPost, "/v1/tasks/{id}/result", s.handleV1Result())
	keyed.Method(http.MethodPost, "/v1/tasks/{id}/events", s.handleV1Event())
	keyed.Method(http.MethodPost, "/v1/tools/fetch", s.handleV1Fetch())
	if v.Models != nil {
		h := s.v1Models(v.Models)
		for _, p := range []string{"/v1/chat/completions", "/v1/responses", "/v1/embeddings"} {
			keyed.Method(http.MethodPost, p, h)
		}
		keyed.Method(http.MethodGet, "/v1/models", h)
		keyed.Method(http.MethodGet, "/v1/models/*", h)
	}
}

// isV1 reports whether path is the /v1 surface's.
func isV1(path string) bool { return path == "/v1" || strings.HasPrefix(path, "/v1/") }

// v1Body refuses a body by its headers before anything reads it: 415 when
// it is not JSON, 413 when Content-Length is over FAREGATE_V1_MAX_BODY; a
// body of unknown length is cut after the limit plus one byte.
func (s *server) v1Body(next http.Handler) http.Handler {
	limit := s.d.V1.MaxBody
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			next.ServeHTTP(w, r)
			return
		}
		if ct := r.Header.Get("Content-Type"); ct != "application/json" {
			if mt, _, err := mime.ParseMediaType(ct); err != nil || mt != "application/json" {
				refuseBody(w, r)
				s.WriteV1Error(w, r, ErrUnsupportedMedia)
				return
			}
		}
		if r.ContentLength > limit {
			refuseBody(w, r)
			s.WriteV1Error(w, r, &v1TooLarge{limit})
			return
		}
		if r.ContentLength < 0 && r.Body != nil {
			r.Body = &capReader{r: r.Body, left: limit + 1}
		}
		next.ServeHTTP(w, r)
	})
}

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
		token, present := policy.BearerToken(r.Header)
		if !present {
			s.WriteV1Error(w, r, errNoKey)
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
		ctx = context.WithValue(taskkey.WithGrant(ctx, g), v1WriterKey{}, s)
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// grantPrincipal is the principal a task key acts for, for logs.
func grantPrincipal(g taskkey.Grant) principal.Principal {
	p := principal.FromAccount(g.Principal)
	p.Tier = g.Tier
	return p
}

// v1Models runs the model endpoint, answering the errors it returns.
func (s *server) v1Models(h V1Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			if st := stateOf(r); st != nil && st.status != 0 {
				return // it had begun its answer: a stream ends as it may
			}
			s.WriteV1Error(w, r, err)
		}
	})
}

// readV1Body reads a body within the /v1 limit.
func (s *server) readV1Body(r *http.Request) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, s.d.V1.MaxBody+1))
	if err != nil {
		return nil, invalid("body", "could not be read")
	}
	if int64(len(body)) > s.d.V1.MaxBody {
		return nil, &v1TooLarge{s.d.V1.MaxBody}
	}
	return body, nil
}

// decodeV1Object decodes one JSON object of body into v.
func decodeV1Object(body []byte, v any) error {
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
	URL      *string      `json:"url"`
	MaxBytes *json.Number `json:"max_bytes"`
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
		if req.MaxBytes != nil {
			n, err := req.MaxBytes.Int64()
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
		if err := s.d.V1.Keys.Tool(r.Context(), g); err != nil {
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

// WriteV1Error answers err on /v1 from the one error table, in the OpenAI
// shape {"error":{"code","message","type"}}. The model endpoint answers
// its own refusals through it (or by returning them from its V1Handler).
func (srv *Server) WriteV1Error(w http.ResponseWriter, r *http.Request, err error) {
	srv.s.WriteV1Error(w, r, err)
}

type v1WriterKey struct{}

// WriteV1Error answers err for a /v1 handler behind the task key (the
// model endpoint), from the one error table in the OpenAI shape, without
// a reference to the Server: the request carries it.
func WriteV1Error(w http.ResponseWriter, r *http.Request, err error) {
	if s, ok := r.Context().Value(v1WriterKey{}).(*server); ok {
		s.WriteV1Error(w, r, err)
		return
	}
	jsonHeaders(w.Header())
	w.WriteHeader(http.StatusInternalServerError)
	_, _ = w.Write([]byte(`{"error":{"code":"internal_error","message":"Something went wrong on our side.","type":"api_error"}}` + "\n"))
}

// WriteV1Error is Server.WriteV1Error.
func (s *server) WriteV1Error(w http.ResponseWriter, r *http.Request, err error) {
	spec := s.errors.lookup(err)
	st := stateOf(r)
	if st != nil {
		st.code, st.err = spec.code, err
	}
	h := w.Header()
	jsonHeaders(h)
	if taskScoped[spec.code] && spec.status == http.StatusTooManyRequests {
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
	msg := spec.message
	var pm interface{ publicMessage() string }
	if errors.As(err, &pm) {
		msg = pm.publicMessage()
	}
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) {
		msg = v1BudgetMessage(ex, msg)
	}
	body := map[string]any{"code": spec.code, "message": msg, "type": v1Type(spec.status, spec.code)}
	if st != nil && st.id != "" {
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
	raw, _ := json.Marshal(map[string]any{"error": body})
	w.WriteHeader(spec.status)
	_, _ = w.Write(append(raw, '\n'))
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
