package api

import (
	"context"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"

	"faregate/agent/alert"
	"faregate/agent/plancache"
	"faregate/agent/task"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
)

// MaxBody is the largest accepted request body, in bytes (inclusive).
const MaxBody = 16384

// Verifier checks a Turnstile token (protect/turnstile).
type Verifier interface {
	Verify(ctx context.Context, token, remoteIP string) error
}

// Quota is the daily task quota (protect/quota).
type Quota interface {
	Remembered(s quota.Subject) error
	Check(ctx context.Context, s quota.Subject) (quota.Decision, error)
	Take(ctx context.Context, s quota.Subject) (quota.Decision, error)
}

// Limiter is the per-principal request windows, failed-check log, invalid
// ratio, hourly tokens and token bucket (protect/ratelimit).
type Limiter interface {
	Gate(ctx context.Context, r ratelimit.GateRequest) (ratelimit.GateDecision, error)
	RecordFailedCheck(ctx context.Context, scope, op string, perHour int64) (int64, time.Duration, error)
	// Record counts a refused creation in the invalid ratio's window,
	// with its failed check (visitors) in the same round trip.
	Record(ctx context.Context, n ratelimit.Note) (int64, time.Duration, error)
	Peek(ctx context.Context, scope string, ratePerMin, need int64) (bool, time.Duration, error)
	HourRoom(ctx context.Context, scope string, perHour, need int64) (bool, time.Duration, int64, error)
}

// Budget answers whether a principal can afford one minimal run, and what
// a key has spent (protect/budget).
type Budget interface {
	CanAfford(ctx context.Context, r budget.AffordRequest) error
	Usage(ctx context.Context, q budget.UsageQuery) (budget.UsageReport, error)
}

// Tasks stores admitted tasks and puts them on the queue (agent.Runner).
type Tasks interface {
	Submit(ctx context.Context, rec task.Record) (task.Record, error)
	// Depth is how many tasks wait or run, for the queue bound.
	Depth(ctx context.Context) (int64, error)
	// Cached stores a task that is final at once: a served cached plan.
	Cached(ctx context.Context, rec task.Record) (task.Record, error)
}

// TaskStore reads tasks (agent/taskstore).
type TaskStore interface {
	Get(ctx context.Context, id string) (task.Record, error)
}

// Follower streams a task's events (the taskstore Hub).
type Follower interface {
	Follow(ctx context.Context, id, after string, fn func(task.Event) error) error
}

// ModelHealth reports the model's state (govern.Models).
type ModelHealth interface {
	Status() string
	Offline() bool
}

// PlanCache answers a normalised request with a plan cached earlier
// (agent/plancache).
type PlanCache interface {
	Get(ctx context.Context, r plancache.Request) (plancache.Plan, bool, error)
}

// Policy is the policy in force (protect/policy, adapted by the caller):
// tiers, keys and prompt rules. One request sees one Policy value, so a
// reload never mixes two.
type Policy interface {
	Public() principal.Tier
	// Authenticate resolves a bearer token to its key's id and tier, or
	// fails with an error that maps to 401 invalid_api_key.
	Authenticate(token string) (id string, tier principal.Tier, err error)
	// CheckPrompt names the first static rule the texts match.
	CheckPrompt(texts ...string) (rule string, matched bool)
}

// PublicConfig is what GET /api/config tells the page.
type PublicConfig struct {
	TurnstileSiteKey   string
	TurnstileScriptURL string
	TurnstileTest      bool
	DevMode            bool
	// Input is the body POST /api/tasks takes: InputTrip (also when empty)
	// or InputPrompt (FAREGATE_TASK_INPUT).
	Input string
	// PromptMaxChars bounds a prompt in code points of its NFKC form
	// (FAREGATE_PROMPT_MAX_CHARS; 0: DefaultPromptMaxChars).
	PromptMaxChars int
}

// The request forms of POST /api/tasks (FAREGATE_TASK_INPUT).
const (
	InputTrip   = "trip"
	InputPrompt = "prompt"
)

