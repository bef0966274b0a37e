package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/go-chi/chi/v5"
)

// The speed goal of issue #11: the gate's denied path (a visitor already
// over its daily limit, refused from memory) serves at least 0.9× the
// requests of a bare chi handler that does the same visible work. This file
// holds that baseline, in-process benchmarks of the denied and admitted
// paths, and the wrk comparison (FAREGATE_WRK=1) that measures both side
// by side in one run.

// baselineHandler is the bare handler: it reads the body, sets the headers
// a JSON refusal carries (Cache-Control, the short JSON CSP, Content-Type,
// Referrer-Policy, X-Content-Type-Options, both RateLimit fields,
// Retry-After, X-Request-Id) and writes the 429 envelope with the request id.
func baselineHandler() http.Handler {
	r := chi.NewRouter()
	r.Post("/api/tasks", func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		var b [12]byte
		_, _ = rand.Read(b[:])
		id := hex.EncodeToString(b[:])
		secs := strconv.FormatInt(int64(time.Until(nextMidnightUTC())/time.Second)+1, 10)
		h := w.Header()
		h.Set("Cache-Control", "no-store")
		h.Set("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'")
		h.Set("Content-Type", "application/json; charset=utf-8")
		h.Set("Referrer-Policy", "strict-origin-when-cross-origin")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("RateLimit-Policy", `"daily";q=5;w=86400`)
		h.Set("RateLimit", `"daily";r=0;t=`+secs)
		h.Set("Retry-After", secs)
		h.Set("X-Request-Id", id)
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = io.WriteString(w, `{"error":{"code":"demo_ip_limit_reached","message":"You have used all of today's demo tasks. They reset at 00:00 UTC.","request_id":"`+id+`"}}`+"\n")
	})
	return r
}

func nextMidnightUTC() time.Time {
	u := time.Now().UTC()
	return time.Date(u.Year(), u.Month(), u.Day()+1, 0, 0, 0, 0, time.UTC)
}

// speedBody is a valid creation body, as the page sends it.
const speedBody = `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Lisbon","days":3,"interests":["food","history"],"language":"en"}`

// gateHandler builds the real server (embedded defaults, a daily limit of
// one) and uses the visitor's one task, so every later creation is refused
// from memory.
func gateHandler(tb testing.TB, env map[string]string) (http.Handler, func()) {
	tb.Helper()
	full := map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1", "FAREGATE_LOG_LEVEL": "warn", "FAREGATE_AITF_MODE": "observe"}
	for k, v := range env {
		full[k] = v
	}
	cfg, err := loadConfig(envOf(full))
	if err != nil {
		tb.Fatal(err)
	}
	a, err := build(context.Background(), cfg, newLogger(cfg, io.Discard), io.Discard, nil)
	if err != nil {
		tb.Fatal(err)
	}
	if err := a.runner.Start(context.Background()); err != nil {
		tb.Fatal(err)
	}
	stop := func() {
		_ = a.runner.Shutdown(context.Background())
		a.close()
	}
	return a.server, stop
}

// serveOnce sends one creation through h from 192.0.2.1 and returns the status.
func serveOnce(h http.Handler) int {
	req := httptest.NewRequest(http.MethodPost, "/api/tasks", strings.NewReader(speedBody))
	req.Header.Set("Content-Type", "application/json")
	req.RemoteAddr = "192.0.2.1:40000"
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	return w.Code
}

// BenchmarkDeniedPath is the gate refusing a visitor over its daily limit
// from memory (no Redis call), in process.
func BenchmarkDeniedPath(b *testing.B) {
	h, stop := gateHandler(b, nil)
	defer stop()
	if got := serveOnce(h); got != http.StatusAccepted {
		b.Fatalf("first creation: %d", got)
	}
	if got := serveOnce(h); got != http.StatusTooManyRequests {
		b.Fatalf("second creation: %d", got)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		serveOnce(h)
	}
}

// BenchmarkBaseline is the bare chi handler doing the same visible work.
// The gate is built beside it and kept alive, unused: the garbage collector
// paces itself by the live heap, so a baseline on a near-empty heap collects
// several times as often and the comparison would measure that instead.
func BenchmarkBaseline(b *testing.B) {
	_, stop := gateHandler(b, nil)
	defer stop()
	h := baselineHandler()
	b.ReportAllocs()
	for b.Loop() {
		serveOnce(h)
	}
}

