package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"

	"faregate/agent"
	"faregate/agent/guide"
	"faregate/agent/offline"
	"faregate/agent/openai"
	"faregate/agent/outbound"
	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/agent/tools"
	"faregate/api"
	"faregate/protect/aitf"
	"faregate/protect/breaker"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/quota"
	"faregate/protect/turnstile"
	"faregate/web"
)

// version is stamped at build time (-ldflags "-X main.version=...").
var version = "dev"

// run is the whole program; main only wires it to the process. Tests call
// it directly on 127.0.0.1:0 and read the address from stdout.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) > 1 {
		switch args[1] {
		case "usage":
			return runUsage(ctx, args[2:], getenv, stdout)
		case "aitf":
			return runAITF(args[2:], stdout)
		case "serve":
		case "-h", "-help", "--help", "help":
			fmt.Fprintln(stdout, "usage: faregate [serve] | faregate usage [-day YYYY-MM-DD] | faregate aitf score [FILE]\nConfiguration is read from FAREGATE_* environment variables; see .env.example.")
			return nil
		default:
			return fmt.Errorf("unknown command %q (want serve, usage or aitf)", args[1])
		}
	}
	cfg, err := loadConfig(getenv)
	if err != nil {
		return err
	}
	lg := newLogger(cfg, stdout)
	app, err := build(ctx, cfg, lg, stdout)
	if err != nil {
		return err
	}
	defer app.close()
	return app.serve(ctx)
}

func newLogger(cfg *config, w io.Writer) *slog.Logger {
	var level slog.Level
	_ = level.UnmarshalText([]byte(cfg.LogLevel))
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler = slog.NewTextHandler(w, opts)
	if cfg.LogFormat == "json" {
		h = slog.NewJSONHandler(w, opts)
	}
	return slog.New(api.ContextLogHandler(h))
}

// app is a built server with what must be closed after it.
type app struct {
	cfg     *config
	lg      *slog.Logger
	stdout  io.Writer
	handler http.Handler
	runner  *agent.Runner
	closers []func()
}

func (a *app) close() {
	for i := len(a.closers) - 1; i >= 0; i-- {
		a.closers[i]()
	}
}

