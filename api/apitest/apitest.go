// Package apitest checks live HTTP answers against faregate's OpenAPI
// document (api/openapi.json), so end-to-end tests notice the moment the
// server and the document disagree. It uses kin-openapi's openapi3filter,
// which validates OpenAPI 3.1 documents with a JSON Schema 2020-12
// validator (type arrays, const, prefixItems…), headers included.
//
// Beyond the schemas it checks the few documented rules a schema cannot say:
// an error body's request_id equals the X-Request-Id header, a 202's
// Location names the new task, and a 429 that carries RateLimit has a
// Retry-After equal to one of its items' t.
package apitest

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"

	"github.com/getkin/kin-openapi/openapi3"
	"github.com/getkin/kin-openapi/openapi3filter"
	"github.com/getkin/kin-openapi/routers"
	"github.com/getkin/kin-openapi/routers/legacy"

	"faregate/api"
)

// Errors returned by the validator; each wraps the library's own error.
var (
	// ErrDocument: the OpenAPI document does not load or is not valid 3.1.
	ErrDocument = errors.New("apitest: OpenAPI document invalid")
	// ErrMismatch: an answer differs from what the document says.
	ErrMismatch = errors.New("apitest: response does not match the OpenAPI document")
	// ErrUndocumented: an /api path or an event the document does not know.
	ErrUndocumented = errors.New("apitest: not in the OpenAPI document")
)

// Validator checks responses against one loaded document. It is safe for
// concurrent use: the harness's clients may share one.
type Validator struct {
	doc    *openapi3.T
	router routers.Router
	// Synthetic operations for answers the document cannot place on a
	// path: a method a path lacks (405) and an unknown /api path (404).
	notAllowed *openapi3.Operation
	notFound   *openapi3.Operation
	checked    atomic.Int64
}

// NewValidator loads the document the server embeds (api.OpenAPIDocument).
func NewValidator() (*Validator, error) {
	return New(api.OpenAPIDocument())
}

// New loads an OpenAPI 3.1 document, validates it and prepares its router.
func New(document []byte) (*Validator, error) {
	doc, err := Load(document)
	if err != nil {
		return nil, err
	}
	router, err := legacy.NewRouter(doc)
	if err != nil {
		return nil, fmt.Errorf("%w: router: %w", ErrDocument, err)
	}
	v := &Validator{doc: doc, router: router}
	// Middleware answers before routing: an unknown key, the request
	// window, a crash or an outage can meet any /api request.
	common := []string{"401:InvalidAPIKey", "429:RateLimited", "500:InternalError", "503:Unavailable"}
	if v.notAllowed, err = v.operation(append(common, "405:MethodNotAllowed")...); err != nil {
		return nil, err
	}
	if v.notFound, err = v.operation(append(common, "404:NotFound")...); err != nil {
		return nil, err
	}
	return v, nil
}

// Load parses document and validates it as OpenAPI 3.1, the way New does;
// api/openapi_test.go uses it to test the document itself.
func Load(document []byte) (*openapi3.T, error) {
	loader := openapi3.NewLoader()
	doc, err := loader.LoadFromData(document)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDocument, err)
	}
	if !doc.IsOpenAPI31OrLater() {
		return nil, fmt.Errorf("%w: openapi is %q, want 3.1", ErrDocument, doc.OpenAPI)
	}
	if err := doc.Validate(loader.Context, openapi3.EnableMultiError()); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrDocument, err)
	}
	return doc, nil
}

// operation builds an operation from "status:ComponentName" pairs of
// components/responses.
func (v *Validator) operation(pairs ...string) (*openapi3.Operation, error) {
	op := &openapi3.Operation{Responses: openapi3.NewResponses()}
	op.Responses.Delete("default")
	for _, p := range pairs {
		status, name, _ := strings.Cut(p, ":")
		ref := v.doc.Components.Responses[name]
		if ref == nil || ref.Value == nil {
			return nil, fmt.Errorf("%w: components/responses/%s missing", ErrDocument, name)
		}
		op.Responses.Set(status, ref)
	}
	return op, nil
}

// Document returns the loaded document, for tests that read it.
func (v *Validator) Document() *openapi3.T { return v.doc }

// Checked reports how many responses Check (or the Transport) has checked,
// passed or not.
func (v *Validator) Checked() int { return int(v.checked.Load()) }

// Enum lists the enum of a components/schemas entry, e.g. Enum("ErrorCode"),
// so a test can compare the document's codes with the server's table. An
// unknown name gives nil.
func (v *Validator) Enum(schema string) []string {
	ref := v.doc.Components.Schemas[schema]
	if ref == nil || ref.Value == nil {
		return nil
	}
	out := make([]string, 0, len(ref.Value.Enum))
	for _, e := range ref.Value.Enum {
		if s, ok := e.(string); ok {
			out = append(out, s)
		}
	}
	return out
}

