package plancache

import (
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
)

// The label values of faregate_plan_cache_total.
const (
	opGet = "get"
	opPut = "put"

	outcomeHit     = "hit"
	outcomeMiss    = "miss"
	outcomeError   = "error"
	outcomeOK      = "ok"
	outcomeSkipped = "skipped"
)

// newTotal returns faregate_plan_cache_total{op,outcome}, shared with any
// Cache already registered on reg.
func newTotal(reg prometheus.Registerer) *prometheus.CounterVec {
	total := promreg.Register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_plan_cache_total",
		Help: "Plan cache operations: get (hit, miss, error) and put (ok, error, skipped for a plan that may not be cached).",
	}, []string{"op", "outcome"}))
	// Every series exists at 0 before its first event, so rate() and
	// hit-ratio queries work from the start.
	for _, o := range []string{outcomeHit, outcomeMiss, outcomeError} {
		total.WithLabelValues(opGet, o)
	}
	for _, o := range []string{outcomeOK, outcomeError, outcomeSkipped} {
		total.WithLabelValues(opPut, o)
	}
	return total
}

func (c *Cache) count(op, outcome string) { c.total.WithLabelValues(op, outcome).Inc() }
