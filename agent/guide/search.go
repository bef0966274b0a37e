package guide

import (
	"cmp"
	"math"
	"slices"
	"strings"
)

// DefaultK is the number of hits Search returns when k is not positive.
const DefaultK = 5

// Search ranks the guide's sections against query with BM25 and returns at
// most k hits, best first. Sections that share no term with the query are
// never returned, so an empty or meaningless query yields no hits.
func (ix *Index) Search(query string, k int) []Hit {
	if k <= 0 {
		k = DefaultK
	}
	terms := tokenize(query)
	if len(terms) == 0 || len(ix.docs) == 0 {
		return nil
	}
	// A term repeated in the query counts once: models sometimes echo the
	// city name, and that must not drown the rest of the question.
	slices.Sort(terms)
	terms = slices.Compact(terms)

	n := float64(len(ix.docs))
	scores := make(map[int]float64)
	for _, t := range terms {
		ps := ix.post[t]
		if len(ps) == 0 {
			continue
		}
		df := float64(len(ps))
		// The "+1" form of IDF stays positive for terms found in most
		// documents, so a common word can only add to a score.
		idf := math.Log(1 + (n-df+0.5)/(df+0.5))
		for _, p := range ps {
			d := ix.docs[p.doc]
			norm := bm25K1 * (1 - bm25B + bm25B*d.length/ix.avgLen)
			scores[p.doc] += idf * p.tf * (bm25K1 + 1) / (p.tf + norm)
		}
	}

	hits := make([]Hit, 0, len(scores))
	for id, s := range scores {
		d := ix.docs[id]
		hits = append(hits, Hit{City: ix.cities[d.city].Name, Section: d.section, Text: d.text, Entries: slices.Clone(d.entries), Score: s})
	}
	// Ties are broken by city and section name so results are stable from
	// run to run (map iteration order is not).
	slices.SortFunc(hits, func(a, b Hit) int {
		if c := cmp.Compare(b.Score, a.Score); c != 0 {
			return c
		}
		if c := strings.Compare(a.City, b.City); c != 0 {
			return c
		}
		return strings.Compare(a.Section, b.Section)
	})
	if len(hits) > k {
		hits = hits[:k]
	}
	return hits
}

// Lookup finds a city by name or alias, ignoring case, accents and
// punctuation, and tolerating a trailing region or country as in
// "Lisbon, Portugal" or "Kyoto Japan".
func (ix *Index) Lookup(name string) (City, bool) {
	for _, cand := range lookupCandidates(name) {
		if i, ok := ix.byKey[cand]; ok {
			return ix.cities[i], true
		}
		// "Kyoto Japan": a known name followed by that city's own country.
		for _, c := range ix.cities {
			base, ok := strings.CutSuffix(cand, " "+normalize(c.Country))
			if !ok {
				continue
			}
			if i, ok := ix.byKey[base]; ok && ix.cities[i].Country == c.Country {
				return ix.cities[i], true
			}
		}
	}
	return City{}, false
}

// lookupCandidates lists the normalised forms worth trying for a place
// name: the whole string, then the part before the first comma or bracket,
// which is where people put the city.
func lookupCandidates(name string) []string {
	out := []string{normalize(name)}
	if i := strings.IndexAny(name, ",(/;"); i > 0 {
		out = append(out, normalize(name[:i]))
	}
	return out
}

// Cities returns the names of every city in the index, sorted.
func (ix *Index) Cities() []string {
	names := make([]string, 0, len(ix.cities))
	for _, c := range ix.cities {
		names = append(names, c.Name)
	}
	slices.Sort(names)
	return names
}
