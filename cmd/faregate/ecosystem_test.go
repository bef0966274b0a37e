package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caarlos0/env/v11"
	"github.com/prometheus/client_golang/prometheus/testutil/promlint"

	"faregate/protect/kit/testkit/clocktest"
)

// repoRoot is the module root, seen from this package's directory (where
// go test runs).
const repoRoot = "../.."

// envLine is one assignment in .env.example.
type envLine struct {
	Value     string
	Commented bool // "#NAME=value": shown, deliberately not set
	Line      int
}

// readEnvExample parses .env.example: every line is blank, a comment, an
// assignment NAME=value or a commented-out assignment #NAME=value. Anything
// else, and a name assigned twice, fails the test: docker run --env-file
// would take such a line literally.
func readEnvExample(t *testing.T) map[string]envLine {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(repoRoot, ".env.example"))
	if err != nil {
		t.Fatal(err)
	}
	assign := regexp.MustCompile(`^(#?)([A-Z][A-Z0-9_]*)=(.*)$`)
	out := map[string]envLine{}
	sc := bufio.NewScanner(bytes.NewReader(raw))
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		m := assign.FindStringSubmatch(line)
		switch {
		case m != nil:
			if prev, dup := out[m[2]]; dup {
				t.Errorf(".env.example:%d: %s already appears on line %d", n, m[2], prev.Line)
			}
			if v := m[3]; strings.TrimSpace(v) != v || strings.ContainsAny(v, `"'#`) {
				t.Errorf(".env.example:%d: %s=%q: --env-file keeps quotes, spaces and trailing comments as part of the value", n, m[2], v)
			}
			out[m[2]] = envLine{Value: m[3], Commented: m[1] == "#", Line: n}
		case line == "", strings.HasPrefix(line, "# "), line == "#":
		default:
			t.Errorf(".env.example:%d: neither a comment nor NAME=value: %q", n, line)
		}
	}
	return out
}

// TestEnvExampleShowsEveryDefault: each variable of the config struct is in
// .env.example with exactly its envDefault (empty when it has none), and
// only FAREGATE_ADDR is commented out, so the image's address stays in
// force under docker run --env-file.
func TestEnvExampleShowsEveryDefault(t *testing.T) {
	lines := readEnvExample(t)
	params, err := env.GetFieldParams(&config{})
	if err != nil {
		t.Fatal(err)
	}
	if len(params) < 60 {
		t.Fatalf("only %d config variables found: the struct walk is broken", len(params))
	}
	deliberatelyCommented := map[string]bool{"FAREGATE_ADDR": true}
	for _, p := range params {
		name := "FAREGATE_" + p.Key
		l, ok := lines[name]
		switch {
		case !ok:
			t.Errorf(".env.example lacks %s (default %q)", name, p.DefaultValue)
			continue
		case l.Value != p.DefaultValue:
			t.Errorf(".env.example:%d: %s=%s, but config.go's default is %q", l.Line, name, l.Value, p.DefaultValue)
		}
		if l.Commented != deliberatelyCommented[name] {
			t.Errorf(".env.example:%d: %s commented out = %v, want %v", l.Line, name, l.Commented, deliberatelyCommented[name])
		}
	}
}

