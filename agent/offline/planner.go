// Package offline is the built-in demo planner: deterministic rules, not a
// language model, behind the same chat.Model interface as a real one. It
// asks for guide_search and weather through tool calls like a model would,
// then composes the itinerary JSON from what those tools returned. It reads
// the request and the tool results as typed values (chat.Turn.Request and
// the tool messages' Data), never from the text meant for a model.
package offline

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"strings"
	"unicode/utf8"

	"faregate/agent/chat"
	"faregate/agent/guide"
	"faregate/agent/task"
	"faregate/agent/tools"
)

// ModelName is how the planner is named in results, the ledger and the
// page: plainly not an LLM.
const ModelName = "offline-demo-planner"

// ErrNoRequest: the turn carries no typed request to plan for.
var ErrNoRequest = errors.New("offline: the turn carries no request")

// Planner is the offline demo planner; the zero value is ready to use.
type Planner struct{}

// New returns the planner.
func New() Planner { return Planner{} }

// Generate implements chat.Model. Its usage is not reported: the caller's
// estimate is as good as any the planner could make, having no tokenizer.
func (Planner) Generate(ctx context.Context, t chat.Turn) (chat.Reply, error) {
	if err := ctx.Err(); err != nil {
		return chat.Reply{}, err
	}
	if t.Request == nil {
		return chat.Reply{}, ErrNoRequest
	}
	req := *t.Request
	res := readResults(t.Messages)
	offered := map[string]bool{}
	for _, d := range t.Tools {
		offered[d.Name] = true
	}

	reply := chat.Reply{StopReason: "stop"}
	// First turn with tools: ask for the guide (sights and food separately,
	// so both kinds of section come back) and the weather, in one step.
	if !res.any && len(offered) > 0 {
		add := func(name string, args map[string]string) {
			if !offered[name] {
				return
			}
			raw, _ := json.Marshal(args)
			reply.ToolCalls = append(reply.ToolCalls, chat.ToolCall{
				ID: fmt.Sprintf("offline_%d", len(reply.ToolCalls)+1), Name: name, Arguments: string(raw)})
		}
		interests := strings.Join(req.Interests, " ")
		add(tools.NameGuideSearch, map[string]string{"query": strings.TrimSpace(req.Destination + " sights neighbourhoods " + interests)})
		add(tools.NameGuideSearch, map[string]string{"query": strings.TrimSpace(req.Destination + " food practical " + interests)})
		add(tools.NameWeather, map[string]string{"location": req.Destination})
		if len(reply.ToolCalls) > 0 {
			reply.StopReason = "tool_calls"
			return reply, nil
		}
	}
	reply.Content = compose(req, res)
	if t.Stream != nil {
		// Stream like a provider does, so cut-offs and loop checks see it.
		for s := reply.Content; s != ""; {
			n := min(len(s), 24)
			for n < len(s) && !utf8.RuneStart(s[n]) {
				n++
			}
			if err := t.Stream(chat.Chunk{Text: s[:n]}); err != nil {
				return chat.Reply{}, fmt.Errorf("offline: streaming stopped: %w", err)
			}
			s = s[n:]
		}
	}
	return reply, nil
}

// results are the typed tool results of a conversation.
type results struct {
	any      bool // some tool answered, with data or not
	guides   []tools.GuideResult
	forecast tools.Forecast // the last weather answer that had data
}

func readResults(msgs []chat.Message) results {
	var r results
	for _, m := range msgs {
		if m.Role != chat.RoleTool {
			continue
		}
		r.any = true
		switch d := m.Data.(type) {
		case tools.GuideResult:
			r.guides = append(r.guides, d)
		case tools.Forecast:
			if len(d.Days) > 0 || d.Norm != nil {
				r.forecast = d
			}
		}
	}
	return r
}

// notes are the guide entries of the plan's city, by section.
type notes struct {
	city                                    string
	neighbourhoods, food, sights, practical []string
}

