package budget

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
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
	m.siteRemaining = register(reg, m.siteRemaining)
	m.outstanding = register(reg, m.outstanding)
	m.refusals = register(reg, m.refusals)
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

// register adds c to reg, or returns the collector already registered under
// the same name, so two Budgets (or a Budget rebuilt in a test) can share
// one registry. Any other registration error is a programming error.
func register[T prometheus.Collector](reg prometheus.Registerer, c T) T {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(T); ok {
				return existing
			}
		}
		panic(err)
	}
	return c
}
