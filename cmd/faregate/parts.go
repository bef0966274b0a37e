package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"time"

	"github.com/go-chi/cors"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/trace"

	"faregate/agent"
	"faregate/agent/alert"
	"faregate/agent/govern"
	"faregate/agent/guide"
	"faregate/agent/plancache"
	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/api"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/policy"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
	"faregate/protect/turnstile"
	"faregate/web"
)

// The parts build assembles, in the order it makes them. Each constructor
// takes the parts it needs and returns a small struct of what it made;
// those that hold something open return its close as well.

// storage is Redis (its pools) and the visitor keys derived from it.
type storage struct {
	redis    *redisClients
	visitors *clientip.Resolver
	close    func()
}

func newStorage(ctx context.Context, cfg *config, stdout io.Writer) (*storage, error) {
	rcs, closeRedis, err := openRedis(ctx, cfg, stdout)
	if err != nil {
		return nil, err
	}
	key := []byte(cfg.IPHashKey)
	if len(key) == 0 {
		key = clientip.RandomKey()
		fmt.Fprintln(stdout, "faregate: FAREGATE_IP_HASH_KEY unset: visitor keys use a random per-process key (replicas would disagree; set it for production)")
	}
	return &storage{redis: rcs, visitors: clientip.NewResolver(cfg.trusted, cfg.ClientIPHeader, key), close: closeRedis}, nil
}

// operations is what the operator watches: the metrics registry and the
// alert webhook.
type operations struct {
	registry *prometheus.Registry
	alerts   *alert.Notifier
	close    func()
	// windows is the clock of the per-principal windows (windowclock.go).
	windows func() time.Time
}

func newOperations(cfg *config, lg *slog.Logger, st *storage) *operations {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		buildInfo(), poolStats(st.redis))
	alerts := alert.New(alert.Options{URL: cfg.AlertWebhookURL, Secret: cfg.AlertWebhookSecret,
		Dedupe: alert.RedisDeduper(st.redis.main), Logger: lg, Registerer: reg})
	return &operations{registry: reg, alerts: alerts, close: alerts.Close}
}

// spending is the models and everything that meters what they cost: the
// task quota, the token and money budget, the ledger, the rate limiter,
// the workflow that makes the calls, and the size of one minimal run.
type spending struct {
	models   *govern.Models
	quota    *quota.Quota
	budget   *budget.Budget
	ledger   *budget.Ledger
	limiter  *ratelimit.Limiter
	workflow *agent.Workflow
	minimal  minRun
}

