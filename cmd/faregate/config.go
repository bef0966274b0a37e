package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"reflect"
	"slices"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"

	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/plancache"
)

// config is every FAREGATE_ variable, read once from the injected getenv.
// .env.example lists each with its default and a comment; keep them in step.
type config struct {
	Addr string `env:"ADDR" envDefault:"127.0.0.1:8080"`
	Dev  bool   `env:"DEV" envDefault:"false"`

	RedisURL     string        `env:"REDIS_URL"`
	RedisCluster bool          `env:"REDIS_CLUSTER" envDefault:"false"`
	RedisTimeout time.Duration `env:"REDIS_TIMEOUT" envDefault:"2s"`

	TurnstileSecret    string        `env:"TURNSTILE_SECRET_KEY"`
	TurnstileSiteKey   string        `env:"TURNSTILE_SITE_KEY" envDefault:"1x00000000000000000000AA"`
	TurnstileHostnames []string      `env:"TURNSTILE_HOSTNAMES" envSeparator:","`
	TurnstileVerifyURL string        `env:"TURNSTILE_VERIFY_URL" envDefault:"https://challenges.cloudflare.com/turnstile/v0/siteverify"`
	TurnstileTimeout   time.Duration `env:"TURNSTILE_TIMEOUT" envDefault:"5s"`
	TurnstileScriptURL string        `env:"TURNSTILE_SCRIPT_URL" envDefault:"https://challenges.cloudflare.com/turnstile/v0/api.js"`
	TurnstileAction    string        `env:"TURNSTILE_ACTION"`

	IPDailyLimit     int64  `env:"IP_DAILY_LIMIT" envDefault:"5"`
	GlobalDailyLimit int64  `env:"GLOBAL_DAILY_LIMIT" envDefault:"100"`
	IPHashKey        string `env:"IP_HASH_KEY"`
	TrustedProxies   string `env:"TRUSTED_PROXIES"`
	ClientIPHeader   string `env:"CLIENT_IP_HEADER" envDefault:"X-Forwarded-For"`

	LLMBaseURL         string        `env:"LLM_BASE_URL"`
	LLMAPIKey          string        `env:"LLM_API_KEY"`
	LLMModel           string        `env:"LLM_MODEL"`
	LLMLegacyMaxTokens bool          `env:"LLM_LEGACY_MAX_TOKENS" envDefault:"false"`
	LLMMaxTokens       int           `env:"LLM_MAX_TOKENS" envDefault:"1024"`
	LLMTimeout         time.Duration `env:"LLM_TIMEOUT" envDefault:"60s"`
	FallbackBaseURL    string        `env:"LLM_FALLBACK_BASE_URL"`
	FallbackModel      string        `env:"LLM_FALLBACK_MODEL"`
	FallbackAPIKey     string        `env:"LLM_FALLBACK_API_KEY"`

	AgentMaxSteps     int           `env:"AGENT_MAX_STEPS" envDefault:"6"`
	AgentMaxToolCalls int           `env:"AGENT_MAX_TOOL_CALLS" envDefault:"12"`
	AgentTimeout      time.Duration `env:"AGENT_TIMEOUT" envDefault:"90s"`
	AgentConcurrency  int           `env:"AGENT_CONCURRENCY" envDefault:"0"`

	// The operator's own agent (config_agent.go).
	AgentURL         string `env:"AGENT_URL"`
	AgentSecret      string `env:"AGENT_SECRET"`
	AgentCallbackURL string `env:"AGENT_CALLBACK_URL"`
	AgentMaxCalls    int    `env:"AGENT_MAX_CALLS" envDefault:"40"`
	AgentMaxParallel int    `env:"AGENT_MAX_PARALLEL" envDefault:"4"`
	EmbeddingModel   string `env:"EMBEDDING_MODEL"`
	V1MaxBody        int64  `env:"V1_MAX_BODY" envDefault:"2097152"`

	WeatherURL   string `env:"WEATHER_URL" envDefault:"https://api.open-meteo.com/v1/forecast"`
	GeocodingURL string `env:"GEOCODING_URL" envDefault:"https://geocoding-api.open-meteo.com/v1/search"`
	SearchURL    string `env:"SEARCH_URL"`
	PublicURL    string `env:"PUBLIC_URL"`

	DailyTokenBudget int64   `env:"DAILY_TOKEN_BUDGET" envDefault:"200000"`
	IPDailyTokens    int64   `env:"IP_DAILY_TOKENS" envDefault:"40000"`
	TaskTokenLimit   int64   `env:"TASK_TOKEN_LIMIT" envDefault:"12000"`
	LoopThreshold    float64 `env:"LOOP_THRESHOLD" envDefault:"0.8"`

	BreakerWindow         time.Duration `env:"BREAKER_WINDOW" envDefault:"60s"`
	BreakerMinCalls       uint32        `env:"BREAKER_MIN_CALLS" envDefault:"10"`
	BreakerFailureRatio   float64       `env:"BREAKER_FAILURE_RATIO" envDefault:"0.2"`
	BreakerSlowRatio      float64       `env:"BREAKER_SLOW_RATIO" envDefault:"0.1"`
	BreakerSlowCall       time.Duration `env:"BREAKER_SLOW_CALL" envDefault:"20s"`
	BreakerOpenFor        time.Duration `env:"BREAKER_OPEN_FOR" envDefault:"30s"`
	BreakerHalfOpenProbes uint32        `env:"BREAKER_HALF_OPEN_PROBES" envDefault:"3"`

	AITFMode           string  `env:"AITF_MODE" envDefault:"observe"`
	AITFThreshold      float64 `env:"AITF_THRESHOLD" envDefault:"0.6"`
	AITFDegradeBacklog int     `env:"AITF_DEGRADE_BACKLOG" envDefault:"500"`
	AITFMaxQueue       int     `env:"AITF_MAX_QUEUE" envDefault:"2000"`
	AITFDebug          bool    `env:"AITF_DEBUG" envDefault:"false"`

	StreamsPerVisitor   int           `env:"STREAMS_PER_VISITOR" envDefault:"4"`
	StreamsMax          int           `env:"STREAMS_MAX" envDefault:"2000"`
	StreamMaxDuration   time.Duration `env:"STREAM_MAX_DURATION" envDefault:"15m"`
	RequestsPerMinute   int64         `env:"REQUESTS_PER_MINUTE" envDefault:"120"`
	FailedChecksPerHour int64         `env:"FAILED_CHECKS_PER_HOUR" envDefault:"20"`
	LogSummaryInterval  time.Duration `env:"LOG_SUMMARY_INTERVAL" envDefault:"10s"`
	MaxConnections      int           `env:"MAX_CONNECTIONS" envDefault:"0"`
	ConnectionsPerPeer  int           `env:"CONNECTIONS_PER_PEER" envDefault:"0"`
	IdleTimeout         time.Duration `env:"IDLE_TIMEOUT" envDefault:"30s"`

	PolicyFile          string        `env:"POLICY_FILE"`
	SiteTokensPerMinute int64         `env:"SITE_TOKENS_PER_MINUTE" envDefault:"0"`
	SitePaceWait        time.Duration `env:"SITE_PACE_WAIT" envDefault:"30s"`
	TokenWait           time.Duration `env:"TOKEN_WAIT" envDefault:"20s"`

	ModelPrices        string        `env:"MODEL_PRICES"`
	DailySpendLimit    string        `env:"DAILY_SPEND_LIMIT" envDefault:"0"`
	AlertWebhookURL    string        `env:"ALERT_WEBHOOK_URL"`
	AlertWebhookSecret string        `env:"ALERT_WEBHOOK_SECRET"`
	PlanCache          string        `env:"PLAN_CACHE" envDefault:"fallback"`
	PlanCacheTTL       time.Duration `env:"PLAN_CACHE_TTL" envDefault:"24h"`

	CORSOrigins []string `env:"CORS_ORIGINS" envSeparator:","`
	MetricsAddr string   `env:"METRICS_ADDR"`

	TaskLease time.Duration `env:"TASK_LEASE" envDefault:"30s"`
	QueueMax  int64         `env:"QUEUE_MAX" envDefault:"200"`

	ShutdownTimeout time.Duration `env:"SHUTDOWN_TIMEOUT" envDefault:"20s"`
	LogLevel        string        `env:"LOG_LEVEL" envDefault:"info"`
	LogFormat       string        `env:"LOG_FORMAT" envDefault:"text"`

	// Derived by loadConfig.
	trusted    []netip.Prefix
	prices     budget.Prices
	spendMicro int64
	cacheMode  plancache.Mode
}

