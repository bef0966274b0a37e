package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"faregate/agent/tokens"
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
func (h *handler) serveCall(w http.ResponseWriter, r *http.Request, t Task, kind string) {
	body, err := h.readBody(r)
	if err != nil {
		h.o.WriteError(w, r, err)
		return
	}
	allowed := func(m string) bool { return slices.Contains(t.Models, m) }
	if kind == KindEmbeddings {
		allowed = func(m string) bool { return m == h.o.EmbeddingModel }
	}
	refs := h.o.ReferenceTokens
	if refs <= 0 {
		refs = DefaultReferenceTokens
	}
	c, err := parseCallHolding(kind, body, allowed, refs)
	if err != nil {
		h.o.WriteError(w, r, err)
		return
	}
	spec := Spec{TaskID: t.ID, Principal: t.Principal, Tier: t.Tier, Kind: kind,
		Model: c.model, PromptTokens: c.prompt, MaxOutput: c.maxOut, Stream: c.stream}
	if kind != KindEmbeddings {
		spec.MinOutput = minOutput(kind, c.model)
		// An image costs what the model that serves it says (gpt-4o-mini
		// 33 times gpt-4o): a fallback's dearer images are reserved too.
		for _, m := range h.o.FallbackModels {
			spec.MinOutput = max(spec.MinOutput, minOutput(kind, m))
		}
		if c.images+c.lowImages > 0 {
			spec.PromptTokens += c.images*h.dearerImage(c.model, false) + c.lowImages*h.dearerImage(c.model, true)
		}
		if spec.MaxOutput > 0 {
			spec.MaxOutput = max(spec.MaxOutput, spec.MinOutput)
		}
	}
	if h.o.RequestID != nil {
		spec.RequestID = h.o.RequestID(r)
	}
	// Embeddings are not model calls in FAREGATE_AGENT_MAX_CALLS' sense
	// (the contract); their tokens are governed like any other. The slot
	// is the governor's to take, beside its own bookings (one round trip).
	hold := &heldSlot{}
	if kind != KindEmbeddings && h.o.Limits != nil {
		spec.Hold = func(ctx context.Context) (func(context.Context, bool), error) { return hold.take(ctx, h.o.Limits, t) }
	}
	var used, started atomic.Bool
	var end heldEnd
	_, err = h.o.Governor.Call(r.Context(), spec, func(ctx context.Context, a Attempt) (Outcome, error) {
		if spec.Hold != nil && !hold.taken() {
			return Outcome{}, fmt.Errorf("%w: the governor did not take the call's slot", ErrLimitsUnavailable)
		}
		used.Store(true)
		if started.Load() {
			// A governor that retries after bytes reached the client
			// would send a second answer into the first.
			return Outcome{Started: true}, fmt.Errorf("%w: attempt after the answer started", ErrUpstream)
		}
		out, err := h.attempt(ctx, w, c, a, &end)
		if out.Started {
			started.Store(true)
		}
		return out, err
	})
	hold.release(r.Context(), used.Load())
	// The answer completes for the client only now that the call is
	// settled and its step written (they ride in the Governor's settle
	// round trip): an agent that ends its task on the answer's last byte
	// cannot end it before the call is on the task. It is written whatever
	// Call returned: a settle that failed must not lose the answer.
	end.write()
	switch {
	case err == nil:
	case !started.Load() && r.Context().Err() != nil && !errors.Is(err, ErrEndsTask):
		if why := context.Cause(r.Context()); why != nil && !errors.Is(why, context.Canceled) && !errors.Is(why, context.DeadlineExceeded) {
			// The request was ended for a reason of its own (the task's
			// key could not be checked: 503, fail closed; or its task
			// finished: 409): that reason is the answer.
			h.o.WriteError(w, r, fmt.Errorf("%w: %w", why, err))
			break
		}
		h.o.WriteError(w, r, fmt.Errorf("%w: %w", ErrCallEnded, err))
	case !started.Load():
		h.o.WriteError(w, r, err)
	default:
		// The answer went out and was ended well formed; what is left is
		// for the ledger and the breaker, which the governor has.
		h.o.Logger.Debug("gateway: call ended after the answer started", "task", t.ID, "err", err)
	}
}

// heldSlot is a call's slot of the task's limits, as the governor took it.
type heldSlot struct {
	mu   sync.Mutex
	rel  func(context.Context, bool)
	done bool
}

