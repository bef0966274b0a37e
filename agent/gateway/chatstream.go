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
	ToolCalls        []struct {
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

func (d *chatDelta) count(oc *outCounter) {
	for i, s := range []*string{d.Content, d.ReasoningContent, d.Reasoning, d.Refusal} {
		if s != nil && *s != "" {
			oc.Part(byte(1+i), *s)
		}
	}
	for _, tc := range d.ToolCalls {
		if tc.Function.Name != "" {
			oc.Part(5, tc.Function.Name)
		}
		if tc.Function.Arguments != "" {
			oc.Part(6, tc.Function.Arguments)
		}
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
	Delta        rawDeltas `json:"delta"`
	FinishReason *string   `json:"finish_reason"`
	delta        chatDelta
}

// decodeChunk decodes data into ch, each choice's delta after the chunk
// (rawDeltas); any error, the chunk's or a delta's, is the chunk's.
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
	}
	return nil
}

// rawDeltas is a choice's delta as the chunk's decode found it, each
// occurrence of the key in order (a provider may repeat it; decoded in
// turn into one chatDelta, as encoding/json merges a repeated key into one
// struct). The delta is decoded after the chunk, not inside it: a chunk
// decoded in one pass nests the delta's frames under the chunk's, and
// the relay's deepest point sets the stack every open stream keeps.
type rawDeltas [][]byte

func (r *rawDeltas) UnmarshalJSON(b []byte) error {
	*r = append(*r, b) // a slice of the chunk, used only by decodeChunk, while the chunk is
	return nil
}

// decode decodes the deltas into d, in order; an error is the chunk's.
func (r rawDeltas) decode(d *chatDelta) error {
	for _, b := range r {
		if err := json.Unmarshal(b, d); err != nil {
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
	var (
		passed       int64
		reported     *Usage
		usageSent    bool
		id, model    string
		created      = h.o.Now().Unix()
		end          streamEnd
		brokenReason string
	)
	for {
		ev, err := rd.next()
		if err != nil {
			end, brokenReason = readEnd(ctx, err)
			break
		}
		data := bytes.TrimSpace(ev.data)
		if string(data) == "[DONE]" {
			end = endDone
			break
		}
		var ch chatChunk
		if decodeChunk(data, &ch) != nil {
			end, brokenReason = endBroken, "an event that is not a chunk"
			if ctx.Err() != nil {
				end = endCut
			}
			break
		}
		if len(ch.Error) > 0 && !isNull(ch.Error) {
			end, brokenReason = endBroken, "an error event"
			break
		}
		if id == "" {
			id, model = boundedName(ch.ID), boundedName(ch.Model)
			if n, ok := asInt(ch.Created); ok {
				created = n
			}
		}
		if ch.Usage != nil && !isNull(*ch.Usage) {
			u := h.usage(c, ch.Usage, 0)
			if u.Reported {
				reported = &u
			}
		}
		if ch.Choices == nil || len(*ch.Choices) == 0 {
			// The usage chunk goes to the client only if it asked.
			if ch.Usage != nil && !isNull(*ch.Usage) && !c.includeUsage {
				continue
			}
			if ch.Usage != nil && !isNull(*ch.Usage) {
				usageSent = true
			}
		} else {
			before := oc.Tokens()
			for i := range *ch.Choices {
				(*ch.Choices)[i].delta.count(oc)
			}
			if a.MaxOutput > 0 && oc.Tokens() > a.MaxOutput {
				passed, end = before, endCut
				break
			}
		}
		passed = oc.Tokens()
		if sw.send("", oneLine(data)) != nil {
			end = endGone
			break
		}
	}

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
