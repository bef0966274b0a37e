package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"

	"faregate/agent/govern"
	"faregate/protect/codes"
	"faregate/protect/kit/randhex"
)

// msgEvent is the part of a Messages stream event the relay reads.
type msgEvent struct {
	Type    string `json:"type"`
	Index   int64  `json:"index"`
	Message *struct {
		ID    string          `json:"id"`
		Model string          `json:"model"`
		Usage json.RawMessage `json:"usage"`
	} `json:"message"`
	ContentBlock *msgBlock       `json:"content_block"`
	Delta        *msgDelta       `json:"delta"`
	Usage        json.RawMessage `json:"usage"`
}

// msgBlock is a content block of a stream's content_block_start or of a
// JSON answer: what of it is the model's output.
type msgBlock struct {
	Type     string          `json:"type"`
	Text     string          `json:"text"`
	Thinking string          `json:"thinking"`
	Name     string          `json:"name"`
	Input    json.RawMessage `json:"input"`
	Data     string          `json:"data"` // redacted thinking
}

// count counts a block's output as a text of kind each part.
func (b *msgBlock) count(oc *outCounter, kind byte) {
	for _, s := range []string{b.Text, b.Thinking, b.Name, b.Data} {
		oc.Part(kind, s)
	}
	// A started tool_use block carries "input":{}, which the model did
	// not write; an answer's holds the whole input.
	if in := bytes.TrimSpace(b.Input); len(in) > 0 && string(in) != "{}" {
		oc.Part(kind, string(in))
	}
}

// msgDelta is a content_block_delta's or a message_delta's delta.
type msgDelta struct {
	Type        string  `json:"type"`
	Text        string  `json:"text"`
	PartialJSON string  `json:"partial_json"`
	Thinking    string  `json:"thinking"`
	StopReason  *string `json:"stop_reason"`
}

// maxOpenBlocks bounds the content blocks a stream may hold open at
// once: Anthropic closes each before the next, or nearly; the relay
// keeps the open ones to close them on a cut.
const maxOpenBlocks = 64

// msgState is what the pass-through relay keeps of a Messages stream.
type msgState struct {
	usage    msgUsage
	open     []int64 // the content blocks begun and not stopped
	id       string
	model    string
	passed   int64
	relayed  int64
	started  bool // message_start was sent
	end      streamEnd
	why      string // the broken stream's reason
	terminal bool   // message_stop arrived
	// looped: the text or tool input repeats past the loop cut's
	// threshold (Options.LoopThreshold), read through loop.
	looped bool
	loop   *loopFeed
}

// relayMessages relays an Anthropic Messages stream event by event,
// counting text, tool input (input_json_delta) and thinking as they
// pass, reading the usage as Anthropic defines it (msgUsage), and cutting
// at the attempt's output limit: the open blocks' content_block_stop,
// then message_delta with stop_reason "max_tokens" and the usage so far.
// The final message_stop (or, on a stream that broke after it began,
// event: error) is left in held, for after the settle.
//
// A client that stops reading does not end the read: the provider's
// stream is drained (counted, bounded like a relayed one) to its final
// usage, so a hang-up is charged what the provider reports, not what had
// passed.
func (h *handler) relayMessages(ctx context.Context, w http.ResponseWriter, m *msgCall, a govern.Attempt, body io.Reader, held *heldEnd) (govern.Outcome, error) {
	sw := newSSEWriter(w)
	rd := newSSEReader(body, h.o.MaxEvent)
	rd.lr.beforeBlock = sw.flush
	oc := newOutCounter(a.Model.Name)
	echoed := int64(totalSize(m.obj))
	st := &msgState{loop: &loopFeed{threshold: h.o.LoopThreshold}}
	gone := false
	for {
		ev, err := rd.next()
		if err != nil {
			st.end, st.why = readEnd(ctx, err)
			break
		}
		data := bytes.TrimSpace(ev.data)
		if st.relayed += int64(len(data)); overStreamBytes(st.relayed, a.MaxOutput, echoed) {
			st.passed, st.end = max(st.passed, a.MaxOutput), endCut
			break
		}
		var e msgEvent
		if json.Unmarshal(data, &e) != nil || !safeName(e.Type) {
			st.end, st.why = endBroken, "an event that is not a Messages event"
			if ctx.Err() != nil {
				st.end = endCut
			}
			break
		}
		if !st.observe(&e, oc, a.MaxOutput) {
			break
		}
		if st.terminal {
			st.end = endDone
			break
		}
		if !gone && sw.send(e.Type, oneLine(data)) != nil {
			gone = true // drained from here on: see the doc
		}
		st.started = st.started || e.Type == "message_start"
		if st.looped {
			// Cut after the event that made the loop plain, as the chat
			// relay is.
			st.end = endCut
			break
		}
	}
	if gone {
		st.end = endGone
	}
	return h.endMessages(sw, m, a, held, st)
}

