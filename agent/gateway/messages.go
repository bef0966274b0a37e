// The Anthropic Messages wire: POST /v1/messages (JSON and SSE), POST
// /v1/messages/count_tokens and the models list in Anthropic's shape, for
// agents built on Anthropic's SDKs, the Claude Agent SDK or Claude Code.
//
// How it plugs into the governed call. NewMessages returns the routes
// (MessagesHandlers) beside New's, sharing its Options (Governor, Limits,
// Task, bounds) with Errors a writer in Anthropic's shape; the router
// mounts them on the Messages paths, and on GET /v1/models and
// /v1/models/{id} for a request that carries anthropic-version. Each
// Messages call is one Governor.Call, as a chat call is, with:
//   - Spec: Kind KindMessages; PromptTokens the prompt counted by the chat
//     route's rules (messages_count.go), images at their dearest;
//     MaxOutput the client's max_tokens; MinOutput msgCall.minOutput(wire):
//     MinThinkingBudget+1 when manual thinking is sent, so a call that
//     cannot afford 1,024 thinking tokens is refused with the budget's code
//     before anything is sent; Hold the task's call slot, as for chat.
//   - the attempt (attemptMessages): govern.Attempt.MaxOutput is the reservation's
//     output limit, sent as max_tokens, thinking.budget_tokens held below
//     it; the stream is cut at it. The upstream's kind (MessagesOptions.Wire,
//     one for the primary and the fallback) chooses the path: WireAnthropic
//     forwards the raw body with model, max_tokens and thinking patched and
//     relays the event stream as it comes; WireOpenAI translates to a chat
//     completion call and its answer back, event by event.
//   - the Outcome: govern.Usage.Prompt is input + cache writes + cache reads as
//     the provider reported them (Anthropic's input_tokens excludes its
//     cache), with CacheCreation, CacheCreation1h and CacheRead apart for the
//     money (budget.Price.CostOf); Counted what passed, as on the chat
//     route.
//
// The answer's end (message_stop, or the JSON answer) is held until the
// Governor has settled, as on the other routes. Refusals before the answer
// began are written by Options.Errors in Anthropic's error shape
// (WriteAnthropicError); after it began, a stream ends with event: error
// (Errors.ErrorEvent: AnthropicErrorEvent).

package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"faregate/agent/govern"
)

// KindMessages is the govern.Spec.Kind of a Messages call.
const KindMessages = "messages"

// The wires an upstream speaks.
const (
	// WireOpenAI is an OpenAI-compatible server: a Messages call is
	// translated to a chat completion and back.
	WireOpenAI = "openai"
	// WireAnthropic is an Anthropic-compatible server (BaseURL the URL
	// /messages is appended to): a Messages call is forwarded.
	WireAnthropic = "anthropic"
)

// DefaultAnthropicVersion is the anthropic-version sent upstream when the
// client sent none.
const DefaultAnthropicVersion = "2023-06-01"

// MessagesOptions configure the Messages routes beside Options.
type MessagesOptions struct {
	// Wire is the upstream's, primary and fallback alike: WireOpenAI
	// (default) or WireAnthropic.
	Wire string
	// CountUpstream answers count_tokens with WireAnthropic (the primary
	// upstream); nil, or WireOpenAI: faregate's own estimate answers.
	CountUpstream *Upstream
}

// MessagesHandlers are the Messages routes. The router mounts each on its
// method and path (a query string, as Claude Code's ?beta=true, is the
// router's to ignore), gating and reading the body as for the other
// routes, with Options.Errors a writer in Anthropic's error shape
// (WriteAnthropicError, AnthropicErrorEvent):
//
//	POST /v1/messages               Messages
//	POST /v1/messages/count_tokens  CountTokens
//	GET  /v1/models                 Models (a request with anthropic-version)
//	GET  /v1/models/{model}         Model  (likewise)
type MessagesHandlers struct {
	Messages, CountTokens Call
	Models, Model         http.Handler
}

// messages serves the Messages routes.
type messages struct {
	h  *handler
	mo MessagesOptions
}

