package turnstile

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

const (
	testSecret   = "0x4AAAAAAAsecret-never-printed"
	testRemoteIP = "198.51.100.23"
	testHost     = "demo.example.com"
	testToken    = "0.token-from-the-widget"
)

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// received is one siteverify request as the emulator saw it.
type received struct {
	contentType string
	form        url.Values
}

// emulator stands in for siteverify. respond gets the 0-based number of the
// request and its form and returns the status and body to send.
type emulator struct {
	srv     *httptest.Server
	mu      sync.Mutex
	got     []received
	respond func(n int, f url.Values) (int, string)
}

func newEmulator(t *testing.T, respond func(n int, f url.Values) (int, string)) *emulator {
	t.Helper()
	e := &emulator{respond: respond}
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := r.ParseForm(); err != nil {
			http.Error(w, "bad form", http.StatusBadRequest)
			return
		}
		e.mu.Lock()
		n := len(e.got)
		e.got = append(e.got, received{contentType: r.Header.Get("Content-Type"), form: r.PostForm})
		e.mu.Unlock()
		status, body := e.respond(n, r.PostForm)
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	t.Cleanup(e.srv.Close)
	return e
}

func (e *emulator) requests() []received {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]received(nil), e.got...)
}

func (e *emulator) client(o Options) *Client {
	o.Secret = testSecret
	o.VerifyURL = e.srv.URL
	if o.Hostnames == nil {
		o.Hostnames = []string{"other.example.org", testHost}
	}
	if o.Timeout == 0 {
		o.Timeout = 2 * time.Second
	}
	o.HTTPClient = e.srv.Client()
	return NewClient(o)
}

// always answers every request the same way.
func always(status int, body string) func(int, url.Values) (int, string) {
	return func(int, url.Values) (int, string) { return status, body }
}

// sequence answers request n with answers[n] (the last one repeats).
func sequence(answers ...[2]string) func(int, url.Values) (int, string) {
	return func(n int, _ url.Values) (int, string) {
		a := answers[min(n, len(answers)-1)]
		var status int
		_, _ = fmt.Sscan(a[0], &status)
		return status, a[1]
	}
}

func okFor(host string) string {
	return `{"success":true,"hostname":"` + host + `","challenge_ts":"2026-11-29T10:00:00Z"}`
}

func failWith(codes string) string { return `{"success":false,"error-codes":[` + codes + `]}` }

