package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"faregate/agent/govern"
	"faregate/protect/codes"
	"faregate/protect/kit/randhex"
)

// respEvent is the part of a Responses stream event the relay reads.
type respEvent struct {
	Type         string          `json:"type"`
	Seq          json.RawMessage `json:"sequence_number"`
	Delta        json.RawMessage `json:"delta"`
	OutputIndex  int64           `json:"output_index"`
	ContentIndex int64           `json:"content_index"`
	SummaryIndex int64           `json:"summary_index"`
	ItemID       string          `json:"item_id"`
	Item         json.RawMessage `json:"item"`
	Response     json.RawMessage `json:"response"`
	// The texts of the events that close a text (….done).
	Text      json.RawMessage `json:"text"`
	Arguments json.RawMessage `json:"arguments"`
	Refusal   json.RawMessage `json:"refusal"`
	Part      json.RawMessage `json:"part"`
}

// respOpen is an output item the provider has begun and not finished:
// kept so a cut can finish it with what passed.
type respOpen struct {
	index        int64
	item         map[string]json.RawMessage
	typ, id      string
	text         strings.Builder // output_text of a message, arguments of a call
	contentIndex int64
	hasPart      bool
}

// respState is what the relay keeps of a Responses stream to end it well
// formed: the response as created, the items done and the items open. It
// holds at most keep bytes of them; beyond that a synthesized ending
// carries less of the output (the usage stays right).
type respState struct {
	base  map[string]json.RawMessage
	done  []json.RawMessage
	open  []*respOpen
	seq   int64
	bytes int
	keep  int
}

func (s *respState) find(index int64) *respOpen {
	for _, o := range s.open {
		if o.index == index {
			return o
		}
	}
	return nil
}

func (s *respState) room(n int) bool {
	if s.bytes+n > s.keep {
		return false
	}
	s.bytes += n
	return true
}

// observe updates the state with an event that was passed on.
func (s *respState) observe(ev *respEvent, data []byte) {
	if n, ok := asInt(ev.Seq); ok && n > s.seq {
		s.seq = n
	}
	switch ev.Type {
	case "response.created", "response.in_progress":
		var m map[string]json.RawMessage
		if json.Unmarshal(ev.Response, &m) == nil && s.room(len(ev.Response)) {
			s.base = m
		}
	case "response.output_item.added":
		var m map[string]json.RawMessage
		if json.Unmarshal(ev.Item, &m) != nil || !s.room(len(ev.Item)) {
			return
		}
		o := &respOpen{index: ev.OutputIndex, item: m}
		o.typ, _ = asString(m["type"])
		o.id, _ = asString(m["id"])
		s.open = append(s.open, o)
	case "response.content_part.added":
		if o := s.find(ev.OutputIndex); o != nil {
			o.hasPart, o.contentIndex = true, ev.ContentIndex
		}
	case "response.output_text.delta", "response.function_call_arguments.delta":
		if o := s.find(ev.OutputIndex); o != nil {
			if d, ok := asString(ev.Delta); ok && s.room(len(d)) {
				o.text.WriteString(d)
				if ev.Type == "response.output_text.delta" {
					o.hasPart = true
				}
			}
		}
	case "response.output_item.done":
		for i, o := range s.open {
			if o.index == ev.OutputIndex {
				s.open = append(s.open[:i], s.open[i+1:]...)
				break
			}
		}
		if len(ev.Item) > 0 && s.room(len(ev.Item)) {
			s.done = append(s.done, append(json.RawMessage(nil), ev.Item...))
		}
	}
}

// isDelta reports whether an event carries newly produced output: every
// "….delta" event with a string delta (text, refusal, function and tool
// arguments, reasoning text and summaries).
func isDelta(ev *respEvent) (string, bool) {
	if !strings.HasSuffix(ev.Type, ".delta") {
		return "", false
	}
	return asString(ev.Delta)
}

