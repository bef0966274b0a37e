package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"

	"faregate/agent/govern"
)

// chatToolDelta is a tool call of a chat delta or message, with what
// the translation needs besides the count: its index and id.
type chatToolDelta struct {
	Index    int    `json:"index"`
	ID       string `json:"id"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// chatMsg is a chat delta or message as translated.
type chatMsg struct {
	Content          *string         `json:"content"`
	ReasoningContent *string         `json:"reasoning_content"`
	Reasoning        *string         `json:"reasoning"`
	Refusal          *string         `json:"refusal"`
	ToolCalls        []chatToolDelta `json:"tool_calls"`
}

// loops feeds m's content and tool-call arguments to f, as the chat relay
// feeds a delta's (chatDelta.loops).
func (m *chatMsg) loops(f *loopFeed) bool {
	if m.Content != nil && f.feed(1, *m.Content) {
		return true
	}
	for _, tc := range m.ToolCalls {
		if f.feed(6, tc.Function.Arguments) {
			return true
		}
	}
	return false
}

// count counts m as the chat relay counts a delta (chatDelta.count).
func (m *chatMsg) count(oc *outCounter) {
	d := chatDelta{Content: m.Content, ReasoningContent: m.ReasoningContent, Reasoning: m.Reasoning, Refusal: m.Refusal}
	for _, tc := range m.ToolCalls {
		var c chatToolCall
		c.fn.Name, c.fn.Arguments = tc.Function.Name, tc.Function.Arguments
		d.ToolCalls = append(d.ToolCalls, c)
	}
	d.count(oc)
}

// reasoning is the reasoning text of m, in whichever member the server
// sends it (DeepSeek and vLLM reasoning_content, others reasoning).
func (m *chatMsg) reasoning() string {
	s := ""
	for _, p := range []*string{m.ReasoningContent, m.Reasoning} {
		if p != nil {
			s += *p
		}
	}
	return s
}

// text is the visible text of m: its content, or its refusal.
func (m *chatMsg) text() string {
	s := ""
	for _, p := range []*string{m.Content, m.Refusal} {
		if p != nil {
			s += *p
		}
	}
	return s
}

// chatAnswer is a chat completion (or, with Delta, a chunk) as
// translated.
type chatAnswer struct {
	ID      string `json:"id"`
	Model   string `json:"model"`
	Choices *[]struct {
		Index        int     `json:"index"`
		Message      chatMsg `json:"message"`
		Delta        chatMsg `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage *json.RawMessage `json:"usage"`
	Error json.RawMessage  `json:"error"`
}

// translateChatJSON answers a non-streamed Messages call from an
// OpenAI-compatible upstream's chat completion: read within MaxAnswer,
// counted as the chat route counts one, and held in end as a Messages
// answer (thinking from reasoning, text, tool_use blocks; stop_reason from
// finish_reason; the usage mapped) to be sent once settled.
func (h *handler) translateChatJSON(l *link, w http.ResponseWriter, m *msgCall, c *call, a govern.Attempt, body io.Reader, hint int64, end *heldEnd) (govern.Outcome, error) {
	// Bounded as every JSON answer is: by its reservation (answerJSON).
	raw, out, err := readAnswer(l, body, hint, h.answerBound(c, a), c.prompt, a)
	if err != nil {
		return out, err
	}
	var ans chatAnswer
	if json.Unmarshal(raw, &ans) != nil || len(ans.Error) > 0 && !isNull(ans.Error) || ans.Choices == nil || len(*ans.Choices) == 0 {
		return govern.Outcome{Counted: a.MaxOutput, Sent: true}, fmt.Errorf("%w: answer is not a chat result", ErrUpstream)
	}
	model := a.Model.Name
	if ans.Usage != nil && !isNull(*ans.Usage) {
		model = "" // beside a report the bound serves (answerJSON)
	}
	oc := newOutCounter(model)
	for _, ch := range *ans.Choices {
		oc.cut()
		oc.kind = 0
		ch.Message.count(oc)
	}
	out = govern.Outcome{Counted: oc.Tokens(), Answered: boundedName(ans.Model), Sent: true}
	out.Usage = h.usage(c, ans.Usage, out.Counted)
	if a.MaxOutput > 0 && out.Counted > satAdd(a.MaxOutput, overTolerance(a.MaxOutput, oc.enc.Known())) {
		// A Messages answer is never cut (answerMessagesJSON): refused,
		// charged what it used.
		return out, fmt.Errorf("%w: chat answer of %d output tokens on a reservation of %d", ErrUpstreamAnswer, out.Counted, a.MaxOutput)
	}
	out.Started = true
	ch := (*ans.Choices)[0]
	finish := ""
	if ch.FinishReason != nil {
		finish = *ch.FinishReason
	}
	b := []byte(`{"id":`)
	b = appendJSONString(b, msgID(ans.ID))
	b = append(b, `,"type":"message","role":"assistant","model":`...)
	b = appendJSONString(b, firstOf(out.Answered, a.Model.Name))
	b = append(b, `,"content":[`...)
	b = appendMsgContent(b, &ch.Message)
	b = append(b, `],"stop_reason":`...)
	b = appendJSONString(b, stopReasonOf(finish))
	b = append(b, `,"stop_sequence":null,"usage":`...)
	b = appendMsgUsage(b, out.Usage)
	b = append(b, '}')
	end.holdJSON(w, b)
	return out, nil
}

// appendMsgContent appends the content blocks of a chat message: its
// reasoning as a thinking block (unsigned: it is not Anthropic's), its
// text, its tool calls as tool_use blocks.
func appendMsgContent(b []byte, m *chatMsg) []byte {
	n := 0
	sep := func() {
		if n > 0 {
			b = append(b, ',')
		}
		n++
	}
	if s := m.reasoning(); s != "" {
		sep()
		b = append(b, `{"type":"thinking","thinking":`...)
		b = appendJSONString(b, s)
		b = append(b, `,"signature":""}`...)
	}
	if s := m.text(); s != "" {
		sep()
		b = append(b, `{"type":"text","text":`...)
		b = appendJSONString(b, s)
		b = append(b, '}')
	}
	for _, tc := range m.ToolCalls {
		sep()
		b = append(b, `{"type":"tool_use","id":`...)
		b = appendJSONString(b, toolID(tc.ID))
		b = append(b, `,"name":`...)
		b = appendJSONString(b, tc.Function.Name)
		b = append(b, `,"input":`...)
		b = append(b, toolInput(tc.Function.Arguments)...)
		b = append(b, '}')
	}
	return b
}

// toolInput is a tool call's arguments as a tool_use input, which must be
// a JSON object: arguments that are not one (a model's broken JSON) are
// given as {}, their text counted all the same.
func toolInput(args string) []byte {
	in := bytes.TrimSpace([]byte(args))
	if len(in) > 0 && in[0] == '{' && json.Valid(in) {
		var buf bytes.Buffer
		if json.Compact(&buf, in) == nil {
			return buf.Bytes()
		}
	}
	return []byte("{}")
}

// msgID is a message id of a provider's chat id.
func msgID(id string) string {
	if id == "" {
		return newMessageID()
	}
	return "msg_" + boundedName(id)
}

// toolID is a tool_use id of a provider's tool call id.
func toolID(id string) string {
	if id == "" {
		return "toolu_" + newMessageID()[4:]
	}
	return boundedName(id)
}

func firstOf(s ...string) string {
	for _, v := range s {
		if v != "" {
			return v
		}
	}
	return ""
}
