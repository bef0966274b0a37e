package api

import (
	"context"
	"net/http"
	"strings"
	"sync"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// router is the whole HTTP surface on one screen. The order of the checks
// matters and follows the operator's manual: the front middleware (id, visitor,
// connection limit) for everything; then, for /api paths, CORS, and for
// requests a route serves (others are 404 or 405 whatever their headers)
// the body's shape from its headers and the principal (a bad key is 401);
// then per route the request window and the AITF scorer. POST /api/tasks
// runs its own list of checks in order (admission.go). The routes sit in one
// flat tree: a request is routed once (a mounted sub-router would route it
// twice).
func (s *server) router() http.Handler {
	r := chi.NewRouter()
	r.Use(s.front, s.apiOnly(s.serverSpan, s.d.CORS, s.routedOnly(r, s.bodyShape, s.principal)))

	r.Method(http.MethodGet, "/healthz", handleHealth())
	r.Method(http.MethodGet, "/readyz", s.handleReady())
	if s.d.Registry != nil && s.d.Metrics {
		r.Method(http.MethodGet, "/metrics", promhttp.HandlerFor(s.d.Registry, promhttp.HandlerOpts{}))
	}

	// Documents about the API cost nothing and are not counted.
	if s.d.OpenAPI != nil {
		r.Method(http.MethodGet, "/api/openapi.json", s.handleOpenAPI())
	}
	if s.d.Client != nil {
		r.Method(http.MethodGet, "/api/client.js", s.d.Client)
		r.Method(http.MethodGet, "/api/client.d.ts", s.d.Client)
	}

	// POST /api/tasks is its list of checks, in order (admission.go).
	r.Method(http.MethodPost, "/api/tasks", s.admit(s.createChecks(), s.storeAndAnswer))

	read := r.With(s.deadline, s.window(false), s.aitfScore, s.aitfDelay)
	read.Method(http.MethodGet, "/api/config", s.handleConfig())
	read.Method(http.MethodGet, "/api/tasks/{id}", s.handleGetTask())
	// Stream caps are refusals known from memory: they come first.
	r.With(s.streamSlot, s.window(false), s.aitfScore, s.aitfDelay).
		Method(http.MethodGet, "/api/tasks/{id}/events", s.handleTaskEvents())
	r.With(s.deadline, s.window(false)).Method(http.MethodGet, "/api/usage", s.handleUsage())

	// The external agent's surface, on task keys (v1.go).
	if s.d.V1 != nil {
		s.v1Routes(r)
	}

	// Every other path is the page and its assets (the web handler answers
	// its own 404s and 405s), but under /api a JSON 404, and under /v1 one
	// in the model endpoint's shape, mounted or not (a client of the
	// built-in planner's deployment gets an answer its SDK reads).
	r.NotFound(func(w http.ResponseWriter, req *http.Request) {
		if isV1(req.URL.Path) {
			s.WriteV1Error(w, req, ErrNotFound)
			return
		}
		if isAPI(req.URL.Path) || s.d.Web == nil {
			s.writeErr(w, req, ErrNotFound)
			return
		}
		if st := stateOf(req); st != nil {
			st.route = "/*"
		}
		s.d.Web.ServeHTTP(w, req)
	})
	r.MethodNotAllowed(s.methodNotAllowed(r))
	return r
}

// deadline gives the request RequestTimeout to be answered in: a wait in
// the principal's lane or for a Redis connection that would outlast it
// ends in 503 server_busy (or the failing check's own 503), never in a
// connection the write timeout closes without a word. After the
// refusals answered from memory, so those cost no timer.
func (s *server) deadline(next http.Handler) http.Handler {
	d := s.d.Limits.RequestTimeout
	if d <= 0 {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), d)
		defer cancel()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// isAPI reports whether path is the API's.
func isAPI(path string) bool { return path == "/api" || strings.HasPrefix(path, "/api/") }

// apiOnly applies the middleware (nil ones skipped), in order, to /api
// paths only: before routing, so a CORS preflight is answered whatever the
// method and path (and a bad key whatever the route's method, once
// routedOnly has found that the route exists).
func (s *server) apiOnly(mws ...func(http.Handler) http.Handler) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		api := next
		for i := len(mws) - 1; i >= 0; i-- {
			if mws[i] != nil {
				api = mws[i](api)
			}
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if isAPI(r.URL.Path) {
				api.ServeHTTP(w, r)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

// routedOnly applies mws (in order) only to requests some route serves by
// method and path. The rest go straight on to routing, which answers 404 or
// 405 with Allow: whether a method exists does not depend on the headers.
// Their body is never read, so the connection is closed after the answer
// (net/http would otherwise read what is left of it first).
func (s *server) routedOnly(routes chi.Routes, mws ...func(http.Handler) http.Handler) func(http.Handler) http.Handler {
	return func(next http.Handler) http.Handler {
		routed := next
		for i := len(mws) - 1; i >= 0; i-- {
			routed = mws[i](routed)
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodOptions || s.routable(routes, r.Method, routePath(r)) {
				// OPTIONS is CORS's (answered before this when it is on).
				routed.ServeHTTP(w, r)
				return
			}
			if r.ContentLength != 0 {
				w.Header()["Connection"] = hdrCloseConn
			}
			next.ServeHTTP(w, r)
		})
	}
}

// routePath is the path chi routes r by: the escaped form when the URL has
// one (an id holding %2F is one segment), else the path.
func routePath(r *http.Request) string {
	if r.URL.RawPath != "" {
		return r.URL.RawPath
	}
	if r.URL.Path == "" {
		return "/"
	}
	return r.URL.Path
}

// routable reports whether a route serves method on path. Its scratch
// contexts are recycled, so the check costs no allocation per request.
func (s *server) routable(routes chi.Routes, method, path string) bool {
	rc, _ := s.routeCtxs.Get().(*chi.Context)
	if rc == nil {
		rc = chi.NewRouteContext()
	} else {
		rc.Reset()
	}
	ok := routes.Match(rc, method, path)
	s.routeCtxs.Put(rc)
	return ok
}

// allMethods are the methods a 405's Allow header may list.
var allMethods = []string{http.MethodGet, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions}

// methodNotAllowed answers 405 with the Allow header the path supports,
// found by asking the router which methods match it.
func (s *server) methodNotAllowed(routes chi.Routes) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		path := r.URL.Path
		var allow []string
		for _, m := range allMethods {
			if routes.Match(chi.NewRouteContext(), m, path) {
				allow = append(allow, m)
			}
		}
		if len(allow) > 0 {
			w.Header().Set("Allow", strings.Join(allow, ", "))
		}
		if s.d.V1 != nil && isV1(path) {
			s.WriteV1Error(w, r, ErrMethodNotAllowed)
			return
		}
		s.writeErr(w, r, ErrMethodNotAllowed)
	}
}

