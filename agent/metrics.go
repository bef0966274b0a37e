package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/promreg"
)

// modelMetrics time the model calls: how long each took by model and
// outcome, and how long until its first streamed token by model ("how slow
// is the model" without reading logs).
type modelMetrics struct {
	duration *prometheus.HistogramVec
	ttft     *prometheus.HistogramVec
}

// modelBuckets are model-call latency boundaries in seconds, written out.
var modelBuckets = []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120}

func newModelMetrics(reg prometheus.Registerer) *modelMetrics {
	return &modelMetrics{
		duration: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_model_call_duration_seconds", Help: "Model call latency, by model and outcome (ok, error, or the reason the stream was cut).",
			Buckets: modelBuckets,
		}, []string{"model", "outcome"})),
		ttft: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_model_time_to_first_token_seconds", Help: "Time from a model call's start to its first streamed token, by model.",
			Buckets: modelBuckets,
		}, []string{"model"})),
	}
}
