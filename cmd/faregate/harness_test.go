package main

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	neturl "net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/api/apitest"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
)

// syncBuffer collects what run writes (start-up lines and logs) safely.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
	// addr receives the listening address once it is printed.
	addr chan string
	line []byte
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf.Write(p)
	b.line = append(b.line, p...)
	for {
		i := bytes.IndexByte(b.line, '\n')
		if i < 0 {
			break
		}
		l := string(b.line[:i])
		b.line = b.line[i+1:]
		if rest, ok := strings.CutPrefix(l, "faregate: listening on "); ok {
			select {
			case b.addr <- rest:
			default:
			}
		}
	}
	return len(p), nil
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// openAPI checks every answer the end-to-end tests receive (through do,
// readSSE and the browser's proxy) against the served OpenAPI document.
var openAPI = func() *apitest.Validator {
	v, err := apitest.NewValidator()
	if err != nil {
		panic(err)
	}
	return v
}()

// TestMain reports how many answers were checked against the document.
func TestMain(m *testing.M) {
	code := m.Run()
	if n := openAPI.Checked(); n > 0 {
		fmt.Printf("openapi: %d responses validated against api/openapi.json\n", n)
	}
	os.Exit(code)
}

// server is a faregate started through run, as the binary would be.
type server struct {
	URL string
	// Web is URL behind a proxy that checks every answer against the
	// OpenAPI document: for browsers, whose requests the test cannot see.
	Web  string
	Out  *syncBuffer
	stop func() error
}

// Stop shuts the server down gracefully and returns run's error.
func (s *server) Stop() error { return s.stop() }

// startServer calls run on 127.0.0.1:0 with env (plus the address) and
// waits until /healthz answers. The server is stopped at the end of the test.
func startServer(t testing.TB, env map[string]string) *server {
	t.Helper()
	return startServerCtx(t, context.Background(), env)
}

// startServerCtx is startServer with run given a context derived from
// parent (which may carry what only tests hand to run).
func startServerCtx(t testing.TB, parent context.Context, env map[string]string) *server {
	t.Helper()
	// The request window and the failed-check throttle are tested on their
	// own; other tests poll and retry freely.
	full := map[string]string{"FAREGATE_ADDR": "127.0.0.1:0", "FAREGATE_LOG_FORMAT": "json", "FAREGATE_SHUTDOWN_TIMEOUT": "5s",
		"FAREGATE_REQUESTS_PER_MINUTE": "1000000", "FAREGATE_FAILED_CHECKS_PER_HOUR": "1000000"}
	for k, v := range env {
		full[k] = v
	}
	out := &syncBuffer{addr: make(chan string, 1)}
	ctx, cancel := context.WithCancel(parent)
	done := make(chan error, 1)
	go func() { done <- run(ctx, []string{"faregate"}, envOf(full), out) }()
	var url string
	select {
	case url = <-out.addr:
	case err := <-done:
		cancel()
		t.Fatalf("run returned before listening: %v\n%s", err, out.String())
	case <-time.After(20 * time.Second):
		cancel()
		t.Fatalf("no listening line within 20s:\n%s", out.String())
	}
	var once sync.Once
	var stopErr error
	s := &server{URL: url, Out: out, stop: func() error {
		once.Do(func() {
			cancel()
			select {
			case stopErr = <-done:
			case <-time.After(30 * time.Second):
				stopErr = fmt.Errorf("run did not return within 30s of cancel")
			}
		})
		return stopErr
	}}
	t.Cleanup(func() {
		if err := s.Stop(); err != nil {
			t.Errorf("stop: %v", err)
		}
	})
	waitHealthy(t, url)
	target, _ := neturl.Parse(url)
	proxy := httptest.NewServer(&httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) { pr.SetURL(target) },
		Transport: openAPI.Transport(nil, func(err error) {
			t.Errorf("OpenAPI: %v", err)
		}),
		FlushInterval: -1, // event streams pass at once
	})
	t.Cleanup(proxy.Close)
	s.Web = proxy.URL
	return s
}

func waitHealthy(t testing.TB, url string) {
	t.Helper()
	clocktest.Eventually(t, 10*time.Second, url+"/healthz answers 200", func() bool {
		resp, err := http.Get(url + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
}

// reply is a decoded HTTP answer.
type reply struct {
	Status int
	Header http.Header
	Body   map[string]any
	Raw    []byte
}

// code is the error code of an error envelope ("" otherwise).
func (r reply) code() string {
	e, _ := r.Body["error"].(map[string]any)
	c, _ := e["code"].(string)
	return c
}

// do sends one request with the default client and checks the answer
// against the OpenAPI document; a header given as "" is removed. It fails
// the test at once when no answer comes.
func do(t testing.TB, method, url string, body string, header map[string]string) reply {
	t.Helper()
	r := doOn(t, http.DefaultClient, true, method, url, body, header)
	if r.Status == 0 {
		t.FailNow()
	}
	return r
}

// taskBody is a valid creation body with the dummy token.
func taskBody(dest string) string {
	return fmt.Sprintf(`{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":%q,"days":3,"interests":["food","history"]}`, dest)
}

// waitTask polls a task until it is final and returns it, at most seven
// times in its first second and four a second after (clocktest.PollAt):
// a visitor's per-second window (FAREGATE_REQUESTS_PER_SECOND, 10 at its
// default) keeps room for the requests the test sends next.
func waitTask(t testing.TB, base, id string) map[string]any {
	t.Helper()
	var task map[string]any
	if !clocktest.PollAt(60*time.Second, 250*time.Millisecond, func() bool {
		r := do(t, "GET", base+"/api/tasks/"+id, "", nil)
		if politePoll(r) {
			return false
		}
		if r.Status != 200 {
			t.Fatalf("GET task: %d %s", r.Status, r.Raw)
		}
		task = r.Body
		s := task["status"]
		return s == "succeeded" || s == "failed"
	}) {
		t.Fatalf("task %s final: not within 60s", id)
	}
	return task
}

// politePoll reports whether a poll was refused by the per-second window
// (FAREGATE_REQUESTS_PER_SECOND, on at its default in these tests): the
// polling helpers look every 20 ms, faster than a visitor may ask, and a
// poll refused so is answered from memory and simply looks again, as a
// client that honours Retry-After would.
func politePoll(r reply) bool {
	return r.Status == http.StatusTooManyRequests && r.code() == codes.RateLimited && r.Header.Get("Ratelimit-Policy") == `"rps";q=10;w=1`
}

// sseEvent is one parsed Server-Sent Event.
type sseEvent struct {
	ID, Type, Data string
}

// readSSE reads events from url until done (or n events when n > 0).
func readSSE(t testing.TB, url string, lastID string, n int) []sseEvent {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	resp, err := http.DefaultClient.Do(req.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("events: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if err := openAPI.Check(req, resp.StatusCode, resp.Header, nil); err != nil {
		t.Errorf("OpenAPI: %v", err)
	}
	var out []sseEvent
	var cur sseEvent
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if cur.Type != "" {
				out = append(out, cur)
				if cur.Type == "done" || (n > 0 && len(out) >= n) {
					return out
				}
			}
			cur = sseEvent{}
		case strings.HasPrefix(line, "id: "):
			cur.ID = line[4:]
		case strings.HasPrefix(line, "event: "):
			cur.Type = line[7:]
		case strings.HasPrefix(line, "data: "):
			cur.Data += line[6:]
		}
	}
	return out
}

func httpGet(url string) (*http.Response, error) {
	c := &http.Client{Timeout: 2 * time.Second}
	resp, err := c.Get(url)
	if err == nil {
		resp.Body.Close()
	}
	return resp, err
}