func TestClientVerify(t *testing.T) {
	big := func(n int) string {
		// A valid answer padded to exactly n bytes.
		head := `{"success":true,"hostname":"` + testHost + `","cdata":"`
		return head + strings.Repeat("x", n-len(head)-2) + `"}`
	}
	tests := []struct {
		name     string
		respond  func(int, url.Values) (int, string)
		action   string
		want     error
		requests int
	}{
		{name: "success", respond: always(200, okFor(testHost)), requests: 1},
		{name: "hostname case-insensitive", respond: always(200, okFor("Demo.EXAMPLE.com")), requests: 1},
		{name: "wrong hostname", respond: always(200, okFor("evil.example.net")), want: ErrRejected, requests: 1},
		{name: "suffix is not the hostname", respond: always(200, okFor("x"+testHost)), want: ErrRejected, requests: 1},
		{name: "missing hostname", respond: always(200, `{"success":true}`), want: ErrRejected, requests: 1},
		{name: "missing-input-secret", respond: always(200, failWith(`"missing-input-secret"`)), want: ErrRejected, requests: 1},
		{name: "invalid-input-secret", respond: always(200, failWith(`"invalid-input-secret"`)), want: ErrRejected, requests: 1},
		{name: "missing-input-response", respond: always(200, failWith(`"missing-input-response"`)), want: ErrRejected, requests: 1},
		{name: "invalid-input-response", respond: always(200, failWith(`"invalid-input-response"`)), want: ErrRejected, requests: 1},
		{name: "bad-request", respond: always(200, failWith(`"bad-request"`)), want: ErrRejected, requests: 1},
		{name: "timeout-or-duplicate", respond: always(200, failWith(`"timeout-or-duplicate"`)), want: ErrRejected, requests: 1},
		{name: "unknown code", respond: always(200, failWith(`"brand-new-code"`)), want: ErrRejected, requests: 1},
		{name: "no codes", respond: always(200, failWith(``)), want: ErrRejected, requests: 1},
		{name: "internal-error", respond: always(200, failWith(`"internal-error"`)), want: ErrUnavailable, requests: 1},
		{name: "internal-error among others", respond: always(200, failWith(`"bad-request","internal-error"`)), want: ErrUnavailable, requests: 1},
		{name: "action matches", action: "create_task", requests: 1,
			respond: always(200, `{"success":true,"hostname":"`+testHost+`","action":"create_task"}`)},
		{name: "action differs", action: "create_task", want: ErrRejected, requests: 1,
			respond: always(200, `{"success":true,"hostname":"`+testHost+`","action":"login"}`)},
		{name: "action missing", action: "create_task", respond: always(200, okFor(testHost)), want: ErrRejected, requests: 1},
		{name: "500 then 200", respond: sequence([2]string{"500", "oops"}, [2]string{"200", okFor(testHost)}), requests: 2},
		{name: "500 twice", respond: always(500, "oops"), want: ErrUnavailable, requests: 2},
		{name: "503", respond: always(503, ""), want: ErrUnavailable, requests: 2},
		{name: "502 then rejection", respond: sequence([2]string{"502", ""}, [2]string{"200", failWith(`"invalid-input-response"`)}),
			want: ErrRejected, requests: 2},
		{name: "400 not retried", respond: always(400, failWith(`"bad-request"`)), want: ErrUnavailable, requests: 1},
		{name: "403 not retried", respond: always(403, ""), want: ErrUnavailable, requests: 1},
		{name: "204 empty", respond: always(204, ""), want: ErrUnavailable, requests: 1},
		{name: "non-JSON", respond: always(200, "<html>hello</html>"), want: ErrUnavailable, requests: 1},
		{name: "JSON array", respond: always(200, `[{"success":true,"hostname":"`+testHost+`"}]`), want: ErrUnavailable, requests: 1},
		{name: "JSON string", respond: always(200, `"success"`), want: ErrUnavailable, requests: 1},
		{name: "JSON null", respond: always(200, `null`), want: ErrUnavailable, requests: 1},
		{name: "empty body", respond: always(200, ""), want: ErrUnavailable, requests: 1},
		{name: "truncated object", respond: always(200, `{"success":true,`), want: ErrUnavailable, requests: 1},
		{name: "object without success", respond: always(200, `{"hostname":"`+testHost+`"}`), want: ErrUnavailable, requests: 1},
		{name: "success not a bool", respond: always(200, `{"success":"true","hostname":"`+testHost+`"}`), want: ErrUnavailable, requests: 1},
		{name: "body exactly 64 KiB", respond: always(200, big(64<<10)), requests: 1},
		{name: "body over 64 KiB", respond: always(200, big(64<<10+1)), want: ErrUnavailable, requests: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEmulator(t, tt.respond)
			err := e.client(Options{Action: tt.action}).Verify(context.Background(), testToken, testRemoteIP)
			checkErr(t, err, tt.want)
			got := e.requests()
			if len(got) != tt.requests {
				t.Fatalf("emulator saw %d requests, want %d", len(got), tt.requests)
			}
			// A retry must carry the first attempt's idempotency key, or
			// Cloudflare would answer it as a replay.
			for _, r := range got[1:] {
				if k := r.form.Get("idempotency_key"); k != got[0].form.Get("idempotency_key") {
					t.Errorf("retry idempotency_key %q differs from %q", k, got[0].form.Get("idempotency_key"))
				}
			}
		})
	}
}

// checkErr asserts err is nil or wraps want, and that its text carries
// neither the secret nor the visitor's address.
func checkErr(t *testing.T, err, want error) {
	t.Helper()
	if want == nil {
		if err != nil {
			t.Fatalf("Verify = %v, want accepted", err)
		}
		return
	}
	if !errors.Is(err, want) {
		t.Fatalf("Verify = %v, want %v", err, want)
	}
	other := ErrRejected
	if want == ErrRejected {
		other = ErrUnavailable
	}
	if errors.Is(err, other) {
		t.Fatalf("Verify = %v wraps both sentinels", err)
	}
	if s := err.Error(); strings.Contains(s, testSecret) || strings.Contains(s, testRemoteIP) {
		t.Fatalf("error text leaks secret or remote IP: %s", s)
	}
}