// gather picks the plan's city and collects that city's entries. The city
// is the one the destination names, by name or alias as the guide reads
// them (e.g. "Lisboa", "東京"); a destination the guide does not know gets
// general suggestions, never another city's sights.
func gather(guides []tools.GuideResult, destination string) notes {
	var n notes
	if c, ok := guide.Default().Lookup(destination); ok {
		n.city = c.Name
	} else {
		dest := strings.ToLower(destination)
		for _, g := range guides {
			for _, h := range g.Hits {
				if h.City != "" && strings.Contains(dest, strings.ToLower(h.City)) {
					n.city = h.City
				}
			}
		}
	}
	seen := map[string]bool{}
	for _, g := range guides {
		for _, h := range g.Hits {
			if h.City != n.city {
				continue
			}
			for _, e := range h.Entries {
				if e = strings.TrimSpace(e); e == "" || seen[e] {
					continue
				}
				seen[e] = true
				switch h.Section {
				case guide.SectionNeighbourhoods:
					n.neighbourhoods = append(n.neighbourhoods, e)
				case guide.SectionFood:
					n.food = append(n.food, e)
				case guide.SectionSights:
					n.sights = append(n.sights, e)
				case guide.SectionPractical:
					n.practical = append(n.practical, e)
				}
			}
		}
	}
	if n.city == "" {
		n.city = destination
	}
	return n
}

// maxTitle bounds a day title, as the workflow's answer check does.
const maxTitle = 120

// compose writes the itinerary JSON deterministically from the request and
// the tool results, in the request's language: a different sight each
// morning and afternoon, a food entry for lunch, a neighbourhood each
// evening, the weather noted.
func compose(req task.Request, res results) string {
	w := writerFor(req.Lang())
	g := w.prepare(gather(res.guides, req.Destination))
	rot := newRotation(req.Destination, g.sights)
	var days []task.Day
	for d := 1; d <= req.Days; d++ {
		days = append(days, composeDay(w, g, rot, req, res.forecast, d))
	}
	tip, _ := rot.pick(g.practical, 0)
	summary := w.summary(req.Days, g.city, len(res.forecast.Days) > 0 || res.forecast.Norm != nil,
		len(g.sights)+len(g.food)+len(g.neighbourhoods) == 0, tip)
	raw, _ := json.Marshal(struct {
		Summary string     `json:"summary"`
		Days    []task.Day `json:"days"`
	}{summary, days})
	return string(raw)
}

// composeDay is day d: a sight in the morning, lunch, a sight in the
// afternoon that matches the day's interest if one does, the evening's
// neighbourhood, the weather.
func composeDay(w writer, g notes, rot *rotation, req task.Request, fc tools.Forecast, d int) task.Day {
	var items []string
	// Titles name the day's area; the day number is a field of its own
	// (the page prints "Day N" itself).
	title := w.around(g.city)
	if n, ok := rot.pick(g.neighbourhoods, d-1); ok {
		title = entryName(n)
	}
	if s, _ := rot.nextSight(""); s != "" {
		items = append(items, w.morning(s))
	} else {
		items = append(items, w.bearings(g.city))
	}
	if f, ok := rot.pick(g.food, d-1); ok {
		items = append(items, w.lunch(f))
	}
	in := ""
	if len(req.Interests) > 0 {
		in = req.Interests[(d-1)%len(req.Interests)]
	}
	if s, matched := rot.nextSight(in); s != "" {
		if !matched {
			in = ""
		}
		items = append(items, w.afternoon(s, in))
	} else if in != "" {
		items = append(items, w.freeAfternoon(in, g.city))
	}
	if n, ok := rot.pick(g.neighbourhoods, d-1); ok {
		items = append(items, w.evening(n))
	}
	if line := weatherFor(w, fc, d); line != "" {
		items = append(items, line)
	}
	return task.Day{Day: d, Title: clip(title, maxTitle), Items: items}
}

