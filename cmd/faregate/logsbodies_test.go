package main

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// floodLog is what a flood of refusals wrote to the log: its bytes, and
// its lines other than the refusal summary, by message.
type floodLog struct {
	bytes   int
	summary int
	other   map[string]int
	lines   []map[string]any
}

// waitFloodLog waits until the log accounts for refused requests (counted
// by a summary, or by a line of their own), then reads what the log grew
// by since base.
func waitFloodLog(t *testing.T, s *server, base int, refused int64) floodLog {
	t.Helper()
	pollUntil(t, 30*time.Second, fmt.Sprintf("the log accounts for %d refusals", refused), func() bool {
		added := s.Out.String()[base:]
		total, _, _ := refusalSummary(added)
		return total+int64(strings.Count(added, `"msg":"request failed"`)) >= refused
	})
	added := s.Out.String()[base:]
	fl := floodLog{bytes: len(added), other: map[string]int{}}
	for _, l := range jsonLogLines(added) {
		if l["msg"] == "refused requests" {
			fl.summary++
			continue
		}
		fl.other[fmt.Sprint(l["msg"])]++
		fl.lines = append(fl.lines, l)
	}
	return fl
}

// TestLogVolumeOf503Floods (#19 item 12): refusals that shed load or report
// a dependency outage are counted in the summary line like 4xx refusals;
// the outage itself writes one line when the dependency's state changes.
// Two floods through the binary: 60 clients against
// FAREGATE_MAX_CONNECTIONS=10 (503 server_busy), and creations while
// siteverify is unreachable (503 demo_protection_unavailable). Each reports
// the bytes of log per 1,000 refusals (before: one JSON line per refusal,
// 262,897 and 377,596 bytes per 1,000; after: about 400 and 900).
func TestLogVolumeOf503Floods(t *testing.T) {
	const refusals = 3000
	// Bytes per 1,000 refusals allowed: the summary's line per interval
	// grows with the flood's duration on a busy machine, never with its
	// refusals; a tenth of the old per-request cost leaves room for that.
	const maxPer1000 = 20_000

	t.Run("connection limit", func(t *testing.T) {
		s := startServer(t, map[string]string{"FAREGATE_MAX_CONNECTIONS": "10", "FAREGATE_METRICS_ADDR": "127.0.0.1:0",
			"FAREGATE_LOG_SUMMARY_INTERVAL": "1s"})
		http.DefaultTransport.(*http.Transport).CloseIdleConnections()
		base := len(s.Out.String())
		var refused, served atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for c := 0; c < 60; c++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var conn net.Conn
				var br *bufio.Reader
				defer func() {
					if conn != nil {
						conn.Close()
					}
				}()
				for refused.Load() < refusals && time.Since(start) < time.Minute {
					if conn == nil {
						var err error
						if conn, err = net.Dial("tcp", hostPort(s.URL)); err != nil {
							continue
						}
						br = bufio.NewReader(conn)
						_ = conn.SetDeadline(time.Now().Add(20 * time.Second))
					}
					_, err := io.WriteString(conn, "GET /api/config HTTP/1.1\r\nHost: "+hostPort(s.URL)+"\r\n\r\n")
					var resp *http.Response
					if err == nil {
						resp, err = http.ReadResponse(br, nil)
					}
					if err != nil {
						conn.Close()
						conn = nil
						continue
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					switch resp.StatusCode {
					case 503:
						refused.Add(1)
					case 200:
						served.Add(1)
					}
					if resp.Close {
						conn.Close()
						conn = nil
					}
				}
			}()
		}
		wg.Wait()
		took := time.Since(start)
		if refused.Load() < refusals {
			t.Fatalf("only %d refusals in %s", refused.Load(), took)
		}
		fl := waitFloodLog(t, s, base, refused.Load())
		per1000 := float64(fl.bytes) * 1000 / float64(refused.Load())
		t.Logf("%d × 503 server_busy (and %d served) in %s: %d bytes of log, %d summary lines, other lines %v = %.0f bytes per 1,000 refusals (before: 262,897 in this test, one 261 B JSON line per refusal)",
			refused.Load(), served.Load(), took.Round(time.Millisecond), fl.bytes, fl.summary, fl.other, per1000)
		if len(fl.other) > 0 {
			t.Errorf("lines other than the summary during the flood: %v", fl.lines[:min(3, len(fl.lines))])
		}
		if per1000 > maxPer1000 {
			t.Errorf("%.0f bytes of log per 1,000 refusals, want at most %d", per1000, maxPer1000)
		}
	})

	t.Run("siteverify unreachable", func(t *testing.T) {
		// 30 requests of each of 100 visitors as fast as they go: the
		// per-second window would refuse some first, and this test is
		// about what the 503s write, so it is off here.
		s := startServer(t, map[string]string{"FAREGATE_TURNSTILE_SECRET_KEY": "test-secret",
			"FAREGATE_TURNSTILE_HOSTNAMES": "demo.example", "FAREGATE_TURNSTILE_VERIFY_URL": deadURL(t),
			"FAREGATE_TRUSTED_PROXIES": "127.0.0.1", "FAREGATE_LOG_SUMMARY_INTERVAL": "1s",
			"FAREGATE_REQUESTS_PER_SECOND": "0"})
		base := len(s.Out.String())
		c := keepAliveClient(t, 16)
		var sent answerTally
		start := time.Now()
		runWorkers(refusals, 16, func(i int) {
			h := map[string]string{"X-Forwarded-For": docVisitorIP(i % 100)}
			r := doOn(t, c, i < 50, "POST", s.URL+"/api/tasks", `{"turnstile_token":"tok","destination":"Rome","days":1}`, h)
			sent.add(r.Status, r.code())
		})
		took := time.Since(start)
		if n := sent.withCode("demo_protection_unavailable"); n != refusals {
			t.Fatalf("answers %s, want %d × demo_protection_unavailable", sent.String(), refusals)
		}
		fl := waitFloodLog(t, s, base, refusals)
		per1000 := float64(fl.bytes) * 1000 / refusals
		t.Logf("%d × 503 demo_protection_unavailable in %s: %d bytes of log, %d summary lines, other lines %v = %.0f bytes per 1,000 refusals (before: 377,596, one 377 B line per refusal)",
			refusals, took.Round(time.Millisecond), fl.bytes, fl.summary, fl.other, per1000)
		// One line says siteverify went down, with the error that said so.
		if len(fl.lines) != 1 || fl.lines[0]["msg"] != "dependency down" || fl.lines[0]["dependency"] != "turnstile" || fl.lines[0]["err"] == nil {
			t.Errorf("want exactly one line besides the summary, dependency down for turnstile; got %d: %v", len(fl.lines), fl.lines[:min(3, len(fl.lines))])
		}
		if per1000 > maxPer1000 {
			t.Errorf("%.0f bytes of log per 1,000 refusals, want at most %d", per1000, maxPer1000)
		}
	})
}

