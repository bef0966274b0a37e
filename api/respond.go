package api

import (
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"sync"

	"faregate/protect/codes"
	"faregate/protect/kit/jsonstr"
)

// Header values shared by every JSON answer. Assigning these slices
// directly (net/http never modifies them) keeps the refusal path free of
// per-request header allocations.
var (
	hdrJSON        = []string{"application/json; charset=utf-8"}
	hdrNoStore     = []string{"no-store"}
	hdrNoSniff     = []string{"nosniff"}
	hdrReferrer    = []string{"strict-origin-when-cross-origin"}
	hdrCSPJSON     = []string{"default-src 'none'; frame-ancestors 'none'"}
	hdrCloseConn   = []string{"close"}
	retryAfterHdrs = func() [61][]string {
		var out [61][]string
		for i := range out {
			out[i] = []string{strconv.Itoa(i)}
		}
		return out
	}()
)

// jsonHeaders sets what every JSON answer carries: its type, no caching,
// and the short CSP a document-less answer needs (the page's full CSP is
// for the page; frame-ancestors 'none' is what X-Frame-Options would say).
func jsonHeaders(h http.Header) {
	h["Content-Type"] = hdrJSON
	h["Cache-Control"] = hdrNoStore
	h["Content-Security-Policy"] = hdrCSPJSON
	h["X-Content-Type-Options"] = hdrNoSniff
	h["Referrer-Policy"] = hdrReferrer
}

func setRetryAfter(h http.Header, secs int64) {
	if secs >= 0 && secs < int64(len(retryAfterHdrs)) {
		h["Retry-After"] = retryAfterHdrs[secs]
		return
	}
	h["Retry-After"] = []string{strconv.FormatInt(secs, 10)}
}

var bufPool = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

// writeErr answers err with the documented error envelope. The table picks
// status, code, message and Retry-After; the request's state records the
// code for the access log and the refusal summary. Only 5xx answers are
// logged one by one (by the access log); the client never sees err's text.
func (s *server) writeErr(w http.ResponseWriter, r *http.Request, err error) {
	spec := s.errors.lookup(err)
	st := stateOf(r)
	if st != nil {
		st.code, st.err = spec.code, err
	}
	h := w.Header()
	jsonHeaders(h)
	if secs, ok := retryAfter(spec, err); ok {
		setRetryAfter(h, secs)
		if spec.status == http.StatusTooManyRequests {
			s.rateLimitHeaders(h, st, spec.code, err, secs)
		}
	}
	if spec.status == http.StatusRequestEntityTooLarge {
		// The rest of the body is never read: without a close, net/http
		// would read it before answering (a chunked body that never ends:
		// until the read timeout), or read it as the next request.
		h["Connection"] = hdrCloseConn
	}
	var fields map[string]string
	var message string
	switch spec.code {
	case codes.InvalidRequest:
		var ie *InvalidError
		if errors.As(err, &ie) {
			fields = ie.Fields
		}
	case codes.PromptRejected:
		var pe *PromptRejectedError
		if errors.As(err, &pe) {
			message = spec.message + " (rule: " + pe.Rule + ")"
		}
	case codes.DemoBudgetExhausted:
		if isHourRefusal(err) {
			message = hourMessage
		}
	case codes.RateLimited:
		message = windowMessage(err)
	}
	bp := bufPool.Get().(*[]byte)
	b := (*bp)[:0]
	if message != "" {
		b = append(b, `{"error":{"code":`...)
		b = jsonstr.Append(b, spec.code)
		b = append(b, `,"message":`...)
		b = jsonstr.Append(b, message)
	} else {
		b = append(b, spec.head...)
	}
	if st != nil && st.id != "" {
		b = append(b, `,"request_id":"`...)
		b = append(b, st.id...) // request ids are validated to be JSON-safe
		b = append(b, '"')
	}
	if len(fields) > 0 {
		raw, _ := json.Marshal(fields)
		b = append(b, `,"fields":`...)
		b = append(b, raw...)
	}
	b = append(b, "}}\n"...)
	w.WriteHeader(spec.status)
	_, _ = w.Write(b)
	*bp = b
	bufPool.Put(bp)
}

// writeJSON writes v as JSON with status; API answers are never cached.
func writeJSON(w http.ResponseWriter, status int, v any) {
	jsonHeaders(w.Header())
	raw, err := json.Marshal(v)
	if err != nil {
		// Every body here is a plain struct; a failure is a bug.
		defaultErrors.writeBare(w, defaultErrors.internal)
		return
	}
	w.WriteHeader(status)
	_, _ = w.Write(append(raw, '\n'))
}