// kindOf tells the texts of a Responses stream apart: the deltas of one
// event type, item and part continue one text.
func kindOf(ev *respEvent) byte {
	h := uint32(2166136261)
	for _, s := range []string{ev.Type, ev.ItemID} {
		for i := 0; i < len(s); i++ {
			h = (h ^ uint32(s[i])) * 16777619
		}
	}
	h = (h ^ uint32(ev.OutputIndex)) * 16777619
	h = (h ^ uint32(ev.ContentIndex)) * 16777619
	return byte(h) | 1 // never 0
}

// relayResponses relays a Responses stream event by event. The terminal
// event (response.completed, response.incomplete, response.failed: the
// official clients act on it) is left in held, for after the settle. Once
// the agent has hung up (l.gone) the stream is read on, relaying nothing,
// to its usage.
func (h *handler) relayResponses(l *link, w http.ResponseWriter, c *call, a govern.Attempt, body io.Reader, held *heldEnd) (govern.Outcome, error) {
	sw := newSSEWriter(w)
	sw.onStart = c.forget // a stream must not hold the prompt for its life
	rd := newSSEReader(body, h.o.MaxEvent)
	rd.lr.beforeBlock = sw.flush
	r := &respRelay{oc: newOutCounter(a.Model.Name), reasoning: newOutCounter(a.Model.Name), st: &respState{keep: h.o.MaxEvent},
		loop: loopFeed{threshold: h.o.LoopThreshold}, model: a.Model.Name}
	echoed := c.echo() // the request's size, taken before the stream forgets it
	var relayed int64
	for {
		raw, err := rd.next()
		if err != nil {
			r.end, r.brokenReason = readEnd(l.ctx, err)
			break
		}
		data := bytes.TrimSpace(raw.data)
		var ev respEvent
		if json.Unmarshal(data, &ev) != nil || ev.Type == "" {
			r.end, r.brokenReason = endBroken, "an event that is not a Responses event"
			if l.ctx.Err() != nil {
				r.end = endCut
			}
			break
		}
		if ev.Type == "error" || ev.Type == "response.failed" && !sw.started && !l.gone.Load() {
			r.end, r.brokenReason = endBroken, "an error event"
			break
		}
		if relayed += int64(len(data)); overStreamBytes(relayed, a.MaxOutput, echoed) {
			r.passed, r.end = max(r.passed, a.MaxOutput), endCut
			break
		}
		if !r.count(&ev, a.MaxOutput) {
			r.end = endCut
			break
		}
		r.terminal(h, c, &ev)
		r.st.observe(&ev, data)
		name := ""
		if safeName(ev.Type) {
			name = ev.Type
		}
		if r.done {
			// Copied: data is the reader's buffer.
			r.last, r.end = sseOut{name, append([]byte(nil), oneLine(data)...)}, endDone
			break
		}
		if l.check(); !l.gone.Load() && sw.send(name, oneLine(data)) != nil {
			l.gone.Store(true) // read on to the usage, relaying nothing
		}
		if r.looped {
			r.end = endCut
			break
		}
	}
	return h.endResponseStream(l, sw, c, a, held, r)
}

// respRelay is what relayResponses keeps of a stream: its counts, the
// state an ending needs, and how it stopped.
type respRelay struct {
	oc, reasoning *outCounter
	model         string
	// extra is output counted from the texts of "done" events beyond what
	// their deltas carried (respCounts).
	extra  int64
	counts respCounts
	st     *respState
	loop   loopFeed

	passed       int64
	reported     *govern.Usage
	answered     string // the model the provider said answered
	end          streamEnd
	brokenReason string
	done, failed bool // the provider's terminal event came; it was response.failed
	looped       bool
	refused      bool // the provider refused to answer (refusal.go)
	last         sseOut
}