// TestChunkedTooLargeAnsweredAtOnce (#19 item 13): a chunked body past
// 16 KiB that never sends its final chunk is answered 413 at once, and the
// connection is closed, as for a declared body: net/http would otherwise
// wait for the rest of it (up to the 15 s read timeout) before answering.
func TestChunkedTooLargeAnsweredAtOnce(t *testing.T) {
	s := startServer(t, nil)
	conn, err := net.Dial("tcp", hostPort(s.URL))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	var b strings.Builder
	b.WriteString("POST /api/tasks HTTP/1.1\r\nHost: " + hostPort(s.URL) + "\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
	chunk := `{"destination":"` + strings.Repeat("a", 4096)
	for sent := 0; sent <= 20*1024; sent += len(chunk) {
		fmt.Fprintf(&b, "%x\r\n%s\r\n", len(chunk), chunk)
	}
	// No final chunk: the client keeps the body open.
	start := time.Now()
	if _, err := io.WriteString(conn, b.String()); err != nil {
		t.Fatal(err)
	}
	req, _ := http.NewRequest("POST", s.URL+"/api/tasks", nil)
	resp, err := http.ReadResponse(bufio.NewReader(conn), req)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	raw, _ := io.ReadAll(resp.Body)
	if err := openAPI.Check(req, resp.StatusCode, resp.Header, raw); err != nil {
		t.Errorf("OpenAPI: %v", err)
	}
	t.Logf("chunked 20 KiB without a final chunk: %d in %s, close=%v", resp.StatusCode, took.Round(time.Millisecond), resp.Close)
	if resp.StatusCode != 413 || !strings.Contains(string(raw), `"code":"request_too_large"`) {
		t.Fatalf("%d %s, want 413 request_too_large", resp.StatusCode, raw)
	}
	if took >= time.Second {
		t.Fatalf("answered in %s, want < 1s", took)
	}
	if !resp.Close {
		t.Fatal("the connection is kept open: its unread body would be read as the next request")
	}
}

// TestMethodNotAllowedBeforeBodyShape (#19 item 14): a method a route does
// not have answers 405 with Allow, whatever the body's headers say (it was
// 415 because the body's shape was judged before routing); a path no route
// has stays 404.
func TestMethodNotAllowedBeforeBodyShape(t *testing.T) {
	s := startServer(t, nil)
	for _, tc := range []struct {
		method, path, ctype string
		status              int
		allow               string
	}{
		{"PUT", "/api/tasks", "", 405, "POST"},
		{"PATCH", "/api/tasks", "text/plain", 405, "POST"},
		{"PUT", "/api/tasks", "application/json", 405, "POST"},
		{"POST", "/api/config", "text/plain", 405, "GET"},
		{"DELETE", "/api/tasks/t_00000000000000000000000000000000", "text/plain", 405, "GET"},
		{"POST", "/api/nothing-here", "text/plain", 404, ""},
		// A route that has the method still judges the body's shape.
		{"POST", "/api/tasks", "text/plain", 415, ""},
	} {
		t.Run(tc.method+" "+tc.path+" "+tc.ctype, func(t *testing.T) {
			h := map[string]string{"Content-Type": tc.ctype}
			r := do(t, tc.method, s.URL+tc.path, `{"destination":"Rome","days":1}`, h)
			if r.Status != tc.status {
				t.Fatalf("%d %s, want %d", r.Status, r.Raw, tc.status)
			}
			if got := r.Header.Get("Allow"); got != tc.allow {
				t.Fatalf("Allow %q, want %q", got, tc.allow)
			}
		})
	}
}

// TestRateLimitFieldsOnEvery429 (#19 item 15): the 429s too_many_failed_checks
// and too_many_streams carry RateLimit-Policy and RateLimit naming their
// policy, and Retry-After equals that policy's t, as on every other 429.
func TestRateLimitFieldsOnEvery429(t *testing.T) {
	be := redistest.Real(t)
	const hold = "Held-RateLimit-Fields"
	llm, _ := heldLLM(t, hold)
	s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		"FAREGATE_STREAMS_PER_VISITOR": "1", "FAREGATE_FAILED_CHECKS_PER_HOUR": "2", "FAREGATE_SHUTDOWN_TIMEOUT": "1s",
		"FAREGATE_TRUSTED_PROXIES": "127.0.0.1"}))

	t.Run("too_many_failed_checks", func(t *testing.T) {
		h := map[string]string{"X-Forwarded-For": "198.51.100.40"}
		for i := 0; i < 2; i++ {
			if r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":0}`, h); r.code() != "invalid_request" {
				t.Fatalf("failed check %d: %d %s", i+1, r.Status, r.Raw)
			}
		}
		// Refused by the window's round trip, then again from memory.
		for i := 0; i < 2; i++ {
			r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), h)
			if r.Status != 429 || r.code() != "too_many_failed_checks" {
				t.Fatalf("after 2 failed checks: %d %s", r.Status, r.Raw)
			}
			ra := retryAfterMatches(t, r, "failed")
			if p, ok := rateLimitItem(r.Header.Get("RateLimit-Policy"), "failed"); !ok || p["q"] != 2 || p["w"] != 3600 {
				t.Fatalf("RateLimit-Policy %q, want \"failed\";q=2;w=3600", r.Header.Get("RateLimit-Policy"))
			}
			t.Logf("refusal %d: Retry-After %d, RateLimit %s, RateLimit-Policy %s", i+1, ra, r.Header.Get("RateLimit"), r.Header.Get("RateLimit-Policy"))
		}
	})

	t.Run("too_many_streams", func(t *testing.T) {
		id := startHeldTask(t, s, llm, hold, nil)
		path := "/api/tasks/" + id + "/events"
		st, err := openStream(t, s.URL, path, nil)
		if err != nil || !st.held() {
			t.Fatalf("the one stream allowed: %v %+v", err, st)
		}
		defer st.close()
		over, err := openStream(t, s.URL, path, nil)
		if err != nil {
			t.Fatal(err)
		}
		r := reply{Status: over.resp.StatusCode, Header: over.resp.Header}
		if r.Status != 429 || over.code() != "too_many_streams" {
			t.Fatalf("stream 2 of 1: %d %q", r.Status, over.raw)
		}
		if ra := retryAfterMatches(t, r, "streams"); ra != 5 {
			t.Fatalf("Retry-After %d, want 5", ra)
		}
		p, ok := rateLimitItem(r.Header.Get("RateLimit-Policy"), "streams")
		if !ok || p["q"] != 1 || !strings.Contains(r.Header.Get("RateLimit-Policy"), `qu="concurrent-requests"`) {
			t.Fatalf("RateLimit-Policy %q, want \"streams\";q=1;qu=\"concurrent-requests\"", r.Header.Get("RateLimit-Policy"))
		}
		t.Logf("RateLimit %s, RateLimit-Policy %s, Retry-After %s", r.Header.Get("RateLimit"), r.Header.Get("RateLimit-Policy"), strconv.Quote(r.Header.Get("Retry-After")))
	})
}
