package api

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"mime"
	"net/http"

	"faregate/protect/policy"
	"faregate/protect/principal"
	"faregate/protect/quota"
	"faregate/protect/ratelimit"
)

// bodyShape refuses a body by its headers alone, before any middleware or
// handler reads a byte of it: 415 when a request that carries a body is not
// JSON, then 413 when Content-Length is over MaxBody (the contract's order:
// a large text body is 415). A body without a length (chunked) is cut after
// MaxBody+1 bytes, so whoever reads it sees it is too large without reading
// further.
func (s *server) bodyShape(next http.Handler) http.Handler {
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
				s.writeErr(w, r, ErrUnsupportedMedia)
				return
			}
		}
		if r.ContentLength > MaxBody {
			refuseBody(w, r)
			s.writeErr(w, r, ErrTooLarge)
			return
		}
		if r.ContentLength < 0 && r.Body != nil {
			r.Body = &capReader{r: r.Body, left: MaxBody + 1}
		}
		next.ServeHTTP(w, r)
	})
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

// windowCheck is the request window: a sliding minute per principal,
// shared by every replica through Redis, over every /api request but the
// documents. For creations the same round trip also checks the
// failed-check log (visitors) and the anomaly block, and remembers a
// refusal of either for as long as it lasts. errGone: the client left
// while waiting for its lane.
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
		CheckAnomaly:      creation,
		Op:                opID(),
	}
	if creation && st.principal.Kind == principal.KindVisitor {
		req.FailedChecksPerHour = s.d.Limits.FailedChecksPerHour
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
	if err != nil {
		var re *ratelimit.RefusedError
		if errors.As(err, &re) {
			if re.Reason == ratelimit.ReasonRateLimited {
				s.limited.remember(st.principal, re.Unwrap(), re.RetryAfter())
			} else {
				s.memo.remember(st.principal, re.Unwrap(), re.RetryAfter())
			}
		}
		return err
	}
	return nil
}

// opID is a fresh idempotency id for one script call.
func opID() string { return rand.Text() }

// failedCheck records a 400/403 answer to a visitor's creation (seed 001's
// "high ratio of invalid requests"); past the limit the visitor is refused
// from memory before siteverify is called again. Keys are not counted: they
// pass no Turnstile and their limits are their own.
func (s *server) failedCheck(r *http.Request, st *state) {
	if st.principal.Kind != principal.KindVisitor || s.d.Limits.FailedChecksPerHour <= 0 {
		return
	}
	_, blocked, err := s.d.Limiter.RecordFailedCheck(r.Context(), st.principal.Scope(), opID(), s.d.Limits.FailedChecksPerHour)
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
