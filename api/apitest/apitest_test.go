package apitest

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"faregate/api"
	"faregate/web"
)

const (
	taskID   = "t_0123456789abcdef0123456789abcdef"
	reqID    = "req-1"
	envelope = `{"error":{"code":"%s","message":"A sentence.","request_id":"req-1"}}`
)

// validator loads the embedded document or stops the test.
func validator(t *testing.T) *Validator {
	t.Helper()
	v, err := NewValidator()
	if err != nil {
		t.Fatalf("NewValidator: %v", err)
	}
	return v
}

// hdr builds response headers from pairs, with X-Request-Id and a JSON
// Content-Type unless the pairs set them.
func hdr(pairs ...string) http.Header {
	h := http.Header{"X-Request-Id": {reqID}, "Content-Type": {"application/json; charset=utf-8"}}
	for i := 0; i+1 < len(pairs); i += 2 {
		if pairs[i+1] == "" {
			h.Del(pairs[i])
			continue
		}
		h.Set(pairs[i], pairs[i+1])
	}
	return h
}

func errBody(code string) string { return strings.Replace(envelope, "%s", code, 1) }

const finishedTask = `{"id":"` + taskID + `","status":"succeeded",
	"created_at":"2026-12-01T10:00:00.123456789Z","updated_at":"2026-12-01T10:00:05Z",
	"request":{"destination":"Lisbon","days":2,"interests":["food"],"language":"zh-CN"},
	"steps":[{"seq":1,"kind":"tool","name":"weather","status":"failed","duration_ms":1500,"detail":"timeout"},
		{"seq":2,"kind":"model","name":"plan","status":"ok","duration_ms":12}],
	"warnings":["weather_unavailable"],
	"result":{"summary":"Two days.","days":[{"day":1,"title":"Alfama","items":["Tram 28"]},{"day":2,"title":"Belém","items":[]}],
		"warnings":["weather_unavailable"],"model":"offline-demo-planner","offline":true,"language":"en","cached":true},
	"usage":{"prompt_tokens":0,"completion_tokens":0}}`

const failedTask = `{"id":"` + taskID + `","status":"failed",
	"created_at":"2026-12-01T10:00:00Z","updated_at":"2026-12-01T10:00:05Z",
	"request":{"destination":"Oslo","days":1,"interests":[],"language":"en"},
	"steps":[],"warnings":[],"usage":{"prompt_tokens":10,"completion_tokens":0},
	"error":{"code":"worker_lost","message":"The replica running this task stopped."}}`

const config = `{"turnstile_site_key":"1x00000000000000000000AA","turnstile_script_url":"https://challenges.cloudflare.com/turnstile/v0/api.js",
	"turnstile_test":true,"dev_mode":true,"model_status":"ok","offline_model":true,
	"input":"trip","limits":{"ip_daily":5,"global_daily":100,"requests_per_minute":120,"prompt_max_chars":2000,
	"destination_max":80,"days_min":1,"days_max":7,"interests_max":5,"interest_max":32},"languages":["en","zh-CN"]}`

const usage = `{"principal":{"kind":"key","id":"acme"},"tier":"partner","day":"2026-12-01",
	"limits":{"tasks_per_day":500,"tokens_per_day":2000000,"tokens_per_minute":100000,"requests_per_minute":600,
	"requests_per_second":0,"tokens_per_hour":0,"max_site_share":0.5},
	"used":{"tasks":3,"tokens":12000},"remaining":{"tasks":497,"tokens":1988000},"throttled":false}`

// usageHourly is a key with an hourly quota, past its soft share.
const usageHourly = `{"principal":{"kind":"key","id":"acme"},"tier":"partner","day":"2026-12-01",
	"limits":{"tasks_per_day":500,"tokens_per_day":2000000,"tokens_per_minute":100000,"requests_per_minute":600,
	"requests_per_second":10,"tokens_per_hour":10000,"soft_at":0.8,"soft_requests_per_minute":5,"max_site_share":0.5},
	"used":{"tasks":3,"tokens":12000},"remaining":{"tasks":497,"tokens":1988000},"throttled":true,
	"hour":{"tokens":8200,"remaining":1800,"soft_tokens":8000}}`