func newSpending(cfg *config, lg *slog.Logger, tp trace.TracerProvider, st *storage, ops *operations) (*spending, error) {
	models, err := buildModels(cfg, lg, ops.registry, ops.alerts.Notify)
	if err != nil {
		return nil, err
	}
	rdb := st.redis.main
	sp := &spending{models: models, quota: quota.New(rdb, nil).Pipelined(st.redis.admissions)}
	// The ledger's shape (export groups, FAREGATE_LEDGER_MAX_ENTRIES) goes
	// into every settle's entry, its events to the operator's alerts.
	sp.ledger = budget.OpenLedger(rdb, budget.LedgerOptions{MaxEntries: cfg.LedgerMaxEntries,
		Watch: ledgerAlerts(ops.alerts.Notify), Registerer: ops.registry})
	// Priced from FAREGATE_MODEL_PRICES until the policy is loaded
	// (newPolicies), which sets the policy file's prices over them, at
	// start and on every reload.
	sp.budget = budget.New(rdb, budget.Options{
		Limits: budget.Limits{Site: cfg.DailyTokenBudget, Principal: cfg.IPDailyTokens, Task: cfg.TaskTokenLimit, SpendMicro: cfg.spendMicro},
		Prices: cfg.prices,
		// A reservation outlives the longest call it can cover, then is given back.
		ReservationTTL: cfg.AgentTimeout + cfg.LLMTimeout + time.Minute,
		MaxCallTokens:  cfg.LLMMaxCallTokens,
		Lease:          budget.LeaseOptions{Calls: cfg.BudgetLeaseCalls},
		Registerer:     ops.registry,
		Ledger:         sp.ledger,
	})
	ops.registry.MustRegister(sp.ledger)
	sp.limiter = ratelimit.New(rdb, ratelimit.Options{Registerer: ops.registry, Now: ops.windows})
	sp.workflow = agent.NewWorkflow(agent.Config{
		MaxSteps: cfg.AgentMaxSteps, MaxToolCalls: cfg.AgentMaxToolCalls, Timeout: cfg.AgentTimeout,
		MaxTokens: cfg.LLMMaxTokens, LoopThreshold: cfg.LoopThreshold,
		TokenWait: cfg.TokenWait, SiteTokensPerMinute: cfg.SiteTokensPerMinute, SitePaceWait: cfg.SitePaceWait,
		SettleTimeout: settleTimeout(cfg.RedisTimeout),
	}, agent.Deps{
		Models: models, Budget: sp.budget, Ledger: sp.ledger, Tools: buildToolbox(cfg, guide.Default(), lg), Limiter: sp.limiter,
		Alert: ops.alerts.Notify, Logger: lg, Estimate: estimator(models), Registerer: ops.registry,
		Tracer: tracerFor(tp, "faregate/agent"),
	})
	minTokens := sp.workflow.MinRunTokens()
	if ext := externalMinRun(cfg, sp.budget, models); ext != nil {
		// An external agent's first call is the visitor's prompt (at its
		// shortest, one character) plus FAREGATE_LLM_MAX_TOKENS: a budget
		// that cannot hold that can never admit a task.
		minTokens, _ = ext(task.Request{Prompt: "x"})
	}
	sp.minimal = newMinRun(models, minTokens, cfg.LLMMaxTokens)
	sp.minimal.external = cfg.AgentURL != ""
	return sp, nil
}

// newPolicies loads the policy (the file, or the public tier from the
// environment), refusing one with a tier that can never hold a minimal
// run, and puts its prices on the budget, at start and on every reload.
// The environment's budgets are checked against the minimal run here too,
// so every problem of the kind is reported at once.
func newPolicies(cfg *config, lg *slog.Logger, hup <-chan struct{}, ops *operations, sp *spending) (*policy.Store, error) {
	tooSmall := sp.minimal.checkEnv(cfg)
	public := principal.Tier{Name: principal.PublicTier, TasksPerDay: cfg.IPDailyLimit, TokensPerDay: cfg.IPDailyTokens,
		RequestsPerMinute: cfg.RequestsPerMinute, RequestsPerSecond: cfg.RequestsPerSecond, MaxSiteShare: 1,
		TokensPerHour: cfg.IPHourlyTokens, SoftAt: cfg.SoftAt, SoftRequestsPerMinute: cfg.SoftRequestsPerMinute}
	store, err := policy.NewStore(policy.Options{
		Path: cfg.PolicyFile, Defaults: public, Reload: hup, Logger: lg, Registerer: ops.registry,
		Check: func(p *policy.Policy) error { return sp.minimal.checkPolicy(cfg, p) },
		// The file's prices are in force for the next call after a reload.
		OnChange: func(_, p *policy.Policy) { sp.budget.SetPrices(mergedPrices(cfg.prices, p)) },
		OnError: func(err error) {
			ops.alerts.Notify(alert.Alert{Event: alert.PolicyReloadFailed, Scope: "policy", Severity: alert.Warning,
				Text: "The policy file could not be reloaded; the last good policy stays in force: " + err.Error()})
		},
	})
	if err != nil && cfg.PolicyFile != "" {
		err = fmt.Errorf("FAREGATE_POLICY_FILE: %w", err)
	}
	if err := errors.Join(tooSmall, err); err != nil {
		return nil, err
	}
	sp.budget.SetPrices(mergedPrices(cfg.prices, store.Current()))
	return store, nil
}

