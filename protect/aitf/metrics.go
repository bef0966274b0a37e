package aitf

import (
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/codes"
	"faregate/protect/kit/promreg"
)

// scoreBuckets are the score histogram's upper bounds, written out so their
// labels read le="0.3", not the float sum of repeated 0.1 steps.
var scoreBuckets = []float64{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1}

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
		return promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "faregate", Subsystem: "aitf", Name: name, Help: help,
		}, route))
	}
	return &metrics{
		score: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "faregate", Subsystem: "aitf", Name: "score",
			Help: "AI-traffic score of requests, per route.",
			// Literal boundaries: LinearBuckets adds 0.1 ten times and
			// prints labels such as le="0.30000000000000004".
			Buckets: scoreBuckets,
		}, route)),
		delayed:  counter("delayed_total", "Requests held in the delay queue (enforce mode)."),
		degraded: counter("degraded_total", "Requests passed without delay but marked degraded because the queue was long."),
		refused:  counter("refused_total", "Requests refused with 503 "+codes.AITFQueueFull+"."),
		observed: counter("observed_total", "Requests at or above the threshold in observe mode (enforce would have delayed them)."),
		alerts:   counter("tool_call_alerts_total", "tool_call_ids queued more than 15 times within 10 minutes."),
		depth: promreg.Register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Namespace: "faregate", Subsystem: "aitf", Name: "queue_depth",
			Help: "Requests currently waiting in the delay queue.",
		})),
	}
}
