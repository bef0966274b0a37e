// Package promreg registers Prometheus collectors so that several
// components (two breakers, a Budget rebuilt in a test, two servers in one
// test process) can share one registry and one series family.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register adds c to reg and returns it, or returns the collector already
// registered under the same description. A nil reg leaves c unregistered.
// Any other failure is a conflicting metric definition, a programming
// error, and panics as MustRegister would.
func Register[T prometheus.Collector](reg prometheus.Registerer, c T) T {
	if reg == nil {
		return c
	}
	err := reg.Register(c)
	if err == nil {
		return c
	}
	var are prometheus.AlreadyRegisteredError
	if errors.As(err, &are) {
		if existing, ok := are.ExistingCollector.(T); ok {
			return existing
		}
	}
	panic(err)
}
