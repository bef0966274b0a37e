package plancache

import (
	"errors"
	"fmt"
)

// EnvMode is the configuration variable that chooses the Mode.
const EnvMode = "FAREGATE_PLAN_CACHE"

// ErrInvalidMode reports a FAREGATE_PLAN_CACHE value that names no Mode.
var ErrInvalidMode = errors.New("plancache: invalid mode")

// Mode is when the gate serves a cached plan.
type Mode int

// The modes of FAREGATE_PLAN_CACHE. The zero Mode is ModeOff, so a Mode
// nobody configured never changes what the gate answers.
const (
	// ModeOff never reads nor writes the cache.
	ModeOff Mode = iota
	// ModeFallback serves a cached plan only where the gate would refuse
	// with 429 demo_budget_exhausted or 503 model_unavailable; the default.
	ModeFallback
	// ModeAlways serves a cached plan before the model is asked at all.
	ModeAlways
)

// DefaultMode is the mode when FAREGATE_PLAN_CACHE is unset.
const DefaultMode = ModeFallback

var modeNames = [...]string{ModeOff: "off", ModeFallback: "fallback", ModeAlways: "always"}

// ParseMode reads a FAREGATE_PLAN_CACHE value: "off", "fallback" or
// "always", exactly as the manual writes them. An empty value is
// DefaultMode, so an unset variable means what the manual says.
func ParseMode(s string) (Mode, error) {
	if s == "" {
		return DefaultMode, nil
	}
	for m, name := range modeNames {
		if s == name {
			return Mode(m), nil
		}
	}
	return ModeOff, fmt.Errorf("%w: %s=%q, want off, fallback or always", ErrInvalidMode, EnvMode, s)
}

// String is the mode's name as FAREGATE_PLAN_CACHE spells it.
func (m Mode) String() string {
	if m < 0 || int(m) >= len(modeNames) {
		return fmt.Sprintf("Mode(%d)", int(m))
	}
	return modeNames[m]
}

// MarshalText writes the mode's name, so a Mode prints by name in JSON and
// in slog attributes.
func (m Mode) MarshalText() ([]byte, error) {
	if m < 0 || int(m) >= len(modeNames) {
		return nil, fmt.Errorf("%w: %d", ErrInvalidMode, int(m))
	}
	return []byte(modeNames[m]), nil
}

// UnmarshalText parses like ParseMode, so a config struct can hold a Mode
// field that an env loader fills from FAREGATE_PLAN_CACHE.
func (m *Mode) UnmarshalText(b []byte) error {
	v, err := ParseMode(string(b))
	if err != nil {
		return err
	}
	*m = v
	return nil
}
