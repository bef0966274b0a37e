package api

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/go-chi/chi/v5"

	"faregate/agent/task"
	"faregate/protect/aitf"
	"faregate/protect/budget"
	"faregate/protect/clientip"
	"faregate/protect/quota"
	"faregate/protect/turnstile"
)

// Input bounds of a task request (the contract's; the page mirrors them).
const (
	destinationMax = 80
	daysMin        = 1
	daysMax        = 7
	interestsMax   = 5
	interestMax    = 32
)

// createRequest is a validated POST /api/tasks body.
type createRequest struct {
	Token string
	task.Request
}

// shapeError is a refusal of the request's shape: a code and, for 400s,
// per-field messages.
type shapeError struct {
	code   string
	fields map[string]string
}

// readCreateRequest applies the shape checks in the contract's order:
// media type (415), size (413), then JSON and fields (400).
func readCreateRequest(r *http.Request) (createRequest, *shapeError) {
	mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mt != "application/json" {
		return createRequest{}, &shapeError{code: CodeUnsupportedMedia}
	}
	if r.ContentLength > MaxBody {
		return createRequest{}, &shapeError{code: CodeRequestTooLarge}
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxBody+1))
	if err != nil {
		return createRequest{}, &shapeError{code: CodeInvalidRequest, fields: map[string]string{"body": "could not be read"}}
	}
	if len(body) > MaxBody {
		return createRequest{}, &shapeError{code: CodeRequestTooLarge}
	}
	return parseCreateRequest(body)
}

