package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"faregate/agent"
	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/plancache"
	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/agent/tokens"
	"faregate/api"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/connlimit"
	"faregate/protect/policy"
	"faregate/protect/principal"
)

// usageText is the help text.
const usageText = `usage:
  faregate [serve]                                   serve the page and the API (configuration: FAREGATE_* variables, see .env.example)
  faregate usage [-day YYYY-MM-DD] [-by model|principal] [-format table|csv]
  faregate ledger export [-group billing] [-day YYYY-MM-DD] [-follow]
                                                     the ledger's unexported entries as JSON Lines, acknowledged once written
  faregate aitf score [FILE]                         score captured bodies or sessions (JSON or NDJSON)
  faregate keys new -id ID -tier TIER                a new API key and its policy line
  faregate health [ADDR]                             exit 0 when /healthz answers (container HEALTHCHECK)
  faregate version                                   the version and Go toolchain`

// writeTimeout bounds writing an answer (event streams lift it), and
// requestTimeout how long a request may wait inside the server before it
// is answered 503 server_busy: enough below writeTimeout that the answer
// is written before the connection is cut.
const (
	writeTimeout   = 30 * time.Second
	requestTimeout = writeTimeout - 5*time.Second
)

// run is the whole program; main only wires it to the process. Tests call
// it directly on 127.0.0.1:0 and read the address from stdout.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) > 1 {
		switch args[1] {
		case "usage":
			return runUsage(ctx, args[2:], getenv, stdout)
		case "ledger":
			return runLedger(ctx, args[2:], getenv, stdout)
		case "aitf":
			return runAITF(args[2:], stdout)
		case "keys":
			return runKeys(args[2:], stdout)
		case "health":
			return runHealth(ctx, args[2:], getenv, stdout)
		case "version", "-version", "--version":
			return runVersion(stdout)
		case "serve":
		case "-h", "-help", "--help", "help":
			fmt.Fprintln(stdout, usageText)
			return nil
		default:
			return fmt.Errorf("unknown command %q (want serve, usage, ledger, aitf, keys, health or version)", args[1])
		}
	}
	cfg, err := loadConfig(getenv)
	if err != nil {
		return err
	}
	lg := newLogger(cfg, stdout)
	tp, shutdownTracing, err := setupTracing(ctx, getenv)
	if err != nil {
		return err
	}
	defer stopTracing(shutdownTracing, lg) // after the app: its last spans are flushed
	app, err := build(ctx, cfg, lg, stdout, tp)
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
	cfg      *config
	lg       *slog.Logger
	stdout   io.Writer
	server   *api.Server
	registry *prometheus.Registry
	runner   *agent.Runner
	hub      *taskstore.Hub
	policies *policy.Store
	alerts   *alert.Notifier
	ledger   *budget.Ledger
	// billing exports the ledger to FAREGATE_BILLING_URL (nil: unset).
	billing *billingFeed
	hup     chan struct{}
	closers []func()
	// callback is set once faregate listens (external agent only).
	callback *callbackURL
}

func (a *app) close() {
	for i := len(a.closers) - 1; i >= 0; i-- {
		a.closers[i]()
	}
}