// rotation hands out a destination's guide entries in an order seeded by
// its name, so one destination always reads the same and two read
// differently: pick cycles through a list by day, nextSight uses each
// sight once.
type rotation struct {
	seed   int
	sights []string
	used   map[int]bool
}

func newRotation(destination string, sights []string) *rotation {
	h := fnv.New32a()
	h.Write([]byte(strings.ToLower(destination)))
	return &rotation{seed: int(h.Sum32() % 97), sights: sights, used: map[int]bool{}}
}

// pick is list's entry for day index i, false when the list is empty.
func (r *rotation) pick(list []string, i int) (string, bool) {
	if len(list) == 0 {
		return "", false
	}
	return list[(r.seed+i)%len(list)], true
}

// nextSight is the next sight not used yet, preferring one that matches
// the interest match (matched reports that it did).
func (r *rotation) nextSight(match string) (sight string, matched bool) {
	for pass := 0; pass < 2; pass++ {
		for i := range r.sights {
			k := (r.seed + i) % len(r.sights)
			if r.used[k] || (pass == 0 && !matchesInterest(r.sights[k], match)) {
				continue
			}
			r.used[k] = true
			return r.sights[k], pass == 0 && match != ""
		}
		if match == "" {
			break
		}
	}
	return "", false
}

// weatherFor is the weather item of day d: that day's forecast when there
// is one, else the seasonal norm, said once on the first day.
func weatherFor(w writer, fc tools.Forecast, d int) string {
	switch {
	case d-1 < len(fc.Days):
		return w.forecastDay(fc.Days[d-1])
	case len(fc.Days) == 0 && fc.Norm != nil && d == 1:
		return w.norm(*fc.Norm)
	}
	return ""
}

// entryName is the part of "Name: description" before the colon: the
// proper name of the place or dish.
func entryName(s string) string {
	if name, ok := named(s); ok {
		return name
	}
	return clip(s, 60)
}

// named returns the name of a "Name: description" entry.
func named(s string) (string, bool) {
	if i := strings.Index(s, ":"); i > 0 && i < 60 {
		return strings.TrimSpace(s[:i]), true
	}
	return "", false
}

// interestWords widens common interests to words guide entries use.
var interestWords = map[string][]string{
	"history":      {"histor", "museum", "castle", "monastery", "ancient", "roman", "palace", "cathedral", "ruins", "temple"},
	"art":          {"art", "gallery", "museum", "painting", "design"},
	"architecture": {"architect", "cathedral", "tower", "palace", "basilica", "bridge", "temple", "shrine"},
	"nature":       {"park", "garden", "beach", "hike", "mountain", "river", "forest", "view"},
	"museums":      {"museum", "gallery", "collection"},
	"nightlife":    {"bar", "night", "club", "music", "fado", "jazz"},
	"shopping":     {"market", "shop", "bazaar", "store", "boutique"},
	"food":         {"market", "food", "tasting", "street food"},
}

// interestAliases maps interests typed in Chinese onto interestWords'
// keys, since the guide's entries are written in English.
var interestAliases = map[string]string{
	"历史": "history", "艺术": "art", "建筑": "architecture", "自然": "nature",
	"博物馆": "museums", "夜生活": "nightlife", "购物": "shopping", "美食": "food",
}

// matchesInterest reports whether a guide entry suits an interest.
func matchesInterest(entry, interest string) bool {
	if interest == "" {
		return true
	}
	e := strings.ToLower(entry)
	in := strings.ToLower(strings.TrimSpace(interest))
	if alias, ok := interestAliases[in]; ok {
		in = alias
	}
	if strings.Contains(e, in) {
		return true
	}
	for _, w := range interestWords[in] {
		if strings.Contains(e, w) {
			return true
		}
	}
	return false
}

// clip cuts s to at most n code points.
func clip(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}
