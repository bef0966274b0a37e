package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
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
	endCut                     // the output limit, or the task ended
	endBroken                  // the provider's stream broke or was malformed
	endGone                    // the client stopped reading
)

// relayChat relays a chat completion stream event by event.
// The final data: [DONE] is left in held, for after the settle.
func (h *handler) relayChat(ctx context.Context, w http.ResponseWriter, c *call, a Attempt, body io.Reader, held *heldEnd) (Outcome, error) {
	sw := newSSEWriter(w)
	sw.onStart = c.forget // a stream must not hold the prompt for its life
	rd := newSSEReader(body, h.o.MaxEvent)
	rd.lr.beforeBlock = sw.flush
	oc := newOutCounter(a.Model)
	e := chatEnd{created: h.o.Now().Unix()}
	var relayed, echoed int64
	if c.obj != nil {
		echoed = int64(totalSize(c.obj)) // vLLM's echo repeats the prompt
	}
	for {
		ev, err := rd.next()
		if err != nil {
			e.end, e.brokenReason = readEnd(ctx, err)
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
			if ctx.Err() != nil {
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
			u := h.usage(c, ch.Usage, 0)
			if u.Reported {
				e.reported = &u
			}
		}
		if ch.Choices == nil || len(*ch.Choices) == 0 {
			// The usage chunk goes to the client only if it asked.
			if ch.Usage != nil && !isNull(*ch.Usage) && !c.includeUsage {
				continue
			}
			if ch.Usage != nil && !isNull(*ch.Usage) {
				e.usageSent = true
			}
		} else {
			before := oc.Tokens()
			for i := range *ch.Choices {
				(*ch.Choices)[i].delta.count(oc)
			}
			if a.MaxOutput > 0 && oc.Tokens() > a.MaxOutput {
				e.passed, e.end = before, endCut
				break
			}
		}
		e.passed = oc.Tokens()
		if sw.send("", oneLine(data)) != nil {
			e.end = endGone
			break
		}
	}
	return h.endChat(sw, c, held, &e)
}

// A stream is cut, as at its reservation, once the provider sent more
// than streamBytesPerToken bytes of events per reserved output token, and
// streamBytesBase besides. Only the output in the events is counted
// (deltas), so a provider that streams what is not counted (a vendor
// field, a Responses event without a delta, forever) is stopped by its
// bytes, and charged its whole reservation. An honest stream sends a few
// hundred bytes a token, logprobs included.
const (
	streamBytesPerToken = 4 << 10
	streamBytesBase     = 1 << 20
)

// overStreamBytes reports whether relayed bytes of events pass the bound
// for maxOutput reserved tokens (0: no bound) and a request of echoed
// bytes that the stream may repeat: a Responses stream echoes the
// request's instructions and tools in its response.created,
// response.in_progress and closing events, four times at most; vLLM's
// echo repeats a chat prompt once.
func overStreamBytes(relayed, maxOutput, echoed int64) bool {
	if maxOutput <= 0 {
		return false
	}
	return relayed > satAdd(satAdd(min(maxOutput, 1<<40)*streamBytesPerToken, streamBytesBase), 4*min(echoed, 1<<40))
}

// chatEnd is what relayChat's loop leaves for the stream's end.
type chatEnd struct {
	passed       int64
	reported     *Usage
	usageSent    bool
	id, model    string
	created      int64
	end          streamEnd
	brokenReason string
}

// endChat ends a chat stream relayChat relayed, as e says it stopped
// (its own frame: the relay's loop, where a stream stays open, does not
// carry the ending's locals).
func (h *handler) endChat(sw *sseWriter, c *call, held *heldEnd, e *chatEnd) (Outcome, error) {
	passed, reported, usageSent, id, model, created, end, brokenReason := e.passed, e.reported, e.usageSent, e.id, e.model, e.created, e.end, e.brokenReason
	out := Outcome{Counted: passed, Model: model}
	out.Usage = Usage{Prompt: c.prompt, Completion: passed}
	if reported != nil && end == endDone {
		out.Usage = *reported
	} else if reported != nil {
		out.Usage.Prompt = reported.Prompt
	}
	if end == endBroken && !sw.started {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, brokenReason)
	}
	chunk := func(rest string) []byte {
		b := []byte(`{"id":`)
		b = appendJSONString(b, id)
		b = append(b, `,"object":"chat.completion.chunk","created":`...)
		b = strconv.AppendInt(b, created, 10)
		b = append(b, `,"model":`...)
		b = appendJSONString(b, model)
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
	case endGone:
		out.Truncated = true
	case endCut:
		out.Truncated = true
		_ = sw.send("", chunk(`"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}`))
		if c.includeUsage {
			_ = sw.send("", usageChunk())
		}
	case endBroken:
		_ = sw.send("", []byte(`{"error":{"code":"model_unavailable","message":"The model provider's stream broke off; the answer is incomplete.","type":"api_error"}}`))
	case endDone:
		if c.includeUsage && !usageSent {
			_ = sw.send("", usageChunk())
		}
	}
	sw.flush()
	out.Started = sw.started
	if end != endGone {
		// The client's reader stops at [DONE]: it is the answer's end.
		out.Started = true
		held.hold(func() {
			_ = sw.send("", []byte("[DONE]"))
			sw.flush()
		})
	}
	if end == endBroken {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, brokenReason)
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