// Check validates one answer to req: status, headers and, except for an
// event stream (text/event-stream), the body. Answers outside the document's
// reach are skipped and not counted: OPTIONS preflights (CORS machinery),
// HEAD requests, and paths outside /api that the document does not list
// (the page and its assets). Inside /api every answer is checked; an
// unknown path must be a 404 not_found and an unknown method a 405
// method_not_allowed, each with the usual envelope and headers.
func (v *Validator) Check(req *http.Request, status int, header http.Header, body []byte) error {
	if req.Method == http.MethodOptions || req.Method == http.MethodHead {
		return nil
	}
	what := fmt.Sprintf("%s %s → %d", req.Method, req.URL.Path, status)
	if ep := req.URL.EscapedPath(); ep != req.URL.Path {
		// Route on the path as sent: an escaped slash stays inside its
		// segment, as it does for the server's router.
		req = req.Clone(req.Context())
		req.URL.Path, req.URL.RawPath = ep, ""
	}
	route, params, err := v.router.FindRoute(req)
	for _, p := range params {
		if err == nil && p == "" {
			// The router matches /api/tasks as /api/tasks/{id} with an
			// empty id; no server route does, so ask for the path itself.
			err = &routers.RouteError{Reason: routers.ErrPathNotFound.Error()}
		}
	}
	if err != nil {
		var re *routers.RouteError
		if !errors.As(err, &re) {
			return fmt.Errorf("%w: %s: %w", ErrUndocumented, what, err)
		}
		switch {
		case re.Reason == routers.ErrMethodNotAllowed.Error() || v.pathKnown(req):
			route = v.synthetic(req, v.notAllowed)
		case req.URL.Path == "/api" || strings.HasPrefix(req.URL.Path, "/api/"):
			route = v.synthetic(req, v.notFound)
		default:
			return nil
		}
	}
	v.checked.Add(1)

	stream := isEventStream(header)
	in := &openapi3filter.ResponseValidationInput{
		RequestValidationInput: &openapi3filter.RequestValidationInput{Request: req, PathParams: params, Route: route},
		Status:                 status,
		Header:                 header,
		Options: &openapi3filter.Options{
			// A status the document does not list is drift too.
			IncludeResponseStatus: true,
			ExcludeResponseBody:   stream,
			MultiError:            true,
		},
	}
	in.Options.WithCustomSchemaErrorFunc(schemaError)
	in.SetBodyBytes(body)
	if err := openapi3filter.ValidateResponse(context.Background(), in); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrMismatch, what, err)
	}
	if stream {
		// With the body left out the library does not look at the media
		// type, so check that the document promises a stream here.
		if resp := route.Operation.Responses.Status(status); resp == nil || resp.Value.Content.Get("text/event-stream") == nil {
			return fmt.Errorf("%w: %s: an event stream where the document has none", ErrMismatch, what)
		}
		return nil
	}
	if err := documentedRules(status, header, body); err != nil {
		return fmt.Errorf("%w: %s: %w", ErrMismatch, what, err)
	}
	return nil
}

// pathKnown reports whether another method of req's path is documented.
// The router says "method not allowed" only for paths without parameters,
// so templated paths (/api/tasks/{id}) are asked once per method.
func (v *Validator) pathKnown(req *http.Request) bool {
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete} {
		if m == req.Method {
			continue
		}
		probe := req.Clone(req.Context())
		probe.Method = m
		if _, _, err := v.router.FindRoute(probe); err == nil {
			return true
		}
	}
	return false
}

// schemaError says where a value failed and why, in one line: the
// library's default repeats the whole schema and value, which buries the
// reason in a test log.
func schemaError(err *openapi3.SchemaError) string {
	where := "/" + strings.Join(err.JSONPointer(), "/")
	if err.Origin != nil {
		// A group (allOf, oneOf, $ref): its causes say what failed.
		return fmt.Sprintf("at %s: %s", where, err.Origin)
	}
	return fmt.Sprintf("at %s: %s (value %.200s)", where, err.Reason, compact(err.Value))
}

// compact renders a value as one line of JSON.
func compact(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprint(v)
	}
	return string(b)
}

// synthetic wraps op as the route of req.
func (v *Validator) synthetic(req *http.Request, op *openapi3.Operation) *routers.Route {
	return &routers.Route{Spec: v.doc, Path: req.URL.Path, Method: req.Method, Operation: op}
}