func TestClientForm(t *testing.T) {
	tests := []struct {
		name     string
		remoteIP string
	}{
		{name: "with remoteip", remoteIP: testRemoteIP},
		{name: "without remoteip", remoteIP: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEmulator(t, always(200, okFor(testHost)))
			c := e.client(Options{})
			for range 2 {
				if err := c.Verify(context.Background(), testToken, tt.remoteIP); err != nil {
					t.Fatalf("Verify: %v", err)
				}
			}
			got := e.requests()
			if len(got) != 2 {
				t.Fatalf("emulator saw %d requests, want 2", len(got))
			}
			for _, r := range got {
				if r.contentType != "application/x-www-form-urlencoded" {
					t.Errorf("Content-Type %q", r.contentType)
				}
				if r.form.Get("secret") != testSecret || r.form.Get("response") != testToken {
					t.Errorf("secret/response = %q/%q", r.form.Get("secret"), r.form.Get("response"))
				}
				if _, has := r.form["remoteip"]; has != (tt.remoteIP != "") || r.form.Get("remoteip") != tt.remoteIP {
					t.Errorf("remoteip = %q (present %v), want %q", r.form.Get("remoteip"), has, tt.remoteIP)
				}
				if k := r.form.Get("idempotency_key"); !uuidV4.MatchString(k) {
					t.Errorf("idempotency_key %q is not a UUIDv4", k)
				}
			}
			// Separate Verify calls are separate attempts: their keys differ.
			if got[0].form.Get("idempotency_key") == got[1].form.Get("idempotency_key") {
				t.Error("two Verify calls shared an idempotency_key")
			}
		})
	}
}

// TestClientReplay runs an emulator that, like Cloudflare, lets a token be
// verified once: a second Verify is a replay, a retry with the same
// idempotency key is not.
func TestClientReplay(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]string{} // token -> idempotency key of its first use
	e := newEmulator(t, func(n int, f url.Values) (int, string) {
		mu.Lock()
		defer mu.Unlock()
		tok, key := f.Get("response"), f.Get("idempotency_key")
		if first, ok := seen[tok]; ok && first != key {
			return 200, failWith(`"timeout-or-duplicate"`)
		}
		seen[tok] = key
		if n == 0 {
			// Fail the very first request after recording the token, as a
			// flaky Cloudflare edge might, to exercise the keyed retry.
			return 500, ""
		}
		return 200, okFor(testHost)
	})
	c := e.client(Options{})
	steps := []struct {
		name string
		want error
	}{
		{name: "first use, retried after 500", want: nil},
		{name: "replay", want: ErrRejected},
	}
	for _, s := range steps {
		t.Run(s.name, func(t *testing.T) {
			checkErr(t, c.Verify(context.Background(), testToken, testRemoteIP), s.want)
		})
	}
	if n := len(e.requests()); n != 3 {
		t.Fatalf("emulator saw %d requests, want 3 (500, retry, replay)", n)
	}
}

func TestClientSlowServer(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	e := newEmulator(t, func(int, url.Values) (int, string) {
		<-release
		return 200, okFor(testHost)
	})
	// Cleanups run last-registered first: free the handler before the
	// emulator's Close waits for it.
	t.Cleanup(func() { once.Do(func() { close(release) }) })

	const timeout = 150 * time.Millisecond
	start := time.Now()
	err := e.client(Options{Timeout: timeout}).Verify(context.Background(), testToken, testRemoteIP)
	elapsed := time.Since(start)
	checkErr(t, err, ErrUnavailable)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want it to wrap context.DeadlineExceeded", err)
	}
	if elapsed < timeout || elapsed > timeout+2*time.Second {
		t.Errorf("Verify took %s with a %s budget", elapsed, timeout)
	}
	// The budget is spent, so there must be no retry.
	if n := len(e.requests()); n != 1 {
		t.Errorf("emulator saw %d requests, want 1", n)
	}
}