// parseCreateRequest decodes field by field so each wrong field gets its
// own message; unknown fields are ignored.
func parseCreateRequest(body []byte) (createRequest, *shapeError) {
	invalid := func(fields map[string]string) (createRequest, *shapeError) {
		return createRequest{}, &shapeError{code: CodeInvalidRequest, fields: fields}
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var obj map[string]json.RawMessage
	if err := dec.Decode(&obj); err != nil || obj == nil {
		return invalid(map[string]string{"body": "must be a JSON object"})
	}
	if _, err := dec.Token(); err != io.EOF {
		return invalid(map[string]string{"body": "must be a single JSON object"})
	}

	var req createRequest
	fields := map[string]string{}
	isNull := func(raw json.RawMessage) bool { return raw == nil || string(raw) == "null" }

	if raw, ok := obj["turnstile_token"]; ok && !isNull(raw) {
		if err := json.Unmarshal(raw, &req.Token); err != nil {
			fields["turnstile_token"] = "must be a string"
		}
	}

	if raw := obj["destination"]; isNull(raw) {
		fields["destination"] = "is required"
	} else if err := json.Unmarshal(raw, &req.Destination); err != nil {
		fields["destination"] = "must be a string"
	} else {
		req.Destination = strings.TrimSpace(req.Destination)
		if msg := checkText(req.Destination, destinationMax); msg != "" {
			fields["destination"] = msg
		}
	}

	if raw := obj["days"]; isNull(raw) {
		fields["days"] = "is required: a whole number from 1 to 7"
	} else {
		var n json.Number
		d := json.NewDecoder(bytes.NewReader(raw))
		// json.Number would also take a string holding digits; a day count
		// must be a JSON number.
		if raw[0] == '"' || d.Decode(&n) != nil {
			fields["days"] = "must be 1 to 7"
		} else if v, err := strconv.ParseInt(n.String(), 10, 64); err != nil || v < daysMin || v > daysMax {
			// A fractional, exponent or out-of-range number is not a day count.
			fields["days"] = "must be 1 to 7"
		} else {
			req.Days = int(v)
		}
	}

	req.Interests = []string{}
	if raw := obj["interests"]; !isNull(raw) {
		var list []json.RawMessage
		if err := json.Unmarshal(raw, &list); err != nil {
			fields["interests"] = "must be a list of strings"
		} else if len(list) > interestsMax {
			fields["interests"] = fmt.Sprintf("must have at most %d entries", interestsMax)
		} else {
			for _, item := range list {
				var s string
				if err := json.Unmarshal(item, &s); err != nil {
					fields["interests"] = "must be a list of strings"
					break
				}
				s = strings.TrimSpace(s)
				if msg := checkText(s, interestMax); msg != "" {
					fields["interests"] = "each " + msg
					break
				}
				req.Interests = append(req.Interests, s)
			}
		}
	}
	if len(fields) > 0 {
		return invalid(fields)
	}
	return req, nil
}

// checkText validates a trimmed string: 1..max code points, no control characters.
func checkText(s string, maxLen int) string {
	n := utf8.RuneCountInString(s)
	if n < 1 || n > maxLen {
		return fmt.Sprintf("must be 1 to %d characters", maxLen)
	}
	for _, c := range s {
		if unicode.IsControl(c) || c == utf8.RuneError {
			return "must not contain control characters"
		}
	}
	return ""
}

// createResponse is the 202 body.
type createResponse struct {
	ID     string      `json:"id"`
	Status string      `json:"status"`
	Quota  quotaCounts `json:"quota"`
}

type quotaCounts struct {
	IPRemaining     int64 `json:"ip_remaining"`
	GlobalRemaining int64 `json:"global_remaining"`
}

// handleCreateTask is the gate. Checks run in the contract's order, and a
// request stopped early consumes nothing later in the chain:
// shape → AITF delay → Turnstile → already over a daily limit → model
// health → token budget → quota script → store → launch → 202.
func handleCreateTask(d Deps, m *metrics) http.Handler {
	deny := func(w http.ResponseWriter, r *http.Request, code string, retry time.Duration, fields map[string]string) {
		m.denials.WithLabelValues(code).Inc()
		writeError(w, r, code, retry, fields)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		lg := Logger(r.Context(), d.Logger)
		req, bad := readCreateRequest(r)
		if bad != nil {
			deny(w, r, bad.code, 0, bad.fields)
			return
		}
		visitor, ok := clientip.FromContext(r.Context())
		if !ok {
			lg.Error("no visitor in context")
			deny(w, r, CodeInternal, 0, nil)
			return
		}

		if d.AITF != nil {
			release, err := d.AITF.Admit(w, r)
			if err != nil {
				var full *aitf.QueueFullError
				if errors.As(err, &full) {
					deny(w, r, CodeAITFQueueFull, full.RetryAfter, nil)
				}
				// Otherwise the client left while queued: nobody to answer.
				return
			}
			defer release()
		}

		start := time.Now()
		err := d.Verifier.Verify(r.Context(), req.Token, visitor.RemoteIP())
		switch {
		case err == nil:
			m.siteverify.WithLabelValues("accepted").Observe(time.Since(start).Seconds())
		case errors.Is(err, turnstile.ErrRejected):
			m.siteverify.WithLabelValues("rejected").Observe(time.Since(start).Seconds())
			lg.Info("turnstile rejected", "reason", err.Error())
			deny(w, r, CodeTurnstileFailed, 0, nil)
			return
		default:
			m.siteverify.WithLabelValues("unavailable").Observe(time.Since(start).Seconds())
			lg.Warn("turnstile unavailable", "err", err.Error())
			deny(w, r, CodeProtectionDown, 0, nil)
			return
		}

		now := d.Now()
		start = time.Now()
		dec, err := d.Quota.Check(r.Context(), visitor.Key())
		m.quota.WithLabelValues("check", outcome(err, dec.Err)).Observe(time.Since(start).Seconds())
		if err != nil {
			lg.Warn("quota check unavailable", "err", err.Error())
			deny(w, r, CodeProtectionDown, 0, nil)
			return
		}
		if dec.Err != nil {
			d.rateLimitHeaders(w, dec, now)
			deny(w, r, quotaCode(dec.Err), quota.UntilReset(now), nil)
			return
		}

		if d.Models != nil && d.Models.Status() == task.ModelUnavailable {
			deny(w, r, CodeModelUnavailable, 0, nil)
			return
		}

		day := quota.Day(now)
		if d.Budget != nil {
			if err := d.Budget.CanAfford(r.Context(), day, visitor.Key(), d.MinRunTokens); err != nil {
				if errors.Is(err, budget.ErrExhausted) {
					d.rateLimitHeaders(w, dec, now)
					deny(w, r, CodeBudgetExhausted, quota.UntilReset(now), nil)
					return
				}
				lg.Warn("budget check unavailable", "err", err.Error())
				deny(w, r, CodeProtectionDown, 0, nil)
				return
			}
		}

		start = time.Now()
		dec, err = d.Quota.Take(r.Context(), visitor.Key())
		m.quota.WithLabelValues("take", outcome(err, dec.Err)).Observe(time.Since(start).Seconds())
		if err != nil {
			lg.Warn("quota unavailable", "err", err.Error())
			deny(w, r, CodeProtectionDown, 0, nil)
			return
		}
		d.rateLimitHeaders(w, dec, now)
		if dec.Err != nil {
			deny(w, r, quotaCode(dec.Err), quota.UntilReset(now), nil)
			return
		}

		rec := task.Record{Task: task.Task{Request: req.Request}, Visitor: visitor.Key(), Day: day, RequestID: RequestID(r.Context())}
		if res, ok := aitf.FromContext(r.Context()); ok {
			rec.AITF = task.AITFTrace{Score: res.Score, Vector: res.Vector[:], Degraded: res.Degraded}
		}
		// The task must outlive the request: a client that leaves after being
		// counted still gets its task.
		ctx := context.WithoutCancel(r.Context())
		rec, err = d.Tasks.Create(ctx, rec)
		if err != nil {
			lg.Error("task not stored after quota was counted", "err", err.Error())
			deny(w, r, CodeProtectionDown, 0, nil)
			return
		}
		if err := d.Tasks.Launch(rec); err != nil {
			lg.Warn("task not launched", "task", rec.ID, "err", err.Error())
			deny(w, r, CodeProtectionDown, 0, nil)
			return
		}
		m.admissions.Inc()
		lg.Info("task admitted", "task", rec.ID, "visitor", visitor.String(),
			"ip_remaining", dec.VisitorRemaining, "global_remaining", dec.GlobalRemaining)
		w.Header().Set("Location", "/api/tasks/"+rec.ID)
		writeJSON(w, http.StatusAccepted, createResponse{ID: rec.ID, Status: rec.Status,
			Quota: quotaCounts{IPRemaining: dec.VisitorRemaining, GlobalRemaining: dec.GlobalRemaining}})
	})
}