// handleOpenAPI serves the OpenAPI document.
func (s *server) handleOpenAPI() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h["Content-Type"] = []string{"application/json; charset=utf-8"}
		h["Cache-Control"] = []string{"no-cache"}
		h["X-Content-Type-Options"] = hdrNoSniff
		h["Content-Security-Policy"] = hdrCSPJSON
		_, _ = w.Write(s.d.OpenAPI)
	})
}

// routeNames remembers the route label of each chain of chi patterns:
// chi joins them anew on every call, and every request's metrics need it.
// The set is bounded by the route table.
type routeNames struct {
	mu sync.RWMutex
	m  map[[3]string]string
}

// of is RoutePattern(r), cached.
func (rn *routeNames) of(r *http.Request) string {
	if st := stateOf(r); st != nil && st.route != "" {
		return st.route
	}
	rc := chi.RouteContext(r.Context())
	if rc == nil || len(rc.RoutePatterns) == 0 {
		return "unmatched"
	}
	if len(rc.RoutePatterns) > 3 {
		return RoutePattern(r)
	}
	var k [3]string
	copy(k[:], rc.RoutePatterns)
	rn.mu.RLock()
	v, ok := rn.m[k]
	rn.mu.RUnlock()
	if ok {
		return v
	}
	v = RoutePattern(r)
	rn.mu.Lock()
	if rn.m == nil {
		rn.m = map[[3]string]string{}
	}
	rn.m[k] = v
	rn.mu.Unlock()
	return v
}
