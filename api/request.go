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

// Input bounds of a task request (the documented ones; the page mirrors them).
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
// were checked by bodyShape) and validates it in the form the server takes
// (InputTrip or InputPrompt, a prompt of at most promptMax code points):
// 413 for a body that turns out too large, 400 with a message per field.
func readCreateRequest(r *http.Request, form string, promptMax int) (createRequest, error) {
	body, err := readBody(r, MaxBody, ErrTooLarge)
	if err != nil {
		return createRequest{}, err
	}
	if form == InputPrompt {
		return parsePromptRequest(body, promptMax)
	}
	return parseCreateRequest(body)
}

// decodeObject decodes a body that must be one JSON object into its
// fields, raw.
func decodeObject(body []byte) (map[string]json.RawMessage, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var obj map[string]json.RawMessage
	if err := dec.Decode(&obj); err != nil || obj == nil {
		return nil, invalid("body", "must be a JSON object")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, invalid("body", "must be a single JSON object")
	}
	return obj, nil
}

func isNull(raw json.RawMessage) bool { return raw == nil || string(raw) == "null" }

// commonFields reads the fields both forms have: the Turnstile token and
// the language.
func commonFields(obj map[string]json.RawMessage, req *createRequest, fields map[string]string) {
	if raw, ok := obj["turnstile_token"]; ok && !isNull(raw) {
		if err := json.Unmarshal(raw, &req.Token); err != nil {
			fields["turnstile_token"] = "must be a string"
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
}

// parsePromptRequest decodes the prompt form, {"turnstile_token",
// "prompt", "language"?}: the prompt is checked by the text rule (tabs and
// line breaks allowed), and is 1 to maxChars code points of NFKC after
// trimming. Unknown fields are ignored, trip fields included.
func parsePromptRequest(body []byte, maxChars int) (createRequest, error) {
	obj, err := decodeObject(body)
	if err != nil {
		return createRequest{}, err
	}
	var req createRequest
	fields := map[string]string{}
	commonFields(obj, &req, fields)
	var prompt string
	if raw := obj["prompt"]; isNull(raw) {
		fields["prompt"] = "is required"
	} else if err := json.Unmarshal(raw, &prompt); err != nil {
		fields["prompt"] = "must be a string"
	} else if text, msg := checkText("prompt", prompt, maxChars); msg != "" {
		fields["prompt"] = msg
	} else {
		req.Prompt = text
	}
	if len(fields) > 0 {
		return createRequest{}, &InvalidError{Fields: fields}
	}
	return req, nil
}

// parseCreateRequest decodes the trip form field by field so each wrong
// field gets its own message; unknown fields are ignored.
func parseCreateRequest(body []byte) (createRequest, error) {
	obj, err := decodeObject(body)
	if err != nil {
		return createRequest{}, err
	}
	var req createRequest
	fields := map[string]string{}
	commonFields(obj, &req, fields)

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

	if len(fields) > 0 {
		return createRequest{}, &InvalidError{Fields: fields}
	}
	return req, nil
}

// checkText applies the documented text rule to one field: text holding
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

// promptTexts are the request's texts the static prompt rules read: the
// prompt, or the destination and the interests.
func promptTexts(req createRequest) []string {
	if req.Prompt != "" {
		return []string{req.Prompt}
	}
	return append([]string{req.Destination}, req.Interests...)
}
