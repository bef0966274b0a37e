package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"

	"faregate/agent/govern"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/repetition"
)

// chatDelta is what a chat choice's delta (or message) is counted for:
// everything the model produced, reasoning included.
type chatDelta struct {
	Content          *string `json:"content"`
	ReasoningContent *string `json:"reasoning_content"`
	Reasoning        *string `json:"reasoning"`
	Refusal          *string `json:"refusal"`
	// ToolCalls' functions are decoded after the delta (decodeTools).
	ToolCalls []chatToolCall `json:"tool_calls"`
	// FunctionCall is the legacy form a model answers in when the
	// request has functions (passed through): counted as a tool call.
	FunctionCall rawJSON `json:"function_call"`
	function     struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	}
}

// chatToolCall is a tool call of a delta: its function as decodeTools
// decoded it.
type chatToolCall struct {
	Function rawJSON `json:"function"`
	fn       struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	}
}

// decodeTools decodes the tool calls' functions, once d is decoded.
func (d *chatDelta) decodeTools() error {
	for i := range d.ToolCalls {
		tc := &d.ToolCalls[i]
		if err := tc.Function.decode(&tc.fn); err != nil {
			return err
		}
	}
	return d.FunctionCall.decode(&d.function)
}

func (d *chatDelta) count(oc *outCounter) {
	for i, s := range []*string{d.Content, d.ReasoningContent, d.Reasoning, d.Refusal} {
		if s != nil && *s != "" {
			oc.Part(byte(1+i), *s)
		}
	}
	for _, tc := range d.ToolCalls {
		countCall(oc, tc.fn.Name, tc.fn.Arguments)
	}
	countCall(oc, d.function.Name, d.function.Arguments)
}

// countCall counts a tool call's name and arguments.
func countCall(oc *outCounter, name, args string) {
	if name != "" {
		oc.Part(5, name)
	}
	if args != "" {
		oc.Part(6, args)
	}
}

// chatChunk is the part of a chat.completion.chunk the relay reads.
// Choices is nil when absent or null, empty when [] (vLLM and OpenAI send
// the usage chunk each way).
type chatChunk struct {
	ID      string           `json:"id"`
	Created json.RawMessage  `json:"created"`
	Model   string           `json:"model"`
	Choices *[]chatChoice    `json:"choices"`
	Usage   *json.RawMessage `json:"usage"`
	Error   json.RawMessage  `json:"error"`
}

// chatChoice is a chunk's choice: its delta as decodeChunk decoded it.
type chatChoice struct {
	Delta        rawJSON `json:"delta"`
	FinishReason *string `json:"finish_reason"`
	delta        chatDelta
}

// decodeChunk decodes data into ch: each choice's delta after the chunk
// and its tool calls' functions after the delta (rawJSON); any error, the
// chunk's or a part's, is the chunk's. (The choices are decoded with the
// chunk: a level more apart cost a decode and a copy per chunk and moved
// no stream's deepest point, which is then the count's.)
func decodeChunk(data []byte, ch *chatChunk) error {
	if err := json.Unmarshal(data, ch); err != nil {
		return err
	}
	if ch.Choices == nil {
		return nil
	}
	for i := range *ch.Choices {
		c := &(*ch.Choices)[i]
		if err := c.Delta.decode(&c.delta); err != nil {
			return err
		}
		if err := c.delta.decodeTools(); err != nil {
			return err
		}
	}
	return nil
}

// rawJSON is a value as the decode of the object holding it found it:
// each occurrence of its key, in order (a provider may repeat one; they are
// decoded in turn into one value, as encoding/json merges a repeated key
// into one struct). The relay decodes a chunk's deltas, and their tool
// calls' functions, each after the level above, not inside it: decoded in one pass,
// each level's frames nest under the one above, and the relay's deepest
// point sets the stack each open stream keeps for its life.
type rawJSON [][]byte

func (r *rawJSON) UnmarshalJSON(b []byte) error {
	*r = append(*r, bytes.Clone(b)) // b is not ours past the call

	return nil
}

// decode decodes each occurrence into v, in order.
func (r rawJSON) decode(v any) error {
	for _, b := range r {
		if err := json.Unmarshal(b, v); err != nil {
			return err
		}
	}
	return nil
}

// streamEnd is why a relay stopped.
type streamEnd int

