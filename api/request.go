package api

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"faregate/agent/task"
	"faregate/protect/canon"
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

// readCreateRequest reads the body (the media type and a declared length
// were checked by bodyShape) and validates it: 413 for a body that turns
// out too large, 400 with a message per field.
func readCreateRequest(r *http.Request) (createRequest, error) {
	body, err := io.ReadAll(io.LimitReader(r.Body, MaxBody+1))
	if err != nil {
		return createRequest{}, invalid("body", "could not be read")
	}
	if len(body) > MaxBody {
		return createRequest{}, ErrTooLarge
	}
	return parseCreateRequest(body)
}

// parseCreateRequest decodes field by field so each wrong field gets its
// own message; unknown fields are ignored.
func parseCreateRequest(body []byte) (createRequest, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var obj map[string]json.RawMessage
	if err := dec.Decode(&obj); err != nil || obj == nil {
		return createRequest{}, invalid("body", "must be a JSON object")
	}
	if _, err := dec.Token(); err != io.EOF {
		return createRequest{}, invalid("body", "must be a single JSON object")
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
	} else if text, msg := checkLine("destination", req.Destination, destinationMax); msg != "" {
		fields["destination"] = msg
	} else {
		req.Destination = text
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
				text, msg := checkLine("interests", s, interestMax)
				if msg != "" {
					fields["interests"] = "each " + msg
					break
				}
				req.Interests = append(req.Interests, text)
			}
		}
	}

	if raw := obj["language"]; !isNull(raw) {
		var lang string
		if err := json.Unmarshal(raw, &lang); err != nil {
			fields["language"] = `must be "en" or "zh-CN"`
		} else if l, ok := languageTag(lang); ok {
			req.Language = l
		} else {
			fields["language"] = `must be "en" or "zh-CN"`
		}
	}
	if len(fields) > 0 {
		return createRequest{}, &InvalidError{Fields: fields}
	}
	return req, nil
}

// checkText applies the contract's text rule to one field: text holding
// format or control characters (canon.Check) is refused before anything
// else sees it; otherwise the text is its NFKC form, trimmed, and must be
// 1..max code points of it. The returned text is what the model is given
// and what the prompt rules and the plan cache fold.
func checkText(field, s string, maxLen int) (text, msg string) {
	if err := canon.Check(field, s); err != nil {
		var ce *canon.Error
		if errors.As(err, &ce) {
			return "", ce.Message()
		}
		return "", err.Error()
	}
	text = strings.TrimSpace(canon.NFKC(s))
	if n := utf8.RuneCountInString(text); n < 1 || n > maxLen {
		return "", fmt.Sprintf("must be 1 to %d characters", maxLen)
	}
	return text, ""
}

// checkLine is checkText for a one-line field of a trip (a destination, an
// interest): tabs and line breaks, which canon allows in longer text, are
// refused too.
func checkLine(field, s string, maxLen int) (text, msg string) {
	text, msg = checkText(field, s, maxLen)
	if msg == "" && strings.ContainsAny(text, "\t\n\r") {
		return "", "must not contain control characters such as tabs or line breaks"
	}
	return text, msg
}

// languageTag accepts the plan languages in any case ("zh-cn" is zh-CN).
func languageTag(s string) (string, bool) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "en":
		return task.LangEnglish, true
	case "zh-cn":
		return task.LangChinese, true
	}
	return "", false
}

// languageFrom picks the plan language from Accept-Language when the body
// names none: the first of the client's preferences we write (Chinese for
// any zh tag), else English. Quality values order the preferences.
func languageFrom(header string) string {
	best, bestQ := task.LangEnglish, -1.0
	for _, part := range strings.Split(header, ",") {
		tag, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		q := 1.0
		if v, ok := strings.CutPrefix(strings.TrimSpace(params), "q="); ok {
			if f, err := strconv.ParseFloat(v, 64); err == nil {
				q = f
			}
		}
		tag = strings.ToLower(strings.TrimSpace(tag))
		var lang string
		switch {
		case tag == "en" || strings.HasPrefix(tag, "en-"):
			lang = task.LangEnglish
		case tag == "zh" || strings.HasPrefix(tag, "zh-"):
			lang = task.LangChinese
		default:
			continue
		}
		if q > bestQ {
			best, bestQ = lang, q
		}
	}
	return best
}

// promptTexts are the request's texts the static prompt rules read.
func promptTexts(req createRequest) []string {
	return append([]string{req.Destination}, req.Interests...)
}
