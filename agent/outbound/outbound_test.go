package outbound

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/codes"
)

// sleeper records the waits a Transport asks for instead of spending them.
type sleeper struct {
	mu sync.Mutex
	ds []time.Duration
}

func (s *sleeper) sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	s.ds = append(s.ds, d)
	s.mu.Unlock()
	return ctx.Err()
}

func (s *sleeper) waits() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Duration(nil), s.ds...)
}

// warnings collects a session's Warn calls.
type warnings struct {
	mu   sync.Mutex
	list []string
}

func (w *warnings) warn(code, detail string) {
	w.mu.Lock()
	w.list = append(w.list, code+":"+detail)
	w.mu.Unlock()
}

func (w *warnings) all() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]string(nil), w.list...)
}

// rig is a Transport and Session wired to recorders.
type rig struct {
	tr    *Transport
	sess  *Session
	sleep *sleeper
	warn  *warnings
}

func newRig(t *testing.T, o Options) rig {
	t.Helper()
	sl := &sleeper{}
	if o.Sleep == nil {
		o.Sleep = sl.sleep
	}
	w := &warnings{}
	tr := New(o)
	return rig{tr: tr, sess: tr.Session(SessionOptions{Warn: w.warn}), sleep: sl, warn: w}
}

// recv waits for a signal from a test server, failing instead of hanging
// when the code under test never sends it.
func recv(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("timed out waiting for %s", what)
	}
}

// taskCtx gives a request a generous task deadline, like a real task has.
func taskCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

func get(t *testing.T, c *http.Client, ctx context.Context, url string) (*http.Response, string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, string(b), nil
}

// fetch is get for a goroutine other than the test's: it reports through
// its error, never through t.
func fetch(c *http.Client, ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestIdentityHeaders(t *testing.T) {
	var got http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got = r.Header.Clone()
	}))
	t.Cleanup(srv.Close)

	tr := New(Options{Version: "1.2.3", PublicURL: "https://demo.example"})
	sess := tr.Session(SessionOptions{Score: 0.25, HasScore: true})
	ctx := WithCall(context.Background(), "call_42", 3)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/x", nil)
	req.Header.Set("User-Agent", "Mozilla/5.0 (Windows NT 10.0) Chrome/120.0")
	resp, err := sess.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()

	want := map[string]string{
		"User-Agent":     "faregate-agent/1.2.3 (+https://demo.example)",
		HeaderOptIn:      "true",
		HeaderToolCallID: "call_42",
		HeaderDepth:      "3",
		HeaderScore:      "0.25",
	}
	for k, v := range want {
		if g := got.Get(k); g != v {
			t.Errorf("%s = %q, want %q", k, g, v)
		}
	}
	for _, bad := range []string{"Mozilla", "Chrome", "Safari"} {
		if strings.Contains(got.Get("User-Agent"), bad) || strings.Contains(tr.UserAgent(), bad) {
			t.Errorf("User-Agent %q poses as a browser (%s)", got.Get("User-Agent"), bad)
		}
	}
	if d := New(Options{}).UserAgent(); d != "faregate-agent/dev (+"+DefaultPublicURL+")" {
		t.Errorf("default User-Agent = %q", d)
	}
}

func TestNoScoreNoCallHeaders(t *testing.T) {
	var got http.Header
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Header.Clone() }))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})
	if _, _, err := get(t, r.sess.Client(), context.Background(), srv.URL); err != nil {
		t.Fatal(err)
	}
	for _, h := range []string{HeaderScore, HeaderToolCallID, HeaderDepth} {
		if v, ok := got[http.CanonicalHeaderKey(h)]; ok {
			t.Errorf("%s sent (%v) without a score or call", h, v)
		}
	}
	if got.Get(HeaderOptIn) != "true" {
		t.Error("opt-in header missing")
	}
}

