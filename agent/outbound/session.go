package outbound

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sync/singleflight"

	"faregate/protect/codes"
)

// SessionOptions describe the task a Session serves.
type SessionOptions struct {
	// Score is the task's AITF score, sent as X-AITF-Score when HasScore.
	Score    float64
	HasScore bool
	// Warn receives task warnings (code, detail). It may be nil.
	Warn func(code, detail string)
}

// Stats counts what a Session did, for tests and the task's closing note.
type Stats struct {
	// RoundTrips counts attempts handed to the base transport.
	RoundTrips int64
	// CacheHits counts requests answered from an earlier, finished request.
	CacheHits int64
	// Shared counts requests that joined an identical request in flight.
	Shared int64
	// Retries counts attempts after the first one.
	Retries int64
}

// Session is one task's client state: every GET or HEAD is made at most
// once, whatever the number of callers, and its outcome (response or
// error) is replayed to each of them. It is an http.RoundTripper.
type Session struct {
	t    *Transport
	opts SessionOptions

	// flights joins callers of a request already under way.
	flights singleflight.Group

	mu     sync.Mutex
	done   map[string]outcome // finished requests, by method and URL
	warned map[string]bool

	roundTrips, cacheHits, shared, retries atomic.Int64
}

// outcome is a finished exchange, kept as bytes so every caller can get a
// fresh *http.Response of its own.
type outcome struct {
	status     string
	statusCode int
	proto      string
	protoMajor int
	protoMinor int
	header     http.Header
	body       []byte
	err        error
	// abandoned marks an outcome cut short by the leader's own context;
	// it says nothing about the server, so it is neither cached nor shared.
	abandoned bool
}

// Session starts the client state of one task.
func (t *Transport) Session(o SessionOptions) *Session {
	return &Session{t: t, opts: o, done: make(map[string]outcome), warned: make(map[string]bool)}
}

// Client returns an http.Client that sends through the session. It keeps
// no cookies and follows at most MaxRedirects redirects.
func (s *Session) Client() *http.Client {
	return &http.Client{Transport: s, CheckRedirect: checkRedirect}
}

func checkRedirect(_ *http.Request, via []*http.Request) error {
	if len(via) > MaxRedirects {
		return fmt.Errorf("%w (more than %d)", ErrTooManyRedirects, MaxRedirects)
	}
	return nil
}

// Stats returns the session's counters so far.
func (s *Session) Stats() Stats {
	return Stats{
		RoundTrips: s.roundTrips.Load(),
		CacheHits:  s.cacheHits.Load(),
		Shared:     s.shared.Load(),
		Retries:    s.retries.Load(),
	}
}

// RoundTrip implements http.RoundTripper.
func (s *Session) RoundTrip(req *http.Request) (*http.Response, error) {
	out := s.prepare(req)
	if !cacheable(req.Method) {
		return s.fetch(out, false).response(req)
	}
	// The request body of a GET is ignored for the cache key and not sent
	// twice; RoundTrip must still close it.
	if req.Body != nil && req.Body != http.NoBody {
		defer req.Body.Close()
	}
	key := req.Method + " " + req.URL.String()
	for {
		if o, ok := s.finished(key); ok {
			s.cacheHits.Add(1)
			return o.response(req)
		}
		// Only the caller whose function runs leads; the others join its
		// flight. led and fromCache are written by the leader's function
		// and read after its result arrives.
		var led, fromCache bool
		ch := s.flights.DoChan(key, func() (any, error) {
			// A flight that ended between the look above and this one left
			// its outcome behind: no second request.
			if o, ok := s.finished(key); ok {
				fromCache = true
				return o, nil
			}
			led = true
			o := s.fetch(out, true)
			if !o.abandoned {
				s.mu.Lock()
				s.done[key] = o
				s.mu.Unlock()
			}
			return o, nil
		})
		var res singleflight.Result
		select {
		case res = <-ch:
		case <-req.Context().Done():
			// This caller gives up; the flight goes on for the others.
			return nil, fmt.Errorf("%w: %s %s: %w", ErrRequest, req.Method, req.URL.Host, req.Context().Err())
		}
		o := res.Val.(outcome)
		switch {
		case o.abandoned && !led:
			// The leader's task gave up, not the server: try again, this
			// time perhaps as the leader.
			continue
		case fromCache:
			s.cacheHits.Add(1)
		case !led:
			s.shared.Add(1)
		}
		return o.response(req)
	}
}