// build assembles every dependency from cfg.
func build(ctx context.Context, cfg *config, lg *slog.Logger, stdout io.Writer) (*app, error) {
	a := &app{cfg: cfg, lg: lg, stdout: stdout}
	defaults := cfg.embeddedDefaults()
	for _, d := range defaults {
		// Loud on purpose: a demo on embedded defaults protects nothing.
		fmt.Fprintf(stdout, "faregate: EMBEDDED DEFAULT (%s unset): %s\n", d.Variable, d.What)
	}

	rcs, closeRedis, err := openRedis(ctx, cfg, stdout)
	if err != nil {
		return nil, err
	}
	a.closers = append(a.closers, closeRedis)

	key := []byte(cfg.IPHashKey)
	if len(key) == 0 {
		key = clientip.RandomKey()
		fmt.Fprintln(stdout, "faregate: FAREGATE_IP_HASH_KEY unset: visitor keys use a random per-process key (replicas would disagree; set it for production)")
	}
	visitors := clientip.NewResolver(cfg.trusted, cfg.ClientIPHeader, key)

	var verifier api.Verifier = turnstile.TestVerifier{}
	if cfg.TurnstileSecret != "" {
		verifier = turnstile.NewClient(turnstile.Options{
			Secret: cfg.TurnstileSecret, VerifyURL: cfg.TurnstileVerifyURL, Hostnames: cfg.TurnstileHostnames,
			Timeout: cfg.TurnstileTimeout, Action: cfg.TurnstileAction,
		})
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	limits := quota.Limits{Visitor: cfg.IPDailyLimit, Global: cfg.GlobalDailyLimit}
	rdb := rcs.main
	q := quota.New(rcs.quota, limits, nil)
	bud := budget.New(rdb, budget.Options{
		Limits: budget.Limits{Site: cfg.DailyTokenBudget, Visitor: cfg.IPDailyTokens, Task: cfg.TaskTokenLimit},
		// A reservation outlives the longest call it can cover, then is given back.
		ReservationTTL: cfg.AgentTimeout + cfg.LLMTimeout + time.Minute,
		Registerer:     reg,
	})
	ledger := budget.NewLedger(rdb, nil)
	reg.MustRegister(ledger)

	models, err := buildModels(cfg, lg, reg)
	if err != nil {
		return nil, err
	}
	ix := guide.Default()
	toolbox := buildToolbox(cfg, ix, lg)
	wf := agent.NewWorkflow(agent.Config{
		MaxSteps: cfg.AgentMaxSteps, MaxToolCalls: cfg.AgentMaxToolCalls, Timeout: cfg.AgentTimeout,
		MaxTokens: cfg.LLMMaxTokens, LoopThreshold: cfg.LoopThreshold,
	}, models, bud, ledger, toolbox, lg)
	store := taskstore.New(rdb)
	a.runner = agent.NewRunner(store, wf, cfg.AgentConcurrency, lg, reg)

	mode, err := aitf.ParseMode(cfg.AITFMode)
	if err != nil {
		return nil, err
	}
	guard := aitf.New(aitf.Options{
		Mode: mode, Threshold: cfg.AITFThreshold, DegradeBacklog: cfg.AITFDegradeBacklog, MaxQueue: cfg.AITFMaxQueue,
		Debug: cfg.AITFDebug, MaxBody: api.MaxBody,
		VisitorKey: func(r *http.Request) string {
			if v, ok := clientip.FromContext(r.Context()); ok {
				return v.Key()
			}
			return ""
		},
		Route:  api.RoutePattern,
		Refuse: api.RefuseAITF,
		Logger: lg, Registerer: reg,
	})

	webHandler, err := web.Handler(web.Files(), web.Options{TurnstileScriptURL: cfg.TurnstileScriptURL})
	if err != nil {
		return nil, err
	}
	a.handler = api.NewServer(api.Deps{
		Logger: lg, Visitors: visitors, Verifier: verifier, Quota: q, Budget: bud,
		MinRunTokens: wf.MinRunTokens(), Models: models, Tasks: a.runner, Store: store, AITF: guard,
		Web: webHandler, Registry: reg, CSP: web.CSP(cfg.TurnstileScriptURL),
		Config: api.PublicConfig{
			TurnstileSiteKey: cfg.TurnstileSiteKey, TurnstileScriptURL: cfg.TurnstileScriptURL,
			TurnstileTest: cfg.TurnstileSecret == "", DevMode: len(defaults) > 0, Limits: limits,
		},
	})
	return a, nil
}

// redisClients are the two connections to the one Redis: main for
// everything, and quota, which never retries. go-redis retries a command
// after io.EOF; a quota script that ran but lost its reply would then count
// a task twice, so the counting script fails closed (503) instead.
type redisClients struct {
	main, quota redis.UniversalClient
}

// openRedis connects to FAREGATE_REDIS_URL, or starts the embedded miniredis.
func openRedis(ctx context.Context, cfg *config, stdout io.Writer) (redisClients, func(), error) {
	url := cfg.RedisURL
	cluster := cfg.RedisCluster
	var stopMini func()
	if url == "" {
		m := miniredis.NewMiniRedis()
		if err := m.Start(); err != nil {
			return redisClients{}, nil, fmt.Errorf("embedded redis: %w", err)
		}
		url, cluster, stopMini = "redis://"+m.Addr(), false, m.Close
	}
	var c redisClients
	var err error
	if c.main, err = newRedis(url, cluster, 3); err != nil {
		return c, nil, err
	}
	if c.quota, err = newRedis(url, cluster, -1); err != nil {
		return c, nil, err
	}
	closeAll := func() {
		_ = c.main.Close()
		_ = c.quota.Close()
		if stopMini != nil {
			stopMini()
		}
	}
	if stopMini != nil {
		return c, closeAll, nil
	}
	// Not fatal: faregate starts and fails closed (503) until Redis answers,
	// and /readyz says so.
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := c.main.Ping(pctx).Err(); err != nil {
		fmt.Fprintf(stdout, "faregate: redis not answering yet (%v); refusing tasks with 503 until it does\n", redactURLError(err))
	}
	return c, closeAll, nil
}

// newRedis builds a client for a redis:// or rediss:// URL (a Cluster
// with cluster set; further nodes as ?addr=host:port). Short timeouts make a
// hung Redis a quick 503 rather than a hung request. retries is go-redis's
// MaxRetries (-1: none).
func newRedis(url string, cluster bool, retries int) (redis.UniversalClient, error) {
	const timeout = 2 * time.Second
	if cluster {
		opt, err := redis.ParseClusterURL(url)
		if err != nil {
			return nil, fmt.Errorf("FAREGATE_REDIS_URL: %w", err)
		}
		opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout, opt.PoolTimeout = timeout, timeout, timeout, timeout+time.Second
		opt.MaxRetries = retries
		return redis.NewClusterClient(opt), nil
	}
	opt, err := redis.ParseURL(url)
	if err != nil {
		return nil, fmt.Errorf("FAREGATE_REDIS_URL: %w", err)
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout, opt.PoolTimeout = timeout, timeout, timeout, timeout+time.Second
	opt.MaxRetries = retries
	return redis.NewClient(opt), nil
}

// redactURLError keeps credentials that a URL error might quote out of logs.
func redactURLError(err error) string {
	s := err.Error()
	if i := strings.Index(s, "@"); i >= 0 {
		if j := strings.LastIndex(s[:i], "//"); j >= 0 {
			s = s[:j+2] + "***" + s[i:]
		}
	}
	return s
}

// buildModels returns the primary model (an OpenAI-compatible server or the
// offline demo planner), its breaker and the fallback.
func buildModels(cfg *config, lg *slog.Logger, reg prometheus.Registerer) (*agent.Models, error) {
	httpClient := &http.Client{Timeout: cfg.LLMTimeout}
	var ms agent.Models
	if cfg.LLMBaseURL == "" {
		ms.Primary = agent.Model{Model: offline.New(), Name: offline.ModelName, Offline: true}
	} else {
		m, err := openai.New(openai.Options{BaseURL: cfg.LLMBaseURL, APIKey: cfg.LLMAPIKey, Model: cfg.LLMModel,
			LegacyMaxTokens: cfg.LLMLegacyMaxTokens, HTTPClient: httpClient})
		if err != nil {
			return nil, err
		}
		ms.Primary = agent.Model{Model: m, Name: m.Name()}
		ms.Breaker = breaker.New(breaker.Settings{
			Name: "primary", Window: cfg.BreakerWindow, MinCalls: cfg.BreakerMinCalls,
			FailureRatio: cfg.BreakerFailureRatio, SlowRatio: cfg.BreakerSlowRatio, SlowCall: cfg.BreakerSlowCall,
			OpenFor: cfg.BreakerOpenFor, HalfOpenProbes: cfg.BreakerHalfOpenProbes,
		}, lg, reg)
	}
	if cfg.FallbackBaseURL != "" {
		fb, err := openai.New(openai.Options{BaseURL: cfg.FallbackBaseURL, APIKey: cfg.FallbackAPIKey,
			Model: cfg.FallbackModel, LegacyMaxTokens: cfg.LLMLegacyMaxTokens, HTTPClient: httpClient})
		if err != nil {
			return nil, err
		}
		ms.Fallback = &agent.Model{Model: fb, Name: fb.Name()}
	}
	return &ms, nil
}

// buildToolbox returns the per-task tool factory. Two process-wide
// transports hold the per-host limits: one for the fixed APIs (weather,
// geocoding, search) and one that refuses non-public addresses for
// fetch_page. Each task gets its own sessions: its own cache and dedup.
func buildToolbox(cfg *config, ix *guide.Index, lg *slog.Logger) agent.Toolbox {
	apis := outbound.New(outbound.Options{Version: version, PublicURL: cfg.PublicURL, Logger: lg})
	pages := outbound.New(outbound.Options{Version: version, PublicURL: cfg.PublicURL, Logger: lg,
		Base: tools.SafeTransport(tools.Policy{})})
	tcfg := tools.Config{WeatherURL: cfg.WeatherURL, GeocodingURL: cfg.GeocodingURL, SearchURL: cfg.SearchURL, Guide: ix}
	return func(rec *task.Record, warn func(code, detail string)) []tools.Tool {
		so := outbound.SessionOptions{Score: rec.AITF.Score, HasScore: rec.AITF.Score > 0, Warn: warn}
		return tools.All(apis.Session(so).Client(), pages.Session(so).Client(), tcfg)
	}
}

// serve listens, prints the address and serves until ctx ends, then shuts
// down gracefully: stop accepting, let running tasks finish within the
// shutdown timeout, mark the rest failed.
func (a *app) serve(ctx context.Context) error {
	ln, err := net.Listen("tcp", a.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", a.cfg.Addr, err)
	}
	// Requests (long SSE streams above all) end when base is cancelled,
	// after running tasks had their grace period.
	base, cancelBase := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBase()
	srv := &http.Server{
		BaseContext:       func(net.Listener) context.Context { return base },
		Handler:           a.handler,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       15 * time.Second,
		WriteTimeout:      30 * time.Second, // the SSE handler lifts it for its stream
		IdleTimeout:       90 * time.Second,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(a.lg.Handler(), slog.LevelWarn),
	}
	fmt.Fprintf(a.stdout, "faregate: listening on http://%s\n", ln.Addr())
	a.lg.Info("serving", "addr", ln.Addr().String(), "version", version)

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	a.lg.Info("shutting down", "grace", a.cfg.ShutdownTimeout.String())
	sctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
	defer cancel()
	// Stop accepting at once; in-flight requests finish meanwhile.
	shut := make(chan error, 1)
	go func() { shut <- srv.Shutdown(sctx) }()
	if err := a.runner.Shutdown(sctx); err != nil {
		a.lg.Warn("tasks still running at the end of the grace period were marked failed")
	}
	// Tasks are final now; followers of other replicas' tasks reconnect elsewhere.
	cancelBase()
	if err := <-shut; err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	_ = srv.Close()
	return nil
}
