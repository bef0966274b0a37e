package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"faregate/agent/govern"
	"faregate/protect/codes"
)

// Block kinds of a translated stream.
const (
	blockNone = iota
	blockText
	blockThinking
	blockTool
)

// maxToolCalls bounds the tool calls one translated answer may hold.
const maxToolCalls = 128

// translation is the state of a chat stream being translated into a
// Messages stream.
type translation struct {
	x      *msgWriter
	next   int64 // the index of the next block
	cur    int64 // the open block, when kind is not blockNone
	kind   int
	tools  map[int]int64 // chat tool call index → block index
	stop   string        // the stop_reason of the finish_reason seen
	begun  bool          // message_start was sent
	prompt govern.Usage  // the usage message_start carries
	looped bool          // the text or tool arguments loop (the loop cut)
}

// begin sends message_start, once.
func (t *translation) begin(id, model string) {
	if t.begun {
		return
	}
	t.begun = true
	t.x.messageStart(msgID(id), model, model, t.prompt)
}

// open makes a block of kind the open one, closing another first; start
// is its content_block_start's block.
func (t *translation) open(kind int, start []byte) {
	if t.kind == kind && kind != blockTool {
		return
	}
	t.close()
	t.cur, t.kind = t.next, kind
	t.next++
	t.x.blockStart(t.cur, start)
}

// close ends the open block, if any.
func (t *translation) close() {
	if t.kind != blockNone {
		t.x.blockStop(t.cur)
		t.kind = blockNone
	}
}

// apply translates one choice's delta into events. false: the answer
// holds more tool calls than maxToolCalls.
func (t *translation) apply(d *chatMsg) bool {
	if s := d.reasoning(); s != "" {
		t.open(blockThinking, []byte(`{"type":"thinking","thinking":"","signature":""}`))
		t.x.delta(t.cur, "thinking_delta", "thinking", s)
	}
	if s := d.text(); s != "" {
		t.open(blockText, []byte(`{"type":"text","text":""}`))
		t.x.delta(t.cur, "text_delta", "text", s)
	}
	for _, tc := range d.ToolCalls {
		i, known := t.tools[tc.Index]
		if !known {
			// A piece of a known call whose block is no longer the open
			// one goes to its block all the same: the SDKs' accumulators
			// add a delta to the block its index names.
			if len(t.tools) >= maxToolCalls {
				return false
			}
			b := []byte(`{"type":"tool_use","id":`)
			b = appendJSONString(b, toolID(tc.ID))
			b = append(b, `,"name":`...)
			b = appendJSONString(b, tc.Function.Name)
			t.open(blockTool, append(b, `,"input":{}}`...))
			t.tools[tc.Index] = t.cur
			i = t.cur
		}
		if tc.Function.Arguments != "" {
			t.x.delta(i, "input_json_delta", "partial_json", tc.Function.Arguments)
		}
	}
	return true
}