// isEventStream reports whether the answer is Server-Sent Events.
func isEventStream(h http.Header) bool {
	mt, _, err := mime.ParseMediaType(h.Get("Content-Type"))
	return err == nil && mt == "text/event-stream"
}

// documentedRules checks what JSON Schema cannot: values that must agree
// across headers and body.
func documentedRules(status int, header http.Header, body []byte) error {
	var env struct {
		Error *struct {
			RequestID string `json:"request_id"`
		} `json:"error"`
		ID string `json:"id"`
	}
	// The schemas passed already, so a body that is not JSON here is one
	// the document allows to be something else (a script, metrics).
	if json.Unmarshal(body, &env) != nil {
		return nil
	}
	// A failed task also has an "error" member, but it is no envelope.
	if status >= 400 && env.Error != nil && env.Error.RequestID != header.Get("X-Request-Id") {
		return fmt.Errorf("error.request_id %q differs from X-Request-Id %q", env.Error.RequestID, header.Get("X-Request-Id"))
	}
	if status == http.StatusAccepted && header.Get("Location") != "/api/tasks/"+env.ID {
		return fmt.Errorf("the Location header %q does not name task %q", header.Get("Location"), env.ID)
	}
	if status == http.StatusTooManyRequests && header.Get("RateLimit") != "" {
		ts := rateLimitResets(header.Get("RateLimit"))
		if !slices.Contains(ts, header.Get("Retry-After")) {
			return fmt.Errorf("Retry-After %q is none of the RateLimit resets %v", header.Get("Retry-After"), ts)
		}
	}
	return nil
}

// rateLimitResets lists the t parameter of every item of a RateLimit field
// (its shape was checked by the document's pattern).
func rateLimitResets(field string) []string {
	var out []string
	for item := range strings.SplitSeq(field, ",") {
		for param := range strings.SplitSeq(item, ";") {
			if t, ok := strings.CutPrefix(strings.TrimSpace(param), "t="); ok {
				out = append(out, t)
			}
		}
	}
	return out
}

// eventSchemas names the schema of each event's data.
var eventSchemas = map[string]string{"status": "StatusEvent", "step": "Step", "done": "Task"}

// CheckEvent validates the data of one event of GET /api/tasks/{id}/events
// against the document's schema for that event; a done event must carry a
// final task. It counts as a checked response.
func (v *Validator) CheckEvent(event string, data []byte) error {
	name, ok := eventSchemas[event]
	if !ok {
		return fmt.Errorf("%w: event %q", ErrUndocumented, event)
	}
	v.checked.Add(1)
	var value any
	if err := json.Unmarshal(data, &value); err != nil {
		return fmt.Errorf("%w: event %s: data is not JSON: %w", ErrMismatch, event, err)
	}
	schema := v.doc.Components.Schemas[name]
	if schema == nil || schema.Value == nil {
		return fmt.Errorf("%w: components/schemas/%s missing", ErrDocument, name)
	}
	if err := schema.Value.VisitJSON(value, openapi3.EnableJSONSchema2020(), openapi3.MultiErrors(),
		openapi3.SetSchemaErrorMessageCustomizer(schemaError)); err != nil {
		return fmt.Errorf("%w: event %s: %w", ErrMismatch, event, err)
	}
	if event == "done" {
		if st, _ := value.(map[string]any)["status"].(string); st != "succeeded" && st != "failed" {
			return fmt.Errorf("%w: event done: task status %q is not final", ErrMismatch, st)
		}
	}
	return nil
}

// Transport returns a RoundTripper that checks every answer passing
// through next (http.DefaultTransport when nil). Bodies other than event
// streams are read whole and handed on unchanged; a stream is checked by
// status, headers and media type and passed on unread. A mismatch goes to
// onErr and the answer still reaches the caller; with onErr nil the round
// trip fails with the mismatch instead.
func (v *Validator) Transport(next http.RoundTripper, onErr func(error)) http.RoundTripper {
	if next == nil {
		next = http.DefaultTransport
	}
	return &transport{v: v, next: next, onErr: onErr}
}

type transport struct {
	v     *Validator
	next  http.RoundTripper
	onErr func(error)
}

func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := t.next.RoundTrip(req)
	if err != nil {
		return resp, err
	}
	var body []byte
	if !isEventStream(resp.Header) {
		body, err = io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("apitest: reading the answer to %s %s: %w", req.Method, req.URL.Path, err)
		}
		resp.Body = io.NopCloser(bytes.NewReader(body))
	}
	if err := t.v.Check(req, resp.StatusCode, resp.Header, body); err != nil {
		if t.onErr == nil {
			resp.Body.Close()
			return nil, err
		}
		t.onErr(err)
	}
	return resp, nil
}
