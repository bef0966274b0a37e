package api

import (
	"context"
	"errors"
	"io"
	"math"
	"mime"
	"net/http"
	"time"

	"faregate/protect/kit/randhex"
	"faregate/protect/policy"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
)

// bodyShape is the /api surface's body gate (gateBody): 16384 bytes, its
// errors in the /api shape.
func (s *server) bodyShape(next http.Handler) http.Handler {
	return gateBody(MaxBody, ErrTooLarge, s.writeErr)(next)
}

// gateBody is the one body gate of every route that takes a body, /api and
// /v1 alike: it refuses a body by its headers alone, before any middleware
// or handler reads a byte of it. 415 when a request that carries a body is
// not Content-Type: application/json (parameters such as charset allowed;
// an empty Content-Type and other JSON types, such as application/x+json,
// are refused), then 413 (tooLarge) when Content-Length is over limit (the
// order is the manual's: a large text body is 415). A body without a
// length (chunked) is cut after limit+1 bytes, so whoever reads it
// (readBody) sees it is too large without reading further.
func gateBody(limit int64, tooLarge error, write func(http.ResponseWriter, *http.Request, error)) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.Method {
			case http.MethodPost, http.MethodPut, http.MethodPatch:
			default:
				next.ServeHTTP(w, r)
				return
			}
			if ct := r.Header.Get("Content-Type"); ct != "application/json" {
				// The exact common form needs no parsing (ParseMediaType
				// allocates a map even when there are no parameters).
				mt, _, err := mime.ParseMediaType(ct)
				if err != nil || mt != "application/json" {
					refuseBody(w, r)
					write(w, r, ErrUnsupportedMedia)
					return
				}
			}
			if r.ContentLength > limit {
				refuseBody(w, r)
				write(w, r, tooLarge)
				return
			}
			if r.ContentLength < 0 && r.Body != nil {
				r.Body = &capReader{r: r.Body, left: limit + 1}
			}
			next.ServeHTTP(w, r)
		})
	}
}

// readBody reads a body gateBody let through, of at most limit bytes
// (tooLarge past it: a chunked body turns out too large only here). The
// buffer is sized by Content-Length when the client declared one, so a
// large prompt is read in one allocation instead of a doubling series.
func readBody(r *http.Request, limit int64, tooLarge error) ([]byte, error) {
	size := int64(512)
	if r.ContentLength > 0 {
		// One more than declared, to see the end without growing.
		size = min(r.ContentLength, limit) + 1
	}
	buf := make([]byte, 0, size)
	lr := io.LimitReader(r.Body, limit+1)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)] // grow (a chunked body)
		}
		n, err := lr.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if int64(len(buf)) > limit {
			return nil, tooLarge
		}
		if err == io.EOF {
			return buf, nil
		}
		if err != nil {
			return nil, invalid("body", "could not be read")
		}
	}
}

// refuseBody closes the connection after a refusal of a declared body.
// Otherwise net/http drains an unread body of up to 256 KiB before it
// writes the answer, and a client that declares a body and sends it
// slowly (or never) would hold the refusal until the read timeout.
func refuseBody(w http.ResponseWriter, r *http.Request) {
	if r.ContentLength != 0 {
		w.Header()["Connection"] = hdrCloseConn
	}
}

// capReader stops a body of unknown length after MaxBody+1 bytes: enough
// for any reader to learn it is too large, and no more.
type capReader struct {
	r    io.ReadCloser
	left int64
}

func (c *capReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		return 0, io.EOF
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

func (c *capReader) Close() error { return c.r.Close() }

// principal names who the request counts against: the API key of an
// Authorization header (a bad key is 401, never the public lane), else the
// visitor, in the public tier.
func (s *server) principal(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		st := stateOf(r)
		pol := s.d.Policy()
		st.policy = pol
		if token, present := policy.BearerToken(r.Header); present {
			id, tier, err := pol.Authenticate(token)
			if err != nil {
				s.writeErr(w, r, err)
				return
			}
			st.principal = principal.Principal{Kind: principal.KindKey, ID: id, Tier: tier.Name}
			st.tier = tier
		} else {
			st.principal = principal.Principal{Kind: principal.KindVisitor, ID: st.visitor.Key(), Tier: principal.PublicTier}
			st.tier = pol.Public()
		}
		next.ServeHTTP(w, r)
	})
}

// subject is the quota subject of the request's principal.
func (s *server) subject(st *state) quota.Subject {
	if st.principal.Kind == principal.KindKey {
		return quota.Subject{Key: st.principal.ID, Limit: st.tier.TasksPerDay}
	}
	return quota.Subject{Visitor: st.principal.ID, Limit: st.tier.TasksPerDay, Global: s.d.Limits.GlobalDailyTasks}
}

// window is the request window (seed 001's L1) as middleware, for the
// routes other than POST /api/tasks (whose order runs windowCheck itself).
func (s *server) window(creation bool) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch err := s.windowCheck(r, stateOf(r), creation); err {
			case nil:
				next.ServeHTTP(w, r)
			case errGone:
			default:
				s.writeErr(w, r, err)
			}
		})
	}
}

