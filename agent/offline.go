package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"regexp"
	"strings"

	"github.com/tmc/langchaingo/llms"
)

// OfflineModelName is how the built-in planner is named in results, the
// ledger and the page: plainly not an LLM.
const OfflineModelName = "offline-demo-planner"

// Offline is the built-in demo planner. It implements llms.Model with
// deterministic rules, not a language model: it asks for guide_search and
// weather through native tool calls like a real model would, then composes
// the itinerary JSON from what those tools observed. It reports estimated
// token usage in GenerationInfo as the openai provider does, so budgets and
// the ledger work the same on it.
type Offline struct{}

// NewOffline returns the offline planner as a Model.
func NewOffline() Model {
	return Model{Model: Offline{}, Name: OfflineModelName, Offline: true}
}

// Call implements llms.Model for single prompts.
func (o Offline) Call(ctx context.Context, prompt string, options ...llms.CallOption) (string, error) {
	return llms.GenerateFromSinglePrompt(ctx, o, prompt, options...)
}

// GenerateContent implements llms.Model.
func (o Offline) GenerateContent(ctx context.Context, msgs []llms.MessageContent, options ...llms.CallOption) (*llms.ContentResponse, error) {
	var opts llms.CallOptions
	for _, f := range options {
		f(&opts)
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	req, ok := requestFromMessages(msgs)
	if !ok {
		req = Request{Destination: "your destination", Days: 1}
	}
	obs := observations(msgs)
	offered := map[string]bool{}
	for _, t := range opts.Tools {
		if t.Function != nil {
			offered[t.Function.Name] = true
		}
	}

	choice := &llms.ContentChoice{StopReason: "stop"}
	// First turn with tools: ask for the guide (sights and food separately,
	// so both kinds of section come back) and the weather, in one step.
	if len(obs) == 0 && len(offered) > 0 {
		var calls []llms.ToolCall
		add := func(name string, args map[string]string) {
			if !offered[name] {
				return
			}
			raw, _ := json.Marshal(args)
			calls = append(calls, llms.ToolCall{ID: fmt.Sprintf("offline_%d", len(calls)+1), Type: "function",
				FunctionCall: &llms.FunctionCall{Name: name, Arguments: string(raw)}})
		}
		interests := strings.Join(req.Interests, " ")
		add("guide_search", map[string]string{"query": strings.TrimSpace(req.Destination + " sights neighbourhoods " + interests)})
		add("guide_search", map[string]string{"query": strings.TrimSpace(req.Destination + " food practical " + interests)})
		add("weather", map[string]string{"location": req.Destination})
		if len(calls) > 0 {
			choice.ToolCalls = calls
			choice.StopReason = "tool_calls"
		}
	}
	if len(choice.ToolCalls) == 0 {
		choice.Content = composePlan(req, obs)
	}
	if opts.StreamingFunc != nil && choice.Content != "" {
		// Stream like a provider does, so cut-offs and loop checks see it.
		for s := choice.Content; s != ""; {
			n := min(len(s), 24)
			for n < len(s) && !isRuneStart(s[n]) {
				n++
			}
			if err := opts.StreamingFunc(ctx, []byte(s[:n])); err != nil {
				return nil, fmt.Errorf("offline: streaming stopped: %w", err)
			}
			s = s[n:]
		}
	}
	var completion int64
	if choice.Content != "" {
		completion = EstimateTokens(choice.Content)
	} else {
		completion = toolCallTokens(choice)
	}
	prompt := estimatePrompt(msgs, opts.Tools)
	choice.GenerationInfo = map[string]any{
		"PromptTokens": int(prompt), "CompletionTokens": int(completion), "TotalTokens": int(prompt + completion),
	}
	return &llms.ContentResponse{Choices: []*llms.ContentChoice{choice}}, nil
}

func isRuneStart(b byte) bool { return b&0xC0 != 0x80 }

// observation is one tool answer the planner has seen.
type observation struct{ tool, text string }

func observations(msgs []llms.MessageContent) []observation {
	var out []observation
	for _, m := range msgs {
		if m.Role != llms.ChatMessageTypeTool {
			continue
		}
		for _, p := range m.Parts {
			if r, ok := p.(llms.ToolCallResponse); ok {
				out = append(out, observation{tool: r.Name, text: r.Content})
			}
		}
	}
	return out
}

// guideNotes are the entries the guide observations offered, by section.
type guideNotes struct {
	city                                    string
	neighbourhoods, food, sights, practical []string
}

var sectionWord = regexp.MustCompile(`(?i)\b(overview|neighbourhoods?|neighborhoods?|food|sights|practical|climate)\b`)

// parseGuide reads guide_search observations: a header line per hit naming
// its city and section ("[Lisbon — food]"), then one entry per line. Lines
// before the first header (the result's title) are skipped.
func parseGuide(obs []observation, destination string) guideNotes {
	var g guideNotes
	// The plan is about one city: the one the destination names, else the
	// guide's best match (the first hit).
	for _, o := range obs {
		for _, line := range strings.Split(o.text, "\n") {
			line = strings.TrimSpace(line)
			if o.tool != "guide_search" || !isHeader(line) {
				continue
			}
			c := headerCity(line)
			if g.city == "" {
				g.city = c
			}
			if c != "" && strings.Contains(strings.ToLower(destination), strings.ToLower(c)) {
				g.city = c
			}
		}
	}
	seen := map[string]bool{}
	for _, o := range obs {
		if o.tool != "guide_search" {
			continue
		}
		section, city := "", ""
		for _, line := range strings.Split(o.text, "\n") {
			line = strings.TrimSpace(strings.TrimLeft(line, "-•* "))
			if line == "" {
				continue
			}
			if isHeader(line) {
				section = strings.ToLower(sectionWord.FindString(line))
				city = headerCity(line)
				continue
			}
			if city != g.city || seen[line] {
				continue
			}
			seen[line] = true
			switch {
			case strings.HasPrefix(section, "neighbo"):
				g.neighbourhoods = append(g.neighbourhoods, line)
			case section == "food":
				g.food = append(g.food, line)
			case section == "practical":
				g.practical = append(g.practical, line)
			case section == "sights":
				g.sights = append(g.sights, line)
			}
		}
	}
	if g.city == "" {
		g.city = destination
	}
	return g
}

// isHeader recognises a hit's header line, "[Lisbon — food]".
func isHeader(line string) bool {
	return strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]") && sectionWord.MatchString(line)
}

