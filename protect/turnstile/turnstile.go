// Package turnstile checks Cloudflare Turnstile tokens on the server with the
// siteverify API. It fails closed: a token counts only when Cloudflare
// answered success for one of our hostnames; when Cloudflare cannot be asked
// the caller gets ErrUnavailable, never a silent pass.
package turnstile

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"faregate/protect/kit/randhex"
)

// DummyToken is the token Cloudflare's test site keys hand to the page; test
// secrets (and TestVerifier) accept only it, production secrets reject it.
const DummyToken = "XXXX.DUMMY.TOKEN.XXXX"

// MaxTokenLen is the longest token Cloudflare issues, in bytes. Tokens are
// ASCII, so this is also their length in characters.
const MaxTokenLen = 2048

// DefaultVerifyURL is Cloudflare's siteverify endpoint.
const DefaultVerifyURL = "https://challenges.cloudflare.com/turnstile/v0/siteverify"

// DefaultTimeout bounds one Verify call when Options.Timeout is zero.
const DefaultTimeout = 5 * time.Second

// maxBody caps the siteverify answer we read; real answers are a few hundred
// bytes, so anything larger is not Cloudflare talking.
const maxBody = 64 << 10

// ErrRejected means the token is not good: missing, too long, refused by
// Cloudflare or issued for another hostname or action. The API answers 403
// turnstile_failed.
var ErrRejected = errors.New("turnstile: rejected")

// ErrUnavailable means Cloudflare could not give a usable answer: network
// failure, timeout, non-2xx status, a body that is not a JSON object, or
// internal-error. The API answers 503 demo_protection_unavailable.
var ErrUnavailable = errors.New("turnstile: unavailable")

// Verifier checks one Turnstile token. A nil error means accepted; otherwise
// the error wraps ErrRejected or ErrUnavailable. remoteIP is optional.
type Verifier interface {
	Verify(ctx context.Context, token, remoteIP string) error
}

// Options configures a Client.
type Options struct {
	// Secret is the widget's secret key.
	Secret string
	// VerifyURL defaults to DefaultVerifyURL; tests point it at an emulator.
	VerifyURL string
	// Hostnames lists the hostnames a token must have been issued for,
	// compared case-insensitively. Empty rejects every token.
	Hostnames []string
	// Timeout bounds a whole Verify call, retry included. Zero means
	// DefaultTimeout.
	Timeout time.Duration
	// Action is the widget action a token must carry; "" skips the check.
	Action string
	// HTTPClient defaults to a fresh client; Timeout is applied through the
	// context, so the client needs no timeout of its own.
	HTTPClient *http.Client
}

// Client verifies tokens against siteverify. It is safe for concurrent use.
type Client struct {
	secret    string
	url       string
	hostnames []string
	timeout   time.Duration
	action    string
	hc        *http.Client
}

var (
	_ Verifier = (*Client)(nil)
	_ Verifier = TestVerifier{}
)

// NewClient returns a Client for o, filling in defaults.
func NewClient(o Options) *Client {
	c := &Client{
		secret:  o.Secret,
		url:     o.VerifyURL,
		timeout: o.Timeout,
		action:  o.Action,
		hc:      o.HTTPClient,
	}
	if c.url == "" {
		c.url = DefaultVerifyURL
	}
	if c.timeout <= 0 {
		c.timeout = DefaultTimeout
	}
	if c.hc == nil {
		c.hc = &http.Client{}
	}
	for _, h := range o.Hostnames {
		if h = strings.ToLower(strings.TrimSpace(h)); h != "" {
			c.hostnames = append(c.hostnames, h)
		}
	}
	return c
}

// siteverifyAnswer is the part of Cloudflare's answer we act on. Success is a
// pointer so that an object without it is told apart from success:false.
type siteverifyAnswer struct {
	Success    *bool    `json:"success"`
	Hostname   string   `json:"hostname"`
	Action     string   `json:"action"`
	ErrorCodes []string `json:"error-codes"`
}

// Verify checks token with siteverify, passing remoteIP when it is not
// empty. It retries once, with the same idempotency key so Cloudflare does
// not treat the retry as a replay, after a network error or a 5xx status if
// the Timeout budget is not spent. Error texts never contain the secret or
// remoteIP.
func (c *Client) Verify(ctx context.Context, token, remoteIP string) error {
	if err := checkToken(token); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()

	form := url.Values{
		"secret":          {c.secret},
		"response":        {token},
		"idempotency_key": {randhex.UUID()},
	}
	if remoteIP != "" {
		form.Set("remoteip", remoteIP)
	}
	body := form.Encode()

	var err error
	for attempt := 0; attempt < 2; attempt++ {
		var ans siteverifyAnswer
		var retry bool
		ans, retry, err = c.post(ctx, body)
		if err == nil {
			return c.judge(ans)
		}
		if !retry || ctx.Err() != nil {
			break
		}
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		// Report the budget rather than whatever the transport made of the
		// cancellation; %w keeps context.DeadlineExceeded/Canceled visible.
		return fmt.Errorf("%w: siteverify gave no answer within %s: %w", ErrUnavailable, c.timeout, ctxErr)
	}
	return err
}