const (
	endDone   streamEnd = iota // the provider finished
	endCut                     // the output limit, a loop, the task ended or the deadline passed
	endBroken                  // the provider's stream broke or was malformed
	endGone                    // the agent hung up; a Messages relay drained the stream (messages_stream.go)
)

// loopFeed feeds the loop cut the texts it reads (content, tool-call
// arguments), a word break between texts of different kinds. A detector
// holds about 7 KiB for the stream's life, and gives no verdict before its
// window holds a quarter of its words (protect/repetition), which take
// more than loopStartBytes of text: the text before that is kept here,
// and the detector made only once a stream has that much to say (an open
// stream that has sent a word or two holds none).
type loopFeed struct {
	threshold float64
	d         *repetition.Detector
	early     []byte
	kind      byte
}

// loopStartBytes is less than the text of the fewest words the detector
// needs for a verdict (a quarter of its window of 200: 50 words of a
// letter and a space).
const loopStartBytes = repetition.DefaultWindow / 2

// feed reports whether s, of kind, makes the output a loop.
func (f *loopFeed) feed(kind byte, s string) bool {
	if f.threshold <= 0 || s == "" {
		return false
	}
	if kind != f.kind {
		f.kind = kind
		s = "\n" + s
	}
	if f.d == nil {
		if len(f.early)+len(s) < loopStartBytes {
			f.early = append(f.early, s...)
			return false
		}
		f.d = repetition.New(0, 0, f.threshold)
		f.d.Write(f.early)
		f.early = nil
	}
	return f.d.Write([]byte(s))
}

// loops feeds the delta's content and tool-call arguments to f.
func (d *chatDelta) loops(f *loopFeed) bool {
	if d.Content != nil && f.feed(1, *d.Content) {
		return true
	}
	for _, tc := range d.ToolCalls {
		if f.feed(6, tc.fn.Arguments) {
			return true
		}
	}
	return f.feed(6, d.function.Arguments)
}

// relayChat relays a chat completion stream event by event.
// The final data: [DONE] is left in held, for after the settle. Once the
// agent has hung up (l.gone) the stream is read on, relaying nothing, to
// its usage.
func (h *handler) relayChat(l *link, w http.ResponseWriter, c *call, a govern.Attempt, body io.Reader, held *heldEnd) (govern.Outcome, error) {
	sw := newSSEWriter(w)
	sw.onStart = c.forget // a stream must not hold the prompt for its life
	rd := newSSEReader(body, h.o.MaxEvent)
	rd.lr.beforeBlock = sw.flush
	oc := newOutCounter(a.Model.Name)
	loop := &loopFeed{threshold: h.o.LoopThreshold}
	e := chatEnd{created: h.o.Now().Unix()}
	var relayed int64
	echoed := c.echo() // vLLM's echo repeats the prompt
	for {
		ev, err := rd.next()
		if err != nil {
			e.end, e.brokenReason = readEnd(l.ctx, err)
			break
		}
		data := bytes.TrimSpace(ev.data)
		if string(data) == "[DONE]" {
			e.end = endDone
			break
		}
		if relayed += int64(len(data)); overStreamBytes(relayed, a.MaxOutput, echoed) {
			// What it streamed is not counted: it is charged the whole
			// reservation.
			e.passed, e.end = max(e.passed, a.MaxOutput), endCut
			break
		}
		var ch chatChunk
		if decodeChunk(data, &ch) != nil {
			e.end, e.brokenReason = endBroken, "an event that is not a chunk"
			if l.ctx.Err() != nil {
				e.end = endCut
			}
			break
		}
		if len(ch.Error) > 0 && !isNull(ch.Error) {
			e.end, e.brokenReason = endBroken, "an error event"
			break
		}
		if e.id == "" {
			e.id, e.model = boundedName(ch.ID), boundedName(ch.Model)
			if n, ok := asInt(ch.Created); ok {
				e.created = n
			}
		}
		if ch.Usage != nil && !isNull(*ch.Usage) {
			e.report(h, c, ch.Usage)
		}
		if ch.Choices == nil || len(*ch.Choices) == 0 {
			// The usage chunk goes to the client only if it asked.
			if ch.Usage != nil && !isNull(*ch.Usage) && !c.includeUsage {
				continue
			}
			if ch.Usage != nil && !isNull(*ch.Usage) {
				e.usageSent = true
			}
		} else if !e.count(*ch.Choices, oc, loop, a.MaxOutput) {
			break
		}
		e.passed = oc.Tokens()
		if l.check(); !l.gone.Load() && sw.send("", oneLine(data)) != nil {
			l.gone.Store(true) // read on to the usage, relaying nothing
		}
		if e.looped {
			// Cut after the chunk that made the loop plain, as the
			// planner's stream is.
			e.end = endCut
			break
		}
	}
	return h.endChat(l, sw, c, a, held, &e)
}

