package main

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"

	"faregate/agent/gateway"
	"faregate/agent/plancache"
	"faregate/api"
	"faregate/protect/budget"
	"faregate/protect/clientip"
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
	LLMMaxCallTokens   int64         `env:"LLM_MAX_CALL_TOKENS" envDefault:"1000000"`
	LLMTimeout         time.Duration `env:"LLM_TIMEOUT" envDefault:"60s"`
	FallbackBaseURL    string        `env:"LLM_FALLBACK_BASE_URL"`
	FallbackModel      string        `env:"LLM_FALLBACK_MODEL"`
	FallbackAPIKey     string        `env:"LLM_FALLBACK_API_KEY"`
	// LLMProvider is the wire the provider speaks: openai (any
	// OpenAI-compatible server, the offline model) or anthropic
	// (Anthropic's Messages API); the fallback speaks the same.
	LLMProvider      string `env:"LLM_PROVIDER" envDefault:"openai"`
	FallbackProvider string `env:"LLM_FALLBACK_PROVIDER"`

	AgentMaxSteps     int           `env:"AGENT_MAX_STEPS" envDefault:"6"`
	AgentMaxToolCalls int           `env:"AGENT_MAX_TOOL_CALLS" envDefault:"12"`
	AgentTimeout      time.Duration `env:"AGENT_TIMEOUT" envDefault:"90s"`
	// AgentConcurrency 0 is automatic: 8 for the built-in planner, 64
	// with an external agent (config_agent.go says why).
	AgentConcurrency int `env:"AGENT_CONCURRENCY" envDefault:"0"`
	// AgentURL, when set, is the operator's own agent that each admitted
	// task is delivered to instead of the built-in trip planner; the rest
	// of the external agent's variables go with it (config_agent.go).
	AgentURL         string `env:"AGENT_URL"`
	AgentSecret      string `env:"AGENT_SECRET"`
	AgentCallbackURL string `env:"AGENT_CALLBACK_URL"`
	AgentMaxCalls    int    `env:"AGENT_MAX_CALLS" envDefault:"40"`
	AgentMaxParallel int    `env:"AGENT_MAX_PARALLEL" envDefault:"4"`
	// AgentMaxEmbeddingCalls bounds an external task's embedding calls,
	// counted apart from its model calls (agent/tasklimits).
	AgentMaxEmbeddingCalls int    `env:"AGENT_MAX_EMBEDDING_CALLS" envDefault:"200"`
	EmbeddingModel         string `env:"EMBEDDING_MODEL"`
	// EmbeddingBaseURL is where /v1/embeddings goes when not to
	// FAREGATE_LLM_BASE_URL (required with an anthropic provider, which
	// has no embeddings).
	EmbeddingBaseURL string `env:"EMBEDDING_BASE_URL"`
	EmbeddingAPIKey  string `env:"EMBEDDING_API_KEY"`
	V1MaxBody        int64  `env:"V1_MAX_BODY" envDefault:"2097152"`
	// TaskInput is the body POST /api/tasks takes (api.InputTrip or
	// api.InputPrompt); empty: trip with the built-in planner, prompt with
	// an external agent (validate fills it in).
	TaskInput      string `env:"TASK_INPUT"`
	PromptMaxChars int    `env:"PROMPT_MAX_CHARS" envDefault:"2000"`

	WeatherURL   string `env:"WEATHER_URL" envDefault:"https://api.open-meteo.com/v1/forecast"`
	GeocodingURL string `env:"GEOCODING_URL" envDefault:"https://geocoding-api.open-meteo.com/v1/search"`
	SearchURL    string `env:"SEARCH_URL"`
	PublicURL    string `env:"PUBLIC_URL"`

	DailyTokenBudget int64 `env:"DAILY_TOKEN_BUDGET" envDefault:"200000"`
	IPDailyTokens    int64 `env:"IP_DAILY_TOKENS" envDefault:"40000"`
	// IPHourlyTokens is a visitor's sliding hour of tokens (0: off), with
	// its soft throttle from SoftAt of it, to SoftRequestsPerMinute.
	IPHourlyTokens        int64   `env:"IP_HOURLY_TOKENS" envDefault:"0"`
	SoftAt                float64 `env:"SOFT_AT" envDefault:"0.8"`
	SoftRequestsPerMinute int64   `env:"SOFT_REQUESTS_PER_MINUTE" envDefault:"5"`
	TaskTokenLimit        int64   `env:"TASK_TOKEN_LIMIT" envDefault:"12000"`
	BudgetLeaseCalls      int64   `env:"BUDGET_LEASE_CALLS" envDefault:"0"`
	LoopThreshold         float64 `env:"LOOP_THRESHOLD" envDefault:"0.8"`
	LoopCut               bool    `env:"LOOP_CUT" envDefault:"true"`

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
	RequestsPerSecond   int64         `env:"REQUESTS_PER_SECOND" envDefault:"10"`
	FailedChecksPerHour int64         `env:"FAILED_CHECKS_PER_HOUR" envDefault:"20"`
	InvalidRatio        float64       `env:"INVALID_RATIO" envDefault:"0.5"`
	InvalidMinRequests  int64         `env:"INVALID_MIN_REQUESTS" envDefault:"20"`
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

	BillingURL       string `env:"BILLING_URL"`
	BillingSecret    string `env:"BILLING_SECRET"`
	LedgerMaxEntries int64  `env:"LEDGER_MAX_ENTRIES" envDefault:"1000000"`

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

