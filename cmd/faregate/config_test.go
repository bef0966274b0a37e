package main

import (
	"strings"
	"testing"
	"time"
)

func envOf(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestLoadConfigDefaults(t *testing.T) {
	c, err := loadConfig(envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	if c.Addr != "127.0.0.1:8080" || c.IPDailyLimit != 5 || c.GlobalDailyLimit != 100 ||
		c.TurnstileTimeout != 5*time.Second || c.ClientIPHeader != "X-Forwarded-For" ||
		c.TurnstileSiteKey != "1x00000000000000000000AA" || c.AgentMaxSteps != 6 || c.AgentMaxToolCalls != 12 ||
		c.AgentTimeout != 90*time.Second || c.DailyTokenBudget != 200000 || c.IPDailyTokens != 40000 ||
		c.TaskTokenLimit != 12000 || c.LLMMaxTokens != 1024 || c.AITFMode != "observe" || c.AITFThreshold != 0.6 ||
		c.BreakerWindow != 60*time.Second || c.BreakerMinCalls != 10 || c.BreakerOpenFor != 30*time.Second ||
		c.BreakerSlowCall != 20*time.Second {
		t.Fatalf("defaults differ from the documented ones: %+v", c)
	}
	if got := len(c.embeddedDefaults()); got != 3 {
		t.Fatalf("embedded defaults = %d, want 3", got)
	}
}

func TestLoadConfigErrors(t *testing.T) {
	cases := []struct {
		name string
		env  map[string]string
		want []string // every one must appear in the single joined error
	}{
		{
			name: "secret without hostnames, redis without hash key: both reported",
			env:  map[string]string{"FAREGATE_TURNSTILE_SECRET_KEY": "s", "FAREGATE_REDIS_URL": "redis://127.0.0.1:6379/0"},
			want: []string{"FAREGATE_TURNSTILE_HOSTNAMES", "FAREGATE_IP_HASH_KEY"},
		},
		{
			name: "public address on embedded defaults names each variable",
			env:  map[string]string{"FAREGATE_ADDR": "0.0.0.0:8080"},
			want: []string{"FAREGATE_REDIS_URL", "FAREGATE_TURNSTILE_SECRET_KEY", "FAREGATE_LLM_BASE_URL", "FAREGATE_DEV"},
		},
		{
			name: "public address names only the defaults still active",
			env: map[string]string{"FAREGATE_ADDR": "0.0.0.0:8080", "FAREGATE_REDIS_URL": "redis://r:6379",
				"FAREGATE_IP_HASH_KEY": "0123456789abcdef0123", "FAREGATE_TURNSTILE_SECRET_KEY": "s", "FAREGATE_TURNSTILE_HOSTNAMES": "a.example"},
			want: []string{"FAREGATE_LLM_BASE_URL"},
		},
		{
			name: "bad values",
			env: map[string]string{"FAREGATE_IP_DAILY_LIMIT": "0", "FAREGATE_TRUSTED_PROXIES": "10.0.0.0/8, nonsense",
				"FAREGATE_AITF_MODE": "loud", "FAREGATE_REDIS_URL": "http://x", "FAREGATE_IP_HASH_KEY": "0123456789abcdef"},
			want: []string{"FAREGATE_IP_DAILY_LIMIT", "nonsense", "FAREGATE_AITF_MODE", "FAREGATE_REDIS_URL"},
		},
		{
			name: "unparsable number",
			env:  map[string]string{"FAREGATE_GLOBAL_DAILY_LIMIT": "many"},
			want: []string{"GLOBAL_DAILY_LIMIT"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := loadConfig(envOf(tc.env))
			if err == nil {
				t.Fatal("want an error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %s", err, w)
				}
			}
			if strings.Contains(err.Error(), "FAREGATE_TURNSTILE_SECRET_KEY\": \"s") {
				t.Error("error echoes a secret")
			}
		})
	}
}

func TestLoadConfigAccepts(t *testing.T) {
	cases := []map[string]string{
		{"FAREGATE_ADDR": "0.0.0.0:8080", "FAREGATE_DEV": "true"},
		{"FAREGATE_ADDR": "[::1]:0"},
		{"FAREGATE_ADDR": "localhost:9000"},
		{"FAREGATE_TRUSTED_PROXIES": "10.0.0.1, 192.168.0.0/16,2001:db8::/32", "FAREGATE_CLIENT_IP_HEADER": "CF-Connecting-IP"},
		{"FAREGATE_TURNSTILE_SECRET_KEY": "x", "FAREGATE_TURNSTILE_HOSTNAMES": " Demo.Example.com ,b.example"},
	}
	for _, env := range cases {
		c, err := loadConfig(envOf(env))
		if err != nil {
			t.Errorf("%v: %v", env, err)
			continue
		}
		if env["FAREGATE_TURNSTILE_HOSTNAMES"] != "" && (c.TurnstileHostnames[0] != "demo.example.com" || len(c.TurnstileHostnames) != 2) {
			t.Errorf("hostnames not normalised: %q", c.TurnstileHostnames)
		}
	}
}

// TestConfigErrorsNamedOnce: the bugs of the first round stay fixed. A bad
// trusted-proxy list does not hide the embedded-defaults refusal; a bad
// address is not also "not loopback"; URL errors come in one order every
// time; a duration without a unit says what it wants.
func TestConfigErrorsNamedOnce(t *testing.T) {
	_, err := loadConfig(envOf(map[string]string{"FAREGATE_ADDR": "0.0.0.0:8080", "FAREGATE_TRUSTED_PROXIES": "nonsense"}))
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_TRUSTED_PROXIES") || !strings.Contains(err.Error(), "not a loopback address") {
		t.Fatalf("public address with bad proxies: %v", err)
	}
	_, err = loadConfig(envOf(map[string]string{"FAREGATE_ADDR": "nonsense"}))
	if err == nil || !strings.Contains(err.Error(), "want host:port") || strings.Contains(err.Error(), "loopback") {
		t.Fatalf("bad address: %v", err)
	}
	env := map[string]string{"FAREGATE_WEATHER_URL": "ftp://x", "FAREGATE_SEARCH_URL": "nope", "FAREGATE_LLM_BASE_URL": "::", "FAREGATE_PUBLIC_URL": "x"}
	var first string
	for i := 0; i < 20; i++ {
		_, err := loadConfig(envOf(env))
		if err == nil {
			t.Fatal("bad URLs accepted")
		}
		if i == 0 {
			first = err.Error()
		} else if err.Error() != first {
			t.Fatalf("error order changed between runs:\n%s\n%s", first, err)
		}
	}
	_, err = loadConfig(envOf(map[string]string{"FAREGATE_AGENT_TIMEOUT": "90"}))
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_AGENT_TIMEOUT: want a duration with a unit") || strings.Contains(err.Error(), "<nil>") {
		t.Fatalf("duration without a unit: %v", err)
	}
	_, err = loadConfig(envOf(map[string]string{"FAREGATE_IP_DAILY_LIMIT": "five"}))
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_IP_DAILY_LIMIT: want a whole number") {
		t.Fatalf("number: %v", err)
	}
}

