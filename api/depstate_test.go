package api

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"faregate/protect/codes"
	"faregate/protect/quota"
	"faregate/protect/turnstile"
)

// TestDependencyStateLines: an outage writes one line when it is first met
// and one when the dependency answers again; a dependency that flaps on
// every request writes at most one line per hold.
func TestDependencyStateLines(t *testing.T) {
	var buf bytes.Buffer
	lg := slog.New(slog.NewTextHandler(&buf, nil))
	now := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	ds := newDependencies(10*time.Second, func() time.Time { return now }, lg)
	down := fmt.Errorf("%w: dial tcp: connection refused", turnstile.ErrUnavailable)
	st := &state{id: "req-1", code: codes.DemoProtectionUnavailable}

	if ds.failedBy(down) != ds.turnstile || ds.failedBy(fmt.Errorf("x: %w", quota.ErrUnavailable)) != ds.redis || ds.failedBy(errors.New("other")) != nil {
		t.Fatal("failedBy names the wrong dependency")
	}
	ds.turnstile.ok() // up and answering: nothing to say
	for i := 0; i < 1000; i++ {
		ds.turnstile.failed(st, down)
	}
	if n := strings.Count(buf.String(), "\n"); n != 1 || !strings.Contains(buf.String(), `msg="dependency down" dependency=turnstile`) ||
		!strings.Contains(buf.String(), "request_id=req-1") || !strings.Contains(buf.String(), "connection refused") {
		t.Fatalf("1000 failures wrote:\n%s", buf.String())
	}
	// Back within the hold: not yet said; after it, once, with the count.
	now = now.Add(time.Second)
	ds.turnstile.ok()
	if strings.Contains(buf.String(), "dependency back") {
		t.Fatalf("back within the hold:\n%s", buf.String())
	}
	now = now.Add(10 * time.Second)
	ds.turnstile.ok()
	ds.turnstile.ok()
	if strings.Count(buf.String(), "dependency back") != 1 || !strings.Contains(buf.String(), "failures=1000") {
		t.Fatalf("after the hold:\n%s", buf.String())
	}
	// Flapping on every request for a minute: one line per hold at most.
	buf.Reset()
	for i := 0; i < 6000; i++ {
		now = now.Add(10 * time.Millisecond)
		if i%2 == 0 {
			ds.turnstile.failed(st, down)
		} else {
			ds.turnstile.ok()
		}
	}
	if n := strings.Count(buf.String(), "\n"); n < 2 || n > 7 {
		t.Fatalf("a minute of flapping wrote %d lines, want 2..7 (one per 10 s hold):\n%s", n, buf.String())
	}
	// The other dependency is its own.
	if ds.redis.down.Load() {
		t.Fatal("redis marked down by siteverify's outage")
	}
}

// TestSummarisedFailures: the 5xx that shed load or report an outage are
// summarised; internal errors are not.
func TestSummarisedFailures(t *testing.T) {
	for code, want := range map[string]bool{codes.ServerBusy: true, codes.AITFQueueFull: true, codes.DemoProtectionUnavailable: true,
		codes.ModelUnavailable: true, codes.InternalError: false} {
		if summarised(code) != want {
			t.Errorf("summarised(%s) = %v, want %v", code, !want, want)
		}
	}
}
