package guide

import (
	"slices"
	"strings"
	"testing"
)

// required lists the cities the issue names; the corpus must cover each.
var required = []string{"Lisbon", "Tokyo", "Paris", "New York", "Barcelona", "Rome",
	"Kyoto", "London", "Istanbul", "Bangkok", "Mexico City", "Cape Town"}

func TestCorpusComplete(t *testing.T) {
	ix := Default()
	for _, name := range required {
		t.Run(name, func(t *testing.T) {
			c, ok := ix.Lookup(name)
			if !ok {
				t.Fatalf("Lookup(%q) found nothing", name)
			}
			checks := []struct {
				what      string
				n, lo, hi int
			}{
				{"neighbourhoods", len(c.Neighbourhoods), 4, 6},
				{"food", len(c.Food), 5, 8},
				{"sights", len(c.Sights), 6, 10},
				{"practical", len(c.Practical), 4, 6},
			}
			for _, ch := range checks {
				if ch.n < ch.lo || ch.n > ch.hi {
					t.Errorf("%s: %d entries, want %d–%d", ch.what, ch.n, ch.lo, ch.hi)
				}
			}
			if c.Country == "" || c.Timezone == "" || c.Summary == "" || len(c.Aliases) == 0 {
				t.Errorf("missing country, timezone, summary or aliases: %+v", c)
			}
			if c.Lat < -90 || c.Lat > 90 || c.Lon < -180 || c.Lon > 180 || (c.Lat == 0 && c.Lon == 0) {
				t.Errorf("implausible coordinates %v, %v", c.Lat, c.Lon)
			}
			for m, n := range c.Climate {
				if n.Condition == "" || strings.Contains(n.Condition, " ") || n.HighC <= n.LowC || n.HighC > 45 || n.LowC < -30 {
					t.Errorf("%s norm %+v is not a plausible one-word norm", MonthName(m+1), n)
				}
			}
		})
	}
}

func TestSearchFindsCityByName(t *testing.T) {
	ix := Default()
	for _, name := range ix.Cities() {
		t.Run(name, func(t *testing.T) {
			hits := ix.Search(name, 5)
			if len(hits) == 0 || hits[0].City != name {
				t.Fatalf("Search(%q) top hit = %+v, want %s", name, hits, name)
			}
		})
	}
}

func TestSearchRanking(t *testing.T) {
	ix := Default()
	tests := []struct {
		name, query  string
		wantTop      []string // the top hit's city is one of these
		wantAbove    []string // best of these cities ranks above ...
		below        string   // ... the best hit of this one (or it is absent)
		wantSection  string   // "" = any
		wantContains string   // text of the top hit contains this
	}{
		{name: "ramen temple", query: "ramen temple", wantTop: []string{"Kyoto", "Tokyo"}, wantAbove: []string{"Kyoto", "Tokyo"}, below: "Lisbon"},
		{name: "pastel de nata", query: "pastel de nata", wantTop: []string{"Lisbon"}, wantSection: SectionFood, wantContains: "Pastéis de Belém"},
		{name: "city plus section", query: "Lisbon food", wantTop: []string{"Lisbon"}, wantSection: SectionFood},
		{name: "accents folded", query: "Sao Jorge castelo", wantTop: []string{"Lisbon"}},
		{name: "upper case accents", query: "SÃO JORGE", wantTop: []string{"Lisbon"}},
		{name: "chinese alias inside a phrase", query: "东京天气", wantTop: []string{"Tokyo"}},
		{name: "japanese alias", query: "京都 お寺", wantTop: []string{"Kyoto"}},
		{name: "city name dominates common words", query: "Rome food market", wantTop: []string{"Rome"}},
		{name: "penguins", query: "penguins", wantTop: []string{"Cape Town"}},
		{name: "tacos al pastor", query: "tacos al pastor", wantTop: []string{"Mexico City"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			hits := ix.Search(tc.query, 50)
			if len(hits) == 0 {
				t.Fatalf("Search(%q): no hits", tc.query)
			}
			if !slices.Contains(tc.wantTop, hits[0].City) {
				t.Errorf("top hit %s/%s, want one of %v", hits[0].City, hits[0].Section, tc.wantTop)
			}
			if tc.wantSection != "" && hits[0].Section != tc.wantSection {
				t.Errorf("top section %s, want %s", hits[0].Section, tc.wantSection)
			}
			if tc.wantContains != "" && !strings.Contains(hits[0].Text, tc.wantContains) {
				t.Errorf("top text %q lacks %q", hits[0].Text, tc.wantContains)
			}
			// Entries are the same text, one entry each.
			if got := strings.Join(hits[0].Entries, "\n"); got != hits[0].Text {
				t.Errorf("entries %q do not make up the text %q", hits[0].Entries, hits[0].Text)
			}
			if tc.below != "" {
				best := func(cities ...string) int {
					for i, h := range hits {
						if slices.Contains(cities, h.City) {
							return i
						}
					}
					return len(hits)
				}
				if a, b := best(tc.wantAbove...), best(tc.below); a >= b {
					t.Errorf("%v first at rank %d, %s at %d", tc.wantAbove, a, tc.below, b)
				}
			}
		})
	}
}

