// Package outbound is the one door through which the agent's tools reach
// other people's servers. It exists because an AI workflow once fetched the
// same 1.2 MB document 38 times in 47 seconds, retried in storms and posed
// as Chrome. Every request that leaves through here:
//
//   - says who it is (an honest User-Agent and the AITF opt-in headers),
//   - is made at most once per task (per-task cache plus single-flight),
//   - is retried only when that is safe and useful, never past the task's
//     deadline, and never faster than the server asked,
//   - waits its turn behind a per-host concurrency limit, and
//   - brings back at most MaxBody bytes.
//
// A Transport is process-wide (semaphores, connection pool); a Session is
// one task's view of it (cache, warnings, statistics).
package outbound

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sync/semaphore"

	"faregate/protect/kit/pause"
)

// Header names the transport writes or reads.
const (
	HeaderOptIn      = "X-AITF-Opt-In"
	HeaderToolCallID = "X-AITF-Tool-Call-Id"
	HeaderDepth      = "X-AITF-Depth"
	HeaderScore      = "X-AITF-Score"
	// HeaderDegrade on a response means the downstream asks agents to back
	// off; the session records it as a warning.
	HeaderDegrade = "X-AITF-Degrade"
	// HeaderTruncated is set on a response copy whose body was cut at MaxBody.
	HeaderTruncated = "X-Faregate-Truncated"
)

// DefaultPublicURL is named in the User-Agent when no public URL is set.
const DefaultPublicURL = "https://github.com/faregate/faregate"

// MaxRedirects bounds the redirects a Session client follows.
const MaxRedirects = 3

// Defaults for the zero values of Options.
const (
	DefaultMaxRetries  = 2
	DefaultPerHost     = 2
	DefaultCallTimeout = 8 * time.Second
	DefaultMaxBody     = 1 << 20
	// backoffBase is the first retry's longest wait (see backoff).
	backoffBase = 200 * time.Millisecond
)

// backoff is the wait between tries when the server names none: up to
// backoffBase, doubling per attempt, drawn from 1 % to 100 % of that (full
// jitter that never waits nothing). Its cap is past any task's deadline,
// so retryDelay's deadline check, not the cap, ends the growth.
var backoff = pause.Policy{First: backoffBase, Max: time.Minute, Jitter: 0.99}

// Errors returned by round trips, wrapped with the method and host.
var (
	// ErrRequest wraps a transport failure (connect, TLS, timeout, reset).
	ErrRequest = errors.New("outbound: request failed")
	// ErrPermanent marks a failure that retrying cannot fix. Base
	// transports wrap it into their dial errors (fetch_page's address
	// policy does), and the session never retries such an error.
	ErrPermanent = errors.New("outbound: not retryable")
	// ErrTooManyRedirects stops a Session client after MaxRedirects hops.
	ErrTooManyRedirects = errors.New("outbound: too many redirects")
	// ErrHostWait reports that the task's context ended while the request
	// was queued behind the per-host limit.
	ErrHostWait = errors.New("outbound: gave up waiting for a host slot")
)

// Options configure a Transport. Zero values select the documented
// defaults.
type Options struct {
	// Version is the faregate version named in the User-Agent ("dev" if empty).
	Version string
	// PublicURL is where a server operator can learn what this agent is:
	// FAREGATE_PUBLIC_URL, or DefaultPublicURL when empty.
	PublicURL string
	// MaxRetries bounds retries after the first attempt (default 2; a
	// negative value disables retries).
	MaxRetries int
	// PerHost bounds concurrent requests to one host:port (default 2).
	PerHost int
	// CallTimeout bounds one attempt, response body included (default 8s).
	CallTimeout time.Duration
	// MaxBody caps the bytes read from one response body (default 1 MiB).
	MaxBody int64
	// Base performs the actual round trips: by default a clone of
	// http.DefaultTransport with the environment proxy switched off, so
	// requests go where the policy checked they go.
	Base http.RoundTripper
	// Sleep waits between attempts; tests replace it to observe delays
	// without spending them. It must return early with ctx's error.
	Sleep func(ctx context.Context, d time.Duration) error
	// Logger receives retry and pushback events (hosts only, never visitors).
	Logger *slog.Logger
}

// Transport holds what all tasks share: the base round tripper with its
// connection pool and the per-host concurrency limits.
type Transport struct {
	base        http.RoundTripper
	ua          string
	maxRetries  int
	perHost     int64
	callTimeout time.Duration
	maxBody     int64
	sleep       func(ctx context.Context, d time.Duration) error
	lg          *slog.Logger

	mu    sync.Mutex
	hosts map[string]*hostSlot
}

// hostSlot is the semaphore of one host, dropped again when nobody holds or
// waits for it, so a task that visits many hosts leaves nothing behind.
type hostSlot struct {
	sem  *semaphore.Weighted
	refs int
}

