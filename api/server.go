package api

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"

	"faregate/agent/task"
	"faregate/protect/aitf"
	"faregate/protect/clientip"
	"faregate/protect/quota"
)

// MaxBody is the largest accepted request body, in bytes (inclusive).
const MaxBody = 16384

// Verifier checks a Turnstile token (protect/turnstile).
type Verifier interface {
	Verify(ctx context.Context, token, remoteIP string) error
}

// Quota is the daily task quota (protect/quota).
type Quota interface {
	Check(ctx context.Context, visitor string) (quota.Decision, error)
	Take(ctx context.Context, visitor string) (quota.Decision, error)
	Limits() quota.Limits
}

// Budget answers whether the site and the visitor can afford one minimal
// run (protect/budget).
type Budget interface {
	CanAfford(ctx context.Context, day, visitor string, amount int64) error
}

// Tasks creates and launches tasks (agent.Runner).
type Tasks interface {
	Create(ctx context.Context, rec task.Record) (task.Record, error)
	Launch(rec task.Record) error
}

// TaskStore reads tasks and follows their events (agent/taskstore.Store).
type TaskStore interface {
	Get(ctx context.Context, id string) (task.Record, error)
	Follow(ctx context.Context, id, after string, fn func(task.Event) error) error
	Ping(ctx context.Context) error
}

// ModelHealth reports the model's state (agent.Models).
type ModelHealth interface {
	Status() string
	Offline() bool
}

// PublicConfig is what GET /api/config tells the page.
type PublicConfig struct {
	TurnstileSiteKey   string
	TurnstileScriptURL string
	TurnstileTest      bool
	DevMode            bool
	Limits             quota.Limits
}

// Deps is everything the server needs; each is a parameter so tests can
// pass fakes.
type Deps struct {
	Logger   *slog.Logger
	Visitors *clientip.Resolver
	Verifier Verifier
	Quota    Quota
	Budget   Budget
	// MinRunTokens is the reservation of a first model call: what the site
	// and the visitor must be able to afford for a task to be admitted.
	MinRunTokens int64
	Models       ModelHealth
	Tasks        Tasks
	Store        TaskStore
	AITF         *aitf.Guard
	// Web serves the page at / (nil: no page).
	Web      http.Handler
	Config   PublicConfig
	Registry *prometheus.Registry
	// CSP is the Content-Security-Policy sent with every response.
	CSP string
	Now func() time.Time
}

// NewServer returns the whole HTTP API as one handler.
func NewServer(d Deps) http.Handler {
	if d.Now == nil {
		d.Now = time.Now
	}
	if d.Logger == nil {
		d.Logger = slog.New(slog.DiscardHandler)
	}
	m := newMetrics(d.Registry)
	return routes(d, m)
}

// RoutePattern is the chi route pattern of a routed request ("unmatched"
// before routing), a label that cannot grow with user input.
func RoutePattern(r *http.Request) string {
	if rc := chi.RouteContext(r.Context()); rc != nil {
		if p := rc.RoutePattern(); p != "" {
			return p
		}
	}
	return "unmatched"
}

// RefuseAITF writes the 503 aitf_queue_full envelope (for the AITF guard).
func RefuseAITF(w http.ResponseWriter, r *http.Request, retryAfter time.Duration) {
	writeError(w, r, CodeAITFQueueFull, retryAfter, nil)
}