// BenchmarkAdmittedPath is a creation that passes every check on the
// embedded Redis (miniredis) and is stored and queued, from distinct
// visitors behind a trusted proxy.
func BenchmarkAdmittedPath(b *testing.B) {
	h, stop := gateHandler(b, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1000000", "FAREGATE_GLOBAL_DAILY_LIMIT": "100000000",
		"FAREGATE_DAILY_TOKEN_BUDGET": "1000000000000", "FAREGATE_REQUESTS_PER_MINUTE": "100000000",
		"FAREGATE_QUEUE_MAX": "100000000", "FAREGATE_TRUSTED_PROXIES": "192.0.2.1"})
	defer stop()
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		i++
		req := httptest.NewRequest(http.MethodPost, "/api/tasks", strings.NewReader(speedBody))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Forwarded-For", fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255))
		req.RemoteAddr = "192.0.2.1:40000"
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != http.StatusAccepted {
			b.Fatalf("creation %d: %d %s", i, w.Code, w.Body)
		}
	}
}

// TestWrkDeniedVsBaseline runs wrk -t2 -c32 against the bare handler and
// the gate's denied path alternately, in one run, and reports req/s and
// p99 of each; it asserts the gate keeps at least 0.9× the baseline.
// It needs wrk and a quiet machine, so it runs only with FAREGATE_WRK=1.
func TestWrkDeniedVsBaseline(t *testing.T) {
	if os.Getenv("FAREGATE_WRK") != "1" {
		t.Skip("set FAREGATE_WRK=1 to compare the denied path with the baseline under wrk")
	}
	wrk, err := exec.LookPath("wrk")
	if err != nil {
		t.Fatal("wrk not found (apt-get install wrk)")
	}
	script := filepath.Join(t.TempDir(), "post.lua")
	lua := "wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\nwrk.body = '" + speedBody + "'\n"
	if err := os.WriteFile(script, []byte(lua), 0o644); err != nil {
		t.Fatal(err)
	}
	base := newListener(t, baselineHandler())
	gate := startServer(t, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1", "FAREGATE_LOG_LEVEL": "warn"})
	if r := do(t, "POST", gate.URL+"/api/tasks", speedBody, nil); r.Status != 202 {
		t.Fatalf("first creation: %d", r.Status)
	}
	if r := do(t, "POST", gate.URL+"/api/tasks", speedBody, nil); r.Status != 429 {
		t.Fatalf("second creation: %d", r.Status)
	}
	dur := os.Getenv("FAREGATE_WRK_DURATION")
	if dur == "" {
		dur = "10s"
	}
	type result struct{ rps, p99 float64 }
	measure := func(url string) result {
		out, err := exec.Command(wrk, "-t2", "-c32", "-d"+dur, "--latency", "-s", script, url+"/api/tasks").CombinedOutput()
		if err != nil {
			t.Fatalf("wrk: %v\n%s", err, out)
		}
		return result{rps: wrkRPS(t, out), p99: wrkP99(t, out)}
	}
	var b, g []result
	for i := 0; i < 2; i++ {
		b = append(b, measure(base))
		g = append(g, measure(gate.URL))
	}
	avg := func(rs []result) (rps, p99 float64) {
		for _, r := range rs {
			rps += r.rps / float64(len(rs))
			p99 += r.p99 / float64(len(rs))
		}
		return rps, p99
	}
	brps, bp99 := avg(b)
	grps, gp99 := avg(g)
	ratio := grps / brps
	t.Logf("wrk -t2 -c32 -d%s, two rounds each, alternating: baseline %.0f req/s (p99 %.2f ms), gate denied path %.0f req/s (p99 %.2f ms): %.2f×",
		dur, brps, bp99, grps, gp99, ratio)
	if ratio < 0.9 {
		t.Errorf("the denied path serves %.2f× the baseline, want at least 0.9×", ratio)
	}
}

// newListener serves h on a loopback port until the test ends.
func newListener(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String()
}

var (
	wrkRPSLine = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)
	wrkP99Line = regexp.MustCompile(`\s99%\s+([0-9.]+)(us|ms|s)`)
)

func wrkRPS(t *testing.T, out []byte) float64 {
	m := wrkRPSLine.FindSubmatch(out)
	if m == nil {
		t.Fatalf("no Requests/sec in wrk output:\n%s", out)
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// wrkP99 is the 99th percentile latency in milliseconds.
func wrkP99(t *testing.T, out []byte) float64 {
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if m := wrkP99Line.FindStringSubmatch(sc.Text()); m != nil {
			v, _ := strconv.ParseFloat(m[1], 64)
			switch m[2] {
			case "us":
				return v / 1000
			case "s":
				return v * 1000
			}
			return v
		}
	}
	t.Fatalf("no 99%% latency in wrk output:\n%s", out)
	return 0
}
