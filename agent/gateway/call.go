package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"faregate/agent/govern"
	"faregate/agent/tasklimits"
	"faregate/agent/tokens"
	"faregate/protect/codes"
	"faregate/protect/repetition"
)

// dearerImage is how much more an image (at low detail, with low) may
// cost on the dearest fallback model than on model.
func (h *handler) dearerImage(model string, low bool) int64 {
	asked := tokens.ImageTokens(model, low)
	most := asked
	for _, m := range h.o.FallbackModels {
		most = max(most, tokens.ImageTokens(m, low))
	}
	return most - asked
}

// serveCall answers one governed model call.
func (h *handler) serveCall(w http.ResponseWriter, r *http.Request, t Task, kind string, body []byte) {
	allowed := func(m string) bool { return slices.Contains(t.Models, m) }
	if kind == KindEmbeddings {
		allowed = func(m string) bool { return m == h.o.EmbeddingModel }
	}
	refs := h.o.ReferenceTokens
	if refs <= 0 {
		refs = DefaultReferenceTokens
	}
	c, err := parseCallHolding(kind, body, allowed, refs, h.memo)
	if err != nil {
		h.o.Errors.WriteError(w, r, err)
		return
	}
	c.req = r
	g := governed{kind: kind, model: c.model, prompt: c.prompt, maxOut: c.maxOut}
	if kind != KindEmbeddings {
		g.minOut = minOutput(kind, c.model)
		// An image costs what the model that serves it says (gpt-4o-mini
		// 33 times gpt-4o): a fallback's dearer images are reserved too.
		for _, m := range h.o.FallbackModels {
			g.minOut = max(g.minOut, minOutput(kind, m))
		}
		if c.images+c.lowImages > 0 {
			g.prompt += c.images*h.dearerImage(c.model, false) + c.lowImages*h.dearerImage(c.model, true)
		}
		if g.maxOut > 0 {
			g.maxOut = max(g.maxOut, g.minOut)
		}
	}
	h.setDeadline(w, c, t)
	g.attempt = func(ctx context.Context, a govern.Attempt, end *heldEnd) (govern.Outcome, error) {
		out, err := h.attempt(ctx, w, c, a, end)
		out.PromptCounted, out.Exact = c.promptFloor, c.exact(a.Model.Name)
		return out, err
	}
	h.govern(w, r, t, g)
}

// holdFor is what takes the slot of a call of kind for task t,
// into hold (nil without limits). Embeddings are not model calls in
// FAREGATE_AGENT_MAX_CALLS' sense: they have a count of their own
// (FAREGATE_AGENT_MAX_EMBEDDING_CALLS), and share the slots in flight
// (FAREGATE_AGENT_MAX_PARALLEL). The slot is the governor's to take,
// beside its own bookings (one round trip).
func (h *handler) holdFor(t Task, kind string, hold *heldSlot) func(ctx context.Context) (func(context.Context, bool), error) {
	if h.o.Limits == nil {
		return nil
	}
	lk := tasklimits.Calls
	if kind == KindEmbeddings {
		lk = tasklimits.Embeddings
	}
	lt := tasklimits.Task{ID: t.ID, Deadline: t.Deadline}
	return func(ctx context.Context) (func(context.Context, bool), error) {
		return hold.take(ctx, h.o.Limits, lt, lk)
	}
}

// setDeadline sets the call's deadline: FAREGATE_LLM_TIMEOUT from now,
// or the task's when that comes first. It bounds every attempt, a
// stream's whole length included. The server's write timeout does not
// (it would cut a long stream without an end): the answer may be written
// until the deadline, and its end after the settle.
func (h *handler) setDeadline(w http.ResponseWriter, c *call, t Task) {
	c.deadline, c.taskFirst = h.callDeadline(w, t)
}

// callDeadline is a call's deadline and whether it is the task's, with
// the response's write deadline lifted to it (setDeadline).
func (h *handler) callDeadline(w http.ResponseWriter, t Task) (deadline time.Time, taskFirst bool) {
	deadline = time.Now().Add(h.o.CallTimeout)
	if !t.Deadline.IsZero() && t.Deadline.Before(deadline) {
		deadline, taskFirst = t.Deadline, true
	}
	_ = http.NewResponseController(w).SetWriteDeadline(deadline.Add(endGrace))
	return deadline, taskFirst
}