// NewMessages returns the Messages routes. It panics when Governor, Task
// or Errors is nil, or Wire is neither wire: those are wiring.
func NewMessages(o Options, mo MessagesOptions) MessagesHandlers {
	if mo.Wire == "" {
		mo.Wire = firstOf(o.Wire, WireOpenAI)
	}
	if mo.Wire != WireOpenAI && mo.Wire != WireAnthropic {
		panic("gateway: MessagesOptions.Wire must be openai or anthropic")
	}
	// A handler without New's seen memo: Messages bodies are parsed whole.
	h := newHandler(o)
	ms := &messages{h: h, mo: mo}
	return MessagesHandlers{
		Messages:    ms.call(ms.serveMessages),
		CountTokens: ms.call(ms.serveCountTokens),
		Models: h.granted(func(w http.ResponseWriter, r *http.Request, t Task) {
			writeJSON(w, ms.modelList(t))
		}),
		Model: h.granted(func(w http.ResponseWriter, r *http.Request, t Task) {
			id, _ := strings.CutPrefix(r.URL.Path, "/v1/models/")
			if !slices.Contains(h.models(t), id) {
				h.o.Errors.WriteError(w, r, &ParamError{Err: ErrNotFound, Field: "model",
					Reason: "not a model this key may use (GET /v1/models lists them)"})
				return
			}
			writeJSON(w, appendAnthropicModel(nil, id))
		}),
	}
}

// call is a Messages route that reads the body, for the request's task.
func (ms *messages) call(serve func(http.ResponseWriter, *http.Request, Task, []byte)) Call {
	return func(w http.ResponseWriter, r *http.Request, body []byte) {
		t, ok := ms.h.o.Task(r)
		if !ok {
			ms.h.o.Errors.WriteError(w, r, ErrNoTask)
			return
		}
		serve(w, r, t, body)
	}
}

// parse checks a Messages body of t's request r.
func (ms *messages) parse(r *http.Request, t Task, body []byte, countOnly bool) (*msgCall, error) {
	m, err := parseMessages(body, func(model string) bool { return slices.Contains(t.Models, model) }, countOnly)
	if err != nil {
		return nil, err
	}
	m.req = r
	return m, m.checkHeaders(r.Header.Get("anthropic-version"), r.Header.Values("anthropic-beta"))
}

// serveMessages answers one governed Messages call (the package doc of
// this file says what the Governor is given).
func (ms *messages) serveMessages(w http.ResponseWriter, r *http.Request, t Task, body []byte) {
	h := ms.h
	m, err := ms.parse(r, t, body, false)
	if err != nil {
		h.o.Errors.WriteError(w, r, err)
		return
	}
	g := governed{kind: KindMessages, model: m.model, prompt: m.prompt, maxOut: m.maxOut, minOut: m.minOutput(ms.mo.Wire),
		promptCache: ms.mo.Wire == WireAnthropic}
	if m.images > 0 {
		g.prompt += m.images * h.dearerImage(m.model, false)
	}
	g.maxOut = max(g.maxOut, g.minOut)
	m.deadline, m.taskFirst = h.callDeadline(w, t)
	// A Messages call is a model call (FAREGATE_AGENT_MAX_CALLS,
	// FAREGATE_AGENT_MAX_PARALLEL), governed as the chat route's are.
	g.attempt = func(ctx context.Context, a govern.Attempt, end *heldEnd) (govern.Outcome, error) {
		out, err := h.attemptMessages(ctx, w, m, a, end, ms.mo.Wire)
		out.PromptCounted, out.Exact = m.floor, m.counter.Known()
		return out, err
	}
	h.govern(w, r, t, g)
}

// attemptMessages makes one try on the upstream the governor chose, in
// the upstream's wire; the answer's end is left in end.
func (h *handler) attemptMessages(ctx context.Context, w http.ResponseWriter, m *msgCall, a govern.Attempt, end *heldEnd, wire string) (govern.Outcome, error) {
	l := newLink(ctx, m.deadline, m.taskFirst, m.stream)
	defer l.stop() // a relay that stops early hangs up on the provider
	ctx = l.ctx
	if wire == WireOpenAI {
		c, err := m.chatCall()
		if err != nil {
			return govern.Outcome{}, err
		}
		resp, err := h.send(l, c, a)
		if err != nil {
			return l.unanswered(c.prompt, a), err
		}
		defer resp.Body.Close()
		if m.stream {
			return h.translateChatStream(ctx, w, m, c, a, resp.Body, end)
		}
		return h.translateChatJSON(l, w, m, c, a, resp.Body, answerHint(resp), end)
	}
	body, err := m.anthropicBody(a)
	if err != nil {
		return govern.Outcome{}, err
	}
	resp, err := sendAnthropic(l, upstreamOf(a.Model), "/messages", body, m, m.stream)
	if err != nil {
		return l.unanswered(m.prompt, a), err
	}
	defer resp.Body.Close()
	if m.stream {
		return h.relayMessages(ctx, w, m, a, resp.Body, end)
	}
	return h.answerMessagesJSON(l, w, m, a, resp.Body, answerHint(resp), end)
}

