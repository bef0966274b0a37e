package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
)

// runMetrics time the planner's model calls until their first streamed
// token, by model ("how slow is the model" without reading logs). Their
// whole length is the governor's metric.
type runMetrics struct {
	ttft *prometheus.HistogramVec
}

// ttftBuckets are first-token latency boundaries in seconds, written out.
var ttftBuckets = []float64{0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120}

func newRunMetrics(reg prometheus.Registerer) *runMetrics {
	return &runMetrics{ttft: promreg.Register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name: "faregate_model_time_to_first_token_seconds", Help: "Time from a model call's start to its first streamed token, by model.",
		Buckets: ttftBuckets,
	}, []string{"model"}))}
}
