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
		t.Fatalf("defaults differ from the contract: %+v", c)
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
		t.Fatalf("defaults differ from the contract: %+v", c)
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
