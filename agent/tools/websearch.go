package tools

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"faregate/agent/chat"
	"faregate/protect/codes"
)

// searchResults is how many results web_search shows the model.
const searchResults = 5

// snippetLen bounds one result's snippet, in characters.
const snippetLen = 300

// webSearch queries one SearxNG-compatible instance.
type webSearch struct {
	c   *http.Client
	url string
}

// NewWebSearch returns web_search over a SearxNG-compatible JSON API at
// cfg.SearchURL. Offer it only when SearchURL is set (All does this).
func NewWebSearch(c *http.Client, cfg Config) Tool {
	return webSearch{c: c, url: cfg.SearchURL}
}

// Name implements Tool.
func (webSearch) Name() string { return NameWebSearch }

// Definition implements Tool.
func (webSearch) Definition() chat.ToolDef {
	return definition(NameWebSearch,
		"Search the web for current information the built-in guide lacks (events, opening hours, recent news). Returns titles, URLs and snippets of the top results.",
		"query", "search words, e.g. \"Lisbon events September 2026\"")
}

// Call implements Tool. Any failure of the search service reads the same
// to the model (use the guide instead); the detail is in the warning.
func (s webSearch) Call(ctx context.Context, args string) Observation {
	q, ok := stringArg(args, "query", maxQueryLen)
	if !ok {
		return badArgs(NameWebSearch, "query", `{"query": "Lisbon events this week"}`, maxQueryLen)
	}
	unavailable := Observation{Failed: true, Warning: codes.SearchUnavailable,
		Text: "Web search is unavailable right now; rely on the built-in guide (guide_search) instead."}
	if s.url == "" {
		return unavailable
	}
	var res struct {
		Results []struct {
			Title   string `json:"title"`
			URL     string `json:"url"`
			Content string `json:"content"`
		} `json:"results"`
	}
	if err := getJSON(ctx, s.c, s.url, url.Values{"q": {q}, "format": {"json"}}, &res); err != nil {
		return unavailable
	}
	var b strings.Builder
	n := 0
	for _, r := range res.Results {
		// Only web links: a javascript: or data: URL in a result would
		// be an invitation for fetch_page to misbehave.
		u, err := url.Parse(r.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") {
			continue
		}
		n++
		// Titles and snippets come from strangers' pages: flatten and
		// bound them so one result cannot dominate the prompt.
		title, _ := clip(oneLine(r.Title), 150)
		snippet, _ := clip(oneLine(r.Content), snippetLen)
		fmt.Fprintf(&b, "\n%d. %s\n   %s\n", n, title, r.URL)
		if snippet != "" {
			fmt.Fprintf(&b, "   %s\n", snippet)
		}
		if n == searchResults {
			break
		}
	}
	if n == 0 {
		return Observation{Text: fmt.Sprintf("No web results for %q.", q)}
	}
	return Observation{Text: fmt.Sprintf("Web results for %q:\n%s", q, strings.TrimRight(b.String(), "\n"))}
}

// oneLine collapses all whitespace, including newlines, to single spaces.
func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }
