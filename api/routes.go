package api

import (
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// routes is the whole HTTP surface on one screen. Middleware order matters:
// ids and headers first, so every answer (even a panic's) carries them;
// then the visitor, then (on /api) the AITF scorer, which must see the body
// before the handler reads it.
func routes(d Deps, m *metrics) http.Handler {
	r := chi.NewRouter()
	r.Use(
		func(next http.Handler) http.Handler { return requestIDs(d.Visitors, d.Logger, next) },
		func(next http.Handler) http.Handler { return securityHeaders(d.CSP, next) },
		func(next http.Handler) http.Handler { return recoverer(d.Logger, next) },
		func(next http.Handler) http.Handler { return accessLog(m, next) },
		func(next http.Handler) http.Handler {
			return d.Visitors.Middleware(func(w http.ResponseWriter, r *http.Request, _ error) {
				writeError(w, r, CodeInvalidRequest, 0, nil)
			}, next)
		},
	)

	r.Method(http.MethodGet, "/healthz", handleHealth())
	r.Method(http.MethodGet, "/readyz", handleReady(d))
	if d.Registry != nil {
		r.Method(http.MethodGet, "/metrics", promhttp.HandlerFor(d.Registry, promhttp.HandlerOpts{}))
	}

	r.Route("/api", func(r chi.Router) {
		if d.AITF != nil {
			r.Use(d.AITF.Middleware)
		}
		delay := func(h http.Handler) http.Handler {
			if d.AITF == nil {
				return h
			}
			return d.AITF.Delay(h)
		}
		r.Method(http.MethodGet, "/config", delay(handleConfig(d)))
		// POST /api/tasks waits in the AITF queue itself, after the shape
		// check: a malformed request is refused at once, without a delay.
		r.Method(http.MethodPost, "/tasks", handleCreateTask(d, m))
		r.Method(http.MethodGet, "/tasks/{id}", delay(handleGetTask(d)))
		r.Method(http.MethodGet, "/tasks/{id}/events", delay(handleTaskEvents(d)))
		r.NotFound(func(w http.ResponseWriter, r *http.Request) { writeError(w, r, CodeNotFound, 0, nil) })
		r.MethodNotAllowed(func(w http.ResponseWriter, r *http.Request) { writeError(w, r, CodeMethodNotAllowed, 0, nil) })
	})

	// Everything else is the page and its assets (the web handler answers
	// its own 404s).
	if d.Web != nil {
		r.Handle("/*", d.Web)
	}
	r.NotFound(func(w http.ResponseWriter, req *http.Request) { writeError(w, req, CodeNotFound, 0, nil) })
	r.MethodNotAllowed(func(w http.ResponseWriter, r *http.Request) { writeError(w, r, CodeMethodNotAllowed, 0, nil) })
	return r
}