func outcome(err, deny error) string {
	switch {
	case err != nil:
		return "unavailable"
	case deny != nil:
		return "denied"
	}
	return "allowed"
}

func quotaCode(err error) string {
	if errors.Is(err, quota.ErrGlobalLimit) {
		return CodeGlobalLimit
	}
	return CodeIPLimit
}

// rateLimitHeaders sends the IETF draft (draft-ietf-httpapi-ratelimit-headers)
// RateLimit-Policy and RateLimit fields for the visitor's daily quota.
func (d Deps) rateLimitHeaders(w http.ResponseWriter, dec quota.Decision, now time.Time) {
	limit := d.Quota.Limits().Visitor
	reset := int64(quota.UntilReset(now) / time.Second)
	remaining := dec.VisitorRemaining
	if errors.Is(dec.Err, quota.ErrVisitorLimit) {
		remaining = 0
	}
	w.Header().Set("RateLimit-Policy", fmt.Sprintf(`"daily";q=%d;w=86400`, limit))
	w.Header().Set("RateLimit", fmt.Sprintf(`"daily";r=%d;t=%d`, remaining, reset))
}

// handleGetTask answers GET /api/tasks/{id}.
func handleGetTask(d Deps) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rec, err := d.Store.Get(r.Context(), chi.URLParam(r, "id"))
		switch {
		case errors.Is(err, task.ErrNotFound):
			writeError(w, r, CodeTaskNotFound, 0, nil)
			return
		case err != nil:
			Logger(r.Context(), d.Logger).Warn("task read failed", "err", err.Error())
			writeError(w, r, CodeProtectionDown, 0, nil)
			return
		}
		writeJSON(w, http.StatusOK, rec.Task)
	})
}

// configResponse is GET /api/config.
type configResponse struct {
	TurnstileSiteKey   string      `json:"turnstile_site_key"`
	TurnstileScriptURL string      `json:"turnstile_script_url"`
	TurnstileTest      bool        `json:"turnstile_test"`
	DevMode            bool        `json:"dev_mode"`
	ModelStatus        string      `json:"model_status"`
	OfflineModel       bool        `json:"offline_model"`
	Limits             limitsBody  `json:"limits"`
	Input              inputLimits `json:"input"`
}

type limitsBody struct {
	IPDaily     int64 `json:"ip_daily"`
	GlobalDaily int64 `json:"global_daily"`
}

type inputLimits struct {
	DestinationMax int `json:"destination_max"`
	DaysMin        int `json:"days_min"`
	DaysMax        int `json:"days_max"`
	InterestsMax   int `json:"interests_max"`
	InterestMax    int `json:"interest_max"`
}

func handleConfig(d Deps) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		status, offline := task.ModelOK, false
		if d.Models != nil {
			status, offline = d.Models.Status(), d.Models.Offline()
		}
		writeJSON(w, http.StatusOK, configResponse{
			TurnstileSiteKey:   d.Config.TurnstileSiteKey,
			TurnstileScriptURL: d.Config.TurnstileScriptURL,
			TurnstileTest:      d.Config.TurnstileTest,
			DevMode:            d.Config.DevMode,
			ModelStatus:        status,
			OfflineModel:       offline,
			Limits:             limitsBody{IPDaily: d.Config.Limits.Visitor, GlobalDaily: d.Config.Limits.Global},
			Input: inputLimits{DestinationMax: destinationMax, DaysMin: daysMin, DaysMax: daysMax,
				InterestsMax: interestsMax, InterestMax: interestMax},
		})
	})
}

func handleHealth() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
	})
}

// handleReady is 200 only while Redis answers: a replica that cannot check
// quotas should get no traffic.
func handleReady(d Deps) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := d.Store.Ping(ctx); err != nil {
			writeError(w, r, CodeProtectionDown, 0, nil)
			return
		}
		writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
	})
}
