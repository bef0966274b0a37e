// Package guide is the agent's offline travel knowledge: a small corpus of
// cities embedded in the binary, searchable with BM25, and a lookup that
// turns a place name typed by a visitor or a model into coordinates and
// seasonal climate norms. Nothing here touches the network, so the agent can
// still plan a trip when every outbound tool is down.
package guide

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
)

//go:embed corpus.json
var corpusJSON []byte

// Section names of the documents each city is split into for search.
const (
	SectionOverview       = "overview"
	SectionNeighbourhoods = "neighbourhoods"
	SectionFood           = "food"
	SectionSights         = "sights"
	SectionPractical      = "practical"
	SectionClimate        = "climate"
)

// Months names the months for climate text, January first.
var months = [12]string{"January", "February", "March", "April", "May", "June",
	"July", "August", "September", "October", "November", "December"}

// City is one destination of the corpus.
type City struct {
	Name     string   `json:"name"`
	Country  string   `json:"country"`
	Timezone string   `json:"timezone"`
	Aliases  []string `json:"aliases"`
	Lat      float64  `json:"lat"`
	Lon      float64  `json:"lon"`
	Summary  string   `json:"summary"`
	// Neighbourhoods, Food, Sights and Practical are one sentence or short
	// paragraph per entry, written for travellers.
	Neighbourhoods []string `json:"neighbourhoods"`
	Food           []string `json:"food"`
	Sights         []string `json:"sights"`
	Practical      []string `json:"practical"`
	// Climate holds the long-term monthly norms, January first: what the
	// agent quotes when the live forecast is unavailable.
	Climate [12]Norm `json:"climate"`
}

// Norm is one month's climate norm.
type Norm struct {
	HighC     float64
	LowC      float64
	Condition string // one word: sunny, rainy, showery, mixed, cloudy, humid, hot, cold, windy
}

// UnmarshalJSON reads the compact [high, low, "condition"] form the corpus
// uses, which keeps twelve months of a city on one readable line.
func (n *Norm) UnmarshalJSON(b []byte) error {
	var raw [3]json.RawMessage
	if err := json.Unmarshal(b, &raw); err != nil {
		return fmt.Errorf("guide: climate norm %s: %w", b, err)
	}
	if err := json.Unmarshal(raw[0], &n.HighC); err != nil {
		return fmt.Errorf("guide: climate high %s: %w", raw[0], err)
	}
	if err := json.Unmarshal(raw[1], &n.LowC); err != nil {
		return fmt.Errorf("guide: climate low %s: %w", raw[1], err)
	}
	return json.Unmarshal(raw[2], &n.Condition)
}

// MonthName returns the English name of month m (1–12).
func MonthName(m int) string {
	if m < 1 || m > 12 {
		return ""
	}
	return months[m-1]
}

// Norm returns the city's climate norm for month m (1–12).
func (c City) Norm(m int) (Norm, bool) {
	if m < 1 || m > 12 {
		return Norm{}, false
	}
	return c.Climate[m-1], true
}

// Hit is one search result: a section of a city's guide.
type Hit struct {
	City    string
	Section string
	// Text is the section as one text, entries one per line.
	Text string
	// Entries are the section's entries one by one ("Alfama: the oldest
	// quarter…"), for callers that use them as data rather than prose.
	Entries []string
	Score   float64
}

// defaultIndex parses the embedded corpus once. It is immutable after
// construction, so sharing it between goroutines needs no lock.
var defaultIndex = sync.OnceValue(func() *Index {
	var cities []City
	if err := json.Unmarshal(corpusJSON, &cities); err != nil {
		// The corpus is compiled in and covered by tests: a parse failure
		// is a build defect, not a runtime condition to recover from.
		panic(fmt.Sprintf("guide: embedded corpus: %v", err))
	}
	return New(cities)
})

// Default returns the index over the embedded corpus.
func Default() *Index { return defaultIndex() }

// Index searches and looks up cities. It is read-only once built and safe
// for concurrent use.
type Index struct {
	cities []City
	byKey  map[string]int // normalised name or alias -> city position
	docs   []doc
	post   map[string][]posting
	avgLen float64
}

// doc is one searchable section of one city.
type doc struct {
	city    int
	section string
	text    string
	entries []string
	length  float64
}

// posting records a term's weighted frequency in one document.
type posting struct {
	doc int
	tf  float64
}

// BM25 parameters: the textbook values, which suit short sections well.
const (
	bm25K1 = 1.2
	bm25B  = 0.75
	// titleWeight counts each occurrence of a city name, alias or section
	// name as this many body occurrences (a simple BM25F), so "Lisbon food"
	// lands on Lisbon's food section rather than on any text that merely
	// mentions fish.
	titleWeight = 3
)

// New builds an index over cities. Tests use it with hand-made corpora;
// production uses Default.
func New(cities []City) *Index {
	ix := &Index{
		cities: slices.Clone(cities),
		byKey:  make(map[string]int),
		post:   make(map[string][]posting),
	}
	for i, c := range ix.cities {
		for _, name := range append([]string{c.Name}, c.Aliases...) {
			if k := normalize(name); k != "" {
				if _, taken := ix.byKey[k]; !taken {
					ix.byKey[k] = i
				}
			}
		}
		title := c.Name + " " + c.Country + " " + strings.Join(c.Aliases, " ")
		for _, s := range sections(c) {
			ix.addDoc(i, s, title)
		}
	}
	var total float64
	for _, d := range ix.docs {
		total += d.length
	}
	if len(ix.docs) > 0 {
		ix.avgLen = total / float64(len(ix.docs))
	}
	return ix
}

// section is one document of a city: its entries, joined by newlines for
// search and display.
type section struct {
	name    string
	entries []string
}

func (s section) text() string { return strings.Join(s.entries, "\n") }

// sections splits a city into the documents search ranks; the overview
// carries the summary and the facts a planner needs first.
func sections(c City) []section {
	overview := fmt.Sprintf("%s, %s. %s Coordinates %.4f, %.4f; time zone %s.",
		c.Name, c.Country, c.Summary, c.Lat, c.Lon, c.Timezone)
	if len(c.Aliases) > 0 {
		overview += " Also known as " + strings.Join(c.Aliases, ", ") + "."
	}
	var climate []string
	for m, n := range c.Climate {
		if n.Condition == "" && n.HighC == 0 && n.LowC == 0 {
			continue
		}
		climate = append(climate, fmt.Sprintf("%s: high %.0f °C, low %.0f °C, usually %s.",
			months[m], n.HighC, n.LowC, n.Condition))
	}
	return []section{
		{SectionOverview, []string{overview}},
		{SectionNeighbourhoods, c.Neighbourhoods},
		{SectionFood, c.Food},
		{SectionSights, c.Sights},
		{SectionPractical, c.Practical},
		{SectionClimate, climate},
	}
}

func (ix *Index) addDoc(city int, s section, title string) {
	name, text := s.name, s.text()
	if strings.TrimSpace(text) == "" {
		return
	}
	tf := make(map[string]float64)
	var length float64
	for _, t := range tokenize(text) {
		tf[t]++
		length++
	}
	for _, t := range tokenize(title + " " + name) {
		tf[t] += titleWeight
		length += titleWeight
	}
	id := len(ix.docs)
	ix.docs = append(ix.docs, doc{city: city, section: name, text: text, entries: slices.Clone(s.entries), length: length})
	for t, f := range tf {
		ix.post[t] = append(ix.post[t], posting{doc: id, tf: f})
	}
}
