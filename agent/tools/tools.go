// Package tools holds the trip planner's tools: guide_search over the
// embedded corpus, weather, web_search and fetch_page. A tool never returns
// an error to the agent loop: whatever happens becomes an Observation the
// model can read, plus a warning code when a dependency was unavailable, so
// the task degrades instead of failing.
//
// The HTTP tools take an *http.Client; in production it is an
// outbound.Session client, which adds the honest identity headers, the
// per-task cache and the retry policy. fetch_page's client must sit on
// SafeTransport, which refuses every non-public address at dial time.
package tools

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
	"unicode/utf8"

	"faregate/agent/chat"
	"faregate/agent/guide"
)

// Tool names as the model sees them.
const (
	NameGuideSearch = "guide_search"
	NameWeather     = "weather"
	NameWebSearch   = "web_search"
	NameFetchPage   = "fetch_page"
)

// Default endpoints of Open-Meteo's public APIs.
const (
	DefaultWeatherURL   = "https://api.open-meteo.com/v1/forecast"
	DefaultGeocodingURL = "https://geocoding-api.open-meteo.com/v1/search"
)

// Observation is what a tool call produced, ready to hand to the model.
type Observation struct {
	Text string
	// Failed is true when the tool could not do what was asked (bad
	// arguments, dependency down); Text then explains why.
	Failed bool
	// Degraded is true when a dependency was down but the tool answered
	// with a stand-in that Text names (the seasonal norms for a forecast):
	// the task's step shows as degraded, not failed. Failed stays true, for
	// planners that want the asked-for answer.
	Degraded bool
	// Warning is "" or a task warning code (codes.WeatherUnavailable,
	// codes.SearchUnavailable, codes.FetchFailed) for the operator, set
	// only when a dependency let the task down.
	Warning string
	// Data is the result as typed values (GuideResult, Forecast) for
	// planners that are not language models; nil when the tool has none.
	Data any
}

// Tool is one function the model may call.
type Tool interface {
	// Name is the function name the model uses.
	Name() string
	// Definition describes the function and its JSON arguments to the model.
	Definition() chat.ToolDef
	// Call runs the tool with the model's JSON argument string. It never
	// panics and never returns an error: failures are observations.
	Call(ctx context.Context, args string) Observation
}

// Config locates the tools' data sources.
type Config struct {
	// WeatherURL is an Open-Meteo-compatible forecast endpoint
	// (FAREGATE_WEATHER_URL; DefaultWeatherURL when empty).
	WeatherURL string
	// GeocodingURL is an Open-Meteo-compatible geocoding endpoint
	// (FAREGATE_GEOCODING_URL; DefaultGeocodingURL when empty).
	GeocodingURL string
	// SearchURL is a SearxNG-compatible search endpoint
	// (FAREGATE_SEARCH_URL); when empty web_search is not offered.
	SearchURL string
	// Guide supplies coordinates and climate norms; guide.Default() when nil.
	Guide *guide.Index
	// Now is the clock used to pick the month of seasonal norms.
	Now func() time.Time
}

// withDefaults fills the zero values of c.
func (c Config) withDefaults() Config {
	if c.WeatherURL == "" {
		c.WeatherURL = DefaultWeatherURL
	}
	if c.GeocodingURL == "" {
		c.GeocodingURL = DefaultGeocodingURL
	}
	if c.Guide == nil {
		c.Guide = guide.Default()
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	return c
}

// All returns the tools to offer a model: api serves weather and search,
// fetch (which must be built on SafeTransport) serves fetch_page. web_search
// is left out without a SearchURL and fetch_page without a fetch client.
func All(api, fetch *http.Client, cfg Config) []Tool {
	out := []Tool{NewGuideSearch(cfg.Guide), NewWeather(api, cfg)}
	if cfg.SearchURL != "" {
		out = append(out, NewWebSearch(api, cfg))
	}
	if fetch != nil {
		out = append(out, NewFetchPage(fetch))
	}
	return out
}

// Definitions lists the descriptions of ts, to offer them in a chat.Turn.
func Definitions(ts []Tool) []chat.ToolDef {
	out := make([]chat.ToolDef, 0, len(ts))
	for _, t := range ts {
		out = append(out, t.Definition())
	}
	return out
}

// definition builds a function tool with one required string argument.
func definition(name, description, arg, argDescription string) chat.ToolDef {
	return chat.ToolDef{
		Name:        name,
		Description: description,
		Parameters: map[string]any{
			"type": "object",
			"properties": map[string]any{
				arg: map[string]any{"type": "string", "description": argDescription},
			},
			"required":             []string{arg},
			"additionalProperties": false,
		},
	}
}

// stringArg extracts one required string argument from the model's JSON.
// Models sometimes wrap arguments in a string or send a bare string; both
// are accepted because the intent is unambiguous.
func stringArg(args, name string, maxLen int) (string, bool) {
	args = strings.TrimSpace(args)
	var obj map[string]any
	if err := json.Unmarshal([]byte(args), &obj); err != nil {
		var inner string
		if json.Unmarshal([]byte(args), &inner) != nil {
			return "", false
		}
		if json.Unmarshal([]byte(inner), &obj) != nil {
			return "", false
		}
	}
	v, ok := obj[name].(string)
	v = strings.TrimSpace(v)
	if !ok || v == "" || utf8.RuneCountInString(v) > maxLen {
		return "", false
	}
	return v, true
}

// badArgs is the observation for arguments that do not fit the schema.
func badArgs(tool, arg, example string, maxLen int) Observation {
	return Observation{
		Failed: true,
		Text: fmt.Sprintf("%s needs JSON arguments {%q: string} with a non-empty %s of at most %d characters, for example %s.",
			tool, arg, arg, maxLen, example),
	}
}

// clip shortens s to at most n runes, marking the cut.
func clip(s string, n int) (string, bool) {
	if utf8.RuneCountInString(s) <= n {
		return s, false
	}
	r := []rune(s)
	return strings.TrimSpace(string(r[:n])) + " …", true
}