func TestThirtyEightConcurrentFetchesOneRoundTrip(t *testing.T) {
	var hits atomic.Int64
	arrived := make(chan struct{})
	release := make(chan struct{})
	doc := strings.Repeat("the same 1.2 MB document ", 1000)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			close(arrived)
		}
		<-release
		io.WriteString(w, doc)
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})
	c := r.sess.Client()

	const n = 38
	var wg sync.WaitGroup
	open := sync.OnceFunc(func() { close(release) })
	// However the test ends, its callers end before it does: the handlers
	// are let go, then the callers waited for (the server closes after).
	t.Cleanup(func() { open(); wg.Wait() })
	bodies := make([]string, n)
	errs := make([]error, n)
	for i := range n {
		wg.Go(func() { bodies[i], errs[i] = fetch(c, context.Background(), srv.URL+"/doc") })
	}
	recv(t, arrived, "the first request")
	open()
	wg.Wait()

	for i := range n {
		if errs[i] != nil || bodies[i] != doc {
			t.Fatalf("caller %d: err %v, body of %d bytes", i, errs[i], len(bodies[i]))
		}
	}
	if h := hits.Load(); h != 1 {
		t.Fatalf("server saw %d requests, want 1", h)
	}
	st := r.sess.Stats()
	if st.RoundTrips != 1 || st.CacheHits+st.Shared != n-1 {
		t.Fatalf("stats %+v, want 1 round trip and %d shared or cached", st, n-1)
	}
}

func TestSequentialRepeatServedFromCache(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		w.Header().Set("X-Test", "yes")
		io.WriteString(w, "hello")
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})

	for i := range 3 {
		resp, body, err := get(t, r.sess.Client(), context.Background(), srv.URL+"/same?a=1")
		if err != nil || body != "hello" || resp.Header.Get("X-Test") != "yes" || resp.StatusCode != 200 {
			t.Fatalf("call %d: %v %q %v", i, err, body, resp)
		}
	}
	// Another session (another task) is not served from this one's cache.
	other := r.tr.Session(SessionOptions{})
	if _, _, err := get(t, other.Client(), context.Background(), srv.URL+"/same?a=1"); err != nil {
		t.Fatal(err)
	}
	if h := hits.Load(); h != 2 {
		t.Fatalf("server saw %d requests, want 2 (one per session)", h)
	}
	if st := r.sess.Stats(); st.RoundTrips != 1 || st.CacheHits != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestRetryPolicy(t *testing.T) {
	tests := []struct {
		name       string
		method     string
		status     int
		retryAfter string
		deadline   time.Duration
		wantHits   int64
		wantSleeps []time.Duration // nil = don't check values, only count
		wantCount  int
		wantWarn   bool
	}{
		{name: "400 not retried", status: 400, deadline: time.Minute, wantHits: 1},
		{name: "401 not retried", status: 401, deadline: time.Minute, wantHits: 1},
		{name: "403 not retried", status: 403, deadline: time.Minute, wantHits: 1},
		{name: "404 not retried", status: 404, deadline: time.Minute, wantHits: 1},
		{name: "500 not retried", status: 500, deadline: time.Minute, wantHits: 1},
		{name: "502 retried twice", status: 502, deadline: time.Minute, wantHits: 3, wantCount: 2},
		{name: "504 retried twice", status: 504, deadline: time.Minute, wantHits: 3, wantCount: 2},
		{name: "503 Retry-After 1 honoured", status: 503, retryAfter: "1", deadline: time.Minute, wantHits: 3,
			wantSleeps: []time.Duration{time.Second, time.Second}, wantCount: 2},
		{name: "429 retried and warned", status: 429, deadline: time.Minute, wantHits: 3, wantCount: 2, wantWarn: true},
		{name: "429 Retry-After beyond deadline gives up at once", status: 429, retryAfter: "120",
			deadline: 5 * time.Second, wantHits: 1, wantWarn: true},
		{name: "503 Retry-After beyond deadline gives up at once", status: 503, retryAfter: "30",
			deadline: 2 * time.Second, wantHits: 1},
		{name: "POST never retried", method: http.MethodPost, status: 503, deadline: time.Minute, wantHits: 1},
		{name: "PUT never retried", method: http.MethodPut, status: 502, deadline: time.Minute, wantHits: 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var hits atomic.Int64
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				hits.Add(1)
				if tc.retryAfter != "" {
					w.Header().Set("Retry-After", tc.retryAfter)
				}
				w.WriteHeader(tc.status)
			}))
			t.Cleanup(srv.Close)
			r := newRig(t, Options{})
			method := tc.method
			if method == "" {
				method = http.MethodGet
			}
			req, _ := http.NewRequestWithContext(taskCtx(t, tc.deadline), method, srv.URL+"/r", strings.NewReader("x"))
			resp, err := r.sess.Client().Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Errorf("status %d, want %d", resp.StatusCode, tc.status)
			}
			if h := hits.Load(); h != tc.wantHits {
				t.Errorf("server saw %d requests, want %d", h, tc.wantHits)
			}
			sl := r.sleep.waits()
			if len(sl) != tc.wantCount {
				t.Errorf("slept %v, want %d waits", sl, tc.wantCount)
			}
			for i, d := range tc.wantSleeps {
				if i < len(sl) && sl[i] != d {
					t.Errorf("wait %d = %v, want %v", i, sl[i], d)
				}
			}
			for _, d := range sl {
				if tc.wantSleeps == nil && (d < 0 || d > 400*time.Millisecond) {
					t.Errorf("backoff %v outside full-jitter bounds", d)
				}
			}
			if st := r.sess.Stats(); st.Retries != tc.wantHits-1 {
				t.Errorf("Stats.Retries = %d, want %d", st.Retries, tc.wantHits-1)
			}
			gotWarn := len(r.warn.all()) > 0
			if gotWarn != tc.wantWarn {
				t.Errorf("warnings %v, want warning: %v", r.warn.all(), tc.wantWarn)
			}
		})
	}
}