// TestEnvExampleNamesEveryVariableInTheCode is the CI hook's rule: every
// FAREGATE_ name in the module's non-test Go code appears in .env.example,
// and .env.example names nothing the code or the tests do not read (a typo
// there would configure nothing, silently). OTEL_ variables are
// OpenTelemetry's own.
func TestEnvExampleNamesEveryVariableInTheCode(t *testing.T) {
	lines := readEnvExample(t)
	name := regexp.MustCompile(`FAREGATE_[A-Z0-9_]+`)
	// name → the first file that mentions it, in non-test and test code.
	inCode, inTests := map[string]string{}, map[string]string{}
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != repoRoot && strings.HasPrefix(d.Name(), ".") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		seen := inCode
		if strings.HasSuffix(path, "_test.go") {
			seen = inTests
		}
		for _, n := range name.FindAllString(string(src), -1) {
			if _, ok := seen[n]; !ok {
				seen[n] = path
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// The config struct and its rule table name most variables without
	// the prefix (added below); the rest of the code names about 35.
	if len(inCode) < 25 {
		t.Fatalf("only %d FAREGATE_ names found in the code: the walk is broken", len(inCode))
	}
	for n, file := range inCode {
		if _, ok := lines[n]; !ok {
			t.Errorf("%s (in %s) is missing from .env.example", n, file)
		}
	}
	// The config struct names its variables without the prefix.
	params, err := env.GetFieldParams(&config{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range params {
		inCode["FAREGATE_"+p.Key] = "cmd/faregate/config.go"
	}
	for n, l := range lines {
		_, code := inCode[n]
		_, tests := inTests[n]
		if !code && !tests && !strings.HasPrefix(n, "OTEL_") {
			t.Errorf(".env.example:%d: %s is read nowhere in the code", l.Line, n)
		}
	}
}

// TestEnvExampleStartsInAContainer loads .env.example as docker run
// --env-file would (the uncommented lines) on top of the image's
// FAREGATE_ADDR: as it stands it refuses to start on a public address,
// naming what to fill in, and with FAREGATE_DEV=true it starts.
func TestEnvExampleStartsInAContainer(t *testing.T) {
	fromFile := map[string]string{}
	for n, l := range readEnvExample(t) {
		if !l.Commented {
			fromFile[n] = l.Value
		}
	}
	if _, ok := fromFile["FAREGATE_ADDR"]; ok {
		t.Fatal(".env.example sets FAREGATE_ADDR: under --env-file it would replace the image's 0.0.0.0:8080")
	}
	container := func(extra map[string]string) func(string) string {
		m := map[string]string{"FAREGATE_ADDR": "0.0.0.0:8080"} // the Dockerfile's ENV
		for k, v := range fromFile {
			m[k] = v
		}
		for k, v := range extra {
			m[k] = v
		}
		return envOf(m)
	}

	_, err := loadConfig(container(nil))
	if err == nil {
		t.Fatal("an unedited .env.example started on 0.0.0.0 with every embedded default active")
	}
	for _, v := range []string{"FAREGATE_REDIS_URL", "FAREGATE_TURNSTILE_SECRET_KEY", "FAREGATE_LLM_BASE_URL", "FAREGATE_DEV"} {
		if !strings.Contains(err.Error(), v) {
			t.Errorf("refusal %q does not name %s", err, v)
		}
	}

	cfg, err := loadConfig(container(map[string]string{"FAREGATE_DEV": "true"}))
	if err != nil {
		t.Fatalf(".env.example with FAREGATE_DEV=true does not load: %v", err)
	}
	if cfg.Addr != "0.0.0.0:8080" || !cfg.Dev || len(cfg.embeddedDefaults()) != 3 {
		t.Fatalf("loaded %s dev=%v with %d embedded defaults", cfg.Addr, cfg.Dev, len(cfg.embeddedDefaults()))
	}

	// The production shape: Redis, Turnstile and the model filled in.
	cfg, err = loadConfig(container(map[string]string{
		"FAREGATE_REDIS_URL": "redis://redis:6379/0", "FAREGATE_IP_HASH_KEY": "0123456789abcdef0123456789abcdef",
		"FAREGATE_TURNSTILE_SECRET_KEY": "0x4AAA-secret", "FAREGATE_TURNSTILE_HOSTNAMES": "demo.example",
		"FAREGATE_LLM_BASE_URL": "https://api.openai.com/v1", "FAREGATE_LLM_MODEL": "gpt-4o-mini",
	}))
	if err != nil {
		t.Fatalf(".env.example filled in does not load: %v", err)
	}
	if len(cfg.embeddedDefaults()) != 0 {
		t.Fatalf("filled in, still on embedded defaults: %v", cfg.embeddedDefaults())
	}
}

// TestDockerignoreKeepsSecretsOut checks the build context's filter: no
// repository history, no .env of any name except the example (re-included
// last, since the last matching pattern wins).
func TestDockerignoreKeepsSecretsOut(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join(repoRoot, ".dockerignore"))
	if err != nil {
		t.Fatal(err)
	}
	var patterns []string
	for l := range strings.Lines(string(raw)) {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			patterns = append(patterns, l)
		}
	}
	for _, want := range []string{".git", ".env", ".env.*", "**/.env", "**/.env.*", "**/*.test", ".artifacts"} {
		if !slices.Contains(patterns, want) {
			t.Errorf(".dockerignore lacks %q", want)
		}
	}
	last := slices.Index(patterns, "!.env.example")
	if last < 0 {
		t.Fatal(".dockerignore does not re-include .env.example")
	}
	for i, p := range patterns[last+1:] {
		if strings.Contains(p, ".env") {
			t.Errorf(".dockerignore pattern %q (after !.env.example, position %d) excludes the example again", p, last+1+i)
		}
	}
}

// TestCORS: an allowed origin's preflight and request get the right
// headers; a disallowed origin gets none; 405 carries Allow.
func TestCORS(t *testing.T) {
	s := startServer(t, map[string]string{"FAREGATE_CORS_ORIGINS": "https://app.example"})
	corsHeaders := []string{"Access-Control-Allow-Origin", "Access-Control-Allow-Methods", "Access-Control-Allow-Headers",
		"Access-Control-Expose-Headers", "Access-Control-Allow-Credentials", "Access-Control-Max-Age"}
	preflight := func(origin string) reply {
		return do(t, "OPTIONS", s.URL+"/api/tasks", "", map[string]string{
			"Origin": origin, "Access-Control-Request-Method": "POST",
			"Access-Control-Request-Headers": "authorization,content-type,last-event-id",
		})
	}
	// listed reports whether the comma-separated header value v names every
	// one of want (header names compare without case).
	listed := func(v string, want ...string) bool {
		var got []string
		for f := range strings.SplitSeq(v, ",") {
			got = append(got, strings.ToLower(strings.TrimSpace(f)))
		}
		for _, w := range want {
			if !slices.Contains(got, strings.ToLower(w)) {
				return false
			}
		}
		return true
	}

	r := preflight("https://app.example")
	if r.Status/100 != 2 {
		t.Fatalf("allowed preflight: %d %s", r.Status, r.Raw)
	}
	if got := r.Header.Get("Access-Control-Allow-Origin"); got != "https://app.example" {
		t.Errorf("allowed preflight: Access-Control-Allow-Origin %q", got)
	}
	if got := r.Header.Get("Access-Control-Allow-Methods"); !listed(got, "POST") {
		t.Errorf("allowed preflight: Access-Control-Allow-Methods %q lacks POST", got)
	}
	if got := r.Header.Get("Access-Control-Allow-Headers"); !listed(got, "Authorization", "Content-Type", "Last-Event-ID") {
		t.Errorf("allowed preflight: Access-Control-Allow-Headers %q", got)
	}
	if got := r.Header.Get("Access-Control-Allow-Credentials"); got != "" {
		t.Errorf("credentials are not allowed, yet Access-Control-Allow-Credentials: %q", got)
	}
	if !listed(strings.Join(r.Header.Values("Vary"), ","), "Origin") {
		t.Errorf("preflight answer does not vary on Origin: %q", r.Header.Values("Vary"))
	}

	r = do(t, "GET", s.URL+"/api/config", "", map[string]string{"Origin": "https://app.example"})
	if r.Status != 200 {
		t.Fatalf("GET with an allowed origin: %d %s", r.Status, r.Raw)
	}
	if got := r.Header.Get("Access-Control-Allow-Origin"); got != "https://app.example" {
		t.Errorf("GET: Access-Control-Allow-Origin %q", got)
	}
	if got := r.Header.Get("Access-Control-Expose-Headers"); !listed(got, "Retry-After", "RateLimit", "RateLimit-Policy", "X-Request-Id") {
		t.Errorf("GET: Access-Control-Expose-Headers %q", got)
	}
	// A refusal must be readable too: its Retry-After is what a client needs.
	r = do(t, "POST", s.URL+"/api/tasks", `{"destination":"Rome","days":2}`, map[string]string{"Origin": "https://app.example"})
	if r.Status != 403 || r.Header.Get("Access-Control-Allow-Origin") != "https://app.example" {
		t.Errorf("refused POST with an allowed origin: %d, Access-Control-Allow-Origin %q", r.Status, r.Header.Get("Access-Control-Allow-Origin"))
	}

	for _, origin := range []string{"https://evil.example", "http://app.example", "https://app.example.evil.example"} {
		for _, r := range []reply{
			preflight(origin),
			do(t, "GET", s.URL+"/api/config", "", map[string]string{"Origin": origin}),
		} {
			for _, h := range corsHeaders {
				if v := r.Header.Get(h); v != "" {
					t.Errorf("origin %s: %s: %q", origin, h, v)
				}
			}
		}
	}

	// A JSON body for the methods that carry one: a body without it is
	// answered 415 from its headers, before routing.
	for _, c := range []struct{ method, path, body, allow string }{
		{"DELETE", "/api/tasks", "", "POST"},
		{"GET", "/api/tasks", "", "POST"},
		{"PUT", "/api/tasks", "{}", "POST"},
		{"POST", "/api/tasks/t_x", "{}", "GET"},
		{"DELETE", "/api/config", "", "GET"},
	} {
		r := do(t, c.method, s.URL+c.path, c.body, map[string]string{"Origin": "https://app.example"})
		if r.Status != 405 || r.code() != "method_not_allowed" || r.Header.Get("Allow") != c.allow {
			t.Errorf("%s %s: %d %q, Allow %q, want 405 method_not_allowed, Allow %s", c.method, c.path, r.Status, r.code(), r.Header.Get("Allow"), c.allow)
		}
	}
}

// doUnchecked sends a bodiless request and decodes the answer without the
// OpenAPI check of do.
func doUnchecked(t *testing.T, method, url string) reply {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, url, err)
	}
	defer resp.Body.Close()
	var body bytes.Buffer
	_, _ = body.ReadFrom(resp.Body)
	r := reply{Status: resp.StatusCode, Header: resp.Header, Raw: body.Bytes()}
	_ = json.Unmarshal(r.Raw, &r.Body)
	return r
}