func TestClientCallerCancelled(t *testing.T) {
	e := newEmulator(t, always(200, okFor(testHost)))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	err := e.client(Options{}).Verify(ctx, testToken, testRemoteIP)
	checkErr(t, err, ErrUnavailable)
	if !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want it to wrap context.Canceled", err)
	}
	if n := len(e.requests()); n != 0 {
		t.Errorf("emulator saw %d requests for a cancelled context", n)
	}
}

// countingTransport counts round trips before handing them on.
type countingTransport struct {
	mu   sync.Mutex
	n    int
	next http.RoundTripper
}

func (c *countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.n++
	c.mu.Unlock()
	return c.next.RoundTrip(r)
}

func TestClientConnectionRefused(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	tr := &countingTransport{next: &http.Transport{}}
	c := NewClient(Options{Secret: testSecret, VerifyURL: "http://" + addr + "/siteverify",
		Hostnames: []string{testHost}, Timeout: 2 * time.Second, HTTPClient: &http.Client{Transport: tr}})
	checkErr(t, c.Verify(context.Background(), testToken, testRemoteIP), ErrUnavailable)
	if tr.n != 2 {
		t.Errorf("%d attempts, want 2 (one retry after a network error)", tr.n)
	}
}

func TestClientTruncatedBodyRetried(t *testing.T) {
	var n int
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		first := n == 1
		mu.Unlock()
		if first {
			// Promise more than is sent: the server then drops the
			// connection and the client sees a network error mid-body.
			w.Header().Set("Content-Length", "500")
			_, _ = w.Write([]byte(`{"success":true,`))
			return
		}
		_, _ = w.Write([]byte(okFor(testHost)))
	}))
	t.Cleanup(srv.Close)
	c := NewClient(Options{Secret: testSecret, VerifyURL: srv.URL, Hostnames: []string{testHost}, HTTPClient: srv.Client()})
	checkErr(t, c.Verify(context.Background(), testToken, testRemoteIP), nil)
	mu.Lock()
	defer mu.Unlock()
	if n != 2 {
		t.Errorf("server saw %d requests, want 2", n)
	}
}

func TestClientLocalChecks(t *testing.T) {
	tests := []struct {
		name     string
		token    string
		want     error
		requests int
	}{
		{name: "empty", token: "", want: ErrRejected},
		{name: "2049 chars", token: strings.Repeat("a", MaxTokenLen+1), want: ErrRejected},
		{name: "2048 chars reaches siteverify", token: strings.Repeat("a", MaxTokenLen), requests: 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := newEmulator(t, always(200, okFor(testHost)))
			checkErr(t, e.client(Options{}).Verify(context.Background(), tt.token, testRemoteIP), tt.want)
			if n := len(e.requests()); n != tt.requests {
				t.Errorf("emulator saw %d requests, want %d", n, tt.requests)
			}
		})
	}
}

func TestClientNoHostnamesRejects(t *testing.T) {
	e := newEmulator(t, always(200, okFor(testHost)))
	checkErr(t, e.client(Options{Hostnames: []string{}}).Verify(context.Background(), testToken, ""), ErrRejected)
}

func TestClientDefaults(t *testing.T) {
	c := NewClient(Options{Hostnames: []string{" Demo.Example.com ", ""}})
	if c.url != DefaultVerifyURL || c.timeout != DefaultTimeout || c.hc == nil {
		t.Errorf("defaults: url %q timeout %s client %v", c.url, c.timeout, c.hc)
	}
	if len(c.hostnames) != 1 || c.hostnames[0] != testHost {
		t.Errorf("hostnames %q, want [%s]", c.hostnames, testHost)
	}
}

func TestTestVerifier(t *testing.T) {
	tests := []struct {
		name  string
		token string
		want  error
	}{
		{name: "dummy token", token: DummyToken},
		{name: "empty", token: "", want: ErrRejected},
		{name: "real-looking token", token: testToken, want: ErrRejected},
		{name: "dummy with space", token: DummyToken + " ", want: ErrRejected},
		{name: "over-long", token: strings.Repeat("X", MaxTokenLen+1), want: ErrRejected},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			checkErr(t, TestVerifier{}.Verify(context.Background(), tt.token, testRemoteIP), tt.want)
		})
	}
}