func TestPostNotCached(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1) }))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})
	for range 2 {
		resp, err := r.sess.Client().Post(srv.URL, "text/plain", strings.NewReader("a"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if h := hits.Load(); h != 2 {
		t.Fatalf("server saw %d POSTs, want 2", h)
	}
}

// fakeBase is a hand-written base transport whose answers a test scripts.
type fakeBase struct {
	calls atomic.Int64
	fn    func(n int64, r *http.Request) (*http.Response, error)
}

func (f *fakeBase) RoundTrip(r *http.Request) (*http.Response, error) {
	return f.fn(f.calls.Add(1), r)
}

func okResponse(body string) *http.Response {
	return &http.Response{StatusCode: 200, Status: "200 OK", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{}, Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body))}
}

func TestNetworkErrors(t *testing.T) {
	errReset := errors.New("connection reset by peer")
	tests := []struct {
		name      string
		fail      error
		failTimes int64
		wantCalls int64
		wantOK    bool
	}{
		{"transient error retried then succeeds", errReset, 2, 3, true},
		{"persistent error gives up after two retries", errReset, 99, 3, false},
		{"permanent error not retried", fmt.Errorf("dial: %w", ErrPermanent), 99, 1, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fb := &fakeBase{fn: func(n int64, r *http.Request) (*http.Response, error) {
				if n <= tc.failTimes {
					return nil, tc.fail
				}
				return okResponse("fine"), nil
			}}
			r := newRig(t, Options{Base: fb})
			_, body, err := get(t, r.sess.Client(), taskCtx(t, time.Minute), "http://upstream.test/x")
			if fb.calls.Load() != tc.wantCalls {
				t.Errorf("base called %d times, want %d", fb.calls.Load(), tc.wantCalls)
			}
			if tc.wantOK && (err != nil || body != "fine") {
				t.Fatalf("err %v body %q", err, body)
			}
			if !tc.wantOK && !errors.Is(err, ErrRequest) {
				t.Fatalf("err = %v, want ErrRequest", err)
			}
			// The failure is cached too: the task does not hammer a dead host.
			before := fb.calls.Load()
			get(t, r.sess.Client(), taskCtx(t, time.Minute), "http://upstream.test/x")
			if fb.calls.Load() != before {
				t.Error("second identical request reached the base transport")
			}
		})
	}
}

