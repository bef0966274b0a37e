package api

import (
	"net/http"
	"time"

	"faregate/protect/aitf"
)

// newAITF is the AITF guard of o with what only the server knows filled
// in: its refusal (the documented 503 aitf_queue_full), the observe-mode
// count in the refusal summary, the principal as visitor key, the route
// label and the body limit. Built here, the guard and the server need no
// closure over a variable assigned later to find each other.
func (s *server) newAITF(o aitf.Options) *aitf.Guard {
	o.Refuse = s.refuseAITF
	o.Observed = func(*http.Request, aitf.Result) { s.summary.note("aitf_observed") }
	o.VisitorKey = PrincipalScope
	o.Route = RoutePattern
	o.MaxBody = MaxBody
	return aitf.New(o)
}

// refuseAITF answers 503 aitf_queue_full with Retry-After.
func (s *server) refuseAITF(w http.ResponseWriter, r *http.Request, retryAfter time.Duration) {
	s.writeErr(w, r, &retryError{aitf.ErrQueueFull, retryAfter})
}