// TestCheck runs answers the document allows and answers it must refuse.
func TestCheck(t *testing.T) {
	v := validator(t)
	rateLimit202 := []string{"Location", "/api/tasks/" + taskID, "RateLimit-Policy", `"daily";q=5;w=86400`, "RateLimit", `"daily";r=4;t=3600`}
	tests := []struct {
		name    string
		method  string
		path    string
		status  int
		header  http.Header
		body    string
		wantErr error // nil: the answer passes
		counted bool
	}{
		// Answers as the manual has them.
		{"visitor admitted", "POST", "/api/tasks", 202, hdr(rateLimit202...), `{"id":"` + taskID + `","status":"queued","quota":{"ip_remaining":4,"global_remaining":99}}`, nil, true},
		{"key served a cached plan", "POST", "/api/tasks", 202, hdr(rateLimit202...), `{"id":"` + taskID + `","status":"succeeded","quota":{"key_remaining":499}}`, nil, true},
		{"two policies", "POST", "/api/tasks", 202, hdr("Location", "/api/tasks/"+taskID, "RateLimit-Policy", `"daily";q=5;w=86400, "budget";q=40000;w=86400`, "RateLimit", `"daily";r=4;t=3600, "budget";r=39000;t=3600`), `{"id":"` + taskID + `","status":"queued","quota":{"ip_remaining":4,"global_remaining":99}}`, nil, true},
		{"daily limit", "POST", "/api/tasks", 429, hdr("Retry-After", "3600", "RateLimit-Policy", `"daily";q=5;w=86400`, "RateLimit", `"daily";r=0;t=3600`), errBody("demo_ip_limit_reached"), nil, true},
		{"failed checks without a policy", "POST", "/api/tasks", 429, hdr("Retry-After", "1800"), errBody("too_many_failed_checks"), nil, true},
		{"field error", "POST", "/api/tasks", 400, hdr(), `{"error":{"code":"invalid_request","message":"Wrong.","request_id":"req-1","fields":{"days":"must be 1 to 7"}}}`, nil, true},
		{"prompt rule", "POST", "/api/tasks", 400, hdr(), errBody("prompt_rejected"), nil, true},
		{"bad key", "POST", "/api/tasks", 401, hdr(), errBody("invalid_api_key"), nil, true},
		{"model down", "POST", "/api/tasks", 503, hdr("Retry-After", "5"), errBody("model_unavailable"), nil, true},
		{"finished task", "GET", "/api/tasks/" + taskID, 200, hdr(), finishedTask, nil, true},
		{"failed task", "GET", "/api/tasks/" + taskID, 200, hdr(), failedTask, nil, true},
		{"unknown task", "GET", "/api/tasks/t_nope", 404, hdr(), errBody("task_not_found"), nil, true},
		{"event stream", "GET", "/api/tasks/" + taskID + "/events", 200, hdr("Content-Type", "text/event-stream; charset=utf-8"), "", nil, true},
		{"stream refused", "GET", "/api/tasks/" + taskID + "/events", 429, hdr("Retry-After", "5"), errBody("too_many_streams"), nil, true},
		{"stream refused by its policy", "GET", "/api/tasks/" + taskID + "/events", 429, hdr("Retry-After", "5", "RateLimit-Policy", `"streams";q=4;qu="concurrent-requests"`, "RateLimit", `"streams";r=0;t=5`), errBody("too_many_streams"), nil, true},
		{"failed checks by their policy", "POST", "/api/tasks", 429, hdr("Retry-After", "1800", "RateLimit-Policy", `"failed";q=20;w=3600`, "RateLimit", `"failed";r=0;t=1800`), errBody("too_many_failed_checks"), nil, true},
		{"streams exhausted", "GET", "/api/tasks/" + taskID + "/events", 503, hdr("Retry-After", "5"), errBody("server_busy"), nil, true},
		{"window", "GET", "/api/config", 429, hdr("Retry-After", "12", "RateLimit-Policy", `"rpm";q=120;w=60`, "RateLimit", `"rpm";r=0;t=12`), errBody("rate_limited"), nil, true},
		{"config", "GET", "/api/config", 200, hdr(), config, nil, true},
		{"usage", "GET", "/api/usage", 200, hdr(), usage, nil, true},
		{"usage with an hourly quota", "GET", "/api/usage", 200, hdr(), usageHourly, nil, true},
		{"usage without a key", "GET", "/api/usage", 401, hdr(), errBody("invalid_api_key"), nil, true},
		{"the document", "GET", "/api/openapi.json", 200, hdr(), string(api.OpenAPIDocument()), nil, true},
		{"the client", "GET", "/api/client.js", 200, hdr("Content-Type", "text/javascript; charset=utf-8"), "export {};", nil, true},
		{"unknown method", "DELETE", "/api/tasks/" + taskID, 405, hdr("Allow", "GET"), errBody("method_not_allowed"), nil, true},
		{"unknown api path", "GET", "/api/nope", 404, hdr(), errBody("not_found"), nil, true},
		{"ready", "GET", "/readyz", 200, hdr(), `{"status":"ready"}`, nil, true},
		{"not ready", "GET", "/readyz", 503, hdr("Retry-After", "5"), errBody("demo_protection_unavailable"), nil, true},
		{"metrics", "GET", "/metrics", 200, hdr("Content-Type", "text/plain; version=0.0.4; charset=utf-8"), "up 1\n", nil, true},
		// Outside the document's reach: skipped, not counted.
		{"the page", "GET", "/", 200, hdr("Content-Type", "text/html"), "<!doctype html>", nil, false},
		{"an asset", "GET", "/assets/abc/app.js", 200, hdr("Content-Type", "text/javascript"), "", nil, false},
		{"a preflight", "OPTIONS", "/api/tasks", 204, http.Header{}, "", nil, false},

		// Drift the document must catch.
		{"unknown code", "POST", "/api/tasks", 429, hdr("Retry-After", "5"), errBody("brand_new"), ErrMismatch, true},
		{"code of another status", "POST", "/api/tasks", 429, hdr("Retry-After", "5"), errBody("server_busy"), ErrMismatch, true},
		{"no request id header", "GET", "/api/config", 200, hdr("X-Request-Id", ""), config, ErrMismatch, true},
		{"request ids differ", "GET", "/api/config", 401, hdr("X-Request-Id", "other"), errBody("invalid_api_key"), ErrMismatch, true},
		{"429 without Retry-After", "POST", "/api/tasks", 429, hdr(), errBody("demo_ip_limit_reached"), ErrMismatch, true},
		{"Retry-After is not the policy's t", "POST", "/api/tasks", 429, hdr("Retry-After", "60", "RateLimit", `"daily";r=0;t=3600`), errBody("demo_ip_limit_reached"), ErrMismatch, true},
		{"503 waits too long", "POST", "/api/tasks", 503, hdr("Retry-After", "90"), errBody("server_busy"), ErrMismatch, true},
		{"undocumented status", "GET", "/api/config", 418, hdr(), errBody("internal_error"), ErrMismatch, true},
		{"202 without RateLimit", "POST", "/api/tasks", 202, hdr("Location", "/api/tasks/"+taskID), `{"id":"` + taskID + `","status":"queued","quota":{"ip_remaining":4,"global_remaining":99}}`, ErrMismatch, true},
		{"Location of another task", "POST", "/api/tasks", 202, hdr(append(rateLimit202[2:], "Location", "/api/tasks/t_ffffffffffffffffffffffffffffffff")...), `{"id":"` + taskID + `","status":"queued","quota":{"ip_remaining":4,"global_remaining":99}}`, ErrMismatch, true},
		{"unknown policy", "POST", "/api/tasks", 202, hdr("Location", "/api/tasks/"+taskID, "RateLimit-Policy", `"hourly";q=5;w=3600`, "RateLimit", `"hourly";r=4;t=3600`), `{"id":"` + taskID + `","status":"queued","quota":{"ip_remaining":4,"global_remaining":99}}`, ErrMismatch, true},
		{"mixed quota", "POST", "/api/tasks", 202, hdr(rateLimit202...), `{"id":"` + taskID + `","status":"queued","quota":{"ip_remaining":4,"global_remaining":99,"key_remaining":1}}`, ErrMismatch, true},
		{"undocumented field", "GET", "/api/tasks/" + taskID, 200, hdr(), strings.Replace(finishedTask, `"status":"succeeded",`, `"status":"succeeded","visitor":"ab12",`, 1), ErrMismatch, true},
		{"result without language", "GET", "/api/tasks/" + taskID, 200, hdr(), strings.Replace(finishedTask, `"language":"en",`, "", 1), ErrMismatch, true},
		{"null steps", "GET", "/api/tasks/" + taskID, 200, hdr(), strings.Replace(failedTask, `"steps":[]`, `"steps":null`, 1), ErrMismatch, true},
		{"unknown warning", "GET", "/api/tasks/" + taskID, 200, hdr(), strings.Replace(failedTask, `"warnings":[]`, `"warnings":["brand_new"]`, 1), ErrMismatch, true},
		{"unknown task error", "GET", "/api/tasks/" + taskID, 200, hdr(), strings.Replace(failedTask, "worker_lost", "gremlins", 1), ErrMismatch, true},
		{"stream where none is promised", "GET", "/api/config", 200, hdr("Content-Type", "text/event-stream"), "", ErrMismatch, true},
		{"HTML error page", "GET", "/api/config", 500, hdr("Content-Type", "text/html"), "<h1>oops</h1>", ErrMismatch, true},
		{"405 without Allow", "PUT", "/api/config", 405, hdr(), errBody("method_not_allowed"), ErrMismatch, true},
		{"unknown api path answered 200", "GET", "/api/nope", 200, hdr(), `{}`, ErrMismatch, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := v.Checked()
			req := httptest.NewRequest(tc.method, "http://127.0.0.1:8080"+tc.path, nil)
			err := v.Check(req, tc.status, tc.header, []byte(tc.body))
			if tc.wantErr == nil && err != nil {
				t.Fatalf("Check: %v", err)
			}
			if tc.wantErr != nil && !errors.Is(err, tc.wantErr) {
				t.Fatalf("Check = %v, want %v", err, tc.wantErr)
			}
			if counted := v.Checked() == before+1; counted != tc.counted {
				t.Errorf("counted %v, want %v", counted, tc.counted)
			}
		})
	}
}