// endGrace is how long after its deadline an answer may still be written:
// a stream's well-formed end, held until the call is settled, and the
// settle's round trip before it.
const endGrace = 30 * time.Second

// heldSlot is a call's slot of the task's limits, as the governor took it.
type heldSlot struct {
	mu   sync.Mutex
	rel  func(context.Context, bool)
	done bool
}

func (s *heldSlot) take(ctx context.Context, l Limiter, t tasklimits.Task, kind tasklimits.Kind) (func(context.Context, bool), error) {
	// One lock section from the check to the set: two takes of one call
	// (a governor asking again on its fallback) must not both acquire, and
	// a take after the release must not acquire a slot no one gives back.
	// Acquire is one Redis call bounded by ctx and the client's timeout,
	// and only this call's goroutines ever wait on s.mu.
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return nil, fmt.Errorf("%w: the call's slot was already given back", tasklimits.ErrUnavailable)
	}
	if s.rel != nil {
		return s.release, nil // one slot per call, however often asked
	}
	rel, err := l.Acquire(ctx, t, kind)
	if err != nil {
		return nil, err
	}
	s.rel = rel
	return s.release, nil
}

func (s *heldSlot) taken() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rel != nil
}

// release ends the slot once (a second call does nothing).
func (s *heldSlot) release(ctx context.Context, used bool) {
	s.mu.Lock()
	rel := s.rel
	if s.done {
		s.mu.Unlock()
		return
	}
	s.done = true
	s.mu.Unlock()
	if rel != nil {
		rel(ctx, used)
	}
}

// heldEnd is the end of an answer, held back until the Governor has
// settled the call: the whole of a JSON answer (read whole anyway, for its
// usage), a stream's terminator ([DONE], the Responses terminal event).
// Everything before a stream's terminator is relayed as it arrives, so
// what is held is one event at the most (bounded by MaxEvent). An attempt
// that holds an end reports Started: the answer is committed, and no
// other attempt may follow.
type heldEnd struct {
	mu sync.Mutex
	fn func()
}

func (e *heldEnd) hold(fn func()) {
	e.mu.Lock()
	e.fn = fn
	e.mu.Unlock()
}

// holdJSON holds a whole JSON answer, raw, as the end: written with its
// length once the call is settled.
func (e *heldEnd) holdJSON(w http.ResponseWriter, raw []byte) {
	e.hold(func() {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(raw)))
		w.WriteHeader(http.StatusOK)
		if _, err := w.Write(raw); err == nil {
			_ = http.NewResponseController(w).Flush()
		}
	})
}

// write sends the held end, once.
func (e *heldEnd) write() {
	e.mu.Lock()
	fn := e.fn
	e.fn = nil
	e.mu.Unlock()
	if fn != nil {
		fn()
	}
}

// attempt makes one try on the upstream the governor chose; the answer's
// end is left in end, for serveCall to write after the settle. The
// provider's request is the link's (see link): what the call is charged
// when it ends before the provider's answer depends on how it ended. (An
// open stream's goroutine keeps the stack its deepest point needed, and
// the relay's chunk decoding is that point: no frame is added above it.)
func (h *handler) attempt(ctx context.Context, w http.ResponseWriter, c *call, a govern.Attempt, end *heldEnd) (govern.Outcome, error) {
	l := newLink(ctx, c.deadline, c.taskFirst, c.stream)
	defer l.stop() // a relay that stops early hangs up on the provider
	resp, err := h.send(l, c, a)
	if err != nil {
		return l.unanswered(c.prompt, a), err
	}
	defer resp.Body.Close()
	switch {
	case c.stream && c.kind == KindChat:
		return h.relayChat(l, w, c, a, firstEvent(resp.Body, a.FirstEvent), end)
	case c.stream:
		return h.relayResponses(l, w, c, a, firstEvent(resp.Body, a.FirstEvent), end)
	}
	// The buffer starts at the answer's declared length (a hint only: the
	// read is still bounded), not at a fixed 16 KiB that most answers of a
	// few hundred bytes never use.
	hint := int64(4 << 10)
	if resp.ContentLength > 0 {
		hint = resp.ContentLength + 1
	}
	return h.answerJSON(l, w, c, a, resp.Body, hint, end)
}