// count counts an event's output: a delta's text, and the text of a done
// event beyond what the deltas of its part or item carried. It reports
// false when the output passes limit (the event is not relayed).
func (r *respRelay) count(ev *respEvent, limit int64) bool {
	before := r.oc.Tokens() + r.extra
	if d, ok := isDelta(ev); ok {
		r.oc.Part(kindOf(ev), d)
		if strings.HasPrefix(ev.Type, "response.reasoning") {
			r.reasoning.Part(kindOf(ev), d)
		}
		r.counts.delta(ev, len(d), r.oc.Tokens()+r.extra-before)
		r.refused = r.refused || ev.Type == "response.refusal.delta"
		switch ev.Type {
		case "response.output_text.delta":
			r.looped = r.looped || r.loop.feed(1, d)
		case "response.function_call_arguments.delta":
			r.looped = r.looped || r.loop.feed(6, d)
		}
	} else {
		r.extra = satAdd(r.extra, r.counts.done(ev, r.model))
	}
	if now := r.oc.Tokens() + r.extra; limit > 0 && now > limit {
		r.passed = cutCharge(before, now, limit, r.oc.enc.Known())
		return false
	}
	r.passed = r.oc.Tokens() + r.extra
	return true
}

// terminal reads the provider's terminal event, if ev is one.
func (r *respRelay) terminal(h *handler, c *call, ev *respEvent) {
	switch ev.Type {
	case "response.completed", "response.incomplete", "response.failed":
	default:
		return
	}
	r.done, r.failed = true, ev.Type == "response.failed"
	var resp struct {
		Model      string           `json:"model"`
		Usage      *json.RawMessage `json:"usage"`
		Incomplete *respIncomplete  `json:"incomplete_details"`
		Output     []respItem       `json:"output"`
	}
	if json.Unmarshal(ev.Response, &resp) == nil {
		r.refused = r.refused || respRefused(resp.Incomplete, resp.Output)
		r.answered = boundedName(resp.Model)
		if u := h.usage(c, resp.Usage, 0); u.Reported {
			r.reported = &u
		}
	}
}

// endResponseStream ends a Responses stream relayResponses relayed, as r
// says it stopped.
func (h *handler) endResponseStream(l *link, sw *sseWriter, c *call, a govern.Attempt, held *heldEnd, r *respRelay) (govern.Outcome, error) {
	end := r.end
	out := streamOutcome(l, c, a, r.passed, r.reported, end)
	out.Answered, out.Refused = r.answered, r.refused
	if r.looped {
		out.Cut = codes.OutputLoop
	}
	switch {
	case end == endBroken && !sw.started:
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, r.brokenReason)
	case out.Ended != "" && !sw.started && !l.gone.Load():
		// Ended before the first byte: the table's error, charged the
		// prompt.
		return out, l.err()
	case l.gone.Load():
		out.Started = sw.started
		if end == endBroken {
			return out, fmt.Errorf("%w: stream: %s", ErrUpstream, r.brokenReason)
		}
		return out, nil
	}
	last := r.last
	switch end {
	case endCut:
		out.Truncated = true
		last = h.endResponses(sw, r.st, a, out.Usage, r.reasoning.Tokens(), "incomplete")
	case endBroken:
		last = h.endResponses(sw, r.st, a, out.Usage, r.reasoning.Tokens(), "failed")
	}
	sw.flush()
	out.Started = true
	held.hold(func() {
		_ = sw.send(last.name, last.data)
		sw.flush()
	})
	if end == endBroken {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, r.brokenReason)
	}
	if r.failed {
		// Relayed as the provider sent it; the breaker hears of it.
		return out, fmt.Errorf("%w: the provider's response failed", ErrUpstream)
	}
	return out, nil
}

// respCounts is what a Responses stream's deltas carried, by part (an
// item's content or summary part, of one kind of text) and by item, in
// bytes and in tokens: a provider may send a text only in the events that
// close it (response.output_text.done, response.content_part.done,
// response.output_item.done, and their kin), never in deltas, and what
// those carry beyond their deltas is output too. An honest stream's done
// events carry what its deltas did, and are not counted again. At most
// maxCountKeys parts and items are kept; a text of one past them is
// counted whole (which errs high).
type respCounts struct {
	parts map[partKey]sizeCount
	items map[int64]sizeCount
}