// defaultInUse is one embedded default that is active, with the variable
// that would replace it.
type defaultInUse struct {
	Variable string
	What     string
}

// embeddedDefaults lists the embedded defaults this configuration runs on.
func (c *config) embeddedDefaults() []defaultInUse {
	var out []defaultInUse
	if c.RedisURL == "" {
		out = append(out, defaultInUse{"FAREGATE_REDIS_URL", "embedded in-process Redis (miniredis): one process only, all quota and task state is lost on exit"})
	}
	if c.TurnstileSecret == "" {
		out = append(out, defaultInUse{"FAREGATE_TURNSTILE_SECRET_KEY", "local Turnstile test verifier: accepts only the dummy token XXXX.DUMMY.TOKEN.XXXX, protects nothing"})
	}
	if c.LLMBaseURL == "" {
		out = append(out, defaultInUse{"FAREGATE_LLM_BASE_URL", "offline demo planner: a deterministic rule-based model, not an LLM"})
	}
	return out
}

// loadConfig parses the environment and validates it, reporting every
// problem at once.
func loadConfig(getenv func(string) string) (*config, error) {
	var c config
	environ := map[string]string{}
	for _, k := range configKeys() {
		if v := getenv("FAREGATE_" + k); v != "" {
			environ["FAREGATE_"+k] = v
		}
	}
	if err := env.ParseWithOptions(&c, env.Options{Prefix: "FAREGATE_", Environment: environ}); err != nil {
		return nil, parseErrors(err)
	}
	return &c, c.validate()
}