// answerHint is the buffer an answer is read into at first: its declared
// length (still bounded by MaxAnswer), else 4 KiB.
func answerHint(resp *http.Response) int64 {
	if resp.ContentLength > 0 {
		return resp.ContentLength + 1
	}
	return 4 << 10
}

// sendAnthropic posts body to an Anthropic upstream's path on l (post:
// the same hang-up, deadline and refusal rules as every route), with its
// key as x-api-key and the client's anthropic-version and anthropic-beta.
func sendAnthropic(l *link, up Upstream, path string, body []byte, m *msgCall, stream bool) (*http.Response, error) {
	return post(l, up, strings.TrimRight(up.BaseURL, "/")+path, body, stream, func(hd http.Header) {
		if up.APIKey != "" {
			hd.Set("X-Api-Key", up.APIKey)
		}
		hd.Set("Anthropic-Version", firstOf(m.version, DefaultAnthropicVersion))
		if m.beta != "" {
			hd.Set("Anthropic-Beta", m.beta)
		}
	})
}

// serveCountTokens answers count_tokens: not a model call (no
// reservation, no ledger entry, not counted toward the task's calls).
// With an Anthropic upstream it is forwarded, its answer read as a
// number and written anew; otherwise faregate's own estimate, the prompt
// a call of this body would be reserved for, answers.
func (ms *messages) serveCountTokens(w http.ResponseWriter, r *http.Request, t Task, body []byte) {
	m, err := ms.parse(r, t, body, true)
	if err != nil {
		ms.h.o.Errors.WriteError(w, r, err)
		return
	}
	n := m.prompt + m.images*ms.h.dearerImage(m.model, false)
	if ms.mo.Wire == WireAnthropic && ms.mo.CountUpstream != nil {
		if n, err = ms.countUpstream(r.Context(), m); err != nil {
			ms.h.o.Errors.WriteError(w, r, err)
			return
		}
	}
	writeJSON(w, append(strconv.AppendInt([]byte(`{"input_tokens":`), n, 10), '}'))
}

// countUpstream asks the Anthropic upstream to count m's body.
func (ms *messages) countUpstream(ctx context.Context, m *msgCall) (int64, error) {
	body := m.obj.encode(make([]byte, 0, 64+totalSize(m.obj)), nil)
	l := newLink(ctx, time.Now().Add(ms.h.o.CallTimeout), false, false)
	defer l.stop()
	resp, err := sendAnthropic(l, *ms.mo.CountUpstream, "/messages/count_tokens", body, m, false)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	raw, err := readAtMost(resp.Body, 512, 64<<10)
	var ans struct {
		InputTokens *float64 `json:"input_tokens"`
	}
	if err != nil || json.Unmarshal(raw, &ans) != nil || ans.InputTokens == nil {
		return 0, fmt.Errorf("%w: count_tokens answer is not a count", ErrUpstream)
	}
	return max(clampInt(*ans.InputTokens), 0), nil
}

// modelList is the models the key may use in Anthropic's list shape.
func (ms *messages) modelList(t Task) []byte {
	models := ms.h.models(t)
	b := []byte(`{"data":[`)
	for i, m := range models {
		if i > 0 {
			b = append(b, ',')
		}
		b = appendAnthropicModel(b, m)
	}
	b = append(b, `],"has_more":false,"first_id":`...)
	if len(models) == 0 {
		return append(b, `null,"last_id":null}`...)
	}
	b = appendJSONString(b, models[0])
	b = append(b, `,"last_id":`...)
	b = appendJSONString(b, models[len(models)-1])
	return append(b, '}')
}

// appendAnthropicModel appends model m as Anthropic's model object.
func appendAnthropicModel(b []byte, m string) []byte {
	b = append(b, `{"type":"model","id":`...)
	b = appendJSONString(b, m)
	b = append(b, `,"display_name":`...)
	b = appendJSONString(b, m)
	return append(b, `,"created_at":"1970-01-01T00:00:00Z"}`...)
}