type partKey struct {
	item, part int64
	family     string
}

type sizeCount struct{ bytes, tokens int64 }

const maxCountKeys = 1024

// family names the kind of text of a delta or done event type
// ("response.output_text.delta" → "output_text").
func family(typ string) string {
	typ = strings.TrimPrefix(typ, "response.")
	if i := strings.LastIndexByte(typ, '.'); i >= 0 {
		typ = typ[:i]
	}
	return typ
}

// partOf is the part a text event belongs to.
func partOf(ev *respEvent, fam string) partKey {
	k := partKey{item: ev.OutputIndex, part: ev.ContentIndex, family: fam}
	if strings.HasPrefix(fam, "reasoning_summary") {
		k.part = ev.SummaryIndex
	}
	return k
}

// delta records a delta of n bytes that counted tokens.
func (rc *respCounts) delta(ev *respEvent, n int, tokens int64) {
	rc.init()
	add := func(sc sizeCount) sizeCount { return sizeCount{sc.bytes + int64(n), sc.tokens + tokens} }
	if k := partOf(ev, family(ev.Type)); len(rc.parts) < maxCountKeys || hasKey(rc.parts, k) {
		rc.parts[k] = add(rc.parts[k])
	}
	if len(rc.items) < maxCountKeys || hasKey(rc.items, ev.OutputIndex) {
		rc.items[ev.OutputIndex] = add(rc.items[ev.OutputIndex])
	}
}

func (rc *respCounts) init() {
	if rc.parts == nil {
		rc.parts, rc.items = map[partKey]sizeCount{}, map[int64]sizeCount{}
	}
}

func hasKey[K comparable, V any](m map[K]V, k K) bool { _, ok := m[k]; return ok }

// done returns the tokens a done event's text carries beyond its deltas'
// (0 for any other event), counted for model, and records them.
func (rc *respCounts) done(ev *respEvent, model string) int64 {
	if !strings.HasSuffix(ev.Type, ".done") {
		return 0
	}
	rc.init()
	if ev.Type == "response.output_item.done" {
		texts := itemTexts(ev.Item)
		return beyond(rc.items, ev.OutputIndex, texts, model, nil)
	}
	fam, text := family(ev.Type), ""
	switch ev.Type {
	case "response.content_part.done", "response.reasoning_summary_part.done":
		var p struct{ Type, Text, Refusal string }
		if json.Unmarshal(ev.Part, &p) != nil {
			return 0
		}
		fam, text = p.Type, p.Text+p.Refusal
		if fam == "summary_text" {
			fam = "reasoning_summary_text"
		}
	default:
		text, _ = asString(ev.Text)
		if s, ok := asString(ev.Arguments); ok {
			text += s
		}
		if s, ok := asString(ev.Refusal); ok {
			text += s
		}
	}
	if text == "" {
		return 0
	}
	k := partOf(ev, fam)
	return beyond(rc.parts, k, []string{text}, model, func(more sizeCount) {
		if len(rc.items) < maxCountKeys || hasKey(rc.items, ev.OutputIndex) {
			sc := rc.items[ev.OutputIndex]
			rc.items[ev.OutputIndex] = sizeCount{sc.bytes + more.bytes, sc.tokens + more.tokens}
		}
	})
}

// beyond is how many tokens texts hold beyond what m records for k, and
// records them (and tells also what more was found, for the item they
// belong to).
func beyond[K comparable](m map[K]sizeCount, k K, texts []string, model string, also func(more sizeCount)) int64 {
	var size int64
	for _, t := range texts {
		size += int64(len(t))
	}
	seen := m[k] // the zero count when m is full
	if size <= seen.bytes {
		return 0
	}
	oc := newOutCounter(model)
	for _, t := range texts {
		oc.cut()
		oc.Add(t)
	}
	n := max(oc.Tokens()-seen.tokens, 0)
	if len(m) < maxCountKeys || hasKey(m, k) {
		m[k] = sizeCount{size, seen.tokens + n}
	}
	if also != nil {
		also(sizeCount{size - seen.bytes, n})
	}
	return n
}

