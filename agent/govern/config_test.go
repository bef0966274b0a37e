package govern

import (
	"context"
	"testing"
	"time"

	"faregate/protect/budget"
	"faregate/protect/ratelimit"
)

// stubBudget is a Budget that is never asked: New only needs one.
type stubBudget struct{ Budget }

// TestDefaults: the waits and the settle's bound default, and the site's
// pace wait is held to what the limiter accepts.
func TestDefaults(t *testing.T) {
	d := Deps{Models: &Models{Primary: Model{Name: "m"}}, Budget: stubBudget{}}
	for _, tc := range []struct{ in, want time.Duration }{
		{0, DefaultSitePaceWait},
		{5 * time.Second, 5 * time.Second},
		{48 * time.Hour, ratelimit.MaxPaceWait},
	} {
		if got := New(Config{SitePaceWait: tc.in}, d).cfg.SitePaceWait; got != tc.want {
			t.Errorf("SitePaceWait %v became %v, want %v", tc.in, got, tc.want)
		}
	}
	g := New(Config{}, d)
	if g.cfg.TokenWait != DefaultTokenWait || g.cfg.SettleTimeout != DefaultSettleTimeout || g.d.Sleep == nil || g.d.Logger == nil {
		t.Errorf("defaults %+v", g.cfg)
	}
	if err := g.d.Sleep(context.Background(), 0); err != nil {
		t.Errorf("the default sleep: %v", err)
	}
	for _, bad := range []Deps{{Budget: stubBudget{}}, {Models: d.Models}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("New(%+v) did not panic", bad)
				}
			}()
			New(Config{}, bad)
		}()
	}
	var _ Budget = (*budget.Budget)(nil)
}