// headerCity takes the city from a header line.
func headerCity(line string) string {
	h := strings.Trim(line, "[]")
	if i := strings.Index(h, "—"); i > 0 {
		return strings.TrimSpace(h[:i])
	}
	return ""
}

// entryName is the part of "Name: description" before the colon.
func entryName(s string) string {
	if i := strings.Index(s, ":"); i > 0 && i < 60 {
		return strings.TrimSpace(s[:i])
	}
	return clip(s, 60)
}

// weatherLines are the forecast lines of the weather observation, or its
// fallback sentence when the forecast was unavailable.
func weatherLines(obs []observation) []string {
	var out []string
	for _, o := range obs {
		if o.tool != "weather" {
			continue
		}
		for _, line := range strings.Split(o.text, "\n") {
			if line = strings.TrimSpace(strings.TrimLeft(line, "-•* ")); line != "" {
				out = append(out, line)
			}
		}
	}
	return out
}

// composePlan writes the itinerary JSON deterministically from the request
// and the observations: a different sight each morning and afternoon, a
// food entry for lunch, a neighbourhood each evening, the weather noted.
func composePlan(req Request, obs []observation) string {
	g := parseGuide(obs, req.Destination)
	wx := weatherLines(obs)
	h := fnv.New32a()
	h.Write([]byte(strings.ToLower(req.Destination)))
	seed := int(h.Sum32() % 97)
	pick := func(list []string, i int) (string, bool) {
		if len(list) == 0 {
			return "", false
		}
		return list[(seed+i)%len(list)], true
	}
	interest := func(d int) string {
		if len(req.Interests) == 0 {
			return ""
		}
		return req.Interests[(d-1)%len(req.Interests)]
	}

	// Sights are used once each, in a rotation seeded by the destination;
	// the afternoon prefers one that matches the day's interest.
	used := map[int]bool{}
	nextSight := func(match string) (string, bool) {
		for pass := 0; pass < 2; pass++ {
			for i := range g.sights {
				k := (seed + i) % len(g.sights)
				if used[k] || (pass == 0 && !matchesInterest(g.sights[k], match)) {
					continue
				}
				used[k] = true
				return g.sights[k], pass == 0 && match != ""
			}
			if match == "" {
				break
			}
		}
		return "", false
	}

	var days []Day
	for d := 1; d <= req.Days; d++ {
		var items []string
		// Titles name the day's area; the day number is a field of its own
		// (the page prints "Day N" itself).
		title := "Around " + g.city
		if n, ok := pick(g.neighbourhoods, d-1); ok {
			title = entryName(n)
		}
		if s, _ := nextSight(""); s != "" {
			items = append(items, "Morning: "+clip(s, 220))
		} else {
			items = append(items, fmt.Sprintf("Morning: walk the centre of %s and get your bearings", g.city))
		}
		if f, ok := pick(g.food, d-1); ok {
			items = append(items, "Lunch: "+clip(f, 200))
		}
		in := interest(d)
		if s, matched := nextSight(in); s != "" {
			line := "Afternoon: " + clip(s, 200)
			if matched {
				line += " (for your interest in " + in + ")"
			}
			items = append(items, line)
		} else if in != "" {
			items = append(items, fmt.Sprintf("Afternoon: time for %s in %s", in, g.city))
		}
		if n, ok := pick(g.neighbourhoods, d-1); ok {
			items = append(items, "Evening: "+clip(n, 200))
		}
		if w := weatherFor(wx, d); w != "" {
			items = append(items, "Weather: "+clip(w, 160))
		}
		days = append(days, Day{Day: d, Title: clip(title, maxTitle), Items: items})
	}
	summary := fmt.Sprintf("A %d-day plan for %s from the offline demo planner (deterministic rules, not an LLM), built from the travel guide", req.Days, g.city)
	if len(wx) > 0 {
		summary += " and the weather tool's answer"
	}
	summary += "."
	if len(g.sights)+len(g.food)+len(g.neighbourhoods) == 0 {
		summary += " The built-in guide has no entry for this destination, so the days are general suggestions."
	}
	if tip, ok := pick(g.practical, 0); ok {
		summary += " Tip: " + clip(tip, 200)
	}
	raw, _ := json.Marshal(struct {
		Summary string `json:"summary"`
		Days    []Day  `json:"days"`
	}{summary, days})
	return string(raw)
}

// weatherFor picks the weather line for day d: the day's forecast line when
// the observation lists days, else its one sentence (the seasonal norm).
func weatherFor(wx []string, d int) string {
	var days []string
	for _, l := range wx {
		if dayLine.MatchString(l) {
			days = append(days, l)
		}
	}
	switch {
	case d-1 < len(days):
		return days[d-1]
	case len(days) == 0 && len(wx) > 0 && d == 1:
		// No forecast, only the seasonal norm: say it once.
		return wx[len(wx)-1]
	}
	return ""
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

// matchesInterest reports whether a guide entry suits an interest.
func matchesInterest(entry, interest string) bool {
	if interest == "" {
		return true
	}
	e := strings.ToLower(entry)
	in := strings.ToLower(strings.TrimSpace(interest))
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

// dayLine matches a forecast line that starts with a date.
var dayLine = regexp.MustCompile(`^\d{4}-\d{2}-\d{2}`)
