package task

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode"
	"unicode/utf8"
)

// KindAgent is the kind of a step an external agent reported itself
// (POST /v1/tasks/{id}/events); the page shows it as it shows the
// planner's model and tool steps.
const KindAgent = "agent"

// MaxResultText is the most UTF-8 bytes of an external agent's text.
const MaxResultText = 64 << 10

// textResult is the shape of an external agent's result.
type textResult struct {
	Text     string   `json:"text"`
	Title    string   `json:"title,omitempty"`
	Warnings []string `json:"warnings"`
	Model    string   `json:"model"`
	Language string   `json:"language"`
}

// planResult is the trip planner's shape: Result without the text fields.
type planResult struct {
	Summary  string   `json:"summary"`
	Days     []Day    `json:"days"`
	Warnings []string `json:"warnings"`
	Model    string   `json:"model"`
	Offline  bool     `json:"offline"`
	Language string   `json:"language"`
	Cached   bool     `json:"cached,omitempty"`
}

// MarshalJSON writes a plan as {"summary","days",…} and an external
// agent's answer as {"text","title"?,"warnings","model","language"}: one
// type in Go, the two shapes the manual gives clients.
func (r Result) MarshalJSON() ([]byte, error) {
	ws := r.Warnings
	if ws == nil {
		ws = []string{}
	}
	if r.Text != "" {
		return json.Marshal(textResult{Text: r.Text, Title: r.Title, Warnings: ws, Model: r.Model, Language: r.Language})
	}
	return json.Marshal(planResult{Summary: r.Summary, Days: r.Days, Warnings: r.Warnings, Model: r.Model,
		Offline: r.Offline, Language: r.Language, Cached: r.Cached})
}

// maxTitle bounds a result's title, in code points.
const maxTitle = 200

// Answer is the agent's result: the 200's body or what it POSTs to
// result_url; exactly one of Result and Error.
type Answer struct {
	Result *AnswerResult `json:"result"`
	Error  *AnswerError  `json:"error"`
}

// AnswerResult is the agent's final text.
type AnswerResult struct {
	Text  string  `json:"text"`
	Title *string `json:"title"`
}

// AnswerError is an error the agent reports.
type AnswerError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// ParseAnswer decodes and checks an agent's answer: one object with a
// result (text: 1 byte to 64 KiB of UTF-8; title, if any, one line of
// plain text) or an error. The error says what is wrong, for a 400.
func ParseAnswer(body []byte) (Answer, error) {
	var a Answer
	dec := json.NewDecoder(bytes.NewReader(body))
	if err := dec.Decode(&a); err != nil {
		return Answer{}, errors.New("must be a JSON object with result or error")
	}
	if dec.More() {
		return Answer{}, errors.New("must be a single JSON object")
	}
	switch {
	case a.Result != nil && a.Error != nil:
		return Answer{}, errors.New("has both result and error")
	case a.Result != nil:
		if !utf8.ValidString(a.Result.Text) || strings.TrimSpace(a.Result.Text) == "" {
			return Answer{}, errors.New("result.text must be non-empty UTF-8 text")
		}
		if len(a.Result.Text) > MaxResultText {
			return Answer{}, fmt.Errorf("result.text is over %d bytes", MaxResultText)
		}
		if t := a.Result.Title; t != nil {
			*t = strings.TrimSpace(*t)
			if utf8.RuneCountInString(*t) > maxTitle || !plain(*t, false) {
				return Answer{}, fmt.Errorf("result.title must be one line of plain text of at most %d characters", maxTitle)
			}
		}
	case a.Error != nil:
		if a.Error.Code == "" {
			return Answer{}, errors.New("error.code is required")
		}
	default:
		return Answer{}, errors.New("needs result or error")
	}
	return a, nil
}

// plain reports whether s has no control or format characters (nor tag
// characters), but for newlines and tabs when multiline.
func plain(s string, multiline bool) bool {
	for _, r := range s {
		switch {
		case multiline && (r == '\n' || r == '\t' || r == '\r'):
		case unicode.Is(unicode.Cc, r), unicode.Is(unicode.Cf, r), r >= 0xE0000 && r <= 0xE007F:
			return false
		}
	}
	return true
}
