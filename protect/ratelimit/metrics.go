package ratelimit

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
)

// Outcome label values of faregate_ratelimit_decisions_total.
const (
	outcomeAllowed          = "allowed"
	outcomeTokenRateLimited = string(ReasonTokenRateLimited)
	outcomeAnomaly          = "anomaly"
	outcomeTooLarge         = "too_large"
	outcomeHourExhausted    = "hour_exhausted"
)

// metrics are the limiter's Prometheus series. Labels name the kind of
// decision and its outcome, never a scope: scopes are visitors and keys.
// Answers replayed for a re-sent op are not counted again.
type metrics struct {
	decisions *prometheus.CounterVec
	paceWait  prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_ratelimit_decisions_total",
			Help: "Rate-limit decisions by kind (gate, call, pace) and outcome.",
		}, []string{"kind", "outcome"}),
		paceWait: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "faregate_site_pacing_wait_seconds",
			Help:    "Wait given to model calls by the site token bucket before sending.",
			Buckets: []float64{0, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
		}),
	}
	m.decisions = promreg.Register(reg, m.decisions)
	m.paceWait = promreg.Register(reg, m.paceWait)
	// Every series exists at 0 from the start, so rate() sees its first event.
	for kind, outcomes := range map[string][]string{
		"gate": {outcomeAllowed, string(ReasonRateLimited), string(ReasonTooManyFailedChecks), string(ReasonAnomalyBlocked), string(ReasonInvalidRatio)},
		"call": {outcomeAllowed, outcomeTokenRateLimited, outcomeAnomaly, outcomeTooLarge, outcomeHourExhausted},
		"pace": {outcomeAllowed, outcomeTokenRateLimited, outcomeTooLarge},
	} {
		for _, o := range outcomes {
			m.decisions.WithLabelValues(kind, o)
		}
	}
	return m
}

func (m *metrics) gate(d GateDecision) {
	o := outcomeAllowed
	if !d.Allowed {
		o = string(d.Reason)
	}
	m.decisions.WithLabelValues("gate", o).Inc()
}

// call counts a BeforeCall by the script's status code.
func (m *metrics) call(status int64) {
	o := [...]string{outcomeAllowed, outcomeAnomaly, outcomeTokenRateLimited, outcomeTooLarge, outcomeHourExhausted, outcomeHourExhausted}[status]
	m.decisions.WithLabelValues("call", o).Inc()
}

// pace counts a Pace and, when granted, observes the wait it was given.
func (m *metrics) pace(outcome string, wait time.Duration) {
	m.decisions.WithLabelValues("pace", outcome).Inc()
	if outcome == outcomeAllowed {
		m.paceWait.Observe(wait.Seconds())
	}
}
