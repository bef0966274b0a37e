package promreg

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestRegisterShares(t *testing.T) {
	reg := prometheus.NewRegistry()
	opts := prometheus.CounterOpts{Name: "x_total", Help: "x"}
	a := Register(reg, prometheus.NewCounter(opts))
	b := Register(reg, prometheus.NewCounter(opts))
	if a != b {
		t.Fatal("second registration did not return the first collector")
	}
	if c := prometheus.NewCounter(opts); Register(nil, c) != c {
		t.Fatal("nil registry must return the collector itself")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a conflicting definition must panic")
		}
	}()
	Register(reg, prometheus.NewGauge(prometheus.GaugeOpts{Name: "x_total", Help: "other"}))
}
