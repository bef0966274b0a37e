package plancache_test

import (
	"errors"
	"strings"
	"testing"

	"faregate/agent/plancache"
)

func TestParseMode(t *testing.T) {
	tests := []struct {
		in      string
		want    plancache.Mode
		wantErr bool
	}{
		{"off", plancache.ModeOff, false},
		{"fallback", plancache.ModeFallback, false},
		{"always", plancache.ModeAlways, false},
		{"", plancache.ModeFallback, false},
		{"Always", 0, true},
		{" off", 0, true},
		{"on", 0, true},
		{"true", 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := plancache.ParseMode(tt.in)
			if tt.wantErr {
				if !errors.Is(err, plancache.ErrInvalidMode) {
					t.Fatalf("ParseMode(%q) = %v, %v; want ErrInvalidMode", tt.in, got, err)
				}
				if !strings.Contains(err.Error(), "FAREGATE_PLAN_CACHE") {
					t.Fatalf("error %q does not name FAREGATE_PLAN_CACHE", err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseMode(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
			}
		})
	}
}

func TestModeText(t *testing.T) {
	for _, m := range []plancache.Mode{plancache.ModeOff, plancache.ModeFallback, plancache.ModeAlways} {
		b, err := m.MarshalText()
		if err != nil || string(b) != m.String() {
			t.Fatalf("MarshalText(%v) = %q, %v", m, b, err)
		}
		var back plancache.Mode
		if err := back.UnmarshalText(b); err != nil || back != m {
			t.Fatalf("UnmarshalText(%q) = %v, %v; want %v", b, back, err, m)
		}
	}
	if _, err := plancache.Mode(7).MarshalText(); !errors.Is(err, plancache.ErrInvalidMode) {
		t.Fatalf("MarshalText of an unknown mode: %v", err)
	}
	if s := plancache.Mode(7).String(); s != "Mode(7)" {
		t.Fatalf("String of an unknown mode = %q", s)
	}
	m := plancache.ModeAlways
	if err := m.UnmarshalText([]byte("sometimes")); err == nil || m != plancache.ModeAlways {
		t.Fatalf("a bad value must fail and leave the mode alone: %v, %v", m, err)
	}
}
