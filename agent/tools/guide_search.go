package tools

import (
	"context"
	"fmt"
	"strings"

	"faregate/agent/chat"
	"faregate/agent/guide"
)

// guideHits is how many sections one guide_search returns: enough to cover
// a city's food and sights, few enough to keep the prompt small.
const guideHits = 5

const maxQueryLen = 200

// GuideResult is guide_search's answer as data: the query and the guide
// sections it found, best first, each with its entries one by one.
type GuideResult struct {
	Query string
	Hits  []guide.Hit
}

// guideSearch needs no client: the corpus is in the binary, so this tool
// works even when every outbound dependency is down.
type guideSearch struct{ ix *guide.Index }

// NewGuideSearch returns guide_search over ix (guide.Default() when nil).
func NewGuideSearch(ix *guide.Index) Tool {
	if ix == nil {
		ix = guide.Default()
	}
	return guideSearch{ix: ix}
}

// Name implements Tool.
func (guideSearch) Name() string { return NameGuideSearch }

// Definition implements Tool; it lists the covered cities so the model
// knows when the guide can answer and when to search the web instead.
func (g guideSearch) Definition() chat.ToolDef {
	return definition(NameGuideSearch,
		"Search the built-in travel guide (offline, always available) for neighbourhoods, food, sights, practical tips and monthly climate of these cities: "+
			strings.Join(g.ix.Cities(), ", ")+". Put the city name in the query.",
		"query", "words to look for, e.g. \"Lisbon food\" or \"Kyoto temples\"")
}

// Call implements Tool. An empty result is an answer, not a failure.
func (g guideSearch) Call(_ context.Context, args string) Observation {
	q, ok := stringArg(args, "query", maxQueryLen)
	if !ok {
		return badArgs(NameGuideSearch, "query", `{"query": "Lisbon food"}`, maxQueryLen)
	}
	hits := g.ix.Search(q, guideHits)
	data := GuideResult{Query: q, Hits: hits}
	if len(hits) == 0 {
		return Observation{Text: fmt.Sprintf("The guide has nothing matching %q. It covers: %s.",
			q, strings.Join(g.ix.Cities(), ", ")), Data: data}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Guide results for %q:\n", q)
	for _, h := range hits {
		fmt.Fprintf(&b, "\n[%s — %s]\n%s\n", h.City, h.Section, h.Text)
	}
	return Observation{Text: strings.TrimRight(b.String(), "\n"), Data: data}
}