// TestSecondRoundConfig: the variables of the second round, their
// defaults and their checks.
func TestSecondRoundConfig(t *testing.T) {
	c, err := loadConfig(envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	if c.StreamsPerVisitor != 4 || c.StreamsMax != 2000 || c.StreamMaxDuration != 15*time.Minute || c.RequestsPerMinute != 120 ||
		c.FailedChecksPerHour != 20 || c.LogSummaryInterval != 10*time.Second || c.TaskLease != 30*time.Second ||
		c.SiteTokensPerMinute != 0 || c.spendMicro != 0 || c.PlanCache != "fallback" || c.PlanCacheTTL != 24*time.Hour ||
		c.IdleTimeout != 30*time.Second || c.MetricsAddr != "" || len(c.CORSOrigins) != 0 {
		t.Fatalf("defaults differ from the documented ones: %+v", c)
	}
	cases := []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"FAREGATE_TASK_LEASE": "1s"}, "FAREGATE_TASK_LEASE"},
		{map[string]string{"FAREGATE_MODEL_PRICES": "gpt=abc"}, "FAREGATE_MODEL_PRICES"},
		{map[string]string{"FAREGATE_DAILY_SPEND_LIMIT": "-1"}, "FAREGATE_DAILY_SPEND_LIMIT"},
		{map[string]string{"FAREGATE_PLAN_CACHE": "sometimes"}, "FAREGATE_PLAN_CACHE"},
		{map[string]string{"FAREGATE_CORS_ORIGINS": "https://a.example/path"}, "FAREGATE_CORS_ORIGINS"},
		{map[string]string{"FAREGATE_ALERT_WEBHOOK_URL": "mailto:x"}, "FAREGATE_ALERT_WEBHOOK_URL"},
		{map[string]string{"FAREGATE_METRICS_ADDR": "9090"}, "FAREGATE_METRICS_ADDR"},
		{map[string]string{"FAREGATE_STREAMS_PER_VISITOR": "0"}, "FAREGATE_STREAMS_PER_VISITOR"},
		{map[string]string{"FAREGATE_REQUESTS_PER_MINUTE": "0"}, "FAREGATE_REQUESTS_PER_MINUTE"},
	}
	for _, tc := range cases {
		if _, err := loadConfig(envOf(tc.env)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error naming %s", tc.env, err, tc.want)
		}
	}
	c, err = loadConfig(envOf(map[string]string{"FAREGATE_MODEL_PRICES": "gpt-4o-mini=0.15/0.60", "FAREGATE_DAILY_SPEND_LIMIT": "2.50",
		"FAREGATE_CORS_ORIGINS": " https://a.example/ ,https://b.example"}))
	if err != nil {
		t.Fatal(err)
	}
	if c.spendMicro != 2_500_000 || c.prices["gpt-4o-mini"].InputMicroPerMTok != 150000 || c.CORSOrigins[0] != "https://a.example" {
		t.Fatalf("parsed %+v %v %v", c.prices, c.spendMicro, c.CORSOrigins)
	}
}

