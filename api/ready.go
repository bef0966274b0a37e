package api

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// readyMaxAge is how old a readiness probe may be when /readyz answers from
// it: load balancers poll often, and each poll must not cost a Redis call.
const readyMaxAge = time.Second

// readyTimeout bounds one probe.
const readyTimeout = 2 * time.Second

// readiness caches the probe's verdict. A request that finds it older than
// readyMaxAge runs a new probe; concurrent requests wait for that one
// instead of probing too.
type readiness struct {
	probe func(context.Context) error
	now   func() time.Time

	mu       sync.Mutex
	at       time.Time
	err      error
	inflight chan struct{}
}

func (rd *readiness) check(ctx context.Context) error {
	rd.mu.Lock()
	if !rd.at.IsZero() && rd.now().Sub(rd.at) <= readyMaxAge {
		err := rd.err
		rd.mu.Unlock()
		return err
	}
	wait := rd.inflight
	if wait == nil {
		rd.inflight = make(chan struct{})
		rd.mu.Unlock()
		pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), readyTimeout)
		err := rd.probe(pctx)
		cancel()
		rd.mu.Lock()
		rd.at, rd.err = rd.now(), err
		close(rd.inflight)
		rd.inflight = nil
		rd.mu.Unlock()
		return err
	}
	rd.mu.Unlock()
	select {
	case <-wait:
	case <-ctx.Done():
		return ctx.Err()
	}
	rd.mu.Lock()
	defer rd.mu.Unlock()
	return rd.err
}

// handleReady is 200 only while the protection keys' Redis answers a
// key-bound read: a replica that cannot check quotas should get no traffic.
func (s *server) handleReady() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := s.ready.check(r.Context()); err != nil {
			s.writeErr(w, r, err)
			return
		}
		s.deps.redis.ok()
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	})
}

func handleHealth() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
}
