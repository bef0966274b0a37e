package budget

import (
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/promreg"
)

// metrics are the budget's Prometheus series. They are refreshed from the
// numbers every script returns, so they cost no extra Redis round trip.
type metrics struct {
	siteRemaining prometheus.Gauge
	outstanding   prometheus.Gauge
	refusals      *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		siteRemaining: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_budget_site_remaining_tokens",
			Help: "Tokens the whole site can still reserve on the day last operated on.",
		}),
		outstanding: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_budget_outstanding_reservations",
			Help: "Reservations neither settled nor expired on the day last operated on.",
		}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_budget_refusals_total",
			Help: "Reservations and affordability checks refused, by the scope that refused.",
		}, []string{"scope"}),
	}
	m.siteRemaining = promreg.Register(reg, m.siteRemaining)
	m.outstanding = promreg.Register(reg, m.outstanding)
	m.refusals = promreg.Register(reg, m.refusals)
	// Every scope shows up at 0 before its first refusal, so rate() works.
	for _, s := range []Scope{ScopeSite, ScopeVisitor, ScopeTask} {
		m.refusals.WithLabelValues(string(s))
	}
	return m
}

func (m *metrics) update(siteRemaining, reservations int64) {
	m.siteRemaining.Set(float64(max(siteRemaining, 0)))
	m.outstanding.Set(float64(reservations))
}
