package api

import (
	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the gate's Prometheus series. Labels carry codes and route
// patterns only: never a visitor, never an address.
type metrics struct {
	requests   *prometheus.CounterVec
	admissions prometheus.Counter
	denials    *prometheus.CounterVec
	siteverify *prometheus.HistogramVec
	quota      *prometheus.HistogramVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_http_requests_total", Help: "HTTP requests by route pattern, method and status.",
		}, []string{"route", "method", "status"}),
		admissions: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_admissions_total", Help: "Tasks admitted by POST /api/tasks (202).",
		}),
		denials: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_denials_total", Help: "POST /api/tasks refusals by error code.",
		}, []string{"code"}),
		siteverify: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_siteverify_duration_seconds", Help: "Turnstile verification latency by outcome.",
			Buckets: []float64{.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}, []string{"outcome"}),
		quota: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "faregate_quota_duration_seconds", Help: "Quota check latency by operation and outcome.",
			Buckets: []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, 1},
		}, []string{"op", "outcome"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.admissions, m.denials, m.siteverify, m.quota)
	}
	return m
}