// parseErrors names each unparsable variable (env reports struct fields).
func parseErrors(err error) error {
	var agg env.AggregateError
	if !errors.As(err, &agg) {
		return fmt.Errorf("config: %w", err)
	}
	var out []error
	for _, e := range agg.Errors {
		var pe env.ParseError
		if errors.As(e, &pe) {
			if f, ok := reflect.TypeOf(config{}).FieldByName(pe.Name); ok {
				out = append(out, fmt.Errorf("FAREGATE_%s: %s", f.Tag.Get("env"), wantType(pe)))
				continue
			}
		}
		out = append(out, e)
	}
	return errors.Join(out...)
}

// wantType says what a variable of pe's type looks like, with the parser's
// own complaint.
func wantType(pe env.ParseError) string {
	what := "a " + pe.Type.String()
	switch pe.Type {
	case reflect.TypeOf(time.Duration(0)):
		what = "a duration with a unit, such as 90s, 15m or 1h"
	case reflect.TypeOf(0), reflect.TypeOf(int64(0)), reflect.TypeOf(uint32(0)):
		what = "a whole number"
	case reflect.TypeOf(0.0):
		what = "a number"
	case reflect.TypeOf(false):
		what = "true or false"
	}
	if pe.Err != nil {
		return "want " + what + " (" + pe.Err.Error() + ")"
	}
	return "want " + what
}