// windowCheck is the request window: a sliding minute and a sliding
// second per principal, shared by every replica through Redis, over every
// /api request but the documents (the second read from the minute's log,
// in the same round trip). For creations the same round trip also checks
// the failed-check log (visitors), the anomaly block and the invalid
// ratio, and remembers a refusal of any of them for as long as it lasts.
// A principal past the soft share of its hourly tokens is held to its
// soft requests per minute. errGone: the client left while waiting for
// its lane.
func (s *server) windowCheck(r *http.Request, st *state, creation bool) error {
	// A principal the window refused is refused again from memory until a
	// request fits: nothing frees a slot sooner, so this is exact, and a
	// flood of it costs no Redis call.
	if err := s.limited.refusal(st.principal); err != nil {
		return err
	}
	// And one principal holds at most a few window checks at once, so a
	// burst from one address waits behind itself, not in front of everyone
	// else's requests on the gate's Redis pool.
	release, err := s.inflight.acquire(r.Context(), st.principal)
	if err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return err // out of time in the lane: busy
		}
		return errGone
	}
	req := ratelimit.GateRequest{
		Scope:             st.principal.Scope(),
		RequestsPerMinute: st.tier.RequestsPerMinute,
		RequestsPerSecond: st.tier.RequestsPerSecond,
		CheckAnomaly:      creation,
		Hour:              hourRule(st.tier),
		Op:                opID(),
	}
	if creation {
		req.Invalid = s.invalidRule()
		if st.principal.Kind == principal.KindVisitor {
			req.FailedChecksPerHour = s.d.Limits.FailedChecksPerHour
		}
	}
	ctx, end := s.span(r.Context(), "gate.window")
	d, err := s.d.Limiter.Gate(ctx, req)
	release()
	if err == nil {
		s.deps.redis.ok()
		err = d.Err()
	}
	end(err)
	st.window = d
	if d.Soft {
		s.alertThrottled(st)
	}
	if err != nil {
		var re *ratelimit.RefusedError
		if errors.As(err, &re) {
			s.rememberRefusal(st, re)
		}
		return err
	}
	return nil
}

// rememberRefusal keeps a window refusal for as long as it lasts: a
// rate_limited one whole (its window names the RateLimit policy), the
// others by their sentinel; an invalid ratio is alerted.
func (s *server) rememberRefusal(st *state, re *ratelimit.RefusedError) {
	switch re.Reason {
	case ratelimit.ReasonRateLimited:
		s.limited.remember(st.principal, re, re.RetryAfter())
	case ratelimit.ReasonInvalidRatio:
		s.memo.remember(st.principal, re.Unwrap(), re.RetryAfter())
		s.alertInvalid(st, re.RetryAfter())
	default:
		s.memo.remember(st.principal, re.Unwrap(), re.RetryAfter())
	}
}

// hourRule is a tier's hourly quota as the gate reads it (none: zero).
func hourRule(t principal.Tier) ratelimit.HourRule {
	if t.TokensPerHour <= 0 {
		return ratelimit.HourRule{}
	}
	return ratelimit.HourRule{Tokens: t.TokensPerHour, SoftTokens: t.SoftTokens(), SoftRequestsPerMinute: t.SoftRequests()}
}

// invalidRule is the invalid ratio as the gate applies it (off: zero).
func (s *server) invalidRule() ratelimit.InvalidRule {
	ratio := s.d.Limits.InvalidRatio
	if ratio <= 0 {
		return ratelimit.InvalidRule{}
	}
	return ratelimit.InvalidRule{Ratio: min(int64(math.Round(ratio*ratelimit.RatioScale)), ratelimit.RatioScale),
		MinRequests: max(s.d.Limits.InvalidMinRequests, 1)}
}

// opID is a fresh idempotency id for one script call.
func opID() string { return randhex.New(16) }

// failedCheck records a 400/403 answer to a creation (seed 001's "high
// ratio of invalid requests"): for a visitor in its failed-check log, past
// whose limit it is refused from memory before siteverify is called again
// (keys pass no Turnstile and their limits are their own), and for any
// principal as an invalid request of its invalid-ratio window, in the same
// round trip.
func (s *server) failedCheck(r *http.Request, st *state) {
	perHour := s.d.Limits.FailedChecksPerHour
	if st.principal.Kind != principal.KindVisitor {
		perHour = 0
	}
	var invalid int64
	if s.d.Limits.InvalidRatio > 0 {
		invalid = 1
	}
	var blocked time.Duration
	var err error
	switch {
	case invalid > 0:
		_, blocked, err = s.d.Limiter.Record(r.Context(), ratelimit.Note{Scope: st.principal.Scope(), Invalid: invalid,
			FailedChecksPerHour: max(perHour, 0), Op: opID()})
	case perHour > 0:
		_, blocked, err = s.d.Limiter.RecordFailedCheck(r.Context(), st.principal.Scope(), opID(), perHour)
	default:
		return
	}
	if err != nil {
		// The refusal is answered either way; the count is best effort.
		return
	}
	if blocked > 0 {
		s.memo.remember(st.principal, ratelimit.ErrTooManyFailedChecks, blocked)
	}
}

// aitfScore scores the request body for agent-workflow signals (the AITF
// guard's middleware), if the guard is on.
func (s *server) aitfScore(next http.Handler) http.Handler {
	if s.d.AITF == nil {
		return next
	}
	return s.d.AITF.Middleware(next)
}

// aitfDelay applies the AITF delay queue to reads of the public lane.
func (s *server) aitfDelay(next http.Handler) http.Handler {
	if s.d.AITF == nil {
		return next
	}
	delayed := s.d.AITF.Delay(next)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if stateOf(r).principal.Kind == principal.KindKey {
			// A key has declared itself; it is limited by its own tier.
			next.ServeHTTP(w, r)
			return
		}
		delayed.ServeHTTP(w, r)
	})
}

// admitAITF holds a public creation in the AITF delay queue (enforce mode),
// after its shape was found valid.
func (s *server) admitAITF(w http.ResponseWriter, r *http.Request) (release func(), err error) {
	if s.d.AITF == nil || stateOf(r).principal.Kind == principal.KindKey {
		return func() {}, nil
	}
	return s.d.AITF.Admit(w, r)
}