// TestHealthCommand: `faregate health` (in process, as run) succeeds against
// a running server, also when FAREGATE_ADDR is the wildcard the container
// listens on, and fails against a closed port.
func TestHealthCommand(t *testing.T) {
	s := startServer(t, nil)
	u, _ := url.Parse(s.URL)
	_, port, _ := strings.Cut(u.Host, ":")
	health := func(addr string) (string, error) {
		var out bytes.Buffer
		err := run(context.Background(), []string{"faregate", "health"}, envOf(map[string]string{"FAREGATE_ADDR": addr}), &out)
		return out.String(), err
	}
	for _, addr := range []string{u.Host, "0.0.0.0:" + port, ":" + port} {
		out, err := health(addr)
		if err != nil {
			t.Errorf("health %s: %v", addr, err)
		}
		if !strings.Contains(out, "http://127.0.0.1:"+port+"/healthz") {
			t.Errorf("health %s printed %q", addr, out)
		}
	}
	closed := strings.TrimPrefix(deadURL(t), "http://")
	if _, err := health(closed); err == nil {
		t.Errorf("health against the closed port %s succeeded", closed)
	}
	if _, err := health("nonsense"); err == nil || !strings.Contains(err.Error(), "FAREGATE_ADDR") {
		t.Errorf("health with a bad address: %v", err)
	}
}