// observe reads one event of a pass-through stream into st, before it is
// relayed; false ends the relay (a cut, an error event, a malformed
// stream), with st.end saying why.
func (st *msgState) observe(e *msgEvent, oc *outCounter, limit int64) bool {
	before := oc.Tokens()
	kind := byte(1 + e.Index%251) // each block is a text of its own
	switch e.Type {
	case "message_start":
		if e.Message == nil {
			st.end, st.why = endBroken, "a message_start without its message"
			return false
		}
		st.id, st.model = boundedName(e.Message.ID), boundedName(e.Message.Model)
		st.usage.merge(e.Message.Usage, false)
	case "content_block_start":
		if len(st.open) >= maxOpenBlocks {
			st.end, st.why = endBroken, "too many content blocks open at once"
			return false
		}
		st.open = append(st.open, e.Index)
		if e.ContentBlock != nil {
			e.ContentBlock.count(oc, kind)
		}
	case "content_block_delta":
		if d := e.Delta; d != nil {
			// signature_delta is not output the model is billed for;
			// its bytes are bounded with the stream's.
			for _, s := range []string{d.Text, d.PartialJSON, d.Thinking} {
				oc.Part(kind, s)
			}
			st.looped = st.looped || st.loop.feed(kind, d.Text) || st.loop.feed(kind, d.PartialJSON)
		}
	case "content_block_stop":
		if i := slices.Index(st.open, e.Index); i >= 0 {
			st.open = slices.Delete(st.open, i, i+1)
		}
	case "message_delta":
		st.usage.merge(e.Usage, true)
	case "message_stop":
		st.terminal = true
	case "error":
		st.end, st.why = endBroken, "an error event"
		return false
	}
	if limit > 0 && oc.Tokens() > limit {
		st.passed, st.end = before, endCut
		return false
	}
	st.passed = oc.Tokens()
	return true
}

// endMessages ends a Messages stream relayMessages relayed, as st says it
// stopped, and reports what it spent.
func (h *handler) endMessages(sw *sseWriter, m *msgCall, a govern.Attempt, held *heldEnd, st *msgState) (govern.Outcome, error) {
	out := govern.Outcome{Counted: st.passed, Answered: st.model}
	// message_start's output count is a first one, not the message's:
	// only a message_delta's stands beside what passed. A stream drained
	// to its message_stop after the client left is whole.
	completion := st.passed
	if st.usage.final {
		completion = max(completion, st.usage.output)
	}
	out.Usage = st.usage.usage(m.prompt, completion, st.terminal)
	if st.end == endBroken && !sw.started {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, st.why)
	}
	x := &msgWriter{sw: sw}
	switch st.end {
	case endGone:
		out.Truncated = true
	case endCut:
		out.Truncated = true
		if st.looped {
			out.Cut = codes.OutputLoop
		}
		if !st.started {
			x.messageStart(st.id, st.model, a.Model.Name, out.Usage)
		}
		for _, i := range st.open {
			x.blockStop(i)
		}
		// The client's usage says what passed, the provider's prompt and
		// cache parts with it.
		u := out.Usage
		u.Completion = st.passed
		x.messageDelta("max_tokens", u)
	}
	sw.flush()
	out.Started = sw.started
	if st.end == endGone {
		return out, nil
	}
	out.Started = true
	last := sseOut{"message_stop", []byte(`{"type":"message_stop"}`)}
	if st.end == endBroken {
		last = h.errorEvent(m.req, st.why)
	}
	held.hold(func() {
		_ = sw.send(last.name, last.data)
		sw.flush()
	})
	if st.end == endBroken {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, st.why)
	}
	return out, nil
}

// msgWriter writes the events of a Messages stream this package makes
// itself: the end of a cut stream, and every event of a translated one.
type msgWriter struct {
	sw *sseWriter
	b  []byte
}

func (x *msgWriter) send(name string, b []byte) {
	x.b = b[:0]
	_ = x.sw.send(name, b)
}

// messageStart begins a message: id and model as the provider gave them
// (or made up), the usage known so far. The input is never sent as 0: a
// client that tracks usage from message_start (Claude Code) reads it.
func (x *msgWriter) messageStart(id, model, fallback string, u govern.Usage) {
	if id == "" {
		id = newMessageID()
	}
	if model == "" {
		model = fallback
	}
	b := append(x.b[:0], `{"type":"message_start","message":{"id":`...)
	b = appendJSONString(b, id)
	b = append(b, `,"type":"message","role":"assistant","model":`...)
	b = appendJSONString(b, model)
	b = append(b, `,"content":[],"stop_reason":null,"stop_sequence":null,"usage":`...)
	b = appendMsgUsage(b, u)
	x.send("message_start", append(b, "}}"...))
}