// firstEvent is a stream's body that calls mark when its first bytes
// arrive: the breaker judges a stream on the wait for its first event,
// and a provider's events start with its first bytes. A JSON answer is
// not marked (it comes whole; its wait is its length).
func firstEvent(body io.Reader, mark func()) io.Reader {
	if mark == nil {
		return body
	}
	return &markFirst{r: body, mark: mark}
}

type markFirst struct {
	r    io.Reader
	mark func()
}

func (m *markFirst) Read(p []byte) (int, error) {
	n, err := m.r.Read(p)
	if n > 0 && m.mark != nil {
		m.mark()
		m.mark = nil
	}
	return n, err
}

// upstreamPath is the provider path of each kind, under its base URL.
var upstreamPath = map[string]string{
	KindChat:       "/chat/completions",
	KindResponses:  "/responses",
	KindEmbeddings: "/embeddings",
}

// send posts the patched request on l and checks the status.
func (h *handler) send(l *link, c *call, a govern.Attempt) (*http.Response, error) {
	u := strings.TrimRight(a.Model.BaseURL, "/") + upstreamPath[c.kind]
	return post(l, upstreamOf(a.Model), u, c.body(a, h.o.LegacyMaxTokens), c.stream, func(hd http.Header) {
		if a.Model.APIKey != "" {
			hd.Set("Authorization", "Bearer "+a.Model.APIKey)
		}
	})
}

// post sends body to the upstream's URL u on l, its headers set by auth,
// and checks the status: every wire's one way to a provider, so a
// hang-up, a deadline or a refusal means the same on each.
func post(l *link, up Upstream, u string, body []byte, stream bool, auth func(http.Header)) (*http.Response, error) {
	sent := newSentBody(body)
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(l.ctx, l.trace()), http.MethodPost, u, sent.reader())
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUpstream, err)
	}
	req.ContentLength, req.GetBody = int64(len(sent.bytes())), sent.rewind
	// Once the provider answered, the body is never sent again; the
	// transport still holds the request as long as the answer (a stream's
	// whole life), and must not hold the prompt with it.
	defer sent.forget()
	req.Header.Set("Content-Type", "application/json")
	if stream {
		req.Header.Set("Accept", "text/event-stream")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	auth(req.Header)
	client := up.Client
	if client == nil {
		client = http.DefaultClient
	}
	if client.Timeout > 0 {
		// The link's deadline is the call's (and says why it ended); the
		// client's own timeout, the same FAREGATE_LLM_TIMEOUT, would end
		// a stream as a broken one.
		cl := *client
		cl.Timeout = 0
		client = &cl
	}
	resp, err := client.Do(req)
	if err != nil {
		if l.ctx.Err() != nil {
			return nil, l.err()
		}
		// Wrapped, not flattened: the breaker reads a timeout off it.
		return nil, fmt.Errorf("%w: %w", ErrUpstream, err)
	}
	l.sent.Store(true) // answered: it had the request whole
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	// The provider's error text is not relayed: it is about our
	// credentials or our provider as often as about the request.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	ue := &UpstreamError{Status: resp.StatusCode, err: ErrUpstream}
	switch resp.StatusCode {
	case http.StatusBadRequest, http.StatusNotFound, http.StatusConflict, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
		ue.err = ErrUpstreamInvalid
	}
	if s, err := strconv.Atoi(resp.Header.Get("Retry-After")); err == nil && s > 0 {
		ue.After = time.Duration(min(s, 60)) * time.Second
	}
	return nil, ue
}

// forget drops the parsed request (and with it the client's body) once
// the answer has started: no other attempt can follow (serveCall refuses
// one), so the body is never encoded again.
func (c *call) forget() { c.obj, c.streamOptions, c.split = nil, nil, splitBody{} }