// TestBinaryVersionAndHealth builds the binary with the version stamped
// through -ldflags, as the Dockerfile does, and runs it: `version` and
// `--version` print the stamp, and `health` exits 0 against a running
// server and non-zero against a closed port (the HEALTHCHECK's contract).
func TestBinaryVersionAndHealth(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	const stamp = "v9.9.9-test"
	bin := filepath.Join(t.TempDir(), "faregate")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	// The Dockerfile's flags but for -trimpath and CGO_ENABLED=0: they
	// would rebuild every dependency instead of reusing what go test built.
	build := exec.CommandContext(ctx, goBin, "build", "-ldflags", "-X main.version="+stamp, "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}

	// The child sees no FAREGATE_ variable of the test's environment.
	childEnv := func(extra ...string) []string {
		var out []string
		for _, kv := range os.Environ() {
			if !strings.HasPrefix(kv, "FAREGATE_") {
				out = append(out, kv)
			}
		}
		return append(out, extra...)
	}
	for _, arg := range []string{"version", "--version"} {
		cmd := exec.CommandContext(ctx, bin, arg)
		cmd.Env = childEnv()
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("faregate %s: %v\n%s", arg, err, out)
		}
		if !strings.HasPrefix(string(out), "faregate "+stamp+" (go") {
			t.Errorf("faregate %s printed %q, want the stamp %s", arg, out, stamp)
		}
	}

	s := startServer(t, nil)
	u, _ := url.Parse(s.URL)
	exitCode := func(addr string) int {
		cmd := exec.CommandContext(ctx, bin, "health")
		cmd.Env = childEnv("FAREGATE_ADDR=" + addr)
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		switch {
		case err == nil:
			return 0
		case errors.As(err, &ee):
			t.Logf("health %s: exit %d: %s", addr, ee.ExitCode(), bytes.TrimSpace(out))
			return ee.ExitCode()
		default:
			t.Fatalf("health %s: %v", addr, err)
			return -1
		}
	}
	if code := exitCode(u.Host); code != 0 {
		t.Errorf("faregate health against the running server exited %d", code)
	}
	if code := exitCode(strings.TrimPrefix(deadURL(t), "http://")); code == 0 {
		t.Error("faregate health against a closed port exited 0")
	}
}