// TestCheckEvent: each event's data has its own schema; done is final.
func TestCheckEvent(t *testing.T) {
	v := validator(t)
	tests := []struct {
		event, data string
		wantErr     error
	}{
		{"status", `{"status":"running"}`, nil},
		{"step", `{"seq":3,"kind":"tool","name":"weather","status":"started","duration_ms":0}`, nil},
		{"done", finishedTask, nil},
		{"done", failedTask, nil},
		{"status", `{"status":"paused"}`, ErrMismatch},
		{"step", `{"seq":0,"kind":"tool","name":"weather","status":"ok","duration_ms":1}`, ErrMismatch},
		{"done", strings.Replace(finishedTask, `"status":"succeeded"`, `"status":"running"`, 1), ErrMismatch},
		{"step", `not json`, ErrMismatch},
		{"message", `{}`, ErrUndocumented},
	}
	for _, tc := range tests {
		err := v.CheckEvent(tc.event, []byte(tc.data))
		if (tc.wantErr == nil) != (err == nil) || (tc.wantErr != nil && !errors.Is(err, tc.wantErr)) {
			t.Errorf("CheckEvent(%s, %.40s) = %v, want %v", tc.event, tc.data, err, tc.wantErr)
		}
	}
}

// TestTransport: the wrapped client still gets every body; mismatches go
// to onErr, or fail the round trip when there is none.
func TestTransport(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", reqID)
		switch r.URL.Path {
		case "/api/config":
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, config)
		case "/api/tasks/" + taskID + "/events":
			w.Header().Set("Content-Type", "text/event-stream")
			io.WriteString(w, "retry: 2000\n\nid: 1-0\nevent: status\ndata: {\"status\":\"running\"}\n\n")
		case "/":
			w.Header().Set("Content-Type", "text/html")
			io.WriteString(w, "<p>page</p>")
		default:
			// Drift: an error without the envelope.
			http.Error(w, "nope", http.StatusNotFound)
		}
	}))
	t.Cleanup(srv.Close)

	var mu sync.Mutex
	var mismatches []error
	v := validator(t)
	client := &http.Client{Transport: v.Transport(nil, func(err error) {
		mu.Lock()
		mismatches = append(mismatches, err)
		mu.Unlock()
	})}
	get := func(path string) string {
		t.Helper()
		resp, err := client.Get(srv.URL + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if got := get("/api/config"); got != config {
		t.Errorf("config body %q, want it handed on unchanged", got)
	}
	if got := get("/api/tasks/" + taskID + "/events"); !strings.Contains(got, "event: status") {
		t.Errorf("stream body %q", got)
	}
	if got := get("/"); got != "<p>page</p>" {
		t.Errorf("page body %q", got)
	}
	if got := get("/api/tasks/" + taskID); got != "nope\n" {
		t.Errorf("drifted body %q, want it handed on", got)
	}
	if v.Checked() != 3 {
		t.Errorf("checked %d responses, want 3 (the page is not the API's)", v.Checked())
	}
	if len(mismatches) != 1 || !errors.Is(mismatches[0], ErrMismatch) {
		t.Errorf("mismatches %v, want the one 404 without an envelope", mismatches)
	}

	strict := &http.Client{Transport: v.Transport(nil, nil)}
	if _, err := strict.Get(srv.URL + "/api/tasks/" + taskID); !errors.Is(err, ErrMismatch) {
		t.Errorf("strict transport: err %v, want ErrMismatch", err)
	}
}

// TestConcurrentChecks: one validator serves a harness's parallel clients
// (run with -race).
func TestConcurrentChecks(t *testing.T) {
	v := validator(t)
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			req := httptest.NewRequest("GET", "/api/tasks/"+taskID, nil)
			errs <- v.Check(req, 200, hdr(), []byte(finishedTask))
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if v.Checked() != 16 {
		t.Errorf("checked %d, want 16", v.Checked())
	}
}

// TestNewRejectsBadDocuments: a broken document fails at load, naming why.
func TestNewRejectsBadDocuments(t *testing.T) {
	good := string(api.OpenAPIDocument())
	tests := []struct{ name, doc string }{
		{"not JSON", "{"},
		{"OpenAPI 3.0", strings.Replace(good, `"openapi": "3.1.0"`, `"openapi": "3.0.3"`, 1)},
		{"dangling reference", strings.Replace(good, `#/components/schemas/TaskId"`, `#/components/schemas/TaskIdx"`, 1)},
		{"bad pattern", strings.Replace(good, `^t_[0-9a-f]{32}$`, `^t_[0-9a-f{32}$`, 1)},
		{"no NotFound response", strings.Replace(good, `"NotFound": {`, `"NotFoundX": {`, 1)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if tc.doc == good {
				t.Fatal("the replacement did not apply")
			}
			if _, err := New([]byte(tc.doc)); !errors.Is(err, ErrDocument) {
				t.Errorf("New = %v, want ErrDocument", err)
			}
		})
	}
}

// TestServedDocumentAndClient: the answers of the handlers this repository
// ships for /api/openapi.json and /api/client.{js,d.ts} match the document
// (the router adds X-Request-Id to every answer; this test does it too).
func TestServedDocumentAndClient(t *testing.T) {
	mux := http.NewServeMux()
	mux.Handle("GET /api/client.js", web.Client())
	mux.Handle("GET /api/client.d.ts", web.Client())
	mux.HandleFunc("GET /api/openapi.json", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Write(api.OpenAPIDocument())
	})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Request-Id", reqID)
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	v := validator(t)
	client := &http.Client{Transport: v.Transport(nil, nil)}
	for _, p := range []string{"/api/openapi.json", "/api/client.js", "/api/client.d.ts"} {
		resp, err := client.Get(srv.URL + p)
		if err != nil {
			t.Errorf("GET %s: %v", p, err)
			continue
		}
		resp.Body.Close()
	}
	if v.Checked() != 3 {
		t.Errorf("checked %d, want 3", v.Checked())
	}
}