func TestPerHostLimit(t *testing.T) {
	var cur, peak atomic.Int64
	arrived := make(chan struct{}, 6)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := cur.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		arrived <- struct{}{}
		<-release
		cur.Add(-1)
	}))
	t.Cleanup(srv.Close)
	// Cleanups run last-in first-out: handlers are released and the
	// callers waited for before the server waits for its handlers, so a
	// failing assertion can neither hang the test nor leave a caller
	// running after it.
	released := false
	var wg sync.WaitGroup
	t.Cleanup(func() {
		if !released {
			close(release)
		}
		wg.Wait()
	})
	r := newRig(t, Options{})

	for i := range 6 {
		wg.Go(func() { _, _ = fetch(r.sess.Client(), context.Background(), fmt.Sprintf("%s/u%d", srv.URL, i)) })
	}
	recv(t, arrived, "first request")
	recv(t, arrived, "second request")
	// Two are in the handler. A third may only arrive after one leaves;
	// give a broken limit a fair chance to show itself.
	select {
	case <-arrived:
		t.Fatal("a third request reached the host while two were in flight")
	case <-time.After(150 * time.Millisecond):
	}
	for range 4 {
		release <- struct{}{}
		recv(t, arrived, "next request")
	}
	close(release)
	released = true
	wg.Wait()
	if p := peak.Load(); p != 2 {
		t.Fatalf("peak concurrency %d, want 2", p)
	}
}

func TestHostWaitRespectsContext(t *testing.T) {
	arrived := make(chan struct{}, 2)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{PerHost: 1})
	done := make(chan error, 1)
	open := sync.OnceFunc(func() { close(release) })
	// The callers end before the test does (the second's task ends at
	// the latest when the test returns, the first's handler is let go).
	var calls sync.WaitGroup
	t.Cleanup(func() { open(); calls.Wait() })
	calls.Go(func() { _, err := fetch(r.sess.Client(), context.Background(), srv.URL+"/a"); done <- err })
	recv(t, arrived, "the slot holder")

	// A second request queues behind the first; its task then ends.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	queued := make(chan error, 1)
	calls.Go(func() { _, err := fetch(r.sess.Client(), ctx, srv.URL+"/b"); queued <- err })
	waitFor(t, "the second request to queue for the host", func() bool { return r.tr.waiting(srv.Listener.Addr().String()) == 2 })
	cancel()
	var err error
	select {
	case err = <-queued:
	case <-time.After(10 * time.Second):
		t.Fatal("the queued request did not give up with its context")
	}
	// The flight that queued says ErrHostWait; the caller may have left
	// before it did. Either way it is the task's cancellation.
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	open()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	waitFor(t, "host slots to be released", func() bool { return r.tr.waiting(srv.Listener.Addr().String()) == 0 })
	if n := len(arrived); n != 0 {
		t.Fatalf("%d cancelled requests reached the server", n)
	}
}

// waitFor polls cond until it holds, failing after a generous deadline.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-tick.C:
		case <-deadline:
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func TestPushbackWarnedOncePerHost(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set(HeaderDegrade, "true")
		io.WriteString(w, "degraded but here")
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})
	for _, p := range []string{"/a", "/b", "/c"} {
		if _, body, err := get(t, r.sess.Client(), context.Background(), srv.URL+p); err != nil || body != "degraded but here" {
			t.Fatal(err, body)
		}
	}
	w := r.warn.all()
	if len(w) != 1 || w[0] != codes.DownstreamPushback+":127.0.0.1" {
		t.Fatalf("warnings %v, want one %s for the host", w, codes.DownstreamPushback)
	}
}