// cutCharge is the output a stream cut at limit is charged, before the
// event that passed the limit and now with it: what passed, as the
// provider's own cut would have produced, unless the event passed the
// limit by more than a JSON answer may (overTolerance): the provider
// produced what it sent, and a provider that sends a whole answer in one
// event past its limit is charged it.
func cutCharge(before, now, limit int64, exact bool) int64 {
	if now > satAdd(limit, overTolerance(limit, exact)) {
		return now
	}
	return before
}

// count counts a chunk's choices with oc and feeds them to the loop cut;
// false when they take the output past limit (the chunk is not relayed,
// e says the cut). Its own frame: a stream's goroutine keeps the stack
// of its deepest point, the chunk's decoding, which runs beside it.
func (e *chatEnd) count(choices []chatChoice, oc *outCounter, loop *loopFeed, limit int64) bool {
	before := oc.Tokens()
	for i := range choices {
		choices[i].delta.count(oc)
	}
	if limit > 0 && oc.Tokens() > limit {
		e.passed, e.end = cutCharge(before, oc.Tokens(), limit, oc.enc.Known()), endCut
		return false
	}
	for i := range choices {
		e.looped = e.looped || choices[i].delta.loops(loop)
		e.refused = e.refused || chatRefused(choices[i].FinishReason, &choices[i].delta)
	}
	return true
}

// report reads a usage chunk's report into e (its own frame, as count's).
func (e *chatEnd) report(h *handler, c *call, raw *json.RawMessage) {
	if u := h.usage(c, raw, 0); u.Reported {
		e.reported = higherUsage(e.reported, u)
	}
}

// higherUsage is the usage of a stream that reported prev (nil: none)
// and then u: a later report never lowers an earlier one.
func higherUsage(prev *govern.Usage, u govern.Usage) *govern.Usage {
	if prev == nil {
		return &u
	}
	m := *prev
	m.Prompt, m.Completion = max(m.Prompt, u.Prompt), max(m.Completion, u.Completion)
	m.Unreadable = m.Unreadable || u.Unreadable
	m.Raw = boundedRaw([]byte(m.Raw + " " + u.Raw))
	return &m
}

// A stream is cut, as at its reservation, once the provider sent more
// than streamBytesPerToken bytes of events per reserved output token, and
// streamBytesBase besides. Only the output in the events is counted
// (deltas), so a provider that streams what is not counted (a vendor
// field, a Responses event without a delta, forever) is stopped by its
// bytes, and charged its whole reservation. An honest stream sends a few
// hundred bytes a token, logprobs included. A JSON answer has the same
// bound (answerBound).
const (
	streamBytesPerToken = 4 << 10
	streamBytesBase     = 1 << 20
)

// streamBound is the most bytes of events a stream of maxOutput reserved
// tokens may send (0: no bound) for a request of echoed bytes that it may
// repeat: a Responses stream echoes the request's instructions and tools
// in its response.created, response.in_progress and closing events, four
// times at most; vLLM's echo repeats a chat prompt once.
func streamBound(maxOutput, echoed int64) int64 {
	if maxOutput <= 0 {
		return math.MaxInt64
	}
	return satAdd(satAdd(min(maxOutput, 1<<40)*streamBytesPerToken, streamBytesBase), 4*min(echoed, 1<<40))
}

// overStreamBytes reports whether relayed bytes of events pass
// streamBound.
func overStreamBytes(relayed, maxOutput, echoed int64) bool {
	return relayed > streamBound(maxOutput, echoed)
}

// chatEnd is what relayChat's loop leaves for the stream's end.
type chatEnd struct {
	passed       int64
	reported     *govern.Usage
	usageSent    bool
	looped       bool
	id, model    string
	created      int64
	end          streamEnd
	brokenReason string
	refused      bool
}

