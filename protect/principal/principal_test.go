package principal

import "testing"

// TestForms: each form of a principal, and the way back from the Account a
// task record keeps.
func TestForms(t *testing.T) {
	hash := "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	tests := []struct {
		name                          string
		p                             Principal
		scope, account, shown, metric string
	}{
		{"visitor", Principal{Kind: KindVisitor, ID: hash}, "v:" + hash, "v_" + hash, "v:0123456789ab", PublicTier},
		{"key", Principal{Kind: KindKey, ID: "acme"}, "k:acme", "k_acme", "k:acme", "acme"},
		{"short visitor id", Principal{Kind: KindVisitor, ID: "abc"}, "v:abc", "v_abc", "v:abc", PublicTier},
		{"visitor without id", Principal{Kind: KindVisitor}, "v:", "v_", "v:none", PublicTier},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := tc.p
			if p.Scope() != tc.scope || p.Account() != tc.account || p.String() != tc.shown || p.MetricLabel() != tc.metric {
				t.Errorf("scope %q account %q shown %q metric %q, want %q %q %q %q",
					p.Scope(), p.Account(), p.String(), p.MetricLabel(), tc.scope, tc.account, tc.shown, tc.metric)
			}
			if got := string(p.AppendText([]byte("x "))); got != "x "+tc.shown {
				t.Errorf("AppendText = %q", got)
			}
			if back := FromAccount(p.Account()); back != (Principal{Kind: p.Kind, ID: p.ID}) {
				t.Errorf("FromAccount(%q) = %+v", p.Account(), back)
			}
		})
	}
	// Not an Account: taken for a visitor's hash and cut like one.
	if p := FromAccount("0123456789abcdefXYZ"); p.Kind != KindVisitor || p.String() != "v:0123456789ab" {
		t.Errorf("FromAccount of a bare string = %+v (%s)", p, p)
	}
}

// TestAppendTextAllocs: the access log's form costs nothing into a buffer
// that has room.
func TestAppendTextAllocs(t *testing.T) {
	p := Principal{Kind: KindVisitor, ID: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"}
	buf := make([]byte, 0, 64)
	if n := testing.AllocsPerRun(100, func() { buf = p.AppendText(buf[:0]) }); n != 0 {
		t.Errorf("%v allocations", n)
	}
}

// TestSoftTokens: the soft share of an hourly quota in whole tokens, its
// defaults, and nothing without a quota.
func TestSoftTokens(t *testing.T) {
	tests := []struct {
		name string
		tier Tier
		want int64
	}{
		{"no quota", Tier{SoftAt: 0.5}, 0},
		{"default share", Tier{TokensPerHour: 10_000}, 8_000},
		{"given share", Tier{TokensPerHour: 10_000, SoftAt: 0.5}, 5_000},
		{"rounded down", Tier{TokensPerHour: 7, SoftAt: 0.5}, 3},
		{"at least one", Tier{TokensPerHour: 1, SoftAt: 0.1}, 1},
		{"the whole quota", Tier{TokensPerHour: 10, SoftAt: 1}, 10},
		{"a share out of range is the default", Tier{TokensPerHour: 100, SoftAt: 2}, 80},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.tier.SoftTokens(); got != tc.want {
				t.Errorf("SoftTokens = %d, want %d", got, tc.want)
			}
		})
	}
	if got := (Tier{}).SoftRequests(); got != DefaultSoftRequestsPerMinute {
		t.Errorf("default soft requests %d", got)
	}
	if got := (Tier{SoftRequestsPerMinute: 2}).SoftRequests(); got != 2 {
		t.Errorf("soft requests %d", got)
	}
}