// itemTexts are an output item's texts as respItem counts them.
func itemTexts(raw json.RawMessage) []string {
	var it respItem
	if json.Unmarshal(raw, &it) != nil {
		return nil
	}
	out := []string{it.Name, it.Arguments}
	for _, p := range it.Content {
		out = append(out, p.Text, p.Refusal)
	}
	for _, p := range it.Summary {
		out = append(out, p.Text)
	}
	return out
}

// sseOut is one event to send.
type sseOut struct {
	name string
	data []byte
}

// endResponses finishes a Responses stream the provider did not finish:
// the open items done with what passed (sent), then one terminal event
// (returned, for the caller to send once the call is settled),
// response.incomplete (cut: status "incomplete", reason
// max_output_tokens) or response.failed (the provider broke off), whose
// response carries the output so far and the usage charged.
func (h *handler) endResponses(sw *sseWriter, st *respState, a govern.Attempt, u govern.Usage, reasoningTokens int64, status string) sseOut {
	event := func(typ string, fields ...field) sseOut {
		st.seq++
		o := &object{}
		b := o.encode(nil, append([]field{
			{"type", json.RawMessage(appendJSONString(nil, typ))},
			{"sequence_number", json.RawMessage(strconv.AppendInt(nil, st.seq, 10))},
		}, fields...))
		return sseOut{typ, b}
	}
	next := func(typ string, fields ...field) {
		ev := event(typ, fields...)
		_ = sw.send(ev.name, ev.data)
	}
	num := func(n int64) json.RawMessage { return strconv.AppendInt(nil, n, 10) }
	str := func(s string) json.RawMessage { return appendJSONString(nil, s) }
	incomplete := json.RawMessage(`"incomplete"`)
	output := append([]json.RawMessage(nil), st.done...)
	for _, o := range st.open {
		item := o.item
		item["status"] = incomplete
		loc := []field{{"item_id", str(o.id)}, {"output_index", num(o.index)}}
		switch o.typ {
		case "message":
			if o.hasPart {
				text := o.text.String()
				loc = append(loc, field{"content_index", num(o.contentIndex)})
				part := json.RawMessage(`{"type":"output_text","text":` + string(str(text)) + `,"annotations":[],"logprobs":[]}`)
				next("response.output_text.done", append(loc, field{"text", str(text)}, field{"logprobs", json.RawMessage("[]")})...)
				next("response.content_part.done", append(loc, field{"part", part})...)
				item["content"] = json.RawMessage("[" + string(part) + "]")
			}
		case "function_call":
			args := o.text.String()
			next("response.function_call_arguments.done", append(loc, field{"arguments", str(args)})...)
			item["arguments"] = str(args)
		}
		enc, _ := json.Marshal(item)
		next("response.output_item.done", field{"output_index", num(o.index)}, field{"item", enc})
		output = append(output, enc)
	}
	resp := st.base
	if resp == nil {
		resp = map[string]json.RawMessage{
			"id":         str("resp_" + randhex.New(12)),
			"object":     json.RawMessage(`"response"`),
			"created_at": num(h.o.Now().Unix()),
			"model":      str(a.Model.Name),
		}
	}
	outJSON, _ := json.Marshal(output)
	resp["output"] = outJSON
	resp["status"] = str(status)
	if status == "incomplete" {
		resp["incomplete_details"] = json.RawMessage(`{"reason":"max_output_tokens"}`)
	} else {
		resp["error"] = json.RawMessage(`{"code":"server_error","message":"The model provider's stream broke off; the answer is incomplete."}`)
	}
	resp["usage"] = json.RawMessage(fmt.Sprintf(
		`{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":%d},"total_tokens":%d}`,
		u.Prompt, u.Completion, min(reasoningTokens, u.Completion), satAdd(u.Prompt, u.Completion)))
	enc, _ := json.Marshal(resp)
	return event("response."+status, field{"response", enc})
}