// sentBody is a request body that lets go of its bytes: the transport
// reads it once, and rewinds it (GetBody) only to send it again on a fresh
// connection when a reused one failed before any of it was written, which
// can happen only before the answer. After forget, and after a reader has
// read it to the end or been closed, nothing of it is held.
type sentBody struct {
	b atomic.Pointer[[]byte]
}

var errBodyForgotten = errors.New("gateway: the request body was already sent")

func newSentBody(b []byte) *sentBody {
	s := &sentBody{}
	s.b.Store(&b)
	return s
}

func (s *sentBody) bytes() []byte {
	if p := s.b.Load(); p != nil {
		return *p
	}
	return nil
}

func (s *sentBody) forget() { s.b.Store(nil) }

func (s *sentBody) reader() io.ReadCloser { return &dropReader{b: s.bytes()} }

func (s *sentBody) rewind() (io.ReadCloser, error) {
	b := s.bytes()
	if b == nil {
		return nil, errBodyForgotten
	}
	return &dropReader{b: b}, nil
}

// dropReader reads b and drops it at its end or on Close (the transport
// may close it from another goroutine than the one reading).
type dropReader struct {
	mu sync.Mutex
	b  []byte
}

func (d *dropReader) Read(p []byte) (int, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.b) == 0 {
		d.b = nil
		return 0, io.EOF
	}
	n := copy(p, d.b)
	d.b = d.b[n:]
	return n, nil
}

func (d *dropReader) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.b = nil
	return nil
}

// answer is what a non-streamed answer is read for: usage and the output
// to count (chat, responses and embeddings alike; absent parts are empty).
type answer struct {
	Model   string `json:"model"`
	Choices []struct {
		Message      chatDelta `json:"message"`
		FinishReason *string   `json:"finish_reason"`
	} `json:"choices"`
	Output     []respItem       `json:"output"`
	Incomplete *respIncomplete  `json:"incomplete_details"`
	Usage      *json.RawMessage `json:"usage"`
	Error      json.RawMessage  `json:"error"`
}

// decode decodes raw into a, its messages' tool calls included.
func (a *answer) decode(raw []byte) error {
	if err := json.Unmarshal(raw, a); err != nil {
		return err
	}
	for i := range a.Choices {
		if err := a.Choices[i].Message.decodeTools(); err != nil {
			return err
		}
	}
	return nil
}

// respItem is an output item of a Responses answer.
type respItem struct {
	Type      string `json:"type"`
	Name      string `json:"name"`
	Arguments string `json:"arguments"`
	Content   []struct {
		Text    string `json:"text"`
		Refusal string `json:"refusal"`
	} `json:"content"`
	Summary []struct {
		Text string `json:"text"`
	} `json:"summary"`
}

func (it *respItem) count(oc *outCounter) {
	// Each text is a part of its own (kind 0 never equals the last).
	for _, s := range []string{it.Name, it.Arguments} {
		oc.cut()
		oc.Add(s)
	}
	for _, p := range it.Content {
		oc.cut()
		oc.Add(p.Text)
		oc.cut()
		oc.Add(p.Refusal)
	}
	for _, p := range it.Summary {
		oc.cut()
		oc.Add(p.Text)
	}
}