// runs is what holds and runs admitted tasks: the task store, the event
// hub followers read from, the plan cache and the runner.
type runs struct {
	store  *taskstore.Store
	hub    *taskstore.Hub
	cache  *plancache.Cache
	runner *agent.Runner
}

// exec runs each task: the built-in workflow, or the external agent's
// executor (remote.go).
func newRuns(cfg *config, lg *slog.Logger, tp trace.TracerProvider, st *storage, ops *operations, sp *spending, exec agent.Executor) *runs {
	rcs, reg := st.redis, ops.registry
	// The workers' blocking wait for the next task holds a connection of
	// the queue's pool, never one of the gate's.
	rn := &runs{store: taskstore.New(rcs.main).WithWaits(rcs.queue)}
	// Followers read the task's record through the readers' pool as well:
	// a thousand followers arriving at once must not queue on the gate's.
	rn.hub = taskstore.NewHub(taskstore.New(rcs.streams), rcs.streams, taskstore.HubOptions{Logger: lg, Registerer: reg})
	rn.cache = plancache.New(rcs.main, plancache.Options{TTL: cfg.PlanCacheTTL, Registerer: reg})
	bud := sp.budget
	rn.runner = agent.NewRunner(rn.store, exec, agent.RunnerOptions{
		Concurrency: cfg.AgentConcurrency, Lease: cfg.TaskLease, Timeout: cfg.AgentTimeout,
		Release: func(ctx context.Context, rec task.Record) error {
			_, err := bud.ReleaseTask(ctx, rec.Day, rec.Principal, rec.ID)
			return err
		},
		Succeeded: cachePlans(rn.cache, cfg.cacheMode, lg),
		Logger:    lg, Registerer: reg,
		Tracer: tracerFor(tp, "faregate/agent"),
	})
	return rn
}

