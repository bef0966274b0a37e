package api_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"

	"faregate/agent/task"
	"faregate/api"
	"faregate/api/apitest"
)

// The codes issues #7–#12 name. The lead's table test compares the enum
// with the server's error table; this one keeps the document complete on
// its own.
var (
	wantErrorCodes = []string{
		"invalid_request", "prompt_rejected", "invalid_api_key", "turnstile_failed",
		"task_not_found", "not_found", "method_not_allowed", "request_too_large",
		"unsupported_media_type", "demo_ip_limit_reached", "demo_global_limit_reached",
		"demo_budget_exhausted", "too_many_streams", "rate_limited", "too_many_failed_checks",
		"token_rate_limited", "key_daily_limit_reached", "anomaly_blocked", "internal_error",
		"demo_protection_unavailable", "model_unavailable", "aitf_queue_full", "server_busy",
		// Issue #21 (the external agent's /v1).
		"fetch_refused", "task_finished", "event_limit", "tool_limit",
	}
	wantTaskErrorCodes = []string{"model_unavailable", "agent_failed", "worker_lost", "input_spike", "token_rate_limited",
		"agent_unreachable", "agent_timeout"}
	wantWarningCodes = []string{
		"weather_unavailable", "search_unavailable", "fetch_failed", "downstream_pushback",
		"budget_exhausted", "output_truncated", "output_loop", "step_limit", "tool_limit",
		"time_limit", "tool_loop", "low_precision", "fallback_model",
	}
)

// openAPIDoc loads the embedded document as apitest does, or stops the test.
func openAPIDoc(t *testing.T) *openapi3.T {
	t.Helper()
	doc, err := apitest.Load(api.OpenAPIDocument())
	if err != nil {
		t.Fatal(err)
	}
	return doc
}

// TestOpenAPIDocumentValid: the embedded document loads and validates as
// OpenAPI 3.1 (JSON Schema 2020-12) with kin-openapi, and is plain JSON.
func TestOpenAPIDocumentValid(t *testing.T) {
	doc := openAPIDoc(t)
	if doc.OpenAPI != "3.1.0" {
		t.Errorf("openapi %q, want 3.1.0", doc.OpenAPI)
	}
	var raw map[string]any
	if err := json.Unmarshal(api.OpenAPIDocument(), &raw); err != nil {
		t.Fatalf("not JSON: %v", err)
	}
	// Callers get a copy: changing it changes nothing that is served.
	b := api.OpenAPIDocument()
	b[0] = 'x'
	if api.OpenAPIDocument()[0] != '{' {
		t.Error("OpenAPIDocument hands out its own backing array")
	}
}

// TestOpenAPICodes: every stable code is in the enums, and nothing else.
func TestOpenAPICodes(t *testing.T) {
	v, err := apitest.NewValidator()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		schema string
		want   []string
	}{
		{"ErrorCode", wantErrorCodes},
		{"TaskErrorCode", wantTaskErrorCodes},
		{"WarningCode", wantWarningCodes},
	}
	for _, tc := range tests {
		t.Run(tc.schema, func(t *testing.T) {
			got := v.Enum(tc.schema)
			for _, c := range tc.want {
				if !slices.Contains(got, c) {
					t.Errorf("%s lacks %q", tc.schema, c)
				}
			}
			for _, c := range got {
				if !slices.Contains(tc.want, c) {
					t.Errorf("%s has %q, which no issue names", tc.schema, c)
				}
			}
		})
	}
}