// answerJSON relays a non-streamed answer: read within its bound
// (answerBound), checked, counted, cut when it passed its reservation or
// loops (cut.go), and held in end to be sent on once settled.
func (h *handler) answerJSON(l *link, w http.ResponseWriter, c *call, a govern.Attempt, body io.Reader, hint int64, end *heldEnd) (govern.Outcome, error) {
	raw, out, err := readAnswer(l, body, hint, h.answerBound(c, a), c.prompt, a)
	if err != nil {
		return out, err
	}
	var ans answer
	if err := ans.decode(raw); err != nil || ans.Error != nil && !isNull(ans.Error) {
		return govern.Outcome{Counted: a.MaxOutput, Sent: true}, fmt.Errorf("%w: answer is not a %s result", ErrUpstream, c.kind)
	}
	// Counted with the model's tokenizer, report or not: a report is
	// charged at least this count (budget.Charged).
	oc := newOutCounter(a.Model.Name)
	refused := respRefused(ans.Incomplete, ans.Output)
	for _, ch := range ans.Choices {
		oc.cut()
		oc.kind = 0
		ch.Message.count(oc)
		refused = refused || chatRefused(ch.FinishReason, &ch.Message)
	}
	for i := range ans.Output {
		ans.Output[i].count(oc)
	}
	out = govern.Outcome{Counted: oc.Tokens(), Answered: boundedName(ans.Model), Sent: true, Refused: refused}
	out.Usage = h.usage(c, ans.Usage, out.Counted)
	if c.kind != KindEmbeddings {
		over := a.MaxOutput > 0 && out.Counted > satAdd(a.MaxOutput, overTolerance(a.MaxOutput, oc.enc.Known()))
		var loop *repetition.Detector
		if ans.loopBytes() >= loopStartBytes {
			loop = h.loopDetector() // a shorter answer cannot loop
		}
		if over || loop != nil && ans.loops(loop) {
			limit := int64(0)
			if over {
				limit = a.MaxOutput
			}
			cut, looped, err := cutAnswer(raw, c.kind, a.Model.Name, limit, h.loopDetector())
			if err != nil {
				return out, fmt.Errorf("%w: %s answer of %d output tokens on a reservation of %d", ErrUpstreamAnswer, c.kind, out.Counted, a.MaxOutput)
			}
			if len(cut) != len(raw) || looped {
				raw, out.Truncated = cut, true
				if looped {
					out.Cut = codes.OutputLoop
				}
			}
		}
	}
	out.Started = true
	end.holdJSON(w, raw)
	return out, nil
}

// readAnswer reads a non-streamed answer within bound, for every wire's
// JSON relay; when it cannot, the outcome the attempt reports: the link's
// end (the agent's hang-up, the task's end, the deadline) as unanswered;
// an answer past the bound, which may have cost up to the limit and more
// than could be counted, or one that broke off, the whole reservation
// (nothing of it passed).
func readAnswer(l *link, body io.Reader, hint, bound, prompt int64, a govern.Attempt) ([]byte, govern.Outcome, error) {
	raw, err := readAtMost(body, hint, bound)
	switch {
	case err == nil:
		return raw, govern.Outcome{}, nil
	case l.ended() != "":
		return nil, l.unanswered(prompt, a), l.err()
	case errors.Is(err, errTooLong):
		return nil, govern.Outcome{Counted: a.MaxOutput, Sent: true}, fmt.Errorf("%w: an answer over %d bytes", ErrUpstreamAnswer, bound)
	}
	return nil, govern.Outcome{Counted: a.MaxOutput, Sent: true}, fmt.Errorf("%w: answer: %v", ErrUpstream, err)
}

// answerBound is the most a non-streamed answer of c on a may hold: the
// bound a stream of its reservation has (4 KiB a reserved output token,
// 1 MiB, and the request's echo), MaxAnswer for embeddings (no output).
func (h *handler) answerBound(c *call, a govern.Attempt) int64 {
	if c.kind == KindEmbeddings || a.MaxOutput <= 0 {
		return h.o.MaxAnswer
	}
	return streamBound(a.MaxOutput, c.echo())
}

// loopDetector is a fresh repetition detector for one answer, nil when
// the loop cut is off.
func (h *handler) loopDetector() *repetition.Detector {
	if h.o.LoopThreshold <= 0 {
		return nil
	}
	return repetition.New(0, 0, h.o.LoopThreshold)
}

// loopBytes is the size of the texts loops reads.
func (a *answer) loopBytes() int {
	n := 0
	for _, ch := range a.Choices {
		m := &ch.Message
		if m.Content != nil {
			n += len(*m.Content)
		}
		for _, tc := range m.ToolCalls {
			n += len(tc.fn.Arguments)
		}
		n += len(m.function.Arguments)
	}
	for _, it := range a.Output {
		n += len(it.Arguments)
		for _, p := range it.Content {
			n += len(p.Text)
		}
	}
	return n
}

