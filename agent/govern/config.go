package govern

import (
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	oteltrace "go.opentelemetry.io/otel/trace"

	"faregate/agent/alert"
	"faregate/protect/budget"
	"faregate/protect/kit/pause"
	"faregate/protect/kit/promreg"
	"faregate/protect/ratelimit"
)

// Config bounds every governed call.
type Config struct {
	// MaxTokens is a call's largest completion limit (FAREGATE_LLM_MAX_TOKENS):
	// Spec.MaxOutput above it, or 0, is it.
	MaxTokens int
	// TokenWait bounds how long one call waits, in all, for its
	// principal's tokens-per-minute bucket (FAREGATE_TOKEN_WAIT); past it
	// the call fails token_rate_limited. Zero takes DefaultTokenWait.
	TokenWait time.Duration
	// SiteTokensPerMinute is the site-wide token bucket's rate, sized to
	// the provider's tokens-per-minute limit (FAREGATE_SITE_TOKENS_PER_MINUTE):
	// every call of every lane and replica waits its turn for it instead of
	// meeting the provider's 429. 0 turns pacing off.
	SiteTokensPerMinute int64
	// SitePaceWait bounds the wait for a turn at the site bucket; a call
	// whose turn is further away fails token_rate_limited. Zero takes
	// DefaultSitePaceWait; at most ratelimit.MaxPaceWait.
	SitePaceWait time.Duration
	// SettleTimeout bounds a settle's (and a withdraw's) retries once the
	// call is over. A settle that gives up leaves its reservation to
	// expire, and the expiry gives back tokens the provider billed, so it
	// must cover the budget's attempts at the store's own timeouts; a
	// settle that lands late is still charged (as overage). Zero takes
	// DefaultSettleTimeout.
	SettleTimeout time.Duration
}

// DefaultSettleTimeout is Config.SettleTimeout's default.
const DefaultSettleTimeout = 5 * time.Second

// DefaultTokenWait is Config.TokenWait's default: long enough to ride out
// a burst, short enough that a visitor is told rather than left waiting.
const DefaultTokenWait = 20 * time.Second

// DefaultSitePaceWait is Config.SitePaceWait's default.
const DefaultSitePaceWait = 30 * time.Second

// Budget reserves tokens and money before a model call and settles after
// it (*budget.Budget).
type Budget interface {
	Reserve(ctx context.Context, req budget.Request) (budget.Reservation, error)
	// SettleCall settles and, with call.Ledger set, writes the call's
	// ledger entry in the same idempotent script.
	SettleCall(ctx context.Context, r budget.Reservation, call budget.Call) (budget.Settlement, error)
	// Charged is what SettleCall charges: the provider's report, or the
	// conservative charge of one it cannot believe.
	Charged(r budget.Reservation, call budget.Call) (prompt, completion int64, implausible bool)
	// Withdraw undoes a reserve (by req.ID) as if it had never been sent:
	// a call's bookings go to Redis at once, and one refused among them
	// gives back the others.
	Withdraw(ctx context.Context, req budget.Request) (bool, error)
}

var _ Budget = (*budget.Budget)(nil)

// Ledger counts the entry of each model call that reached a model
// (*budget.Ledger); with a Ledger set, the settle writes the entry.
type Ledger interface {
	Count(e budget.Entry)
}

// Limiter is the part of the rate limiter (*ratelimit.Limiter) a model
// call needs: the principal's input spike check and tokens-per-minute
// bucket before the call, the site bucket's turn right before the provider
// is called, and both buckets' settlement after it.
type Limiter interface {
	BeforeCall(ctx context.Context, r ratelimit.CallRequest) (ratelimit.CallDecision, error)
	Settle(ctx context.Context, r ratelimit.SettleRequest) (overage int64, err error)
	Pace(ctx context.Context, scope string, ratePerMin, amount int64, maxWait time.Duration, op string) (wait time.Duration, err error)
}

// Deps are what a Governor works with. Models and Budget are required; the
// rest may be left zero.
type Deps struct {
	Models *Models
	// Budget must be able to withdraw a reserve as if it had never been
	// sent (*budget.Budget): a call's bookings go to Redis at once, and a
	// refusal among them gives back the others.
	Budget Budget
	// Ledger, when set, records every call that reached a model.
	Ledger Ledger
	// Limiter, when set, checks every call for an input spike, takes its
	// tokens from the principal's bucket and hour and, with
	// Config.SiteTokensPerMinute, paces it through the site's.
	Limiter Limiter
	// Sleep waits d or until ctx ends (then it returns ctx.Err()): the
	// waits for the token buckets. Default: pause.For.
	Sleep func(ctx context.Context, d time.Duration) error
	// Alert, when set, receives the alerts a call raises (overage,
	// budget_warning, budget_exhausted, anomaly, usage_implausible,
	// principal_throttled), on the call's goroutine: it must not block.
	// Their Scope, Text and Details never show more of a visitor's hash
	// than its first 12 hex digits.
	Alert func(alert.Alert)
	// Logger defaults to one that discards.
	Logger *slog.Logger
	// Tracer starts the spans of calls and settles (nil: tracing off).
	Tracer oteltrace.Tracer
	// Registerer receives the call histograms (nil: unregistered).
	Registerer prometheus.Registerer
}

// New assembles a Governor from cfg and d, defaults applied. It panics
// when Models or Budget is nil: those are wiring.
func New(cfg Config, d Deps) *Governor {
	if d.Models == nil || d.Budget == nil {
		panic("govern: Models and Budget are required")
	}
	if d.Logger == nil {
		d.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.TokenWait <= 0 {
		cfg.TokenWait = DefaultTokenWait
	}
	if cfg.SitePaceWait <= 0 {
		cfg.SitePaceWait = DefaultSitePaceWait
	}
	cfg.SitePaceWait = min(cfg.SitePaceWait, ratelimit.MaxPaceWait)
	if cfg.SettleTimeout <= 0 {
		cfg.SettleTimeout = DefaultSettleTimeout
	}
	if d.Sleep == nil {
		d.Sleep = pause.For
	}
	return &Governor{cfg: cfg, d: d, metrics: newMetrics(d.Registerer)}
}

// Models is the governor's model router (for health and config).
func (g *Governor) Models() *Models { return g.d.Models }

// MaxTokens is Config.MaxTokens: a call's largest completion limit.
func (g *Governor) MaxTokens() int64 { return int64(g.cfg.MaxTokens) }

// metrics time the calls: how long each took by model and outcome.
type metrics struct {
	duration *prometheus.HistogramVec
}

// callBuckets are call latency boundaries in seconds, written out.
var callBuckets = []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120}

func newMetrics(reg prometheus.Registerer) *metrics {
	return &metrics{duration: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "faregate_model_call_duration_seconds", Help: "Model call latency, by model and outcome (ok, error, or the reason the stream was cut).",
		Buckets: callBuckets,
	}, []string{"model", "outcome"}))}
}