// DefaultPromptMaxChars is FAREGATE_PROMPT_MAX_CHARS's default, and
// MaxPromptChars its largest value: a prompt of that many code points of
// four UTF-8 bytes each, with a Turnstile token of up to 2048 characters,
// still fits the 16 KiB body of /api.
const (
	DefaultPromptMaxChars = 2000
	MaxPromptChars        = 3000
)

// Limits are the gate's own bounds.
type Limits struct {
	// GlobalDailyTasks is the public lane's site-wide tasks per day.
	GlobalDailyTasks int64
	// SiteDailyTokens is the site's token budget (the bill cap of all lanes)
	// and DailySpendMicro its money cap in micro-units (0: off).
	SiteDailyTokens, DailySpendMicro int64
	// FailedChecksPerHour refuses a visitor's creations before siteverify.
	FailedChecksPerHour int64
	// InvalidRatio refuses a principal's creations while more than that
	// share of its requests of the last 10 minutes were invalid, once it
	// made InvalidMinRequests (0: off).
	InvalidRatio       float64
	InvalidMinRequests int64
	// StreamsPerPrincipal and StreamsMax bound concurrent event streams;
	// StreamMaxDuration is a stream's lifetime.
	StreamsPerPrincipal, StreamsMax int
	StreamMaxDuration               time.Duration
	// QueueMax bounds the tasks waiting or running (503 server_busy past it).
	QueueMax int64
	// RequestTimeout bounds how long a request other than an event stream
	// may wait inside the server (0: no bound). Set below the server's
	// write timeout, an overloaded replica answers 503 server_busy rather
	// than close the connection without an answer.
	RequestTimeout time.Duration
	// SummaryInterval is how often refusals are summarised in one log line.
	SummaryInterval time.Duration
}

// Deps is everything the server needs; each is a parameter so tests can
// pass fakes.
type Deps struct {
	Logger    *slog.Logger
	Visitors  *clientip.Resolver
	Verifier  Verifier
	Quota     Quota
	Limiter   Limiter
	Budget    Budget
	Policy    func() Policy
	PlanCache PlanCache
	// PlanCacheMode says when the cache answers: never, instead of a
	// budget or model refusal, or first.
	PlanCacheMode plancache.Mode
	// MinRunTokens is the reservation of a first model call: what the
	// principal must be able to afford for a task to be admitted; MinRunCost
	// the same in money micro-units (0: money is off).
	MinRunTokens, MinRunCost int64
	// MinRun, when set, is one minimal run of this request instead of the
	// fixed MinRunTokens and MinRunCost: with an external agent, the
	// estimated prompt of the visitor's request plus FAREGATE_LLM_MAX_TOKENS.
	MinRun func(task.Request) (tokens, costMicro int64)
	Models ModelHealth
	Tasks  Tasks
	Store  TaskStore
	Events Follower
	AITF   *aitf.Guard
	// AITFOptions, when AITF is nil, are the AITF guard's settings: the
	// server builds the guard itself, filling in its refusal, the
	// observe-mode count, the visitor key, the route label and the body
	// limit (aitfguard.go).
	AITFOptions *aitf.Options
	// Web serves the page at / (nil: no page); Client serves the typed
	// client module at /api/client.js and its types.
	Web, Client http.Handler
	// OpenAPI is the document served at /api/openapi.json.
	OpenAPI []byte
	// CORS wraps /api for other origins (nil: same origin only).
	CORS func(http.Handler) http.Handler
	// Ready probes the protection keys' Redis for /readyz.
	Ready    func(ctx context.Context) error
	Config   PublicConfig
	Limits   Limits
	Registry *prometheus.Registry
	// Metrics: serve /metrics on this handler's listener (false: elsewhere).
	Metrics bool
	Now     func() time.Time
	// Tracer starts the spans of /api requests and the gate's checks
	// (nil: tracing off, at no cost).
	Tracer trace.Tracer
	// V1 is the external agent's surface (nil: no /v1 routes).
	V1 *V1
	// Alert tells the operator (nil: nobody): invalid_ratio and
	// principal_throttled, raised by the gate.
	Alert func(alert.Alert)
	// WindowNow is the clock of the per-principal windows the Limiter
	// keeps, which the memory of their refusals must follow (nil: Now).
	WindowNow func() time.Time
}