// configKeys lists every variable name (without prefix) the struct reads, so
// only those are looked up through getenv.
func configKeys() []string {
	keys, _ := env.GetFieldParams(&config{})
	out := make([]string, 0, len(keys))
	for _, k := range keys {
		out = append(out, k.Key)
	}
	return out
}

func (c *config) validate() error {
	var errs []error
	bad := func(format string, a ...any) { errs = append(errs, fmt.Errorf(format, a...)) }

	host, _, addrErr := net.SplitHostPort(c.Addr)
	if addrErr != nil {
		bad("FAREGATE_ADDR %q: want host:port", c.Addr)
	}
	if c.RedisURL != "" {
		u, err := url.Parse(c.RedisURL)
		if err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") {
			bad("FAREGATE_REDIS_URL: want a redis:// or rediss:// URL")
		}
		if c.IPHashKey == "" {
			bad("FAREGATE_IP_HASH_KEY is required when FAREGATE_REDIS_URL is set, so replicas agree on visitor keys")
		}
	}
	if c.IPHashKey != "" && len(c.IPHashKey) < 16 {
		bad("FAREGATE_IP_HASH_KEY: use at least 16 characters (32 random bytes recommended)")
	}
	if c.TurnstileSecret != "" && len(c.TurnstileHostnames) == 0 {
		bad("FAREGATE_TURNSTILE_HOSTNAMES is required when FAREGATE_TURNSTILE_SECRET_KEY is set: tokens must be checked against your hostnames")
	}
	for i, h := range c.TurnstileHostnames {
		c.TurnstileHostnames[i] = strings.ToLower(strings.TrimSpace(h))
	}
	c.TurnstileHostnames = slices.DeleteFunc(c.TurnstileHostnames, func(s string) bool { return s == "" })
	// A list, not a map: errors are reported in a stable order.
	for _, v := range []struct{ name, raw string }{
		{"FAREGATE_TURNSTILE_VERIFY_URL", c.TurnstileVerifyURL},
		{"FAREGATE_TURNSTILE_SCRIPT_URL", c.TurnstileScriptURL},
		{"FAREGATE_WEATHER_URL", c.WeatherURL},
		{"FAREGATE_GEOCODING_URL", c.GeocodingURL},
		{"FAREGATE_SEARCH_URL", c.SearchURL},
		{"FAREGATE_LLM_BASE_URL", c.LLMBaseURL},
		{"FAREGATE_LLM_FALLBACK_BASE_URL", c.FallbackBaseURL},
		{"FAREGATE_PUBLIC_URL", c.PublicURL},
	} {
		if v.raw == "" {
			continue
		}
		if u, err := url.Parse(v.raw); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("%s %q: want an http(s) URL", v.name, v.raw)
		}
	}
	if c.TurnstileTimeout <= 0 || c.TurnstileTimeout > time.Minute {
		bad("FAREGATE_TURNSTILE_TIMEOUT: want between 1ms and 1m")
	}
	if c.IPDailyLimit < 1 {
		bad("FAREGATE_IP_DAILY_LIMIT: want at least 1")
	}
	if c.GlobalDailyLimit < 1 {
		bad("FAREGATE_GLOBAL_DAILY_LIMIT: want at least 1")
	}
	var err error
	if c.trusted, err = clientip.ParseTrusted(c.TrustedProxies); err != nil {
		bad("FAREGATE_TRUSTED_PROXIES: %v", err)
	}
	if strings.TrimSpace(c.ClientIPHeader) == "" {
		bad("FAREGATE_CLIENT_IP_HEADER: must not be empty")
	}
	if c.LLMMaxTokens < 16 || c.LLMMaxTokens > 1_000_000 {
		bad("FAREGATE_LLM_MAX_TOKENS: want 16 to 1000000")
	}
	if c.FallbackBaseURL != "" && c.FallbackModel == "" {
		bad("FAREGATE_LLM_FALLBACK_MODEL is required when FAREGATE_LLM_FALLBACK_BASE_URL is set")
	}
	if c.AgentMaxSteps < 1 || c.AgentMaxSteps > 50 {
		bad("FAREGATE_AGENT_MAX_STEPS: want 1 to 50")
	}
	if c.AgentMaxToolCalls < 0 || c.AgentMaxToolCalls > 200 {
		bad("FAREGATE_AGENT_MAX_TOOL_CALLS: want 0 to 200")
	}
	if c.AgentTimeout < time.Second {
		bad("FAREGATE_AGENT_TIMEOUT: want at least 1s")
	}
	if c.AgentConcurrency < 0 {
		bad("FAREGATE_AGENT_CONCURRENCY: want 0 (automatic) or more")
	}
	c.validateAgent(bad)
	if c.DailyTokenBudget < 1 || c.IPDailyTokens < 1 || c.TaskTokenLimit < 1 {
		bad("FAREGATE_DAILY_TOKEN_BUDGET, FAREGATE_IP_DAILY_TOKENS and FAREGATE_TASK_TOKEN_LIMIT: want at least 1")
	}
	if c.LoopThreshold <= 0 || c.LoopThreshold > 1 {
		bad("FAREGATE_LOOP_THRESHOLD: want a ratio in (0, 1]")
	}
	if c.BreakerWindow <= 0 || c.BreakerOpenFor <= 0 || c.BreakerSlowCall <= 0 {
		bad("FAREGATE_BREAKER_WINDOW, FAREGATE_BREAKER_OPEN_FOR and FAREGATE_BREAKER_SLOW_CALL: want positive durations")
	}
	if c.BreakerFailureRatio <= 0 || c.BreakerFailureRatio > 1 || c.BreakerSlowRatio <= 0 || c.BreakerSlowRatio > 1 {
		bad("FAREGATE_BREAKER_FAILURE_RATIO and FAREGATE_BREAKER_SLOW_RATIO: want ratios in (0, 1]")
	}
	if c.BreakerMinCalls < 1 || c.BreakerHalfOpenProbes < 1 {
		bad("FAREGATE_BREAKER_MIN_CALLS and FAREGATE_BREAKER_HALF_OPEN_PROBES: want at least 1")
	}
	switch c.AITFMode {
	case "off", "observe", "enforce":
	default:
		bad("FAREGATE_AITF_MODE %q: want off, observe or enforce", c.AITFMode)
	}
	if c.AITFThreshold <= 0 || c.AITFThreshold > 1 {
		bad("FAREGATE_AITF_THRESHOLD: want a score in (0, 1]")
	}
	if c.AITFDegradeBacklog < 0 || c.AITFMaxQueue < 1 {
		bad("FAREGATE_AITF_DEGRADE_BACKLOG and FAREGATE_AITF_MAX_QUEUE: want non-negative and positive")
	}
	if c.ShutdownTimeout <= 0 {
		bad("FAREGATE_SHUTDOWN_TIMEOUT: want a positive duration")
	}
	if c.StreamsPerVisitor < 1 || c.StreamsMax < 1 {
		bad("FAREGATE_STREAMS_PER_VISITOR and FAREGATE_STREAMS_MAX: want at least 1")
	}
	if c.StreamMaxDuration < time.Second {
		bad("FAREGATE_STREAM_MAX_DURATION: want at least 1s")
	}
	if c.RequestsPerMinute < 1 {
		bad("FAREGATE_REQUESTS_PER_MINUTE: want at least 1")
	}
	if c.FailedChecksPerHour < 1 {
		bad("FAREGATE_FAILED_CHECKS_PER_HOUR: want at least 1")
	}
	if c.LogSummaryInterval < 100*time.Millisecond {
		bad("FAREGATE_LOG_SUMMARY_INTERVAL: want at least 100ms")
	}
	if c.MaxConnections < 0 || c.ConnectionsPerPeer < 0 {
		bad("FAREGATE_MAX_CONNECTIONS and FAREGATE_CONNECTIONS_PER_PEER: want 0 (automatic / off) or more")
	}
	if c.IdleTimeout < time.Second {
		bad("FAREGATE_IDLE_TIMEOUT: want at least 1s")
	}
	if c.TaskLease < 3*time.Second {
		// Renewed every third of it: shorter leases would need renewals
		// faster than a busy machine can promise.
		bad("FAREGATE_TASK_LEASE: want at least 3s")
	}
	if c.SiteTokensPerMinute < 0 {
		bad("FAREGATE_SITE_TOKENS_PER_MINUTE: want 0 (off) or more")
	}
	if c.SitePaceWait <= 0 || c.TokenWait <= 0 {
		bad("FAREGATE_SITE_PACE_WAIT and FAREGATE_TOKEN_WAIT: want positive durations")
	}
	if c.prices, err = budget.ParsePrices(c.ModelPrices); err != nil {
		bad("FAREGATE_MODEL_PRICES: %v", err)
	}
	if c.spendMicro, err = budget.ParseMicro(c.DailySpendLimit); err != nil || c.spendMicro < 0 {
		bad("FAREGATE_DAILY_SPEND_LIMIT %q: want an amount in the prices' currency, such as 5 or 2.50 (0: off)", c.DailySpendLimit)
	}
	if c.AlertWebhookURL != "" {
		if u, err := url.Parse(c.AlertWebhookURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("FAREGATE_ALERT_WEBHOOK_URL: want an http(s) URL")
		}
	}
	if c.cacheMode, err = plancache.ParseMode(c.PlanCache); err != nil {
		bad("%v", err)
	}
	if c.PlanCacheTTL < time.Minute {
		bad("FAREGATE_PLAN_CACHE_TTL: want at least 1m")
	}
	for i, o := range c.CORSOrigins {
		o = strings.TrimRight(strings.TrimSpace(o), "/")
		c.CORSOrigins[i] = o
		if u, err := url.Parse(o); o != "*" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Path != "") {
			bad("FAREGATE_CORS_ORIGINS %q: want origins such as https://app.example (scheme and host, no path)", o)
		}
	}
	c.CORSOrigins = slices.DeleteFunc(c.CORSOrigins, func(s string) bool { return s == "" })
	if c.MetricsAddr != "" {
		if _, _, err := net.SplitHostPort(c.MetricsAddr); err != nil {
			bad("FAREGATE_METRICS_ADDR %q: want host:port", c.MetricsAddr)
		}
	}
	if c.RedisTimeout < 100*time.Millisecond || c.RedisTimeout > time.Minute {
		bad("FAREGATE_REDIS_TIMEOUT: want between 100ms and 1m")
	}
	if c.QueueMax < 1 {
		bad("FAREGATE_QUEUE_MAX: want at least 1")
	}
	switch c.LogLevel {
	case "debug", "info", "warn", "error":
	default:
		bad("FAREGATE_LOG_LEVEL %q: want debug, info, warn or error", c.LogLevel)
	}
	switch c.LogFormat {
	case "text", "json":
	default:
		bad("FAREGATE_LOG_FORMAT %q: want text or json", c.LogFormat)
	}

	// Embedded defaults are for a laptop. On an address others can reach they
	// would silently protect nothing, so refuse unless the operator says so.
	if addrErr == nil && !c.Dev && !isLoopbackHost(host) {
		if defs := c.embeddedDefaults(); len(defs) > 0 {
			names := make([]string, len(defs))
			for i, d := range defs {
				names[i] = d.Variable
			}
			bad("FAREGATE_ADDR %s is not a loopback address and embedded defaults are active: set %s (or FAREGATE_DEV=true for a throwaway demo)",
				c.Addr, strings.Join(names, ", "))
		}
	}
	return errors.Join(errs...)
}

func isLoopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.IsLoopback()
}