// build assembles the server from its parts (parts.go), each made from
// the ones before it: storage, operations, spending, policies, runs and
// the HTTP front. A part that holds something open returns its close,
// run in reverse order by app.close.
func build(ctx context.Context, cfg *config, lg *slog.Logger, stdout io.Writer, tp trace.TracerProvider) (_ *app, err error) {
	a := &app{cfg: cfg, lg: lg, stdout: stdout, hup: make(chan struct{}, 1)}
	defer func() {
		if err != nil {
			a.close() // what was opened before the failure (Redis, the embedded server)
		}
	}()
	for _, d := range cfg.embeddedDefaults() {
		// Loud on purpose: a demo on embedded defaults protects nothing.
		fmt.Fprintf(stdout, "faregate: EMBEDDED DEFAULT (%s unset): %s\n", d.Variable, d.What)
	}
	if cfg.AgentURL != "" {
		fmt.Fprintf(stdout, "faregate: FAREGATE_AGENT_URL set: an external agent answers (%s form); the plan cache is off, whatever FAREGATE_PLAN_CACHE says (its answers are never shared between visitors)\n", cfg.TaskInput)
	}
	quietRedisLog(lg)
	quietTracingErrors(lg)

	st, err := newStorage(ctx, cfg, stdout)
	if err != nil {
		return nil, err
	}
	a.closers = append(a.closers, st.close)
	ops := newOperations(cfg, lg, st)
	ops.windows = windowClock(ctx)
	a.closers = append(a.closers, ops.close)
	sp, err := newSpending(cfg, lg, tp, st, ops)
	if err != nil {
		return nil, err
	}
	// Before Redis closes: the budget's leased blocks go back, with what
	// this replica's calls spent (else they are charged when they expire).
	a.closers = append(a.closers, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := sp.budget.Close(ctx); err != nil {
			lg.Warn("budget leases not given back; they are charged what they hold when they expire", "err", err)
		}
	})
	pol, err := newPolicies(cfg, lg, a.hup, ops, sp)
	if err != nil {
		return nil, err
	}
	// With FAREGATE_AGENT_URL the operator's agent runs each task (remote.go).
	ext := buildExternalAgent(cfg, st.redis.main, st.redis.queue, sp.models, lg)
	rn := newRuns(cfg, lg, tp, st, ops, sp, ext.executor(sp.workflow))
	ext.mountModels(cfg, lg, sp, rn)
	srv, err := newFront(cfg, lg, stdout, tp, st, ops, sp, pol, rn, ext.surface())
	if err != nil {
		return nil, err
	}
	// A reload that raises a limit clears the denials it made wrong.
	pol.Subscribe(func(old, p *policy.Policy) {
		srv.ForgetDenials(slices.Contains(p.RaisedTiers(old), principal.PublicTier), p.RaisedKeys(old))
	})
	a.server, a.registry, a.alerts, a.policies, a.runner, a.hub = srv, ops.registry, ops.alerts, pol, rn.runner, rn.hub
	a.ledger, a.billing = sp.ledger, newBillingFeed(cfg, lg, sp.ledger, rn.runner.Consumer())
	a.callback = ext.callbackURL()
	return a, nil
}

// estimator counts a call's prompt with the model's own tokenizer when its
// encoding is known, else with a conservative bound. Encodings load at
// start-up, so the first call does not pay for it.
func estimator(models *govern.Models) func(string, []chat.Message, []chat.ToolDef) int64 {
	counters := map[string]tokens.Counter{models.Primary.Name: tokens.ForModel(models.Primary.Name)}
	if models.Fallback != nil {
		counters[models.Fallback.Name] = tokens.ForModel(models.Fallback.Name)
	}
	return func(model string, msgs []chat.Message, defs []chat.ToolDef) int64 {
		c, ok := counters[model]
		if !ok {
			c = tokens.ForModel(model)
		}
		tm := make([]tokens.Message, len(msgs))
		for i, m := range msgs {
			tm[i] = tokens.Message{Role: string(m.Role), Name: m.Name, Content: m.Content}
			for _, tc := range m.ToolCalls {
				tm[i].ToolCalls = append(tm[i].ToolCalls, tokens.ToolCall{Name: tc.Name, Arguments: tc.Arguments})
			}
		}
		var toolsJSON string
		if len(defs) > 0 {
			raw, _ := json.Marshal(openaiTools(defs))
			toolsJSON = string(raw)
		}
		return c.Chat(tm, toolsJSON)
	}
}

// openaiTools is the "tools" array of a chat completion request, the form
// the tokenizer renders tool definitions from.
func openaiTools(defs []chat.ToolDef) []map[string]any {
	out := make([]map[string]any, len(defs))
	for i, d := range defs {
		out[i] = map[string]any{"type": "function", "function": map[string]any{
			"name": d.Name, "description": d.Description, "parameters": d.Parameters}}
	}
	return out
}