// Server is the whole HTTP API as one handler, with the background work it
// needs (the refusal summary).
type Server struct {
	h http.Handler
	s *server
}

// server holds what the handlers share.
type server struct {
	d       Deps
	m       *metrics
	errors  *errorTable
	summary *summary
	streams *streamCaps
	memo    *denials
	// limited remembers window refusals (rate_limited) until a request
	// fits; inflight bounds each principal's window checks in flight.
	limited  *denials
	inflight *inflight
	ready    *readiness
	routes   routeNames
	// deps logs the state changes of Redis and siteverify.
	deps dependencies
	// routeCtxs holds scratch route contexts (routable).
	routeCtxs sync.Pool
}

// NewServer returns the HTTP API.
func NewServer(d Deps) *Server {
	if d.Now == nil {
		d.Now = time.Now
	}
	if d.Logger == nil {
		d.Logger = slog.New(slog.DiscardHandler)
	}
	if d.Ready == nil {
		d.Ready = func(context.Context) error { return nil }
	}
	if d.WindowNow == nil {
		d.WindowNow = d.Now
	}
	s := &server{
		d:        d,
		m:        newMetrics(d.Registry),
		errors:   newErrorTable(errorRows()),
		summary:  newSummary(),
		streams:  newStreamCaps(d.Limits.StreamsPerPrincipal, d.Limits.StreamsMax),
		memo:     newDenials(200_000, d.WindowNow),
		limited:  newDenials(200_000, d.WindowNow),
		inflight: newInflight(inflightPerPrincipal),
		ready:    &readiness{probe: d.Ready, now: d.Now},
		deps:     newDependencies(d.Limits.SummaryInterval, d.Now, d.Logger),
	}
	if d.AITF == nil && d.AITFOptions != nil {
		s.d.AITF = s.newAITF(*d.AITFOptions)
	}
	s.m.streams(d.Registry, s.streams)
	return &Server{h: s.router(), s: s}
}

// ServeHTTP implements http.Handler.
func (srv *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) { srv.h.ServeHTTP(w, r) }

// Run writes the refusal summary every interval until ctx ends.
func (srv *Server) Run(ctx context.Context) {
	srv.s.summary.run(ctx, srv.s.d.Logger, srv.s.d.Limits.SummaryInterval)
}

// Observed counts an AITF observe-mode verdict in the summary (the AITF
// guard's Observed callback), instead of a log line per request.
func (srv *Server) Observed(*http.Request, aitf.Result) { srv.s.summary.note("aitf_observed") }

// RefuseAITF answers 503 aitf_queue_full (the AITF guard's Refuse).
func (srv *Server) RefuseAITF(w http.ResponseWriter, r *http.Request, retryAfter time.Duration) {
	srv.s.refuseAITF(w, r, retryAfter)
}

// PrincipalScope names a request's principal for the AITF behaviour memory
// ("v:<hash>" or "k:<id>"; "" outside the API).
func PrincipalScope(r *http.Request) string {
	st := stateOf(r)
	if st == nil {
		return ""
	}
	if st.principal.Kind != "" {
		return st.principal.Scope()
	}
	return principal.Principal{Kind: principal.KindVisitor, ID: st.visitor.Key()}.Scope()
}

// RoutePattern is the chi route pattern of a routed request ("unmatched"
// before routing), a label that cannot grow with user input.
func RoutePattern(r *http.Request) string {
	if st := stateOf(r); st != nil && st.route != "" {
		return st.route
	}
	if rc := chi.RouteContext(r.Context()); rc != nil {
		if p := rc.RoutePattern(); p != "" {
			return p
		}
	}
	return "unmatched"
}