// TestOpenAPICoverage: every /api path is described, and every response
// promises what the contract puts on all of its kind: X-Request-Id
// everywhere, the error envelope with codes of the response's own status
// on errors, Retry-After on 429 and 503, Allow on 405.
func TestOpenAPICoverage(t *testing.T) {
	doc := openAPIDoc(t)
	for _, p := range []string{
		"/api/tasks", "/api/tasks/{id}", "/api/tasks/{id}/events", "/api/config",
		"/api/usage", "/api/openapi.json", "/api/client.js", "/api/client.d.ts",
	} {
		if doc.Paths.Value(p) == nil {
			t.Errorf("no path %s", p)
		}
	}
	type response struct {
		where  string
		status int
		ref    *openapi3.ResponseRef
	}
	var all []response
	for path, item := range doc.Paths.Map() {
		for method, op := range item.Operations() {
			for status, r := range op.Responses.Map() {
				n, err := strconv.Atoi(status)
				if err != nil {
					t.Errorf("%s %s: response %q is not a status", method, path, status)
				}
				all = append(all, response{method + " " + path + " " + status, n, r})
			}
		}
	}
	// Answers apitest places on no path (unknown path, unknown method).
	all = append(all,
		response{"components/responses/NotFound", 404, doc.Components.Responses["NotFound"]},
		response{"components/responses/MethodNotAllowed", 405, doc.Components.Responses["MethodNotAllowed"]})
	if len(all) < 40 {
		t.Fatalf("only %d responses found", len(all))
	}
	for _, r := range all {
		if r.ref == nil || r.ref.Value == nil {
			t.Errorf("%s: missing", r.where)
			continue
		}
		resp := r.ref.Value
		if r.where != "GET /metrics 200" {
			if h := resp.Headers["X-Request-Id"]; h == nil || !h.Value.Required {
				t.Errorf("%s: X-Request-Id not required", r.where)
			}
		}
		limited := r.status == 429 || r.status == 503
		if h := resp.Headers["Retry-After"]; limited != (h != nil && h.Value.Required) {
			t.Errorf("%s: Retry-After required = %v", r.where, !limited)
		}
		if h := resp.Headers["Allow"]; (r.status == 405) != (h != nil && h.Value.Required) {
			t.Errorf("%s: Allow required = %v", r.where, r.status != 405)
		}
		if r.status < 400 {
			continue
		}
		codes, err := envelopeCodes(resp)
		if err != "" {
			t.Errorf("%s: %s", r.where, err)
		}
		for _, c := range codes {
			if errorStatus[c] != r.status {
				t.Errorf("%s: code %q belongs to status %d", r.where, c, errorStatus[c])
			}
		}
	}
}

// envelopeCodes reads the codes an error response allows: allOf of the
// envelope and a schema narrowing error.code by enum or const.
func envelopeCodes(r *openapi3.Response) ([]string, string) {
	mt := r.Content.Get("application/json")
	if mt == nil || mt.Schema == nil {
		return nil, "no JSON body"
	}
	all := mt.Schema.Value.AllOf
	if len(all) != 2 || all[0].Ref != "#/components/schemas/ErrorEnvelope" {
		return nil, "not allOf [ErrorEnvelope, codes]"
	}
	code := all[1].Value.Properties["error"].Value.Properties["code"].Value
	var out []string
	for _, e := range code.Enum {
		s, _ := e.(string)
		out = append(out, s)
	}
	if s, ok := code.Const.(string); ok {
		out = append(out, s)
	}
	if len(out) == 0 {
		return nil, "error.code not narrowed"
	}
	return out, ""
}

// errorStatus is the status of each code, as the issues fix it.
var errorStatus = map[string]int{
	"invalid_request": 400, "prompt_rejected": 400, "invalid_api_key": 401, "turnstile_failed": 403,
	"task_not_found": 404, "not_found": 404, "method_not_allowed": 405, "request_too_large": 413,
	"unsupported_media_type": 415, "demo_ip_limit_reached": 429, "demo_global_limit_reached": 429,
	"demo_budget_exhausted": 429, "too_many_streams": 429, "rate_limited": 429,
	"too_many_failed_checks": 429, "token_rate_limited": 429, "key_daily_limit_reached": 429,
	"anomaly_blocked": 429, "internal_error": 500, "demo_protection_unavailable": 503,
	"model_unavailable": 503, "aitf_queue_full": 503, "server_busy": 503,
}

// TestCodesMatchOpenAPI: every code of the error table is in the OpenAPI
// document's ErrorCode enum, and the enum names no code the table cannot
// answer with.
func TestCodesMatchOpenAPI(t *testing.T) {
	v, err := apitest.NewValidator()
	if err != nil {
		t.Fatal(err)
	}
	enum := v.Enum("ErrorCode")
	slices.Sort(enum)
	codes := api.Codes()
	if fmt.Sprint(codes) != fmt.Sprint(enum) {
		t.Fatalf("error table %v\nOpenAPI enum %v", codes, enum)
	}
	taskCodes := v.Enum("TaskErrorCode")
	for _, c := range []string{task.CodeModelUnavailable, task.CodeAgentFailed, task.CodeWorkerLost, task.CodeInputSpike, task.CodeTokenRateLimited} {
		if !slices.Contains(taskCodes, c) {
			t.Errorf("task code %s missing from TaskErrorCode", c)
		}
	}
}