// finished returns the outcome of a request made earlier in this session.
func (s *Session) finished(key string) (outcome, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	o, ok := s.done[key]
	return o, ok
}

func cacheable(method string) bool {
	return method == http.MethodGet || method == http.MethodHead || method == ""
}

// prepare copies req with the identity headers; a caller's User-Agent is
// replaced, never kept, so no tool can pose as a browser.
func (s *Session) prepare(req *http.Request) *http.Request {
	out := req.Clone(req.Context())
	out.Header.Set("User-Agent", s.t.ua)
	out.Header.Set(HeaderOptIn, "true")
	out.Header.Del(HeaderToolCallID)
	out.Header.Del(HeaderDepth)
	out.Header.Del(HeaderScore)
	if c, ok := callFrom(req.Context()); ok {
		if c.id != "" {
			out.Header.Set(HeaderToolCallID, c.id)
		}
		out.Header.Set(HeaderDepth, strconv.Itoa(c.depth))
	}
	if s.opts.HasScore {
		out.Header.Set(HeaderScore, strconv.FormatFloat(s.opts.Score, 'f', -1, 64))
	}
	return out
}

// fetch performs req with retries when idempotent allows them.
//
// The loop is written here rather than taken from hashicorp/go-retryablehttp
// (v0.7.8 was checked), because that client cannot keep this policy: its
// wait between attempts is a fixed time.NewTimer (tests here observe the
// waits a server asked for without spending them, through Options.Sleep);
// its Backoff can only name a wait, not decline a retry whose wait would
// outlast the task's deadline; and when it gives up it calls
// CloseIdleConnections on the client, which here is the process-wide pool
// every task shares. The per-attempt host slot, call timeout, body cap and
// pushback warning would still have to live below it, so it would replace
// about twenty lines and need five hooks to do it.
func (s *Session) fetch(req *http.Request, idempotent bool) outcome {
	ctx := req.Context()
	retries := 0
	if idempotent && (req.Body == nil || req.Body == http.NoBody || req.GetBody != nil) {
		retries = s.t.maxRetries
	}
	for attempt := 0; ; attempt++ {
		if attempt > 0 && req.GetBody != nil {
			body, err := req.GetBody()
			if err != nil {
				return outcome{err: fmt.Errorf("%w: %s %s: %w", ErrRequest, req.Method, req.URL.Host, err)}
			}
			req.Body = body
		}
		o, retryable := s.attempt(req)
		if o.err != nil && ctx.Err() != nil {
			o.abandoned = true
			return o
		}
		s.notePushback(req.URL.Hostname(), o)
		if !retryable || attempt >= retries {
			return o
		}
		d, ok := s.t.retryDelay(ctx, o.header, attempt)
		if !ok {
			s.t.lg.Info("outbound: not retrying, the wait does not fit the task deadline",
				"host", req.URL.Host, "status", o.statusCode)
			return o
		}
		s.t.lg.Debug("outbound: retrying", "host", req.URL.Host, "attempt", attempt+1,
			"status", o.statusCode, "delay", d)
		s.retries.Add(1)
		if err := s.t.sleep(ctx, d); err != nil {
			return outcome{err: fmt.Errorf("%w: %s %s: %w", ErrRequest, req.Method, req.URL.Host, err), abandoned: true}
		}
	}
}

