package main

import (
	"log"
	"log/slog"
	"net/http"
	"runtime"
	"runtime/debug"
	"syscall"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/agent"
	"faregate/agent/alert"
	"faregate/agent/govern"
	"faregate/agent/guide"
	"faregate/agent/offline"
	"faregate/agent/openai"
	"faregate/agent/outbound"
	"faregate/agent/task"
	"faregate/agent/tools"
	"faregate/protect/breaker"
)

// buildModels returns the primary model (an OpenAI-compatible server or the
// offline demo planner), its breaker and the fallback.
func buildModels(cfg *config, lg *slog.Logger, reg prometheus.Registerer, notify func(alert.Alert)) (*govern.Models, error) {
	httpClient := &http.Client{Timeout: cfg.LLMTimeout, Transport: modelTransport()}
	var ms govern.Models
	if cfg.LLMBaseURL == "" {
		// The offline model answers the model endpoint too, through an
		// in-process transport, so its relay is the same as a provider's.
		ms.Primary = govern.Model{Model: offline.New(), Name: offline.ModelName, Offline: true,
			BaseURL: offline.BaseURL, HTTPClient: offline.Client()}
	} else {
		m, err := openai.New(openai.Options{BaseURL: cfg.LLMBaseURL, APIKey: cfg.LLMAPIKey, Model: cfg.LLMModel,
			LegacyMaxTokens: cfg.LLMLegacyMaxTokens, HTTPClient: httpClient})
		if err != nil {
			return nil, err
		}
		ms.Primary = govern.Model{Model: m, Name: m.Name(), BaseURL: cfg.LLMBaseURL, APIKey: cfg.LLMAPIKey, HTTPClient: httpClient}
		ms.Breaker = breaker.New(breaker.Settings{
			Name: "primary", Window: cfg.BreakerWindow, MinCalls: cfg.BreakerMinCalls,
			FailureRatio: cfg.BreakerFailureRatio, SlowRatio: cfg.BreakerSlowRatio, SlowCall: cfg.BreakerSlowCall,
			OpenFor: cfg.BreakerOpenFor, HalfOpenProbes: cfg.BreakerHalfOpenProbes,
			OnStateChange: func(from, to breaker.State) { breakerAlert(notify, m.Name(), from, to) },
		}, lg, reg)
	}
	if cfg.FallbackBaseURL != "" {
		fb, err := openai.New(openai.Options{BaseURL: cfg.FallbackBaseURL, APIKey: cfg.FallbackAPIKey,
			Model: cfg.FallbackModel, LegacyMaxTokens: cfg.LLMLegacyMaxTokens, HTTPClient: httpClient})
		if err != nil {
			return nil, err
		}
		ms.Fallback = &govern.Model{Model: fb, Name: fb.Name(), BaseURL: cfg.FallbackBaseURL, APIKey: cfg.FallbackAPIKey, HTTPClient: httpClient}
	}
	return &ms, nil
}

// modelTransport is the transport of the model providers: Go's default
// (proxy from the environment, HTTP/2 where the provider offers it) with
// 1 KiB connection buffers instead of 4 KiB each way. Over HTTP/1.1 every
// open stream is a connection of its own, and both buffers live as long
// as it does, though the write buffer is done once the request is sent
// (a body past it goes straight to the socket) and the read buffer only
// frames the chunks of an SSE stream whose events arrive a few hundred
// bytes at a time (a larger read bypasses it). 1,000 open streams keep
// 6 MB less (BenchmarkGovernedOpenStreams). HTTP/2 connections, shared by
// many streams, keep their own buffers.
func modelTransport() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.ReadBufferSize = 1 << 10
	t.WriteBufferSize = 1 << 10
	return t
}

// buildToolbox returns the per-task tool factory. Two process-wide
// transports hold the per-host limits: one for the fixed APIs (weather,
// geocoding, search) and one that refuses non-public addresses for
// fetch_page. Each task gets its own sessions: its own cache and dedup.
func buildToolbox(cfg *config, ix *guide.Index, lg *slog.Logger) agent.Toolbox {
	apis := outbound.New(outbound.Options{Version: versionString(), PublicURL: cfg.PublicURL, Logger: lg})
	pages := outbound.New(outbound.Options{Version: versionString(), PublicURL: cfg.PublicURL, Logger: lg,
		Base: tools.SafeTransport(tools.Policy{})})
	tcfg := tools.Config{WeatherURL: cfg.WeatherURL, GeocodingURL: cfg.GeocodingURL, SearchURL: cfg.SearchURL, Guide: ix}
	return func(rec *task.Record, warn func(code, detail string)) []tools.Tool {
		so := outbound.SessionOptions{Score: rec.AITF.Score, HasScore: rec.AITF.Score > 0, Warn: warn}
		return tools.All(apis.Session(so).Client(), pages.Session(so).Client(), tcfg)
	}
}

// breakerAlert tells the operator the primary model's breaker opened (calls
// go to the fallback, or creations are refused) or closed again.
func breakerAlert(notify func(alert.Alert), model string, from, to breaker.State) {
	switch to {
	case breaker.Open:
		notify(alert.Alert{Event: alert.BreakerOpen, Scope: "model:" + model, Severity: alert.Critical,
			Text:    "The model provider's circuit breaker opened: calls go to the fallback model, or new tasks are refused without one.",
			Details: map[string]any{"model": model, "from": string(from)}})
	case breaker.Closed:
		notify(alert.Alert{Event: alert.BreakerClosed, Scope: "model:" + model, Severity: alert.Info,
			Text:    "The model provider's circuit breaker closed again: calls go to the primary model.",
			Details: map[string]any{"model": model, "from": string(from)}})
	}
}

// poolStats exports each Redis pool's waits for a connection: the event
// readers have a pool of their own precisely so the gate's never waits.
func poolStats(rcs *redisClients) prometheus.Collector {
	return &poolCollector{pools: map[string]redis.UniversalClient{"main": rcs.main, "streams": rcs.streams, "queue": rcs.queue},
		waits: prometheus.NewDesc("faregate_redis_pool_waits_total", "Times a command waited for a free connection, by pool.", []string{"pool"}, nil),
		conns: prometheus.NewDesc("faregate_redis_pool_connections", "Connections open, by pool.", []string{"pool"}, nil)}
}

type poolCollector struct {
	pools        map[string]redis.UniversalClient
	waits, conns *prometheus.Desc
}

func (p *poolCollector) Describe(ch chan<- *prometheus.Desc) { ch <- p.waits; ch <- p.conns }

func (p *poolCollector) Collect(ch chan<- prometheus.Metric) {
	for name, c := range p.pools {
		st := c.PoolStats()
		if st == nil {
			continue
		}
		ch <- prometheus.MustNewConstMetric(p.waits, prometheus.CounterValue, float64(st.WaitCount), name)
		ch <- prometheus.MustNewConstMetric(p.conns, prometheus.GaugeValue, float64(st.TotalConns), name)
	}
}

// goVersion is the Go toolchain that built the binary.
func goVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		return bi.GoVersion
	}
	return runtime.Version()
}

// logLogger adapts a writer to the *log.Logger http.Server wants.
func logLogger(w *limitedLog) *log.Logger { return log.New(w, "", 0) }

// maxConnections is FAREGATE_MAX_CONNECTIONS, or by default three quarters
// of the process's open-file limit (leaving room for Redis and outbound
// connections), at most 10000.
func maxConnections(configured int) int {
	if configured > 0 {
		return configured
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil || lim.Cur == 0 {
		return 1000
	}
	return int(min(uint64(10000), lim.Cur*3/4))
}