// cachePlans stores every succeeded plan without warnings for the plan
// cache (unless it is off); plans served from the cache are not stored again.
func cachePlans(c *plancache.Cache, mode plancache.Mode, lg *slog.Logger) func(context.Context, task.Record) {
	if mode == plancache.ModeOff {
		return nil
	}
	return func(ctx context.Context, rec task.Record) {
		if rec.Result == nil || rec.Result.Cached || len(rec.Warnings) > 0 || len(rec.Result.Warnings) > 0 {
			return
		}
		raw, err := json.Marshal(rec.Result)
		if err != nil {
			return
		}
		req := plancache.Request{Destination: rec.Request.Destination, Days: rec.Request.Days,
			Interests: rec.Request.Interests, Language: rec.Request.Lang()}
		if err := c.Put(ctx, req, plancache.Plan{Result: raw, Model: rec.Result.Model}); err != nil && !errors.Is(err, plancache.ErrNotCacheable) {
			lg.Warn("plan not cached", "task", rec.ID, "err", err.Error())
		}
	}
}

func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// buildInfo is faregate_build_info{version,goversion} 1.
func buildInfo() prometheus.Collector {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "faregate_build_info", Help: "A constant 1, labelled with the running version.",
	}, []string{"version", "goversion"})
	gover := "unknown"
	if v := strings.TrimSpace(goVersion()); v != "" {
		gover = v
	}
	g.WithLabelValues(versionString(), gover).Set(1)
	return g
}

// redisLogOnce installs the rate-limited go-redis logger once per process:
// go-redis's logger is its own global.
var redisLogOnce sync.Once

// quietRedisLog routes go-redis's own messages ("failed to dial" while
// Redis is down) through slog, at most one line per 10 s: a Redis outage
// under load must not fill the disk.
func quietRedisLog(lg *slog.Logger) {
	redisLogOnce.Do(func() { redis.SetLogger(&limitedLog{lg: lg, every: 10 * time.Second}) })
}

// limitedLog writes at most one line per interval and counts the rest.
type limitedLog struct {
	lg    *slog.Logger
	every time.Duration

	mu         sync.Mutex
	last       time.Time
	suppressed int
}

func (l *limitedLog) Printf(_ context.Context, format string, v ...any) {
	l.write(fmt.Sprintf(format, v...))
}

// Write lets it serve as http.Server's ErrorLog writer too.
func (l *limitedLog) Write(p []byte) (int, error) {
	l.write(strings.TrimSpace(string(p)))
	return len(p), nil
}

func (l *limitedLog) write(msg string) {
	l.mu.Lock()
	now := time.Now()
	if now.Sub(l.last) < l.every {
		l.suppressed++
		l.mu.Unlock()
		return
	}
	n := l.suppressed
	l.last, l.suppressed = now, 0
	l.mu.Unlock()
	l.lg.Warn(redactURL(msg), "suppressed_before", n)
}

// redactURL keeps credentials that a URL in a message might carry out of logs.
func redactURL(s string) string { return redactURLError(errors.New(s)) }

