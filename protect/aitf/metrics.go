package aitf

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the Guard's Prometheus collectors, all prefixed faregate_aitf_.
type metrics struct {
	score    *prometheus.HistogramVec
	delayed  *prometheus.CounterVec
	degraded *prometheus.CounterVec
	refused  *prometheus.CounterVec
	observed *prometheus.CounterVec
	alerts   *prometheus.CounterVec
	depth    prometheus.Gauge
}

// newMetrics builds the collectors and registers them on reg (nil: not
// registered). A second Guard on the same registry shares the first one's
// collectors rather than failing; the depth gauge is only ever moved up and
// down, so shared it sums both queues.
func newMetrics(reg prometheus.Registerer) *metrics {
	route := []string{"route"}
	counter := func(name, help string) *prometheus.CounterVec {
		return register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "faregate", Subsystem: "aitf", Name: name, Help: help,
		}, route))
	}
	return &metrics{
		score: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "faregate", Subsystem: "aitf", Name: "score",
			Help:    "AI-traffic score of requests, per route.",
			Buckets: prometheus.LinearBuckets(0.1, 0.1, 10),
		}, route)),
		delayed:  counter("delayed_total", "Requests held in the delay queue (enforce mode)."),
		degraded: counter("degraded_total", "Requests passed without delay but marked degraded because the queue was long."),
		refused:  counter("refused_total", "Requests refused with 503 aitf_queue_full."),
		observed: counter("observed_total", "Requests at or above the threshold in observe mode (enforce would have delayed them)."),
		alerts:   counter("tool_call_alerts_total", "tool_call_ids queued more than 15 times within 10 minutes."),
		depth: register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "faregate", Subsystem: "aitf", Name: "queue_depth",
			Help: "Requests currently waiting in the delay queue.",
		})),
	}
}

// register registers c on reg, or returns the collector already registered
// under the same description. Any other failure is a programming error
// (conflicting metric definitions) and panics, as MustRegister would.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if reg == nil {
		return c
	}
	err := reg.Register(c)
	if err == nil {
		return c
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(C); ok {
			return existing
		}
	}
	panic(err)
}