// TestConfigReportsEveryProblemAtOnce: a variable that does not parse no
// longer hides the others (issue 19, item 19): before, one parse error was
// the whole answer. A rule on the unparsable variable itself is skipped
// (its parse error says it), so it is named once.
func TestConfigReportsEveryProblemAtOnce(t *testing.T) {
	_, err := loadConfig(envOf(map[string]string{"FAREGATE_GLOBAL_DAILY_LIMIT": "many", "FAREGATE_AGENT_TIMEOUT": "90",
		"FAREGATE_IP_DAILY_LIMIT": "0", "FAREGATE_AITF_MODE": "loud", "FAREGATE_LOG_FORMAT": "xml"}))
	if err == nil {
		t.Fatal("accepted")
	}
	for _, want := range []string{"FAREGATE_GLOBAL_DAILY_LIMIT: want a whole number", "FAREGATE_AGENT_TIMEOUT: want a duration",
		"FAREGATE_IP_DAILY_LIMIT: want at least 1", `FAREGATE_AITF_MODE: "loud": want off, observe or enforce`, "FAREGATE_LOG_FORMAT"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("missing %q in:\n%v", want, err)
		}
	}
	if n := strings.Count(err.Error(), "FAREGATE_AGENT_TIMEOUT"); n != 1 {
		t.Errorf("FAREGATE_AGENT_TIMEOUT named %d times:\n%v", n, err)
	}
	if n := len(strings.Split(err.Error(), "\n")); n != 5 {
		t.Errorf("%d problems reported, want 5:\n%v", n, err)
	}
}