// translateChatStream answers a streamed Messages call from an
// OpenAI-compatible upstream's chat stream, event by event: message_start
// on the first chunk (its usage the prompt as counted: never 0), a
// thinking, text or tool_use block for each run of reasoning, text or a
// tool call, message_delta with the stop_reason and usage at the end,
// message_stop held in end for after the settle. It is counted and cut
// as the chat relay counts and cuts (the same output limit and byte
// bound), a cut ending as a pass-through cut does; a client that stops
// reading leaves the provider's stream drained to its usage.
func (h *handler) translateChatStream(ctx context.Context, w http.ResponseWriter, m *msgCall, c *call, a govern.Attempt, body io.Reader, held *heldEnd) (govern.Outcome, error) {
	sw := newSSEWriter(w)
	rd := newSSEReader(body, h.o.MaxEvent)
	rd.lr.beforeBlock = sw.flush
	oc := newOutCounter(a.Model.Name)
	t := &translation{x: &msgWriter{sw: sw}, tools: map[int]int64{}, stop: "end_turn",
		prompt: govern.Usage{Prompt: m.prompt}}
	echoed := int64(totalSize(c.obj))
	loop := &loopFeed{threshold: h.o.LoopThreshold}
	var (
		passed, relayed int64
		reported        *govern.Usage
		end             streamEnd
		why             string
		gone            bool
	)
	for end == endDone {
		ev, err := rd.next()
		if err != nil {
			end, why = readEnd(ctx, err)
			break
		}
		data := bytes.TrimSpace(ev.data)
		if string(data) == "[DONE]" {
			break
		}
		if relayed += int64(len(data)); overStreamBytes(relayed, a.MaxOutput, echoed) {
			passed, end = max(passed, a.MaxOutput), endCut
			break
		}
		var ch chatAnswer
		if json.Unmarshal(data, &ch) != nil || len(ch.Error) > 0 && !isNull(ch.Error) {
			end, why = endBroken, "an event that is not a chunk"
			if ctx.Err() != nil {
				end = endCut
			}
			break
		}
		if ch.Usage != nil && !isNull(*ch.Usage) {
			if u := h.usage(c, ch.Usage, 0); u.Reported {
				reported = &u
			}
		}
		t.begin(ch.ID, firstOf(boundedName(ch.Model), a.Model.Name))
		for _, choice := range derefChoices(ch.Choices) {
			before := oc.Tokens()
			choice.Delta.count(oc)
			if a.MaxOutput > 0 && oc.Tokens() > a.MaxOutput {
				passed, end = before, endCut
				break
			}
			if choice.Index == 0 {
				if !t.apply(&choice.Delta) {
					end, why = endBroken, "more tool calls than one answer may hold"
					break
				}
				if choice.FinishReason != nil {
					t.stop = stopReasonOf(*choice.FinishReason)
				}
				t.looped = t.looped || choice.Delta.loops(loop)
			}
		}
		if end == endDone {
			passed = oc.Tokens()
			if t.looped {
				// Cut after the chunk that made the loop plain, as the
				// chat relay is.
				end = endCut
			}
		}
		gone = gone || sw.err != nil
	}
	if gone {
		end = endGone
	}
	return h.endTranslation(t, m, c, a, held, passed, reported, end, why)
}

// endTranslation ends a translated stream as end says it stopped and
// reports what it spent.
func (h *handler) endTranslation(t *translation, m *msgCall, c *call, a govern.Attempt, held *heldEnd, passed int64, reported *govern.Usage, end streamEnd, why string) (govern.Outcome, error) {
	sw := t.x.sw
	out := govern.Outcome{Counted: passed}
	out.Usage = govern.Usage{Prompt: c.prompt, Completion: passed}
	if reported != nil && (end == endDone || end == endGone) {
		out.Usage = *reported
	} else if reported != nil {
		out.Usage.Prompt = reported.Prompt
	}
	if end == endBroken && !sw.started {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, why)
	}
	switch end {
	case endGone:
		out.Truncated = true
	case endCut:
		out.Truncated = true
		if t.looped {
			out.Cut = codes.OutputLoop
		}
		t.begin("", a.Model.Name)
		t.close()
		t.x.messageDelta("max_tokens", out.Usage)
	case endDone:
		t.begin("", a.Model.Name)
		t.close()
		t.x.messageDelta(t.stop, out.Usage)
	}
	sw.flush()
	out.Started = sw.started
	if end == endGone {
		return out, nil
	}
	out.Started = true
	last := sseOut{"message_stop", []byte(`{"type":"message_stop"}`)}
	if end == endBroken {
		last = h.errorEvent(m.req, why)
	}
	held.hold(func() {
		_ = sw.send(last.name, last.data)
		sw.flush()
	})
	if end == endBroken {
		return out, fmt.Errorf("%w: stream: %s", ErrUpstream, why)
	}
	return out, nil
}

func derefChoices[T any](p *[]T) []T {
	if p == nil {
		return nil
	}
	return *p
}
