package api

import (
	"cmp"
	"context"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// summary aggregates refused requests so a flood costs one log line per
// interval instead of one per request: counts by code, and the principals
// refused most (truncated visitor hashes or key ids; never an address).
type summary struct {
	mu          sync.Mutex
	total       int64
	byCode      map[string]int64
	byPrincipal map[string]*int64
	dropped     int64 // principals not tracked because the map was full
	extra       map[string]int64
}

// summaryPrincipals bounds the principals tracked per interval; a flood from
// more distinct principals is still counted by code.
const summaryPrincipals = 10_000

// summaryTop is how many principals the line names.
const summaryTop = 5

func newSummary() *summary {
	return &summary{byCode: map[string]int64{}, byPrincipal: map[string]*int64{}, extra: map[string]int64{}}
}

// add counts one refusal of principal (its log form, see Principal.String,
// given as bytes so a principal seen before costs no allocation).
func (s *summary) add(code string, principal []byte) {
	if code == "" {
		code = "other"
	}
	s.mu.Lock()
	s.total++
	s.byCode[code]++
	if n := s.byPrincipal[string(principal)]; n != nil {
		*n++
	} else if len(s.byPrincipal) < summaryPrincipals {
		one := int64(1)
		s.byPrincipal[string(principal)] = &one
	} else {
		s.dropped++
	}
	s.mu.Unlock()
}

// note counts an event that is not a refusal but must not log per request
// either (an AITF observe-mode verdict).
func (s *summary) note(what string) {
	s.mu.Lock()
	s.extra[what]++
	s.mu.Unlock()
}

// flush writes one line for the interval, if anything happened, and starts
// a new interval.
func (s *summary) flush(lg *slog.Logger, interval time.Duration) {
	s.mu.Lock()
	total, byCode, byPrincipal, extra := s.total, s.byCode, s.byPrincipal, s.extra
	dropped := s.dropped
	s.total, s.dropped = 0, 0
	s.byCode, s.byPrincipal, s.extra = map[string]int64{}, map[string]*int64{}, map[string]int64{}
	s.mu.Unlock()
	if total == 0 && len(extra) == 0 {
		return
	}
	attrs := []slog.Attr{
		slog.String("interval", interval.String()),
		slog.Int64("total", total),
		slog.String("codes", counts(byCode, len(byCode))),
		slog.String("top", counts(deref(byPrincipal), summaryTop)),
	}
	if dropped > 0 {
		attrs = append(attrs, slog.Int64("untracked", dropped))
	}
	if len(extra) > 0 {
		attrs = append(attrs, slog.String("noted", counts(extra, len(extra))))
	}
	lg.LogAttrs(context.Background(), slog.LevelInfo, "refused requests", attrs...)
}

// counts formats the n largest counts as "name=count name=count", largest
// first, names sorted on ties so the line is stable.
func counts(m map[string]int64, n int) string {
	names := slices.Collect(maps.Keys(m))
	slices.SortFunc(names, func(a, b string) int {
		if c := cmp.Compare(m[b], m[a]); c != 0 {
			return c
		}
		return strings.Compare(a, b)
	})
	if len(names) > n {
		names = names[:n]
	}
	var b strings.Builder
	for i, name := range names {
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(name)
		b.WriteByte('=')
		b.WriteString(strconv.FormatInt(m[name], 10))
	}
	return b.String()
}

// run flushes every interval until ctx ends, then once more.
func (s *summary) run(ctx context.Context, lg *slog.Logger, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			s.flush(lg, interval)
			return
		case <-t.C:
			s.flush(lg, interval)
		}
	}
}

func deref(m map[string]*int64) map[string]int64 {
	out := make(map[string]int64, len(m))
	for k, v := range m {
		out[k] = *v
	}
	return out
}