// TestConfigRefusesWhatOnlyFailedLater: values that passed validation and
// then failed or were silently replaced (issue 19 items 19 and 21):
// FAREGATE_AITF_DEGRADE_BACKLOG=0 became 500; a port that is not a port
// failed only when listening.
func TestConfigRefusesWhatOnlyFailedLater(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"FAREGATE_AITF_DEGRADE_BACKLOG": "0"}, "FAREGATE_AITF_DEGRADE_BACKLOG: want at least 1"},
		{map[string]string{"FAREGATE_AITF_DEGRADE_BACKLOG": "3000"}, "FAREGATE_AITF_DEGRADE_BACKLOG: want at most FAREGATE_AITF_MAX_QUEUE (2000)"},
		{map[string]string{"FAREGATE_ADDR": "127.0.0.1:notaport"}, "FAREGATE_ADDR: \"127.0.0.1:notaport\": want host:port with a port number"},
		{map[string]string{"FAREGATE_ADDR": "127.0.0.1:70000"}, "FAREGATE_ADDR"},
		{map[string]string{"FAREGATE_ADDR": "localhost"}, "FAREGATE_ADDR: \"localhost\": want host:port"},
		{map[string]string{"FAREGATE_METRICS_ADDR": "127.0.0.1:-1"}, "FAREGATE_METRICS_ADDR"},
	} {
		if _, err := loadConfig(envOf(tc.env)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.env, err, tc.want)
		}
	}
	for _, ok := range []map[string]string{
		{"FAREGATE_AITF_DEGRADE_BACKLOG": "1"},
		{"FAREGATE_AITF_DEGRADE_BACKLOG": "2000"},
		{"FAREGATE_ADDR": "127.0.0.1:0"},
		{"FAREGATE_ADDR": "127.0.0.1:65535", "FAREGATE_METRICS_ADDR": ":9090"},
	} {
		if _, err := loadConfig(envOf(ok)); err != nil {
			t.Errorf("%v: %v", ok, err)
		}
	}
	// Through the binary: the bad port is refused before anything listens.
	_, err := startErr(t, map[string]string{"FAREGATE_ADDR": "127.0.0.1:notaport"})
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_ADDR") || strings.Contains(err.Error(), "listen ") {
		t.Fatalf("run with FAREGATE_ADDR=127.0.0.1:notaport: %v", err)
	}
}

// TestConfigRulesTyped: every row of the rule table names a variable of
// config and bounds it with a value of the field's type (a mismatch is a
// table mistake, reported as "internal:"); defaults pass every rule.
func TestConfigRulesTyped(t *testing.T) {
	c, err := loadConfig(envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.runRules(configRules(), nil); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	keys := map[string]bool{}
	for _, k := range configKeys() {
		keys[k] = true
	}
	for _, r := range configRules() {
		for _, n := range append([]string{r.name}, r.reads...) {
			if !keys[n] {
				t.Errorf("rule names FAREGATE_%s, which config does not read", n)
			}
		}
	}
	var zero config
	if err := zero.runRules(configRules(), nil); err == nil || strings.Contains(err.Error(), "internal:") {
		t.Errorf("the zero config: %v", err)
	}
}

// TestSeedsConfig: the invalid ratio, the per-second window and the
// hourly quota's variables: their defaults (the hour off, the second on at
// 10), their bounds, and the public tier they make.
func TestSeedsConfig(t *testing.T) {
	c, err := loadConfig(envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	if c.InvalidRatio != 0.5 || c.InvalidMinRequests != 20 || c.RequestsPerSecond != 10 || c.IPHourlyTokens != 0 ||
		c.SoftAt != 0.8 || c.SoftRequestsPerMinute != 5 {
		t.Fatalf("defaults: %+v", c)
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"FAREGATE_INVALID_RATIO": "1"}, "FAREGATE_INVALID_RATIO: want a share from 0 up to (not including) 1"},
		{map[string]string{"FAREGATE_INVALID_RATIO": "-0.1"}, "FAREGATE_INVALID_RATIO"},
		{map[string]string{"FAREGATE_INVALID_RATIO": "NaN"}, "FAREGATE_INVALID_RATIO"},
		{map[string]string{"FAREGATE_INVALID_MIN_REQUESTS": "0"}, "FAREGATE_INVALID_MIN_REQUESTS"},
		{map[string]string{"FAREGATE_REQUESTS_PER_SECOND": "-1"}, "FAREGATE_REQUESTS_PER_SECOND: want 0 to 1000000 (0: off)"},
		{map[string]string{"FAREGATE_IP_HOURLY_TOKENS": "-1"}, "FAREGATE_IP_HOURLY_TOKENS"},
		{map[string]string{"FAREGATE_SOFT_AT": "0"}, "FAREGATE_SOFT_AT: want a ratio in (0, 1]"},
		{map[string]string{"FAREGATE_SOFT_AT": "1.5"}, "FAREGATE_SOFT_AT"},
		{map[string]string{"FAREGATE_SOFT_REQUESTS_PER_MINUTE": "0"}, "FAREGATE_SOFT_REQUESTS_PER_MINUTE"},
	} {
		if _, err := loadConfig(envOf(tc.env)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.env, err, tc.want)
		}
	}
	for _, ok := range []map[string]string{
		{"FAREGATE_INVALID_RATIO": "0"},
		{"FAREGATE_REQUESTS_PER_SECOND": "0"},
		{"FAREGATE_IP_HOURLY_TOKENS": "10000", "FAREGATE_SOFT_AT": "1", "FAREGATE_SOFT_REQUESTS_PER_MINUTE": "1"},
	} {
		if _, err := loadConfig(envOf(ok)); err != nil {
			t.Errorf("%v: %v", ok, err)
		}
	}
	// An hour that can never hold one run refuses to start, naming it.
	_, err = startErr(t, map[string]string{"FAREGATE_IP_HOURLY_TOKENS": "100"})
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_IP_HOURLY_TOKENS") || !strings.Contains(err.Error(), "tokens_per_hour 100 can never hold one run") {
		t.Fatalf("an hour of 100 tokens: %v", err)
	}
}

