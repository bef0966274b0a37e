package budget

import (
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
)

// metrics are the budget's Prometheus series. The gauges are refreshed
// from the numbers every script returns, so they cost no extra round trip.
// No label carries a principal: only scopes and causes.
type metrics struct {
	siteRemaining  prometheus.Gauge
	spendRemaining prometheus.Gauge // nil while the spend cap is off
	outstanding    prometheus.Gauge
	refusals       *prometheus.CounterVec
	overageTokens  *prometheus.CounterVec
	overageSpend   *prometheus.CounterVec
	settleRetries  prometheus.Counter
	implausible    prometheus.Counter
	batches        prometheus.Histogram
}

// Overage causes: the provider reported more than the hold (excess), or
// the settle arrived after the hold was given back (late).
const (
	causeExcess = "excess"
	causeLate   = "late"
)

func newMetrics(reg prometheus.Registerer, spend bool) *metrics {
	m := &metrics{
		siteRemaining: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_budget_site_remaining_tokens",
			Help: "Tokens the whole site can still reserve on the day last operated on.",
		}),
		outstanding: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_budget_outstanding_reservations",
			Help: "Reservations this replica holds open: neither settled nor given back (on a day of the day-tagged layout, the whole day's).",
		}),
		batches: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "faregate_budget_batch_operations",
			Help:    "Operations one budget script carried (group commit: those of concurrent calls to one slot go together).",
			Buckets: []float64{1, 2, 4, 8, 16, 32, 64, 128},
		}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_budget_refusals_total",
			Help: "Reservations and affordability checks refused, by the scope that refused.",
		}, []string{"scope"}),
		overageTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_budget_overage_tokens_total",
			Help: "Tokens charged beyond their reservation: excess (provider reported more than held) or late (settled after the hold was given back).",
		}, []string{"cause"}),
		overageSpend: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "faregate_budget_overage_spend_micro_total",
			Help: "Money charged beyond its reservation, in micro-units of the prices' currency, by cause as for tokens.",
		}, []string{"cause"}),
		settleRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_budget_settle_retries_total",
			Help: "Settle scripts sent again because Redis did not answer (the script is idempotent).",
		}),
		implausible: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_budget_implausible_usage_total",
			Help: "Settles whose usage report was below zero, past FAREGATE_LLM_MAX_CALL_TOKENS or unreadable, and so charged conservatively.",
		}),
	}
	m.siteRemaining = promreg.Register(reg, m.siteRemaining)
	m.settleRetries = promreg.Register(reg, m.settleRetries)
	m.implausible = promreg.Register(reg, m.implausible)
	m.outstanding = promreg.Register(reg, m.outstanding)
	m.batches = promreg.Register(reg, m.batches)
	m.refusals = promreg.Register(reg, m.refusals)
	m.overageTokens = promreg.Register(reg, m.overageTokens)
	m.overageSpend = promreg.Register(reg, m.overageSpend)
	if spend {
		m.spendRemaining = promreg.Register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_budget_spend_remaining_micro",
			Help: "Micro-units of the daily spend limit the site can still reserve on the day last operated on.",
		}))
	}
	// Every series shows up at 0 before its first event, so rate() works.
	for _, s := range scopeByIndex[1:] {
		m.refusals.WithLabelValues(string(s))
	}
	for _, c := range []string{causeExcess, causeLate} {
		m.overageTokens.WithLabelValues(c)
		m.overageSpend.WithLabelValues(c)
	}
	return m
}

// update refreshes the gauges from a script's view of the site scopes.
func (m *metrics) update(l Limits, siteUsed, spendUsed int64) {
	m.siteRemaining.Set(float64(max(l.Site-siteUsed, 0)))
	if m.spendRemaining != nil {
		m.spendRemaining.Set(float64(max(l.SpendMicro-spendUsed, 0)))
	}
}

// overage counts what a settle charged beyond its hold.
func (m *metrics) overage(tokens, micro int64, late bool) {
	cause := causeExcess
	if late {
		cause = causeLate
	}
	if tokens > 0 {
		m.overageTokens.WithLabelValues(cause).Add(float64(tokens))
	}
	if micro > 0 {
		m.overageSpend.WithLabelValues(cause).Add(float64(micro))
	}
}
