package policy

import (
	"reflect"
	"strings"
	"testing"
)

func TestRaised(t *testing.T) {
	const base = `tiers:
  public: {tasks_per_day: 5, tokens_per_day: 40000, tokens_per_minute: 6000, requests_per_minute: 120}
  partner: {tasks_per_day: 500, tokens_per_day: 2000000, tokens_per_minute: 100000, requests_per_minute: 600}
  gold: {tasks_per_day: 900, tokens_per_day: 9000000, requests_per_minute: 900, max_site_share: 0.5}
keys:
  - {id: acme, sha256: "` + hashA + `", tier: partner}
  - {id: bolt, sha256: "` + hashB + `", tier: gold, disabled: true}
`
	old, err := Parse([]byte(base), "old", envDefaults)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		file  string
		tiers []string
		keys  []string
	}{
		{"unchanged", base, nil, nil},
		{"public tasks up", replace(base, "tasks_per_day: 5,", "tasks_per_day: 6,"), []string{"public"}, nil},
		{"public tasks down", replace(base, "tasks_per_day: 5,", "tasks_per_day: 4,"), nil, nil},
		{"partner tokens per day up", replace(base, "tokens_per_day: 2000000", "tokens_per_day: 3000000"), []string{"partner"}, []string{"acme"}},
		{"partner requests per minute up", replace(base, "requests_per_minute: 600", "requests_per_minute: 601"), []string{"partner"}, []string{"acme"}},
		{"partner bucket removed (0 = none)", replace(base, "tokens_per_minute: 100000", "tokens_per_minute: 0"), []string{"partner"}, []string{"acme"}},
		{"partner bucket down", replace(base, "tokens_per_minute: 100000", "tokens_per_minute: 10"), nil, nil},
		{"gold share up, its key disabled", replace(base, "max_site_share: 0.5", "max_site_share: 1"), []string{"gold"}, nil},
		{"key moved to gold", replace(base, `tier: partner}`, `tier: gold}`), nil, []string{"acme"}},
		{"key enabled again", replace(base, "disabled: true", "disabled: false"), nil, []string{"bolt"}},
		{"key removed", replace(base, `  - {id: acme, sha256: "`+hashA+`", tier: partner}`+"\n", ""), nil, nil},
		{"partner second window added is no raise", replace(base, "requests_per_minute: 600", "requests_per_minute: 600, requests_per_second: 10"), nil, nil},
		{"partner hourly quota added is no raise", replace(base, "requests_per_minute: 600", "requests_per_minute: 600, tokens_per_hour: 10000"), nil, nil},
		{"new tier is no raise", replace(base, "keys:", "  silver: {tasks_per_day: 1, tokens_per_day: 1, requests_per_minute: 1}\nkeys:"), nil, nil},
		{"new key", base + `  - {id: cove, sha256: "` + hashA[:63] + `c", tier: partner}` + "\n", nil, []string{"cove"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse([]byte(tt.file), "new", envDefaults)
			if err != nil {
				t.Fatal(err)
			}
			if got := p.RaisedTiers(old); !reflect.DeepEqual(got, tt.tiers) {
				t.Errorf("RaisedTiers = %v, want %v", got, tt.tiers)
			}
			if got := p.RaisedKeys(old); !reflect.DeepEqual(got, tt.keys) {
				t.Errorf("RaisedKeys = %v, want %v", got, tt.keys)
			}
			if p.RaisedTiers(nil) != nil || p.RaisedKeys(nil) != nil {
				t.Error("a nil old policy raised something")
			}
		})
	}
}

// replace is strings.Replace that fails loudly when old is absent, so a
// table row cannot silently test the unchanged file.
func replace(s, old, new string) string {
	i := strings.Index(s, old)
	if i < 0 {
		panic("replace: " + old + " not found")
	}
	return s[:i] + new + s[i+len(old):]
}

// TestRaisedSeeds: the second window, the hourly quota and its soft
// throttle are raised by a higher value or by turning them off (0), and
// a soft share or soft window going up raises the tier too.
func TestRaisedSeeds(t *testing.T) {
	const base = `tiers:
  partner: {tasks_per_day: 500, tokens_per_day: 2000000, requests_per_minute: 600, requests_per_second: 10, tokens_per_hour: 10000, soft_at: 0.5, soft_requests_per_minute: 3}
keys:
  - {id: acme, sha256: "` + hashA + `", tier: partner}
`
	old, err := Parse([]byte(base), "old", envDefaults)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		from   string
		to     string
		raised bool
	}{
		{"second window up", "requests_per_second: 10", "requests_per_second: 11", true},
		{"second window off", "requests_per_second: 10", "requests_per_second: 0", true},
		{"second window down", "requests_per_second: 10", "requests_per_second: 9", false},
		{"hour up", "tokens_per_hour: 10000", "tokens_per_hour: 20000", true},
		{"hour off", "tokens_per_hour: 10000", "tokens_per_hour: 0", true},
		{"hour down", "tokens_per_hour: 10000", "tokens_per_hour: 9000", false},
		{"soft share up", "soft_at: 0.5", "soft_at: 0.9", true},
		{"soft share down", "soft_at: 0.5", "soft_at: 0.4", false},
		{"soft window up", "soft_requests_per_minute: 3", "soft_requests_per_minute: 4", true},
		{"soft window down", "soft_requests_per_minute: 3", "soft_requests_per_minute: 2", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Parse([]byte(replace(base, tt.from, tt.to)), "new", envDefaults)
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			if tt.raised {
				want = []string{"partner"}
			}
			if got := p.RaisedTiers(old); !reflect.DeepEqual(got, want) {
				t.Errorf("RaisedTiers = %v, want %v", got, want)
			}
		})
	}
}