func TestBodyCap(t *testing.T) {
	const served = 3 << 20
	var written atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := []byte(strings.Repeat("a", 32<<10))
		for written.Load() < served {
			n, err := w.Write(chunk)
			written.Add(int64(n))
			if err != nil {
				return
			}
		}
	}))
	t.Cleanup(srv.Close)

	counting := &countingBase{base: defaultBase()}
	r := newRig(t, Options{Base: counting, MaxBody: 1 << 20})
	resp, body, err := get(t, r.sess.Client(), context.Background(), srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	if len(body) != 1<<20 || resp.Header.Get(HeaderTruncated) != "true" {
		t.Fatalf("body %d bytes, truncated header %q", len(body), resp.Header.Get(HeaderTruncated))
	}
	if n := counting.read.Load(); n > 1<<20 {
		t.Fatalf("read %d bytes from the wire, cap is %d", n, 1<<20)
	}

	// A body of exactly the cap with a matching Content-Length is whole.
	exact := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "16")
		io.WriteString(w, strings.Repeat("b", 16))
	}))
	t.Cleanup(exact.Close)
	r2 := newRig(t, Options{MaxBody: 16})
	resp, body, err = get(t, r2.sess.Client(), context.Background(), exact.URL)
	if err != nil || len(body) != 16 || resp.Header.Get(HeaderTruncated) != "" {
		t.Fatalf("exact-size body: %v, %d bytes, truncated %q", err, len(body), resp.Header.Get(HeaderTruncated))
	}
}

// countingBase counts response body bytes the session actually reads.
type countingBase struct {
	base http.RoundTripper
	read atomic.Int64
}

func (c *countingBase) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(r)
	if err == nil {
		resp.Body = &countingBody{ReadCloser: resp.Body, n: &c.read}
	}
	return resp, err
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

func TestTooManyRedirects(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := hits.Add(1)
		http.Redirect(w, r, fmt.Sprintf("/hop%d", n), http.StatusFound)
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})
	_, _, err := get(t, r.sess.Client(), context.Background(), srv.URL)
	if !errors.Is(err, ErrTooManyRedirects) {
		t.Fatalf("err = %v, want ErrTooManyRedirects", err)
	}
	if h := hits.Load(); h != MaxRedirects+1 {
		t.Fatalf("server saw %d requests, want %d", h, MaxRedirects+1)
	}
}

func TestAbandonedLeaderDoesNotPoisonCache(t *testing.T) {
	var hits atomic.Int64
	arrived := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			close(arrived)
			<-r.Context().Done() // the first caller gives up
			return
		}
		io.WriteString(w, "second time lucky")
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})

	ctx, cancel := context.WithCancel(context.Background())
	// However the test ends, the leader's task ends and it is waited for.
	var leader sync.WaitGroup
	t.Cleanup(func() { cancel(); leader.Wait() })
	done := make(chan error, 1)
	leader.Go(func() { _, err := fetch(r.sess.Client(), ctx, srv.URL); done <- err })
	recv(t, arrived, "the leader")
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("leader err = %v, want context.Canceled", err)
	}
	_, body, err := get(t, r.sess.Client(), context.Background(), srv.URL)
	if err != nil || body != "second time lucky" {
		t.Fatalf("follower: %v %q; a cancelled request must not be cached", err, body)
	}
}

func TestRetryAfterParsing(t *testing.T) {
	now := time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		v    string
		want time.Duration
		ok   bool
	}{
		{"", 0, false},
		{"7", 7 * time.Second, true},
		{"-3", 0, false},
		{"soon", 0, false},
		{now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{now.Add(-time.Minute).Format(http.TimeFormat), 0, true},
		{"99999999999", 24 * time.Hour, true},
	}
	for _, tc := range tests {
		t.Run(tc.v, func(t *testing.T) {
			h := http.Header{}
			if tc.v != "" {
				h.Set("Retry-After", tc.v)
			}
			d, ok := retryAfter(h, now)
			if d != tc.want || ok != tc.ok {
				t.Fatalf("retryAfter(%q) = %v, %v; want %v, %v", tc.v, d, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestHeadKeepsLength(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "1234")
	}))
	t.Cleanup(srv.Close)
	r := newRig(t, Options{})
	resp, err := r.sess.Client().Head(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.ContentLength != 1234 {
		t.Fatalf("HEAD ContentLength = %d, want 1234", resp.ContentLength)
	}
}