// attempt makes one round trip under the host limit and call timeout and
// reads the capped body; it reports whether the result is worth a retry.
func (s *Session) attempt(req *http.Request) (outcome, bool) {
	ctx := req.Context()
	release, err := s.t.acquire(ctx, req.URL.Host)
	if err != nil {
		return outcome{err: err}, false
	}
	defer release()

	actx, cancel := context.WithTimeout(ctx, s.t.callTimeout)
	defer cancel()
	s.roundTrips.Add(1)
	resp, err := s.t.base.RoundTrip(req.WithContext(actx))
	if err != nil {
		return outcome{err: fmt.Errorf("%w: %s %s: %w", ErrRequest, req.Method, req.URL.Host, err)}, retryableErr(err)
	}
	defer resp.Body.Close()

	body, truncated, err := readCapped(resp, s.t.maxBody)
	if err != nil {
		// A body cut off mid-way is a network failure like any other.
		return outcome{err: fmt.Errorf("%w: %s %s: reading body: %w", ErrRequest, req.Method, req.URL.Host, err)}, retryableErr(err)
	}
	h := resp.Header.Clone()
	if truncated {
		h.Set(HeaderTruncated, "true")
	}
	if req.Method != http.MethodHead {
		h.Set("Content-Length", strconv.Itoa(len(body)))
	}
	return outcome{
		status: resp.Status, statusCode: resp.StatusCode,
		proto: resp.Proto, protoMajor: resp.ProtoMajor, protoMinor: resp.ProtoMinor,
		header: h, body: body,
	}, retryableStatus(resp.StatusCode)
}

// readCapped reads at most limit bytes and never one more: a body longer
// than the limit is reported truncated from the size alone, so a 3 MiB
// page costs 1 MiB of transfer and memory, not 1 MiB plus a probe.
func readCapped(resp *http.Response, limit int64) ([]byte, bool, error) {
	body, err := io.ReadAll(io.LimitReader(resp.Body, limit))
	if err != nil {
		return nil, false, err
	}
	n := int64(len(body))
	truncated := n == limit && resp.ContentLength != n
	return body, truncated, nil
}

func retryableStatus(code int) bool {
	switch code {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

// retryableErr tells transient network failures from ones a retry cannot
// change: a refused destination, an unknown host, a bad certificate, or a
// task that was cancelled.
func retryableErr(err error) bool {
	if errors.Is(err, ErrPermanent) || errors.Is(err, context.Canceled) {
		return false
	}
	var dns *net.DNSError
	if errors.As(err, &dns) && dns.IsNotFound {
		return false
	}
	var cert *tls.CertificateVerificationError
	return !errors.As(err, &cert)
}

// notePushback records a 429 or X-AITF-Degrade answer as a task warning,
// once per host per session, so the operator sees who pushed back.
func (s *Session) notePushback(host string, o outcome) {
	if o.err != nil {
		return
	}
	if o.statusCode != http.StatusTooManyRequests && !strings.EqualFold(strings.TrimSpace(o.header.Get(HeaderDegrade)), "true") {
		return
	}
	s.mu.Lock()
	first := !s.warned[host]
	s.warned[host] = true
	s.mu.Unlock()
	if !first {
		return
	}
	s.t.lg.Info("outbound: downstream pushed back", "host", host, "status", o.statusCode)
	if s.opts.Warn != nil {
		s.opts.Warn(codes.DownstreamPushback, host)
	}
}

// response builds a fresh response for one caller from the shared outcome.
func (o outcome) response(req *http.Request) (*http.Response, error) {
	if o.err != nil {
		return nil, o.err
	}
	body, length := o.body, int64(len(o.body))
	if req.Method == http.MethodHead {
		// A HEAD answer has no body but may announce the length of one.
		body, length = nil, -1
		if n, err := strconv.ParseInt(o.header.Get("Content-Length"), 10, 64); err == nil {
			length = n
		}
	}
	return &http.Response{
		Status:        o.status,
		StatusCode:    o.statusCode,
		Proto:         o.proto,
		ProtoMajor:    o.protoMajor,
		ProtoMinor:    o.protoMinor,
		Header:        o.header.Clone(),
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: length,
		Request:       req,
	}, nil
}