// post makes one siteverify request. retry reports whether the failure is
// one worth a second attempt (network error or 5xx).
func (c *Client) post(ctx context.Context, body string) (ans siteverifyAnswer, retry bool, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, c.url, strings.NewReader(body))
	if err != nil {
		// Only a malformed VerifyURL gets here: a configuration fault.
		return ans, false, fmt.Errorf("%w: bad verify URL: %v", ErrUnavailable, err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Accept", "application/json")
	resp, err := c.hc.Do(req)
	if err != nil {
		return ans, true, fmt.Errorf("%w: siteverify request failed: %v", ErrUnavailable, redact(err))
	}
	defer resp.Body.Close()
	// Read one byte past the cap to tell "exactly at the cap" from "over".
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxBody+1))
	if err != nil {
		return ans, true, fmt.Errorf("%w: reading siteverify answer: %v", ErrUnavailable, redact(err))
	}
	switch {
	case resp.StatusCode >= 500:
		return ans, true, fmt.Errorf("%w: siteverify status %d", ErrUnavailable, resp.StatusCode)
	case resp.StatusCode < 200 || resp.StatusCode > 299:
		// Cloudflare answers 200 even for bad tokens; any other status means
		// our request or configuration is broken, which is not the
		// visitor's fault, so it is not a rejection either.
		return ans, false, fmt.Errorf("%w: siteverify status %d", ErrUnavailable, resp.StatusCode)
	case len(raw) > maxBody:
		return ans, false, fmt.Errorf("%w: siteverify answer over %d bytes", ErrUnavailable, maxBody)
	}
	// Unmarshal accepts "null" into a struct, so insist on an object first.
	if t := bytes.TrimSpace(raw); len(t) == 0 || t[0] != '{' {
		return ans, false, fmt.Errorf("%w: siteverify answer is not a JSON object", ErrUnavailable)
	}
	if err := json.Unmarshal(raw, &ans); err != nil {
		return ans, false, fmt.Errorf("%w: siteverify answer: %v", ErrUnavailable, err)
	}
	if ans.Success == nil {
		return ans, false, fmt.Errorf("%w: siteverify answer lacks success", ErrUnavailable)
	}
	return ans, false, nil
}

// judge turns a well-formed answer into the verdict.
func (c *Client) judge(ans siteverifyAnswer) error {
	if !*ans.Success {
		if slices.Contains(ans.ErrorCodes, "internal-error") {
			return fmt.Errorf("%w: siteverify internal-error", ErrUnavailable)
		}
		return fmt.Errorf("%w: siteverify error-codes %q", ErrRejected, ans.ErrorCodes)
	}
	if ans.Hostname == "" {
		return fmt.Errorf("%w: answer has no hostname", ErrRejected)
	}
	if !slices.Contains(c.hostnames, strings.ToLower(ans.Hostname)) {
		return fmt.Errorf("%w: hostname %q not allowed", ErrRejected, ans.Hostname)
	}
	if c.action != "" && ans.Action != c.action {
		return fmt.Errorf("%w: action %q, want %q", ErrRejected, ans.Action, c.action)
	}
	return nil
}

// redact drops the *url.Error wrapper, whose text repeats the URL; the rest
// (dial errors, EOF) names the server's address, never the visitor's.
func redact(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		return ue.Err
	}
	return err
}

// checkToken applies the local checks that need no network. The length is
// checked before any request so an attacker cannot make us post megabytes.
func checkToken(token string) error {
	switch {
	case token == "":
		return fmt.Errorf("%w: missing token", ErrRejected)
	case len(token) > MaxTokenLen:
		return fmt.Errorf("%w: token longer than %d", ErrRejected, MaxTokenLen)
	}
	return nil
}

// TestVerifier is the local verifier used when no secret is configured. It
// behaves like Cloudflare's always-pass test secret: it accepts only
// DummyToken and never touches the network.
type TestVerifier struct{}

// Verify accepts DummyToken and rejects every other token with ErrRejected.
func (TestVerifier) Verify(_ context.Context, token, _ string) error {
	if err := checkToken(token); err != nil {
		return err
	}
	if token != DummyToken {
		return fmt.Errorf("%w: test verifier accepts only the dummy token", ErrRejected)
	}
	return nil
}