func TestSearchScoresDecrease(t *testing.T) {
	ix := Default()
	for _, q := range []string{"museum", "street food market", "temple garden", "beach"} {
		t.Run(q, func(t *testing.T) {
			hits := ix.Search(q, 20)
			if len(hits) < 3 {
				t.Fatalf("Search(%q): %d hits, want several", q, len(hits))
			}
			for i := 1; i < len(hits); i++ {
				if hits[i].Score > hits[i-1].Score {
					t.Fatalf("score rises at %d: %v > %v", i, hits[i].Score, hits[i-1].Score)
				}
				if hits[i].Score <= 0 {
					t.Fatalf("non-positive score returned at %d", i)
				}
			}
		})
	}
}

func TestSearchLimitsAndEmpty(t *testing.T) {
	ix := Default()
	tests := []struct {
		name  string
		query string
		k     int
		want  int
	}{
		{"empty", "", 5, 0},
		{"punctuation only", " ,.!? ", 5, 0},
		{"unknown word", "zzzxqv", 5, 0},
		{"k respected", "museum", 2, 2},
		{"default k", "museum", 0, DefaultK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := len(ix.Search(tc.query, tc.k)); got != tc.want {
				t.Fatalf("Search(%q, %d) = %d hits, want %d", tc.query, tc.k, got, tc.want)
			}
		})
	}
}

func TestLookup(t *testing.T) {
	ix := Default()
	tests := []struct{ in, want string }{
		{"Lisbon", "Lisbon"},
		{"lisboa", "Lisbon"},
		{"LISBON, Portugal", "Lisbon"},
		{"Kyoto Japan", "Kyoto"},
		{"里斯本", "Lisbon"},
		{"東京", "Tokyo"},
		{"东京", "Tokyo"},
		{"NYC", "New York"},
		{"New York, NY", "New York"},
		{"CDMX", "Mexico City"},
		{"Ciudad de México", "Mexico City"},
		{"ciudad de mexico", "Mexico City"},
		{"İstanbul", "Istanbul"},
		{"ISTANBUL", "Istanbul"},
		{"Cape Town (South Africa)", "Cape Town"},
		{"  rome  ", "Rome"},
		{"กรุงเทพมหานคร", "Bangkok"},
		{"Sa\u0303o Paulo", ""}, // decomposed accent, unknown city
		{"Berlin", ""},
		{"", ""},
		{"Paris Texas", ""}, // a trailing word that is not Paris's country
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			c, ok := ix.Lookup(tc.in)
			if tc.want == "" {
				if ok {
					t.Fatalf("Lookup(%q) = %s, want none", tc.in, c.Name)
				}
				return
			}
			if !ok || c.Name != tc.want {
				t.Fatalf("Lookup(%q) = %q, %v; want %s", tc.in, c.Name, ok, tc.want)
			}
		})
	}
}

func TestTokenize(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{"Pastéis de Belém", []string{"pasteis", "de", "belem"}},
		{"São-Jorge's", []string{"sao", "jorge", "s"}},
		{"Straße Œuvre", []string{"strasse", "oeuvre"}},
		{"Ryōan-ji 1,001", []string{"ryoan", "ji", "1", "001"}},
		{"东京天气", []string{"东京", "京天", "天气"}},
		{"京", []string{"京"}},
		{"Tokyo東京", []string{"tokyo", "東京"}},
		{"", nil},
	}
	for _, tc := range tests {
		t.Run(tc.in, func(t *testing.T) {
			if got := tokenize(tc.in); !slices.Equal(got, tc.want) {
				t.Fatalf("tokenize(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
}

func TestNewCustomCorpus(t *testing.T) {
	// A tiny corpus proves the index does not depend on the embedded data:
	// the city whose text repeats the query term must win.
	ix := New([]City{
		{Name: "Alpha", Country: "X", Food: []string{"soup soup soup"}},
		{Name: "Beta", Country: "Y", Food: []string{"soup and bread"}},
	})
	hits := ix.Search("soup", 5)
	if len(hits) != 2 || hits[0].City != "Alpha" || hits[0].Section != SectionFood {
		t.Fatalf("hits = %+v", hits)
	}
	if got := ix.Cities(); !slices.Equal(got, []string{"Alpha", "Beta"}) {
		t.Fatalf("Cities() = %v", got)
	}
}

func TestNorm(t *testing.T) {
	c, _ := Default().Lookup("Bangkok")
	n, ok := c.Norm(4)
	if !ok || n.HighC < 30 || MonthName(4) != "April" {
		t.Fatalf("Bangkok April norm = %+v, %v", n, ok)
	}
	if _, ok := c.Norm(13); ok {
		t.Fatal("month 13 accepted")
	}
}
