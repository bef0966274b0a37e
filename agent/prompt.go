package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"faregate/agent/task"
	"faregate/protect/canon"
)

// systemPrompt tells the model its job, its tools and the answer format.
const systemPrompt = `You are faregate's trip planner. Plan a day-by-day itinerary for the visitor's request.
Use the tools when they help: guide_search for the travel guide (neighbourhoods, food, sights, practical notes),
weather for the forecast, web_search and fetch_page (when offered) for anything the guide lacks. Call each tool
at most once with the same arguments; their answers do not change.
When you have enough, answer with ONLY a JSON object, no prose and no code fences, of this exact shape:
{"summary": string, "days": [{"day": 1, "title": string, "items": [string, ...]}, ...]}
with exactly one entry per requested day, days numbered from 1, 3 to 6 short items per day.`

// languageNames are how the prompt names the plan's language.
var languageNames = map[string]string{
	task.LangEnglish: "English",
	task.LangChinese: "Simplified Chinese (zh-CN)",
}

// userPrompt is the first user message of a run: the request in words,
// and the language the plan is to be written in. The visitor's text is
// given in NFKC, as the manual says the model sees it: the api stores it
// so already, and a record written otherwise must not show the model a
// spelling the plan cache would not key (plancache.CheckRequest refuses
// it).
func userPrompt(r task.Request) string {
	interests := "none in particular"
	if len(r.Interests) > 0 {
		in := make([]string, len(r.Interests))
		for i, s := range r.Interests {
			in[i] = canon.NFKC(s)
		}
		interests = strings.Join(in, ", ")
	}
	lang, ok := languageNames[r.Lang()]
	if !ok {
		lang = r.Lang()
	}
	return fmt.Sprintf("Plan %d day(s) in %s. Interests: %s.\n"+
		"Write the summary, the day titles and the items in %s; keep the JSON keys in English and place names as the guide gives them.",
		r.Days, canon.NFKC(r.Destination), interests, lang)
}

// closingPrompt is added as a user message to the one call without tools
// that ends a run after a bound was hit, so the model answers instead of
// asking for more tools it is no longer offered.
const closingPrompt = "Stop using tools now. From what you have, answer with ONLY the final JSON object described above."

// repairPrompt asks once more after an invalid answer.
func repairPrompt(problem string) string {
	return "That answer was not valid: " + problem + ". Reply again with ONLY the JSON object " +
		`{"summary": string, "days": [{"day": int, "title": string, "items": [string]}]}` + ", nothing else."
}

// Answer bounds: longer model text is cut, not refused.
const (
	maxSummary = 1200
	maxTitle   = 120
	maxItem    = 300
	maxItems   = 12
)

var errNoJSON = errors.New("no JSON object found")

// parseAnswer extracts and validates the model's final JSON answer for a
// request of days days. It tolerates code fences and text around the object.
func parseAnswer(text string, days int) (summary string, out []task.Day, err error) {
	start := strings.Index(text, "{")
	end := strings.LastIndex(text, "}")
	if start < 0 || end <= start {
		return "", nil, errNoJSON
	}
	var raw struct {
		Summary *string `json:"summary"`
		Days    []struct {
			Day   *int     `json:"day"`
			Title *string  `json:"title"`
			Items []string `json:"items"`
		} `json:"days"`
	}
	if err := json.Unmarshal([]byte(text[start:end+1]), &raw); err != nil {
		return "", nil, fmt.Errorf("not valid JSON of the requested shape (%v)", err)
	}
	if raw.Summary == nil || strings.TrimSpace(*raw.Summary) == "" {
		return "", nil, errors.New(`"summary" must be a non-empty string`)
	}
	if len(raw.Days) != days {
		return "", nil, fmt.Errorf(`"days" must have exactly %d entries, it has %d`, days, len(raw.Days))
	}
	for i, d := range raw.Days {
		if d.Day == nil || *d.Day != i+1 {
			return "", nil, fmt.Errorf(`day entries must be numbered 1 to %d in order`, days)
		}
		if d.Title == nil || strings.TrimSpace(*d.Title) == "" {
			return "", nil, fmt.Errorf(`day %d needs a non-empty "title"`, i+1)
		}
		var items []string
		for _, it := range d.Items {
			if it = strings.TrimSpace(it); it != "" {
				items = append(items, clip(it, maxItem))
			}
		}
		if len(items) == 0 {
			return "", nil, fmt.Errorf(`day %d needs at least one item`, i+1)
		}
		if len(items) > maxItems {
			items = items[:maxItems]
		}
		out = append(out, task.Day{Day: i + 1, Title: clip(strings.TrimSpace(*d.Title), maxTitle), Items: items})
	}
	return clip(strings.TrimSpace(*raw.Summary), maxSummary), out, nil
}

// clip cuts s to at most n code points.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}
