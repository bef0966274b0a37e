package alert

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"faregate/protect/kit/pause"
)

// ErrRefused marks an answer that a retry would not change (a 4xx other
// than 429): the receiver refused the body.
var ErrRefused = errors.New("alert: webhook refused the body")

// Poster POSTs JSON bodies to one URL as the Notifier delivers alerts:
// each signed (X-Faregate-Signature: sha256=<hex HMAC-SHA256 of the exact
// body>) when a secret is set, sent at most four times (three retries on
// network errors, 5xx and 429, with exponential backoff and full jitter,
// honouring Retry-After up to MaxRetryAfter), each attempt bounded by
// Timeout, and only a 2xx counting as delivered. The billing export sends
// its batches with one.
type Poster struct {
	URL, Secret string
	// UserAgent names the sender ("faregate-alert").
	UserAgent string
	// Client sends the POSTs (default: one that does not follow redirects).
	Client *http.Client
	// Timeout bounds one attempt (5s); MaxRetryAfter caps the wait a
	// Retry-After asks for (30s).
	Timeout, MaxRetryAfter time.Duration
	// Backoff is the wait before retry number attempt (1, 2, 3); by
	// default a random time up to 500ms, 1s, 2s.
	Backoff func(attempt int) time.Duration
	// Now is the clock Retry-After dates are read against (time.Now).
	Now func() time.Time
}

// Post sends body as the Poster's doc says and returns how many attempts
// it made; the error of the last one, wrapping ErrRefused when the
// receiver refused it.
func (p *Poster) Post(ctx context.Context, body []byte) (int, error) {
	return p.post(ctx, body, pause.For)
}

// post is Post with wait sleeping between attempts (tests see the waits).
func (p *Poster) post(ctx context.Context, body []byte, wait func(context.Context, time.Duration) error) (int, error) {
	sig := ""
	if p.Secret != "" {
		mac := hmac.New(sha256.New, []byte(p.Secret))
		mac.Write(body)
		sig = "sha256=" + hex.EncodeToString(mac.Sum(nil))
	}
	backoff := p.Backoff
	if backoff == nil {
		backoff = defaultBackoff
	}
	var err error
	for attempt := 1; ; attempt++ {
		var retryAfter time.Duration
		retryAfter, err = p.attempt(ctx, body, sig)
		if err == nil || errors.Is(err, ErrRefused) || attempt == maxAttempts {
			return attempt, err
		}
		d := backoff(attempt)
		if retryAfter > 0 {
			d = max(d, min(retryAfter, p.maxRetryAfter()))
		}
		if werr := wait(ctx, d); werr != nil {
			return attempt, fmt.Errorf("%w (then %w)", err, werr)
		}
	}
}

func (p *Poster) maxRetryAfter() time.Duration {
	if p.MaxRetryAfter > 0 {
		return p.MaxRetryAfter
	}
	return 30 * time.Second
}

// attempt makes one POST. A non-nil error is retryable unless it wraps
// ErrRefused; retryAfter is what a 429 or 503 asked for.
func (p *Poster) attempt(ctx context.Context, body []byte, sig string) (retryAfter time.Duration, err error) {
	timeout := p.Timeout
	if timeout <= 0 {
		timeout = 5 * time.Second
	}
	actx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(actx, http.MethodPost, p.URL, bytes.NewReader(body))
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrRefused, err)
	}
	req.Header.Set("Content-Type", "application/json")
	if p.UserAgent != "" {
		req.Header.Set("User-Agent", p.UserAgent)
	}
	if sig != "" {
		req.Header.Set("X-Faregate-Signature", sig)
	}
	client := p.Client
	if client == nil {
		client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, fmt.Errorf("alert: post: %w", err)
	}
	// Drain a little so the connection can be reused; never read unbounded.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	_ = resp.Body.Close()
	now := time.Now
	if p.Now != nil {
		now = p.Now
	}
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		return 0, nil
	case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		return parseRetryAfter(resp.Header.Get("Retry-After"), now()), fmt.Errorf("alert: webhook answered %d", resp.StatusCode)
	default:
		return 0, fmt.Errorf("%w: status %d", ErrRefused, resp.StatusCode)
	}
}

// parseRetryAfter reads delay-seconds or an HTTP date; 0 when absent or bad.
func parseRetryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(v); err == nil {
		return time.Duration(max(s, 0)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(t.Sub(now), 0)
	}
	return 0
}
