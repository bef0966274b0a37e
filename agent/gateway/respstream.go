package gateway

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// respEvent is the part of a Responses stream event the relay reads.
type respEvent struct {
	Type         string          `json:"type"`
	Seq          json.RawMessage `json:"sequence_number"`
	Delta        json.RawMessage `json:"delta"`
	OutputIndex  int64           `json:"output_index"`
	ContentIndex int64           `json:"content_index"`
	ItemID       string          `json:"item_id"`
	Item         json.RawMessage `json:"item"`
	Response     json.RawMessage `json:"response"`
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
// official clients act on it) is left in held, for after the settle.
func (h *handler) relayResponses(ctx context.Context, w http.ResponseWriter, c *call, a Attempt, body io.Reader, held *heldEnd) (Outcome, error) {
	sw := newSSEWriter(w)
	sw.onStart = c.forget // a stream must not hold the prompt for its life
	rd := newSSEReader(body, h.o.MaxEvent)
	rd.lr.beforeBlock = sw.flush
	oc, reasoning := newOutCounter(a.Model), newOutCounter(a.Model)
	st := &respState{keep: h.o.MaxEvent}
	var echoed int64 // the request's size, taken before the stream forgets it
	if c.obj != nil {
		echoed = int64(totalSize(c.obj))
	}
	var (
		passed       int64
		relayed      int64
		reported     *Usage
		model        string
		end          streamEnd
		brokenReason string
		terminal     bool
		failed       bool // the provider's own terminal event was response.failed
		last         sseOut
	)
	for {
		raw, err := rd.next()
		if err != nil {
			end, brokenReason = readEnd(ctx, err)
			break
		}
		data := bytes.TrimSpace(raw.data)
		var ev respEvent
		if json.Unmarshal(data, &ev) != nil || ev.Type == "" {
			end, brokenReason = endBroken, "an event that is not a Responses event"
			if ctx.Err() != nil {
				end = endCut
			}
			break
		}
		if ev.Type == "error" || ev.Type == "response.failed" && !sw.started {
			end, brokenReason = endBroken, "an error event"
			break
		}
		if relayed += int64(len(data)); overStreamBytes(relayed, a.MaxOutput, echoed) {
			passed, end = max(passed, a.MaxOutput), endCut
			break
		}
		if d, ok := isDelta(&ev); ok {
			before := oc.Tokens()
			oc.Part(kindOf(&ev), d)
			if strings.HasPrefix(ev.Type, "response.reasoning") {
				reasoning.Part(kindOf(&ev), d)
			}
			if a.MaxOutput > 0 && oc.Tokens() > a.MaxOutput {
				passed, end = before, endCut
				break
			}
		}
		switch ev.Type {
		case "response.completed", "response.incomplete", "response.failed":
			terminal, failed = true, ev.Type == "response.failed"
			var r struct {
				Model string           `json:"model"`
				Usage *json.RawMessage `json:"usage"`
			}
			if json.Unmarshal(ev.Response, &r) == nil {
				model = boundedName(r.Model)
				if u := h.usage(c, r.Usage, 0); u.Reported {
					reported = &u
				}
			}
		}
		st.observe(&ev, data)
		passed = oc.Tokens()
		name := ""
		if safeName(ev.Type) {
			name = ev.Type
		}
		if terminal {
			// Copied: data is the reader's buffer.
			last, end = sseOut{name, append([]byte(nil), oneLine(data)...)}, endDone
			break
		}
		if sw.send(name, oneLine(data)) != nil {
			end = endGone
			break
		}
	}

	out := Outcome{Counted: passed, Model: model}
	out.Usage = Usage{Prompt: c.prompt, Completion: passed}
	if reported != nil && end == endDone {
		out.Usage = *reported
	}
	if end == endBroken && !sw.started {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, brokenReason)
	}
	switch end {
	case endGone:
		out.Truncated = true
	case endCut:
		out.Truncated = true
		last = h.endResponses(sw, st, a, out.Usage, reasoning.Tokens(), "incomplete")
	case endBroken:
		last = h.endResponses(sw, st, a, out.Usage, reasoning.Tokens(), "failed")
	}
	sw.flush()
	out.Started = sw.started
	if end != endGone {
		out.Started = true
		held.hold(func() {
			_ = sw.send(last.name, last.data)
			sw.flush()
		})
	}
	if end == endBroken {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, brokenReason)
	}
	if failed {
		// Relayed as the provider sent it; the breaker hears of it.
		return out, fmt.Errorf("%w: the provider's response failed", ErrUpstream)
	}
	return out, nil
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
func (h *handler) endResponses(sw *sseWriter, st *respState, a Attempt, u Usage, reasoningTokens int64, status string) sseOut {
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
		var id [12]byte
		_, _ = rand.Read(id[:])
		resp = map[string]json.RawMessage{
			"id":         str("resp_" + hex.EncodeToString(id[:])),
			"object":     json.RawMessage(`"response"`),
			"created_at": num(h.o.Now().Unix()),
			"model":      str(a.Model),
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
