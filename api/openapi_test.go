package api_test

import (
	"encoding/json"
	"slices"
	"strconv"
	"testing"

	"github.com/getkin/kin-openapi/openapi3"

	"faregate/api"
	"faregate/api/apitest"
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

// TestOpenAPICodes: the enums name exactly the codes of the API's table
// (api/codes.go): each code it knows, and nothing else.
func TestOpenAPICodes(t *testing.T) {
	v, err := apitest.NewValidator()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		schema string
		want   []string
	}{
		{"ErrorCode", api.Codes()},
		{"TaskErrorCode", api.TaskErrorCodes()},
		{"WarningCode", api.WarningCodes()},
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
					t.Errorf("%s has %q, which api/codes.go does not know", tc.schema, c)
				}
			}
		})
	}
}

// TestOpenAPICoverage: every /api path is described, and every response
// promises what the manual puts on all of its kind: X-Request-Id
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
	answered := map[string]bool{}
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
			answered[c] = true
			if st, ok := api.CodeStatus(c); !ok || st != r.status {
				t.Errorf("%s: code %q belongs to status %d", r.where, c, st)
			}
		}
	}
	// Every code the table can answer with is promised by some response.
	for _, c := range api.Codes() {
		if !answered[c] {
			t.Errorf("no response of the document answers %q", c)
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
	// The Messages routes answer the same codes in Anthropic's envelope.
	if len(all) != 2 || all[0].Ref != "#/components/schemas/ErrorEnvelope" && all[0].Ref != "#/components/schemas/AnthropicEnvelope" {
		return nil, "not allOf [ErrorEnvelope or AnthropicEnvelope, codes]"
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