// TestConfigProviders: an anthropic provider needs a base URL and an
// external agent (the built-in planner speaks only the openai wire), and
// refuses the legacy max_tokens setting; the fallback speaks the
// primary's wire; an embeddings server needs no more than its URL. Each
// refusal says why, and the binary does not start on it.
func TestConfigProviders(t *testing.T) {
	agent := map[string]string{"FAREGATE_AGENT_URL": "http://127.0.0.1:9/agent", "FAREGATE_AGENT_SECRET": "0123456789abcdef0123"}
	with := func(kv ...string) map[string]string {
		m := map[string]string{}
		for k, v := range agent {
			m[k] = v
		}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i]] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"FAREGATE_LLM_PROVIDER": "anthropic", "FAREGATE_LLM_BASE_URL": "https://api.anthropic.com/v1"}, "the built-in trip planner speaks only the openai wire"},
		{with("FAREGATE_LLM_PROVIDER", "anthropic"), "needs FAREGATE_LLM_BASE_URL"},
		{with("FAREGATE_LLM_PROVIDER", "claude"), "FAREGATE_LLM_PROVIDER"},
		{with("FAREGATE_LLM_PROVIDER", "anthropic", "FAREGATE_LLM_BASE_URL", "https://api.anthropic.com/v1", "FAREGATE_LLM_LEGACY_MAX_TOKENS", "true"), "FAREGATE_LLM_LEGACY_MAX_TOKENS is an openai setting"},
		{with("FAREGATE_LLM_FALLBACK_PROVIDER", "anthropic"), `FAREGATE_LLM_FALLBACK_PROVIDER: "anthropic": must equal FAREGATE_LLM_PROVIDER ("openai")`},
		{with("FAREGATE_EMBEDDING_API_KEY", "sk-e"), "FAREGATE_EMBEDDING_BASE_URL: required when FAREGATE_EMBEDDING_API_KEY is set"},
	} {
		if _, err := loadConfig(envOf(tc.env)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.env, err, tc.want)
		}
	}
	for _, ok := range []map[string]string{
		with("FAREGATE_LLM_PROVIDER", "anthropic", "FAREGATE_LLM_BASE_URL", "https://api.anthropic.com/v1"),
		with("FAREGATE_LLM_PROVIDER", "anthropic", "FAREGATE_LLM_FALLBACK_PROVIDER", "anthropic", "FAREGATE_LLM_BASE_URL", "https://api.anthropic.com/v1",
			"FAREGATE_EMBEDDING_BASE_URL", "https://api.openai.com/v1", "FAREGATE_EMBEDDING_API_KEY", "sk-e", "FAREGATE_EMBEDDING_MODEL", "text-embedding-3-small"),
		{"FAREGATE_LLM_PROVIDER": "openai"},
	} {
		c, err := loadConfig(envOf(ok))
		if err != nil {
			t.Errorf("%v: %v", ok, err)
		} else if c.FallbackProvider != c.LLMProvider {
			t.Errorf("%v: fallback provider %q", ok, c.FallbackProvider)
		}
	}
	_, err := startErr(t, map[string]string{"FAREGATE_LLM_PROVIDER": "anthropic", "FAREGATE_LLM_BASE_URL": "https://api.anthropic.com/v1"})
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_AGENT_URL") {
		t.Fatalf("the built-in planner on an anthropic provider started: %v", err)
	}
}