// New builds a Transport from o.
func New(o Options) *Transport {
	if o.Version == "" {
		o.Version = "dev"
	}
	if o.PublicURL == "" {
		o.PublicURL = DefaultPublicURL
	}
	switch {
	case o.MaxRetries == 0:
		o.MaxRetries = DefaultMaxRetries
	case o.MaxRetries < 0:
		o.MaxRetries = 0
	}
	if o.PerHost <= 0 {
		o.PerHost = DefaultPerHost
	}
	if o.CallTimeout <= 0 {
		o.CallTimeout = DefaultCallTimeout
	}
	if o.MaxBody <= 0 {
		o.MaxBody = DefaultMaxBody
	}
	if o.Base == nil {
		o.Base = defaultBase()
	}
	if o.Sleep == nil {
		o.Sleep = pause.For
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return &Transport{
		base:        o.Base,
		ua:          fmt.Sprintf("faregate-agent/%s (+%s)", o.Version, o.PublicURL),
		maxRetries:  o.MaxRetries,
		perHost:     int64(o.PerHost),
		callTimeout: o.CallTimeout,
		maxBody:     o.MaxBody,
		sleep:       o.Sleep,
		lg:          o.Logger,
		hosts:       make(map[string]*hostSlot),
	}
}

// defaultBase clones the standard transport without its proxy: a proxy
// taken from the environment would make the dialled address someone
// else's choice.
func defaultBase() *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	t.MaxResponseHeaderBytes = 64 << 10
	return t
}

// UserAgent returns the honest User-Agent every request carries.
func (t *Transport) UserAgent() string { return t.ua }

// acquire waits for a slot of host's semaphore, or for ctx to end.
func (t *Transport) acquire(ctx context.Context, host string) (release func(), err error) {
	t.mu.Lock()
	h := t.hosts[host]
	if h == nil {
		h = &hostSlot{sem: semaphore.NewWeighted(t.perHost)}
		t.hosts[host] = h
	}
	h.refs++
	t.mu.Unlock()

	if err := h.sem.Acquire(ctx, 1); err != nil {
		t.unref(host, h)
		return nil, fmt.Errorf("%w %s: %w", ErrHostWait, host, err)
	}
	return func() {
		h.sem.Release(1)
		t.unref(host, h)
	}, nil
}

// waiting counts the requests holding or waiting for a slot of host.
func (t *Transport) waiting(host string) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	if h := t.hosts[host]; h != nil {
		return h.refs
	}
	return 0
}

func (t *Transport) unref(host string, h *hostSlot) {
	t.mu.Lock()
	defer t.mu.Unlock()
	h.refs--
	if h.refs == 0 && t.hosts[host] == h {
		delete(t.hosts, host)
	}
}

// retryDelay decides how long to wait before attempt number attempt+1, or
// that waiting is pointless. Retry-After wins over backoff; either way the
// wait must end before ctx's deadline, because a retry that cannot finish
// inside the task only burns the server's capacity.
func (t *Transport) retryDelay(ctx context.Context, h http.Header, attempt int) (time.Duration, bool) {
	d, fromServer := retryAfter(h, time.Now())
	if !fromServer {
		d = backoff.Nth(attempt)
	}
	limit := t.callTimeout // with no task deadline, a server may ask for at most one call's worth
	if dl, ok := ctx.Deadline(); ok {
		limit = time.Until(dl)
	}
	if d >= limit {
		return 0, false
	}
	return d, true
}

// retryAfter parses Retry-After as delay-seconds or an HTTP date.
func retryAfter(h http.Header, now time.Time) (time.Duration, bool) {
	v := h.Get("Retry-After")
	if v == "" {
		return 0, false
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs < 0 {
			return 0, false
		}
		// Clamp absurd values before they overflow a Duration.
		if secs > 24*3600 {
			secs = 24 * 3600
		}
		return time.Duration(secs) * time.Second, true
	}
	if at, err := http.ParseTime(v); err == nil {
		if d := at.Sub(now); d > 0 {
			return d, true
		}
		return 0, true
	}
	return 0, false
}

// callKey carries the tool call a request belongs to.
type callKey struct{}

type callInfo struct {
	id    string
	depth int
}

// WithCall tags ctx with the model's tool call id and the agent step (hop)
// that issued it; requests made with the context carry them in
// X-AITF-Tool-Call-Id and X-AITF-Depth.
func WithCall(ctx context.Context, toolCallID string, depth int) context.Context {
	return context.WithValue(ctx, callKey{}, callInfo{id: toolCallID, depth: depth})
}

func callFrom(ctx context.Context) (callInfo, bool) {
	c, ok := ctx.Value(callKey{}).(callInfo)
	return c, ok
}