// TestMetricsFamiliesAndLint scrapes /metrics, from the private listener of
// FAREGATE_METRICS_ADDR, after one admitted task on a model behind a
// breaker: every family the second round added is there, the output passes
// promlint with no problem, and the public listener has no /metrics.
func TestMetricsFamiliesAndLint(t *testing.T) {
	llm := newFakeLLM(t, func(chatRequest, int) fakeReply { return fakeReply{Content: itinerary(3, "")} })
	s := startServer(t, map[string]string{
		"FAREGATE_LLM_BASE_URL": llm.BaseURL(), "FAREGATE_LLM_MODEL": "fake-model",
		"FAREGATE_METRICS_ADDR": "127.0.0.1:0",
		"FAREGATE_WEATHER_URL":  deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t),
	})
	m := regexp.MustCompile(`faregate: metrics on (http://\S+/metrics)`).FindStringSubmatch(s.Out.String())
	if m == nil {
		t.Fatalf("no metrics line at start-up:\n%s", s.Out.String())
	}
	private := m[1]

	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	if ev := readSSE(t, s.URL+"/api/tasks/"+id+"/events", "", 0); len(ev) == 0 || ev[len(ev)-1].Type != "done" {
		t.Fatalf("events did not end with done: %v", ev)
	}
	if task := waitTask(t, s.URL, id); task["status"] != "succeeded" {
		t.Fatalf("task: %v", task)
	}

	// Unchecked: the OpenAPI document lists /metrics with its 200 only.
	if r := doUnchecked(t, "GET", s.URL+"/metrics"); r.Status != 404 {
		t.Errorf("public /metrics with FAREGATE_METRICS_ADDR set: %d", r.Status)
	}
	// The task's record turns final before its worker observes the run's
	// duration and stores the plan: scrape until both are counted.
	finished := regexp.MustCompile(`(?m)^faregate_task_duration_seconds_count\{outcome="succeeded"\} 1$`)
	var text string
	clocktest.Poll(10*time.Second, func() bool {
		text = scrape(t, private)
		return finished.MatchString(text) && strings.Contains(text, `faregate_plan_cache_total{op="put",outcome="ok"} 1`)
	})

	types := map[string]string{} // family → type, from the # TYPE lines
	for l := range strings.Lines(text) {
		if f := strings.Fields(l); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			types[f[2]] = f[3]
		}
	}
	for family, typ := range map[string]string{
		"faregate_build_info":                        "gauge",
		"faregate_http_request_duration_seconds":     "histogram",
		"faregate_task_duration_seconds":             "histogram",
		"faregate_breaker_state":                     "gauge",
		"faregate_event_readers":                     "gauge",
		"faregate_event_streams":                     "gauge",
		"faregate_redis_pool_waits_total":            "counter",
		"faregate_connections_open":                  "gauge",
		"faregate_connections_refused_total":         "counter",
		"faregate_budget_overage_tokens_total":       "counter",
		"faregate_llm_tokens_total":                  "counter",
		"faregate_alerts_total":                      "counter",
		"faregate_plan_cache_total":                  "counter",
		"faregate_ratelimit_decisions_total":         "counter",
		"faregate_site_pacing_wait_seconds":          "histogram",
		"faregate_policy_reloads_total":              "counter",
		"faregate_tasks_total":                       "counter",
		"faregate_model_call_duration_seconds":       "histogram",
		"faregate_model_time_to_first_token_seconds": "histogram",
		"faregate_policy_reload_errors_total":        "counter",
	} {
		if got, ok := types[family]; !ok {
			t.Errorf("/metrics lacks the family %s", family)
		} else if got != typ {
			t.Errorf("%s is a %s, want a %s", family, got, typ)
		}
	}
	for _, sample := range []*regexp.Regexp{
		regexp.MustCompile(`(?m)^faregate_build_info\{goversion="go[^"]+",version="[^"]+"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_http_request_duration_seconds_count\{route="/api/tasks",status_class="2xx"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_task_duration_seconds_count\{outcome="succeeded"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_breaker_state\{name="primary",state="closed"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_breaker_state\{name="primary",state="open"\} 0$`),
		regexp.MustCompile(`(?m)^faregate_breaker_state\{name="primary",state="half-open"\} 0$`),
		regexp.MustCompile(`(?m)^faregate_redis_pool_waits_total\{pool="main"\} \d+$`),
		regexp.MustCompile(`(?m)^faregate_redis_pool_waits_total\{pool="streams"\} \d+$`),
		regexp.MustCompile(`(?m)^faregate_redis_pool_waits_total\{pool="queue"\} \d+$`),
		regexp.MustCompile(`(?m)^faregate_event_readers_started_total [1-9]\d*$`),
		regexp.MustCompile(`(?m)^faregate_connections_open [1-9]\d*$`),
		regexp.MustCompile(`(?m)^faregate_budget_overage_tokens_total\{cause="excess"\} \d+$`),
		regexp.MustCompile(`(?m)^faregate_llm_tokens_total\{kind="prompt",model="fake-model",source="provider"\} [1-9]\d*$`),
		regexp.MustCompile(`(?m)^faregate_llm_tokens_total\{kind="completion",model="fake-model",source="provider"\} [1-9]\d*$`),
		regexp.MustCompile(`(?m)^faregate_alerts_total\{event="overage",outcome="logged"\} 0$`),
		regexp.MustCompile(`(?m)^faregate_plan_cache_total\{op="put",outcome="ok"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_connections_refused_total\{limit="process"\} 0$`),
		regexp.MustCompile(`(?m)^faregate_ratelimit_decisions_total\{kind="gate",outcome="allowed"\} [1-9]\d*$`),
		regexp.MustCompile(`(?m)^faregate_ratelimit_decisions_total\{kind="call",outcome="allowed"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_model_call_duration_seconds_count\{model="fake-model",outcome="ok"\} 1$`),
		regexp.MustCompile(`(?m)^faregate_model_time_to_first_token_seconds_count\{model="fake-model"\} 1$`),
	} {
		if !sample.MatchString(text) {
			t.Errorf("/metrics has no sample matching %s", sample)
		}
	}

	problems, err := promlint.New(strings.NewReader(text)).Lint()
	if err != nil {
		t.Fatalf("promlint could not parse /metrics: %v", err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
	t.Logf("promlint: %d problems over %d families", len(problems), len(types))
}

// scrape returns the Prometheus text of url.
func scrape(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body bytes.Buffer
	_, _ = body.ReadFrom(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: %d", url, resp.StatusCode)
	}
	return body.String()
}