// loops reports whether the answer's content or tool-call arguments loop,
// fed to d in the order cutAnswer reads them.
func (a *answer) loops(d *repetition.Detector) bool {
	feed := func(s string) bool {
		if s == "" {
			return false
		}
		return d.Write([]byte(s)) || d.Write([]byte{'\n'})
	}
	for _, ch := range a.Choices {
		m := &ch.Message
		if m.Content != nil && feed(*m.Content) {
			return true
		}
		for _, tc := range m.ToolCalls {
			if feed(tc.fn.Arguments) {
				return true
			}
		}
		if feed(m.function.Arguments) {
			return true
		}
	}
	for _, it := range a.Output {
		if feed(it.Arguments) {
			return true
		}
		for _, p := range it.Content {
			if feed(p.Text) {
				return true
			}
		}
	}
	return false
}

// usageReport is every usage shape: chat and embeddings (prompt_tokens,
// completion_tokens), Responses (input_tokens, output_tokens).
type usageReport struct {
	PromptTokens     *float64 `json:"prompt_tokens"`
	CompletionTokens *float64 `json:"completion_tokens"`
	InputTokens      *float64 `json:"input_tokens"`
	OutputTokens     *float64 `json:"output_tokens"`
	CompletionDetail struct {
		Reasoning *float64 `json:"reasoning_tokens"`
	} `json:"completion_tokens_details"`
	OutputDetail struct {
		Reasoning *float64 `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
}

// usage reads a provider's usage object. Numbers are passed on as
// reported (clamped into int64; the governor judges whether they are
// plausible against Counted and its ceiling) with the raw JSON beside
// them. Without a report the usage is this package's estimate, marked so;
// a report that cannot be read is the estimate too, marked Unreadable, so
// that it is not charged as a missing one would be (at the count alone).
func (h *handler) usage(c *call, raw *json.RawMessage, counted int64) govern.Usage {
	est := govern.Usage{Prompt: c.prompt, Completion: counted}
	if raw == nil || isNull(*raw) {
		return est
	}
	unreadable := govern.Usage{Prompt: c.prompt, Completion: counted, Reported: true, Unreadable: true, Raw: boundedRaw(*raw)}
	var u usageReport
	if json.Unmarshal(*raw, &u) != nil {
		return unreadable
	}
	pick := func(a, b *float64) (int64, bool) {
		if a == nil {
			a = b
		}
		if a == nil {
			return 0, false
		}
		return clampInt(*a), true
	}
	p, okP := pick(u.PromptTokens, u.InputTokens)
	o, okO := pick(u.CompletionTokens, u.OutputTokens)
	if c.kind == KindEmbeddings {
		okO = true
	}
	if !okP || !okO {
		return unreadable
	}
	// Reasoning is output; a provider that reports more reasoning than
	// output has left it out of the output count.
	r, okR := pick(u.CompletionDetail.Reasoning, u.OutputDetail.Reasoning)
	if okR && r > o {
		o = satAdd(o, r)
	}
	return govern.Usage{Prompt: p, Completion: o, Reported: true, Raw: boundedRaw(*raw), Reasoning: min(max(r, 0), max(o, 0))}
}

// clampInt turns a reported number into int64 without overflow; a
// fraction is rounded up, NaN is 0.
func clampInt(f float64) int64 {
	switch {
	case f != f:
		return 0
	case f >= 1<<62:
		return 1 << 62
	case f <= -(1 << 62):
		return -(1 << 62)
	}
	n := int64(f)
	if float64(n) < f {
		n++
	}
	return n
}

func satAdd(a, b int64) int64 {
	if a > 0 && b > (1<<62)-a {
		return 1 << 62
	}
	return a + b
}

// boundedRaw keeps at most 4 KiB of a raw usage report for the ledger.
func boundedRaw(b []byte) string {
	if len(b) > 4<<10 {
		b = b[:4<<10]
	}
	return string(b)
}

// boundedName keeps a provider-reported model name short.
func boundedName(s string) string {
	if len(s) > 200 {
		s = s[:200]
	}
	return s
}