// serve listens, prints the address and serves until ctx ends, then shuts
// down gracefully (see shutdown).
func (a *app) serve(ctx context.Context) error {
	ln, err := net.Listen("tcp", a.cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen %s: %w", a.cfg.Addr, err)
	}
	// Before any task is taken: deliveries name it.
	if a.callback != nil && a.callback.get() == "" {
		a.callback.set(a.cfg.agentCallback(ln.Addr()))
	}
	lim := connlimit.Wrap(ln, connlimit.Options{Max: maxConnections(a.cfg.MaxConnections), PerPeer: a.cfg.ConnectionsPerPeer,
		Exempt: clientip.NewResolver(a.cfg.trusted, "", nil).TrustedAddr, Registerer: a.registry})
	// Requests (long SSE streams above all) end when base is cancelled,
	// after running tasks had their grace period and their followers their
	// final events.
	base, cancelBase := context.WithCancel(context.WithoutCancel(ctx))
	defer cancelBase()
	srv := &http.Server{
		BaseContext: func(net.Listener) context.Context { return base },
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			return api.ConnContext(lim.ConnContext(ctx, c), c)
		},
		Handler:           a.server,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       15 * time.Second,
		WriteTimeout:      writeTimeout, // the SSE handler lifts it for its stream
		IdleTimeout:       a.cfg.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          logLogger(&limitedLog{lg: a.lg, every: 10 * time.Second}),
	}
	var metrics *http.Server
	if a.cfg.MetricsAddr != "" {
		mln, err := net.Listen("tcp", a.cfg.MetricsAddr)
		if err != nil {
			return fmt.Errorf("listen %s (FAREGATE_METRICS_ADDR): %w", a.cfg.MetricsAddr, err)
		}
		metrics = &http.Server{Handler: promhttp.HandlerFor(a.registry, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = metrics.Serve(mln) }()
		fmt.Fprintf(a.stdout, "faregate: metrics on http://%s/metrics\n", mln.Addr())
	}

	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	var wg sync.WaitGroup
	for _, f := range []func(context.Context){
		func(ctx context.Context) { a.server.Run(ctx) },
		func(ctx context.Context) { _ = a.policies.Run(ctx) },
		func(ctx context.Context) { _ = a.alerts.Run(ctx) },
		a.ledger.Run,
		a.forwardSIGHUP,
	} {
		wg.Add(1)
		go func() { defer wg.Done(); f(bg) }()
	}
	if a.billing != nil {
		wg.Add(1)
		go func() { defer wg.Done(); a.billing.Run(bg) }()
	}
	if err := a.runner.Start(ctx); err != nil {
		return err
	}

	fmt.Fprintf(a.stdout, "faregate: listening on http://%s\n", ln.Addr())
	a.lg.Info("serving", "addr", ln.Addr().String(), "version", versionString(), "consumer", a.runner.Consumer())

	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(lim) }()
	var serveErr error
	select {
	case serveErr = <-errc:
	case <-ctx.Done():
	}
	a.shutdown(srv, cancelBase)
	if metrics != nil {
		_ = metrics.Close()
	}
	stopBG()
	wg.Wait()
	return serveErr
}

// shutdown stops the server in the order that loses nothing:
//  1. stop accepting (in-flight requests and streams go on);
//  2. give running tasks the grace period, then fail the rest (their final
//     events are written);
//  3. hand every follower its task's final events, and close the streams of
//     tasks that run elsewhere (the client resumes on another replica);
//  4. wait for the handlers to return, then close what is left.
func (a *app) shutdown(srv *http.Server, cancelBase context.CancelFunc) {
	a.lg.Info("shutting down", "grace", a.cfg.ShutdownTimeout.String())
	sctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
	defer cancel()
	shut := make(chan error, 1)
	go func() { shut <- srv.Shutdown(context.Background()) }()
	if err := a.runner.Shutdown(sctx); err != nil {
		a.lg.Warn("tasks still running at the end of the grace period were marked failed")
	}
	hctx, hcancel := context.WithTimeout(context.Background(), 5*time.Second)
	a.hub.Shutdown(hctx)
	hcancel()
	select {
	case <-shut:
	case <-time.After(5 * time.Second):
		a.lg.Warn("handlers still running after the streams were closed; closing their connections")
	}
	cancelBase()
	_ = srv.Close()
}

// forwardSIGHUP turns SIGHUP into a policy reload.
func (a *app) forwardSIGHUP(ctx context.Context) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGHUP)
	defer signal.Stop(sig)
	for {
		select {
		case <-ctx.Done():
			return
		case <-sig:
			select {
			case a.hup <- struct{}{}:
			default:
			}
		}
	}
}