// newFront is the HTTP API and page in front of the other parts: the
// Turnstile verifier, the AITF guard (built by the server itself, so the
// two need no closure over a variable assigned later), CORS and the
// readiness probe.
func newFront(cfg *config, lg *slog.Logger, stdout io.Writer, tp trace.TracerProvider,
	st *storage, ops *operations, sp *spending, pol *policy.Store, rn *runs, v1 *api.V1) (*api.Server, error) {
	var verifier api.Verifier = turnstile.TestVerifier{}
	if cfg.TurnstileSecret != "" {
		verifier = turnstile.NewClient(turnstile.Options{
			Secret: cfg.TurnstileSecret, VerifyURL: cfg.TurnstileVerifyURL, Hostnames: cfg.TurnstileHostnames,
			Timeout: cfg.TurnstileTimeout, Action: cfg.TurnstileAction,
		})
	}
	mode, err := aitf.ParseMode(cfg.AITFMode)
	if err != nil {
		return nil, err
	}
	notify := ops.alerts.Notify
	aitfOptions := &aitf.Options{
		Mode: mode, Threshold: cfg.AITFThreshold, DegradeBacklog: cfg.AITFDegradeBacklog, MaxQueue: cfg.AITFMaxQueue,
		Debug: cfg.AITFDebug,
		ToolCallLoop: func(ctx context.Context, id string, n int) {
			notify(alert.Alert{Event: alert.ToolCallLoop, Scope: "tool_call:" + clip(id, 64), Severity: alert.Warning,
				Text:    fmt.Sprintf("One tool_call_id was queued %d times in 10 minutes: an agent loop is calling the API.", n),
				Details: map[string]any{"tool_call_id": clip(id, 64), "count": n}})
		},
		Logger: lg, Registerer: ops.registry,
	}
	webHandler, err := web.Handler(web.Files(), web.Options{TurnstileScriptURL: cfg.TurnstileScriptURL})
	if err != nil {
		return nil, err
	}
	var corsMW func(http.Handler) http.Handler
	if len(cfg.CORSOrigins) > 0 {
		corsMW = cors.Handler(cors.Options{
			AllowedOrigins:   cfg.CORSOrigins,
			AllowedMethods:   []string{http.MethodGet, http.MethodPost, http.MethodOptions},
			AllowedHeaders:   []string{"Authorization", "Content-Type", "Last-Event-ID"},
			ExposedHeaders:   []string{"Retry-After", "RateLimit", "RateLimit-Policy", "X-Request-Id", "Location"},
			AllowCredentials: false,
			MaxAge:           600,
		})
	}
	prober := &prober{rdb: st.redis.main, now: time.Now, warn: func(msg string) { fmt.Fprintln(stdout, msg); lg.Error(msg) }}
	minimal, bud := sp.minimal, sp.budget
	// With the built-in planner a minimal run is fixed and priced at each
	// request (prices follow reloads); with an external agent it is the
	// request's own, priced when it is measured.
	minRunOf := externalMinRun(cfg, bud, sp.models)
	var runCost func() int64
	if minRunOf == nil {
		runCost = func() int64 { return minimal.costAt(bud) }
	}
	return api.NewServer(api.Deps{
		Logger: lg, Visitors: st.visitors, Verifier: verifier, Quota: sp.quota, Limiter: sp.limiter,
		Budget:    admissionBudget{Budget: bud, notify: notify, runCost: runCost},
		Policy:    func() api.Policy { return policyView{pol.Current()} },
		PlanCache: rn.cache, PlanCacheMode: cfg.cacheMode,
		MinRunTokens: minimal.tokens, MinRunCost: minimal.costAt(bud), MinRun: minRunOf,
		Models: sp.models, Tasks: rn.runner, Store: rn.store, Events: rn.hub, AITFOptions: aitfOptions,
		Web: webHandler, Client: web.Client(), OpenAPI: api.OpenAPIDocument(), CORS: corsMW,
		Ready: prober.probe,
		Config: api.PublicConfig{
			TurnstileSiteKey: cfg.TurnstileSiteKey, TurnstileScriptURL: cfg.TurnstileScriptURL,
			TurnstileTest: cfg.TurnstileSecret == "", DevMode: len(cfg.embeddedDefaults()) > 0,
			Input: cfg.TaskInput, PromptMaxChars: cfg.PromptMaxChars,
		},
		Limits: api.Limits{
			GlobalDailyTasks: cfg.GlobalDailyLimit, SiteDailyTokens: cfg.DailyTokenBudget, DailySpendMicro: cfg.spendMicro,
			FailedChecksPerHour: cfg.FailedChecksPerHour, InvalidRatio: cfg.InvalidRatio, InvalidMinRequests: cfg.InvalidMinRequests,
			StreamsPerPrincipal: cfg.StreamsPerVisitor, StreamsMax: cfg.StreamsMax, StreamMaxDuration: cfg.StreamMaxDuration,
			QueueMax: cfg.QueueMax, SummaryInterval: cfg.LogSummaryInterval,
			RequestTimeout: requestTimeout,
		},
		Registry: ops.registry, Metrics: cfg.MetricsAddr == "",
		V1:        v1,
		Tracer:    tracerFor(tp, "faregate/api"),
		Alert:     notify,
		WindowNow: ops.windows,
	}), nil
}

// settleTimeout is how long a call's settle may keep trying: the budget's
// three attempts, each allowed a pooled connection (FAREGATE_REDIS_TIMEOUT
// + 1 s) and an answer (FAREGATE_REDIS_TIMEOUT), and at least the agent's
// default. A settle that gave up sooner would leave its reservation to
// expire and give back tokens the provider billed: on a loaded machine
// with FAREGATE_REDIS_TIMEOUT=20s, 45 of 115 settles of the exactness
// test gave up at a fixed 5 s.
func settleTimeout(redis time.Duration) time.Duration {
	return max(govern.DefaultSettleTimeout, 3*(2*redis+time.Second))
}