func (x *msgWriter) blockStop(i int64) {
	b := append(x.b[:0], `{"type":"content_block_stop","index":`...)
	b = strconv.AppendInt(b, i, 10)
	x.send("content_block_stop", append(b, '}'))
}

// blockStart begins block i with its JSON start (a text, thinking or
// tool_use block with nothing in it yet).
func (x *msgWriter) blockStart(i int64, block []byte) {
	b := append(x.b[:0], `{"type":"content_block_start","index":`...)
	b = strconv.AppendInt(b, i, 10)
	b = append(b, `,"content_block":`...)
	b = append(b, block...)
	x.send("content_block_start", append(b, '}'))
}

// delta sends a content_block_delta of type typ whose text member key
// holds s.
func (x *msgWriter) delta(i int64, typ, key, s string) {
	b := append(x.b[:0], `{"type":"content_block_delta","index":`...)
	b = strconv.AppendInt(b, i, 10)
	b = append(b, `,"delta":{"type":"`...)
	b = append(b, typ...)
	b = append(b, `","`...)
	b = append(b, key...)
	b = append(b, `":`...)
	b = appendJSONString(b, s)
	x.send("content_block_delta", append(b, "}}"...))
}

// messageDelta sends the message's stop reason and its cumulative usage.
func (x *msgWriter) messageDelta(stop string, u govern.Usage) {
	b := append(x.b[:0], `{"type":"message_delta","delta":{"stop_reason":`...)
	b = appendJSONString(b, stop)
	b = append(b, `,"stop_sequence":null},"usage":`...)
	b = appendMsgUsage(b, u)
	x.send("message_delta", append(b, '}'))
}

// errorEvent is the event: error that ends a stream that broke after it
// began, from the router's error writer (faregate's message and code,
// never the provider's text).
func (h *handler) errorEvent(r *http.Request, why string) sseOut {
	return sseOut{"error", h.o.Errors.ErrorEvent(r, fmt.Errorf("%w: the stream broke off: %s", ErrUpstream, why))}
}

// newMessageID makes a message id for a message the provider gave none.
func newMessageID() string {
	return "msg_" + randhex.New(12)
}

// msgAnswer is the part of a Messages JSON answer read here.
type msgAnswer struct {
	Type    string          `json:"type"`
	Model   string          `json:"model"`
	Content []msgBlock      `json:"content"`
	Usage   json.RawMessage `json:"usage"`
}

// answerMessagesJSON relays a non-streamed Messages answer: read within
// the bound a stream of its reservation has, checked, its content blocks
// counted, its usage read, refused when its output outgrew the
// reservation (a JSON answer cannot be cut well formed for every SDK: a
// tool_use block's input is one object), and held in end to be sent on
// byte for byte once settled.
func (h *handler) answerMessagesJSON(l *link, w http.ResponseWriter, m *msgCall, a govern.Attempt, body io.Reader, hint int64, end *heldEnd) (govern.Outcome, error) {
	raw, out, err := readAnswer(l, body, hint, streamBound(a.MaxOutput, 0), m.prompt, a)
	if err != nil {
		return out, err
	}
	var ans msgAnswer
	if json.Unmarshal(raw, &ans) != nil || ans.Type != "message" {
		return govern.Outcome{Counted: a.MaxOutput, Sent: true}, fmt.Errorf("%w: answer is not a Messages result", ErrUpstream)
	}
	// Beside a report the count is a check only, and the bound (cheaper,
	// never lower) serves; without one it is the charge.
	model := a.Model.Name
	if len(ans.Usage) > 0 && !isNull(ans.Usage) {
		model = ""
	}
	oc := newOutCounter(model)
	for i := range ans.Content {
		ans.Content[i].count(oc, byte(1+i%251))
	}
	var u msgUsage
	u.merge(ans.Usage, true)
	out = govern.Outcome{Counted: oc.Tokens(), Answered: boundedName(ans.Model), Sent: true}
	out.Usage = u.usage(m.prompt, out.Counted, true)
	if a.MaxOutput > 0 && out.Counted > satAdd(a.MaxOutput, overTolerance(a.MaxOutput, oc.enc.Known())) {
		// Charged what it used (budget.Charged: the report or the count,
		// the larger), relayed never.
		return out, fmt.Errorf("%w: messages answer of %d output tokens on a reservation of %d", ErrUpstreamAnswer, out.Counted, a.MaxOutput)
	}
	out.Started = true
	end.holdJSON(w, raw)
	return out, nil
}