// anthropicProvider checks what an anthropic provider needs: a base URL
// (the offline model speaks OpenAI's wire) and an external agent (the
// built-in planner runs on langchaingo's OpenAI client only: its tool
// calls and streamed usage are read in that wire).
func anthropicProvider(c *config) string {
	if c.LLMProvider != gateway.WireAnthropic {
		return ""
	}
	var bad []string
	if c.LLMBaseURL == "" {
		bad = append(bad, "needs FAREGATE_LLM_BASE_URL (the URL /messages is appended to, such as https://api.anthropic.com/v1): the offline model speaks openai")
	}
	if c.AgentURL == "" {
		bad = append(bad, "needs an external agent (FAREGATE_AGENT_URL): the built-in trip planner speaks only the openai wire; run it on an OpenAI-compatible server, or serve your Claude agent behind /v1/messages")
	}
	if c.LLMLegacyMaxTokens {
		bad = append(bad, "FAREGATE_LLM_LEGACY_MAX_TOKENS is an openai setting (Messages has only max_tokens)")
	}
	return strings.Join(bad, "; ")
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
// problem at once: a variable that does not parse is named, and every rule
// that does not read it still runs.
func loadConfig(getenv func(string) string) (*config, error) {
	var c config
	environ := map[string]string{}
	for _, k := range configKeys() {
		if v := getenv("FAREGATE_" + k); v != "" {
			environ["FAREGATE_"+k] = v
		}
	}
	var parseErr error
	unparsed := map[string]bool{}
	if err := env.ParseWithOptions(&c, env.Options{Prefix: "FAREGATE_", Environment: environ}); err != nil {
		parseErr = parseErrors(err, unparsed)
	}
	if err := errors.Join(parseErr, c.validate(unparsed)); err != nil {
		return nil, err
	}
	return &c, nil
}

// parseErrors names each unparsable variable (env reports struct fields)
// and records it in unparsed.
func parseErrors(err error, unparsed map[string]bool) error {
	var agg env.AggregateError
	if !errors.As(err, &agg) {
		return fmt.Errorf("config: %w", err)
	}
	var out []error
	for _, e := range agg.Errors {
		var pe env.ParseError
		if errors.As(e, &pe) {
			if f, ok := reflect.TypeOf(config{}).FieldByName(pe.Name); ok {
				name := f.Tag.Get("env")
				unparsed[name] = true
				out = append(out, fmt.Errorf("FAREGATE_%s: %s", name, wantType(pe)))
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

// validate normalises the lists and runs configRules, skipping the rules
// that read a variable in unparsed.
func (c *config) validate(unparsed map[string]bool) error {
	for i, h := range c.TurnstileHostnames {
		c.TurnstileHostnames[i] = strings.ToLower(strings.TrimSpace(h))
	}
	c.TurnstileHostnames = slices.DeleteFunc(c.TurnstileHostnames, func(s string) bool { return s == "" })
	for i, o := range c.CORSOrigins {
		c.CORSOrigins[i] = strings.TrimRight(strings.TrimSpace(o), "/")
	}
	c.CORSOrigins = slices.DeleteFunc(c.CORSOrigins, func(s string) bool { return s == "" })
	return c.runRules(configRules(), unparsed)
}

// configRules is every check of the configuration, one row per check, in
// the order problems are reported. A row is {variable without FAREGATE_,
// check, other variables the check reads}; the checks are in
// configrules.go. A new variable: its field in config, its line in
// .env.example, and its rows here.
func configRules() []rule {
	return slices.Concat(serveRules(), modelRules(), budgetRules(), costRules())
}

// serveRules: the listener, Redis, Turnstile, the daily task quotas and the tools' URLs.
func serveRules() []rule {
	return []rule{
		{"ADDR", listenAddr(true), nil},
		{"ADDR", custom(embeddedDefaultsOnPublicAddr), []string{"DEV"}},
		{"REDIS_URL", custom(func(c *config) string {
			if c.RedisURL == "" {
				return ""
			}
			if u, err := url.Parse(c.RedisURL); err != nil || (u.Scheme != "redis" && u.Scheme != "rediss") {
				return "want a redis:// or rediss:// URL" // never echoed: it may hold a password
			}
			return ""
		}), nil},
		{"REDIS_TIMEOUT", between(100*time.Millisecond, time.Minute), nil},
		{"IP_HASH_KEY", requiredWith("REDIS_URL", "so replicas agree on visitor keys"), []string{"REDIS_URL"}},
		{"IP_HASH_KEY", minLen(16, "32 random bytes recommended: openssl rand -hex 32"), nil},

		{"TURNSTILE_HOSTNAMES", requiredWith("TURNSTILE_SECRET_KEY", "so tokens are checked against your hostnames"), []string{"TURNSTILE_SECRET_KEY"}},
		{"TURNSTILE_VERIFY_URL", httpURL(), nil},
		{"TURNSTILE_SCRIPT_URL", httpURL(), nil},
		{"TURNSTILE_TIMEOUT", between(time.Millisecond, time.Minute), nil},

		{"IP_DAILY_LIMIT", atLeast[int64](1), nil},
		{"GLOBAL_DAILY_LIMIT", atLeast[int64](1), nil},
		{"TRUSTED_PROXIES", parsed("", func(c *config) (err error) {
			c.trusted, err = clientip.ParseTrusted(c.TrustedProxies)
			return err
		}), nil},
		{"CLIENT_IP_HEADER", custom(func(c *config) string {
			if strings.TrimSpace(c.ClientIPHeader) == "" {
				return "must not be empty"
			}
			return ""
		}), nil},

		{"WEATHER_URL", httpURL(), nil},
		{"GEOCODING_URL", httpURL(), nil},
		{"SEARCH_URL", httpURL(), nil},
		{"PUBLIC_URL", httpURL(), nil},
	}
}

// modelRules: the provider, its wire, the planner and the external agent.
func modelRules() []rule {
	return []rule{
		{"LLM_BASE_URL", httpURL(), nil},
		{"LLM_TIMEOUT", atLeast(time.Second), nil},
		{"LLM_MAX_TOKENS", between(16, 1_000_000), nil},
		// The ceiling of one call's charge must hold at least a call's own
		// output, or every honest report would count as implausible.
		{"LLM_MAX_CALL_TOKENS", custom(func(c *config) string {
			if c.LLMMaxCallTokens < int64(max(c.LLMMaxTokens, 16)) || c.LLMMaxCallTokens > 1<<40 {
				return fmt.Sprintf("want FAREGATE_LLM_MAX_TOKENS (%d) to %d", c.LLMMaxTokens, int64(1<<40))
			}
			return ""
		}), []string{"LLM_MAX_TOKENS"}},
		{"LLM_FALLBACK_BASE_URL", httpURL(), nil},
		{"LLM_FALLBACK_MODEL", requiredWith("LLM_FALLBACK_BASE_URL", "to name the fallback's model"), []string{"LLM_FALLBACK_BASE_URL"}},
		{"LLM_PROVIDER", oneOf(gateway.WireOpenAI, gateway.WireAnthropic), nil},
		{"LLM_PROVIDER", custom(anthropicProvider), []string{"LLM_BASE_URL", "AGENT_URL", "LLM_LEGACY_MAX_TOKENS"}},
		// One wire for both in this version: a call that fell back is the
		// same call, its body patched the same way.
		{"LLM_FALLBACK_PROVIDER", custom(func(c *config) string {
			if c.FallbackProvider == "" {
				c.FallbackProvider = c.LLMProvider
			}
			if c.FallbackProvider != c.LLMProvider {
				return fmt.Sprintf("%q: must equal FAREGATE_LLM_PROVIDER (%q); the fallback speaks the primary's wire", c.FallbackProvider, c.LLMProvider)
			}
			return ""
		}), []string{"LLM_PROVIDER"}},

		{"AGENT_MAX_STEPS", between(1, 50), nil},
		{"AGENT_MAX_TOOL_CALLS", between(0, 200), nil},
		{"AGENT_TIMEOUT", atLeast(time.Second), nil},
		{"AGENT_CONCURRENCY", custom(agentConcurrency), []string{"AGENT_URL"}},
		{"AGENT_URL", httpURL(), nil},
		{"AGENT_SECRET", requiredWith("AGENT_URL", "to sign every delivery"), []string{"AGENT_URL"}},
		{"AGENT_SECRET", minLen(16, "32 random bytes recommended: openssl rand -hex 32"), nil},
		{"AGENT_CALLBACK_URL", custom(agentCallbackURL), nil},
		{"AGENT_MAX_CALLS", between(1, 1000), nil},
		{"AGENT_MAX_PARALLEL", between(1, 64), nil},
		{"AGENT_MAX_EMBEDDING_CALLS", between(1, 100_000), nil},
		{"V1_MAX_BODY", between[int64](16384, 64<<20), nil},
		{"EMBEDDING_BASE_URL", httpURL(), nil},
		{"EMBEDDING_BASE_URL", requiredWith("EMBEDDING_API_KEY", "to be where the key is sent"), []string{"EMBEDDING_API_KEY"}},
		// The form follows the agent unless set: trip for the built-in
		// planner, prompt for an external agent.
		{"TASK_INPUT", custom(func(c *config) string {
			switch c.TaskInput {
			case "":
				c.TaskInput = api.InputTrip
				if c.AgentURL != "" {
					c.TaskInput = api.InputPrompt
				}
			case api.InputTrip:
			case api.InputPrompt:
				if c.AgentURL == "" {
					return "prompt needs an external agent (FAREGATE_AGENT_URL): the built-in trip planner takes trips (destination, days, interests)"
				}
			default:
				return fmt.Sprintf("%q: want trip or prompt", c.TaskInput)
			}
			return ""
		}), []string{"AGENT_URL"}},
		// The bound keeps the largest prompt (4 UTF-8 bytes a code point)
		// with a Turnstile token inside the 16 KiB body of /api.
		{"PROMPT_MAX_CHARS", between(1, api.MaxPromptChars), nil},
	}
}

// budgetRules: token budgets, the breaker, AITF, windows and connections.
func budgetRules() []rule {
	return []rule{
		{"DAILY_TOKEN_BUDGET", atLeast[int64](1), nil},
		{"IP_DAILY_TOKENS", atLeast[int64](1), nil},
		{"IP_HOURLY_TOKENS", noted(between[int64](0, 1<<40), "0: off"), nil},
		{"SOFT_AT", ratio(), nil},
		{"SOFT_REQUESTS_PER_MINUTE", between[int64](1, 1_000_000), nil},
		{"TASK_TOKEN_LIMIT", atLeast[int64](1), nil},
		{"BUDGET_LEASE_CALLS", noted(between[int64](0, 1_000_000), "0: off, every call reserved in the day's slot"), nil},
		{"LOOP_THRESHOLD", ratio(), nil},
		// The /v1 cut reads the planner's threshold: off is its own switch,
		// never a threshold of 0 (which the planner would read as 0.8).
		{"LOOP_CUT", custom(func(c *config) string {
			if c.LoopCut && c.LoopThreshold <= 0 {
				return "needs FAREGATE_LOOP_THRESHOLD in (0, 1]; to turn the cut off on /v1, set FAREGATE_LOOP_CUT=false"
			}
			return ""
		}), []string{"LOOP_THRESHOLD"}},

		{"BREAKER_WINDOW", positive(), nil},
		{"BREAKER_MIN_CALLS", atLeast[uint32](1), nil},
		{"BREAKER_FAILURE_RATIO", ratio(), nil},
		{"BREAKER_SLOW_RATIO", ratio(), nil},
		{"BREAKER_SLOW_CALL", positive(), nil},
		{"BREAKER_OPEN_FOR", positive(), nil},
		{"BREAKER_HALF_OPEN_PROBES", atLeast[uint32](1), nil},

		{"AITF_MODE", oneOf("off", "observe", "enforce"), nil},
		{"AITF_THRESHOLD", ratio(), nil},
		// 0 used to pass and silently become the default 500.
		{"AITF_DEGRADE_BACKLOG", atLeast(1), nil},
		// Past the queue's bound a request is refused before it could be degraded.
		{"AITF_DEGRADE_BACKLOG", atMostVar[int]("AITF_MAX_QUEUE"), []string{"AITF_MAX_QUEUE"}},
		{"AITF_MAX_QUEUE", atLeast(1), nil},

		{"STREAMS_PER_VISITOR", atLeast(1), nil},
		{"STREAMS_MAX", atLeast(1), nil},
		{"STREAM_MAX_DURATION", atLeast(time.Second), nil},
		{"REQUESTS_PER_MINUTE", atLeast[int64](1), nil},
		{"REQUESTS_PER_SECOND", noted(between[int64](0, 1_000_000), "0: off"), nil},
		{"FAILED_CHECKS_PER_HOUR", atLeast[int64](1), nil},
		// A ratio of 1 could never be passed (the share must be above it):
		// 0 is the way to turn the check off.
		{"INVALID_RATIO", custom(func(c *config) string {
			if r := c.InvalidRatio; !(r >= 0 && r < 1) {
				return "want a share from 0 up to (not including) 1 (0: off)"
			}
			return ""
		}), nil},
		{"INVALID_MIN_REQUESTS", between[int64](1, 1_000_000), nil},
		{"LOG_SUMMARY_INTERVAL", atLeast(100 * time.Millisecond), nil},
		{"MAX_CONNECTIONS", noted(atLeast(0), "0: three quarters of the open-file limit"), nil},
		{"CONNECTIONS_PER_PEER", noted(atLeast(0), "0: off"), nil},
		{"IDLE_TIMEOUT", atLeast(time.Second), nil},

		{"SITE_TOKENS_PER_MINUTE", noted(atLeast[int64](0), "0: off"), nil},
		{"SITE_PACE_WAIT", positive(), nil},
		{"TOKEN_WAIT", positive(), nil},
	}
}

// costRules: money, billing, the plan cache, CORS, leases and logs.
func costRules() []rule {
	return []rule{
		{"MODEL_PRICES", parsed("", func(c *config) (err error) {
			c.prices, err = budget.ParsePrices(c.ModelPrices)
			return err
		}), nil},
		{"DAILY_SPEND_LIMIT", parsed("want an amount in the prices' currency, such as 5 or 2.50 (0: off)", func(c *config) (err error) {
			c.spendMicro, err = budget.ParseMicro(c.DailySpendLimit)
			return err
		}), nil},
		{"ALERT_WEBHOOK_URL", httpURL(), nil},
		{"BILLING_URL", httpURL(), nil},
		{"BILLING_SECRET", requiredWith("BILLING_URL", "to sign every batch"), []string{"BILLING_URL"}},
		{"BILLING_SECRET", minLen(16, "32 random bytes recommended: openssl rand -hex 32"), nil},
		{"LEDGER_MAX_ENTRIES", between[int64](1000, 100_000_000), nil},
		{"PLAN_CACHE", parsed("want off, fallback or always", func(c *config) (err error) {
			c.cacheMode, err = plancache.ParseMode(c.PlanCache)
			if c.AgentURL != "" {
				// Plans are the built-in planner's; an external agent's
				// answers are never shared between visitors (run prints a
				// line saying so).
				c.cacheMode = plancache.ModeOff
			}
			return err
		}), []string{"AGENT_URL"}},
		{"PLAN_CACHE_TTL", atLeast(time.Minute), nil},

		{"CORS_ORIGINS", custom(func(c *config) string {
			var bad []string
			for _, o := range c.CORSOrigins {
				if u, err := url.Parse(o); o != "*" && (err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.Path != "") {
					bad = append(bad, strconv.Quote(o))
				}
			}
			if len(bad) > 0 {
				return strings.Join(bad, ", ") + ": want origins such as https://app.example (scheme and host, no path)"
			}
			return ""
		}), nil},
		{"METRICS_ADDR", listenAddr(false), nil},

		// Renewed every third of it: shorter leases would need renewals
		// faster than a busy machine can promise.
		{"TASK_LEASE", atLeast(3 * time.Second), nil},
		{"QUEUE_MAX", atLeast[int64](1), nil},
		{"SHUTDOWN_TIMEOUT", positive(), nil},
		{"LOG_LEVEL", oneOf("debug", "info", "warn", "error"), nil},
		{"LOG_FORMAT", oneOf("text", "json"), nil},
	}
}

// embeddedDefaultsOnPublicAddr refuses embedded defaults on an address
// others can reach: they are for a laptop, and there they would silently
// protect nothing, unless the operator says so (FAREGATE_DEV).
func embeddedDefaultsOnPublicAddr(c *config) string {
	host, _, err := net.SplitHostPort(c.Addr)
	if err != nil || c.Dev || isLoopbackHost(host) {
		return "" // a bad address is listenAddr's to report
	}
	defs := c.embeddedDefaults()
	if len(defs) == 0 {
		return ""
	}
	names := make([]string, len(defs))
	for i, d := range defs {
		names[i] = d.Variable
	}
	return fmt.Sprintf("%s is not a loopback address and embedded defaults are active: set %s (or FAREGATE_DEV=true for a throwaway demo)",
		c.Addr, strings.Join(names, ", "))
}

func isLoopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	a, err := netip.ParseAddr(host)
	return err == nil && a.IsLoopback()
}
