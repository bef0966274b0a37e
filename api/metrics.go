package api

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
)

// metrics are the gate's Prometheus series. Labels carry codes, route
// patterns and key ids only: never a visitor, never an address.
type metrics struct {
	mu     sync.RWMutex
	series map[seriesKey]series

	requests   *prometheus.CounterVec
	duration   *prometheus.HistogramVec
	admissions *prometheus.CounterVec
	denials    *prometheus.CounterVec
	cached     prometheus.Counter
	siteverify *prometheus.HistogramVec
	quota      *prometheus.HistogramVec
}

// latencyBuckets are the HTTP latency boundaries in seconds, written out so
// the exposition shows them as written.
var latencyBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

func newMetrics(reg prometheus.Registerer) *metrics {
	return &metrics{
		requests: promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_http_requests_total", Help: "HTTP requests by route pattern, method and status.",
		}, []string{"route", "method", "status"})),
		duration: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_http_request_duration_seconds", Help: "HTTP request latency by route pattern and status class (event streams: their whole life).",
			Buckets: latencyBuckets,
		}, []string{"route", "status_class"})),
		admissions: promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_admissions_total", Help: "Tasks admitted by POST /api/tasks (202), by principal: a key id, or public.",
		}, []string{"principal"})),
		denials: promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_denials_total", Help: "Refused /api requests by error code.",
		}, []string{"code"})),
		cached: promreg.Register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_cached_plans_served_total", Help: "Creations answered with a cached plan (202, already succeeded).",
		})),
		siteverify: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_siteverify_duration_seconds", Help: "Turnstile verification latency by outcome.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
		}, []string{"outcome"})),
		quota: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_quota_duration_seconds", Help: "Quota check latency by operation and outcome.",
			Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1},
		}, []string{"op", "outcome"})),
	}
}

// streams exports the event streams held, read when scraped.
func (m *metrics) streams(reg prometheus.Registerer, caps *streamCaps) {
	promreg.Register(reg, prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "faregate_event_streams", Help: "Event streams this process serves now.",
	}, func() float64 { return float64(caps.open()) }))
}

// observe counts one finished request. The series of each (route, method,
// status) are looked up once and kept: the label hashing would otherwise
// be a good part of a refusal's cost.
func (m *metrics) observe(route, method string, status int, took time.Duration) {
	k := seriesKey{route, method, status}
	m.mu.RLock()
	se, ok := m.series[k]
	m.mu.RUnlock()
	if !ok {
		se = series{m.requests.WithLabelValues(route, method, statusText(status)), m.duration.WithLabelValues(route, statusClass(status))}
		m.mu.Lock()
		if m.series == nil {
			m.series = map[seriesKey]series{}
		}
		// Routes are the route table's, methods and statuses few; a bound
		// all the same, for methods a client makes up.
		if len(m.series) < 4096 {
			m.series[k] = se
		}
		m.mu.Unlock()
	}
	se.requests.Inc()
	se.duration.Observe(took.Seconds())
}

type seriesKey struct {
	route, method string
	status        int
}

type series struct {
	requests prometheus.Counter
	duration prometheus.Observer
}