func (s *heldSlot) take(ctx context.Context, l Limiter, t Task) (func(context.Context, bool), error) {
	// One lock section from the check to the set: two takes of one call
	// (a governor asking again on its fallback) must not both acquire, and
	// a take after the release must not acquire a slot no one gives back.
	// Acquire is one Redis call bounded by ctx and the client's timeout,
	// and only this call's goroutines ever wait on s.mu.
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done {
		return nil, fmt.Errorf("%w: the call's slot was already given back", ErrLimitsUnavailable)
	}
	if s.rel != nil {
		return s.release, nil // one slot per call, however often asked
	}
	rel, err := l.Acquire(ctx, t)
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
// end is left in end, for serveCall to write after the settle.
func (h *handler) attempt(ctx context.Context, w http.ResponseWriter, c *call, a Attempt, end *heldEnd) (Outcome, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // a relay that stops early hangs up on the provider
	resp, err := h.send(ctx, c, a)
	if err != nil {
		return Outcome{}, err
	}
	defer resp.Body.Close()
	switch {
	case c.stream && c.kind == KindChat:
		return h.relayChat(ctx, w, c, a, resp.Body, end)
	case c.stream:
		return h.relayResponses(ctx, w, c, a, resp.Body, end)
	}
	// The buffer starts at the answer's declared length (a hint only: the
	// read is still bounded by MaxAnswer), not at a fixed 16 KiB that most
	// answers of a few hundred bytes never use.
	hint := int64(4 << 10)
	if resp.ContentLength > 0 {
		hint = resp.ContentLength + 1
	}
	return h.answerJSON(ctx, w, c, a, resp.Body, hint, end)
}

// upstreamPath is the provider path of each kind, under its base URL.
var upstreamPath = map[string]string{
	KindChat:       "/chat/completions",
	KindResponses:  "/responses",
	KindEmbeddings: "/embeddings",
}

// send posts the patched request and checks the status.
func (h *handler) send(ctx context.Context, c *call, a Attempt) (*http.Response, error) {
	u := strings.TrimRight(a.Upstream.BaseURL, "/") + upstreamPath[c.kind]
	sent := newSentBody(c.body(a))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, sent.reader())
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUpstream, err)
	}
	req.ContentLength, req.GetBody = int64(len(sent.bytes())), sent.rewind
	// Once the provider answered, the body is never sent again; the
	// transport still holds the request as long as the answer (a stream's
	// whole life), and must not hold the prompt with it.
	defer sent.forget()
	req.Header.Set("Content-Type", "application/json")
	if c.stream {
		req.Header.Set("Accept", "text/event-stream")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	if a.Upstream.APIKey != "" {
		req.Header.Set("Authorization", "Bearer "+a.Upstream.APIKey)
	}
	client := a.Upstream.Client
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fmt.Errorf("%w: %v", ErrUpstream, err)
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	// The provider's error text is not relayed: it is about our
	// credentials or our provider as often as about the request.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	resp.Body.Close()
	ue := &UpstreamError{Status: resp.StatusCode, err: ErrUpstream}
	switch resp.StatusCode {
	case http.StatusBadRequest, http.StatusNotFound, http.StatusRequestEntityTooLarge, http.StatusUnprocessableEntity:
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
func (c *call) forget() { c.obj, c.streamOptions = nil, nil }

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
		Message chatDelta `json:"message"`
	} `json:"choices"`
	Output []respItem       `json:"output"`
	Usage  *json.RawMessage `json:"usage"`
	Error  json.RawMessage  `json:"error"`
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

// answerJSON relays a non-streamed answer: read within MaxAnswer, checked,
// counted, and held in end to be sent on byte for byte once settled.
func (h *handler) answerJSON(ctx context.Context, w http.ResponseWriter, c *call, a Attempt, body io.Reader, hint int64, end *heldEnd) (Outcome, error) {
	raw, err := readAtMost(body, hint, h.o.MaxAnswer)
	if err != nil {
		if ctx.Err() != nil {
			return Outcome{}, ctx.Err()
		}
		// An answer past the bound may have cost up to the limit; nothing
		// of it passed.
		return Outcome{Counted: a.MaxOutput}, fmt.Errorf("%w: answer: %v", ErrUpstream, err)
	}
	var ans answer
	if err := ans.decode(raw); err != nil || ans.Error != nil && !isNull(ans.Error) {
		return Outcome{Counted: a.MaxOutput}, fmt.Errorf("%w: answer is not a %s result", ErrUpstream, c.kind)
	}
	// A report-less answer is settled on this count, so it uses the
	// model's tokenizer; beside a report it is a check only, and the
	// bound (far cheaper, never lower) serves.
	model := a.Model
	if ans.Usage != nil && !isNull(*ans.Usage) {
		model = ""
	}
	oc := newOutCounter(model)
	for _, ch := range ans.Choices {
		oc.cut()
		oc.kind = 0
		ch.Message.count(oc)
	}
	for i := range ans.Output {
		ans.Output[i].count(oc)
	}
	out := Outcome{Counted: oc.Tokens(), Model: boundedName(ans.Model)}
	out.Usage = h.usage(c, ans.Usage, out.Counted)
	out.Started = true
	end.hold(func() {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(raw)))
		w.WriteHeader(http.StatusOK)
		if _, err := w.Write(raw); err == nil {
			_ = http.NewResponseController(w).Flush()
		}
	})
	return out, nil
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
func (h *handler) usage(c *call, raw *json.RawMessage, counted int64) Usage {
	est := Usage{Prompt: c.prompt, Completion: counted}
	if raw == nil || isNull(*raw) {
		return est
	}
	unreadable := Usage{Prompt: c.prompt, Completion: counted, Reported: true, Unreadable: true, Raw: boundedRaw(*raw)}
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
	if r, ok := pick(u.CompletionDetail.Reasoning, u.OutputDetail.Reasoning); ok && r > o {
		o = satAdd(o, r)
	}
	return Usage{Prompt: p, Completion: o, Reported: true, Raw: boundedRaw(*raw)}
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