// streamOutcome is what a stream that stopped as end says, before its
// end is written: the usage reported when it finished, else the count;
// why it ended (the link), charged at least the prompt; read on after
// the agent hung up and cut without its usage, its whole reservation.
func streamOutcome(l *link, c *call, a govern.Attempt, passed int64, reported *govern.Usage, end streamEnd) govern.Outcome {
	out := govern.Outcome{Counted: passed, Sent: true}
	out.Usage = govern.Usage{Prompt: c.prompt, Completion: passed}
	if reported != nil && end == endDone {
		out.Usage = *reported
	} else if reported != nil {
		out.Usage.Prompt = reported.Prompt
	}
	switch {
	case l.gone.Load():
		out.Ended, out.Truncated = budget.OutcomeClientClosed, true
		if end == endCut && l.ctx.Err() != nil {
			// Hung up on before its usage came: the reservation.
			out.Counted = max(passed, a.MaxOutput)
			out.Usage = govern.Usage{Prompt: c.prompt, Completion: out.Counted}
		}
	case end == endCut && l.ctx.Err() != nil:
		out.Ended = l.ended()
	}
	return out
}

// endChat ends a chat stream relayChat relayed, as e says it stopped
// (its own frame: the relay's loop, where a stream stays open, does not
// carry the ending's locals).
func (h *handler) endChat(l *link, sw *sseWriter, c *call, a govern.Attempt, held *heldEnd, e *chatEnd) (govern.Outcome, error) {
	end := e.end
	out := streamOutcome(l, c, a, e.passed, e.reported, end)
	out.Answered, out.Refused = e.model, e.refused
	if e.looped {
		out.Cut = codes.OutputLoop
	}
	if end == endBroken && !sw.started {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, e.brokenReason)
	}
	if out.Ended != "" && !sw.started && !l.gone.Load() {
		// Ended before the first byte: the table's error (the task's end,
		// the deadline's 503), charged the prompt.
		return out, l.err()
	}
	if l.gone.Load() {
		out.Started = sw.started
		if end == endBroken {
			return out, fmt.Errorf("%w: stream: %s", ErrUpstream, e.brokenReason)
		}
		return out, nil
	}
	chunk := func(rest string) []byte {
		b := []byte(`{"id":`)
		b = appendJSONString(b, e.id)
		b = append(b, `,"object":"chat.completion.chunk","created":`...)
		b = strconv.AppendInt(b, e.created, 10)
		b = append(b, `,"model":`...)
		b = appendJSONString(b, e.model)
		b = append(b, ',')
		return append(b, rest...)
	}
	usageChunk := func() []byte {
		p, o := out.Usage.Prompt, out.Usage.Completion
		b := []byte(`"choices":[],"usage":{"prompt_tokens":`)
		b = strconv.AppendInt(b, p, 10)
		b = append(b, `,"completion_tokens":`...)
		b = strconv.AppendInt(b, o, 10)
		b = append(b, `,"total_tokens":`...)
		b = strconv.AppendInt(b, satAdd(p, o), 10)
		return chunk(string(append(b, "}}"...)))
	}
	switch end {
	case endCut:
		out.Truncated = true
		_ = sw.send("", chunk(`"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`))
		if c.includeUsage {
			_ = sw.send("", usageChunk())
		}
	case endBroken:
		_ = sw.send("", h.o.Errors.ErrorEvent(c.req, fmt.Errorf("%w: the stream broke off: %s", ErrUpstream, e.brokenReason)))
	case endDone:
		if c.includeUsage && !e.usageSent {
			_ = sw.send("", usageChunk())
		}
	}
	sw.flush()
	// The client's reader stops at [DONE]: it is the answer's end.
	out.Started = true
	held.hold(func() {
		_ = sw.send("", []byte("[DONE]"))
		sw.flush()
	})
	if end == endBroken {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, e.brokenReason)
	}
	return out, nil
}

// readEnd classifies a failed read of the provider's stream: the call's
// context ending (the client left, or the task ended) is a cut; anything
// else, the end of the body before [DONE] included, is a broken stream.
func readEnd(ctx context.Context, err error) (streamEnd, string) {
	if ctx.Err() != nil {
		return endCut, ""
	}
	switch {
	case errors.Is(err, errLineTooLong):
		return endBroken, "an event over the bound"
	case errors.Is(err, io.EOF):
		return endBroken, "the stream ended before it was done"
	}
	return endBroken, "the stream failed"
}
