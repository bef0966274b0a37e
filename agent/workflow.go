package agent

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/tmc/langchaingo/llms"

	"faregate/agent/outbound"
	"faregate/agent/tools"
	"faregate/protect/budget"
	"faregate/protect/repetition"
)

// Config bounds a run. Each bound ends the run cleanly: the model is asked
// once more, without tools, for the final answer from what it has.
type Config struct {
	// MaxSteps counts model calls that may request tools; the closing call
	// without tools comes on top (and one repair call if its answer is invalid).
	MaxSteps int
	// MaxToolCalls bounds tool executions per task (answers from the task's
	// memory do not count).
	MaxToolCalls int
	// Timeout is the wall clock of a run.
	Timeout time.Duration
	// MaxTokens is every call's completion limit (max_tokens).
	MaxTokens int
	// LoopThreshold is the repetition detector's share of repeated n-grams.
	LoopThreshold float64
}

// Budget reserves tokens before a model call and settles after it.
type Budget interface {
	Reserve(ctx context.Context, req budget.Request) (budget.Reservation, error)
	Settle(ctx context.Context, r budget.Reservation, actual int64) (int64, error)
}

// Ledger records one entry per model call.
type Ledger interface {
	Append(ctx context.Context, e budget.Entry) error
}

// Toolbox builds the tools of one task. warn receives warnings raised below
// the tools (the outbound transport's downstream pushback).
type Toolbox func(rec *Record, warn func(code, detail string)) []tools.Tool

// Workflow plans trips with a tool-using model loop. It owns the loop
// rather than using langchaingo's agents.Executor, which aborts on a tool
// error, does not check the context between steps and drops token usage.
type Workflow struct {
	cfg    Config
	models *Models
	budget Budget
	ledger Ledger
	tools  Toolbox
	lg     *slog.Logger
}

// NewWorkflow assembles a workflow. ledger may be nil.
func NewWorkflow(cfg Config, models *Models, b Budget, ledger Ledger, tb Toolbox, lg *slog.Logger) *Workflow {
	return &Workflow{cfg: cfg, models: models, budget: b, ledger: ledger, tools: tb, lg: lg}
}

// Models returns the workflow's model router (for health and config).
func (w *Workflow) Models() *Models { return w.models }

// MinRunTokens is what one minimal run must be able to afford: the
// reservation of a first model call for the largest valid request.
func (w *Workflow) MinRunTokens() int64 {
	req := Request{Destination: strings.Repeat("x", 80), Days: 7}
	for i := 0; i < 5; i++ {
		req.Interests = append(req.Interests, strings.Repeat("x", 32))
	}
	msgs := initialMessages(req)
	var defs []llms.Tool
	for _, t := range w.tools(&Record{Task: Task{Request: req}}, func(string, string) {}) {
		defs = append(defs, t.Definition())
	}
	return estimatePrompt(msgs, defs) + int64(w.cfg.MaxTokens)
}

func initialMessages(r Request) []llms.MessageContent {
	return []llms.MessageContent{
		llms.TextParts(llms.ChatMessageTypeSystem, systemPrompt),
		llms.TextParts(llms.ChatMessageTypeHuman, userPrompt(r)),
	}
}

// Progress receives every change of the run: the record after the change
// and the events to publish with it.
type Progress func(rec *Record, events ...Event) error

// failure is a run's terminal error with its task code.
type failure struct {
	code string
	msg  string
}

func (f *failure) Error() string { return f.code + ": " + f.msg }

// run is the state of one task's run.
type run struct {
	w        *Workflow
	rec      *Record
	progress Progress
	lg       *slog.Logger

	mu        sync.Mutex // guards rec.Warnings against warnings from transport goroutines
	msgs      []llms.MessageContent
	tools     map[string]tools.Tool
	defs      []llms.Tool
	memory    map[string]*memo
	executed  int  // tool executions
	noTools   bool // tools withdrawn (loop, limits)
	lowPrec   bool
	lastModel Model
}

// memo is a tool call remembered by name and canonical arguments.
type memo struct {
	obs   tools.Observation
	count int
}

// Run executes the workflow for rec, reporting progress, and fills in
// rec.Result, rec.Usage, rec.Warnings, or returns a *failure-like error
// whose code is CodeAgentFailed or CodeModelUnavailable.
func (w *Workflow) Run(ctx context.Context, rec *Record, progress Progress) error {
	r := &run{w: w, rec: rec, progress: progress, memory: map[string]*memo{},
		lg: w.lg.With("task", rec.ID, "request_id", rec.RequestID)}
	r.lowPrec = rec.AITF.Degraded
	maxSteps := w.cfg.MaxSteps
	if r.lowPrec {
		// Low-precision mode for traffic the AITF queue let through degraded:
		// fewer steps, no page fetching, the cheaper model when there is one.
		maxSteps = min(maxSteps, 2)
		r.warn(WarnLowPrecision)
	}
	r.tools = map[string]tools.Tool{}
	for _, t := range w.tools(rec, func(code, detail string) {
		r.lg.Info("tool warning", "code", code, "detail", detail)
		r.warn(code)
	}) {
		if r.lowPrec && t.Name() == "fetch_page" {
			continue
		}
		r.tools[t.Name()] = t
		r.defs = append(r.defs, t.Definition())
	}
	r.msgs = initialMessages(rec.Request)
	// With no tool calls allowed, offering tools would only invite refusals.
	r.noTools = w.cfg.MaxToolCalls == 0

	// The loop gets the run's time minus a reserve for the closing call, so a
	// run that hits its wall clock still ends with an answer.
	reserve := min(w.cfg.Timeout/4, 20*time.Second)
	loopCtx, cancelLoop := context.WithTimeout(ctx, w.cfg.Timeout-reserve)
	defer cancelLoop()

	for step := 0; ; step++ {
		if step >= maxSteps {
			if !r.noTools {
				r.warn(WarnStepLimit)
			}
			break
		}
		if loopCtx.Err() != nil {
			r.warnTimeIfLoop(ctx)
			break
		}
		offer := !r.noTools && len(r.defs) > 0
		choice, err := r.call(loopCtx, offer, "plan")
		if err != nil {
			if errors.Is(err, errBudgetRefused) {
				break
			}
			if loopCtx.Err() != nil && ctx.Err() == nil {
				r.warn(WarnTimeLimit)
				break
			}
			return err
		}
		if len(choice.ToolCalls) == 0 || !offer {
			return r.finish(ctx, choice.Content)
		}
		r.runTools(loopCtx, choice, step+1)
	}
	// A bound was hit: one closing call without tools.
	choice, err := r.call(ctx, false, "answer")
	if err != nil {
		if errors.Is(err, errBudgetRefused) {
			return &failure{CodeAgentFailed, "the token budget ran out before an answer could be written"}
		}
		return err
	}
	return r.finish(ctx, choice.Content)
}

func (r *run) warnTimeIfLoop(ctx context.Context) {
	if ctx.Err() == nil {
		r.warn(WarnTimeLimit)
	}
}

// finish validates the answer; an invalid one is repaired once by asking
// again without tools, then the run fails with agent_failed.
func (r *run) finish(ctx context.Context, text string) error {
	summary, days, err := parseAnswer(text, r.rec.Request.Days)
	if err != nil {
		r.lg.Info("invalid answer, asking once more", "problem", err.Error())
		r.msgs = append(r.msgs,
			llms.TextParts(llms.ChatMessageTypeAI, text),
			llms.TextParts(llms.ChatMessageTypeHuman, repairPrompt(err.Error())))
		choice, cerr := r.call(ctx, false, "repair")
		if cerr != nil {
			if errors.Is(cerr, errBudgetRefused) {
				return &failure{CodeAgentFailed, "the token budget ran out before a valid answer was written"}
			}
			return cerr
		}
		summary, days, err = parseAnswer(choice.Content, r.rec.Request.Days)
		if err != nil {
			return &failure{CodeAgentFailed, "the model did not produce a valid itinerary: " + err.Error()}
		}
	}
	r.mu.Lock()
	warnings := append([]string{}, r.rec.Warnings...)
	r.mu.Unlock()
	r.rec.Result = &Result{Summary: summary, Days: days, Warnings: warnings,
		Model: r.lastModel.Name, Offline: r.lastModel.Offline}
	return nil
}

// runTools executes the tool calls of one model answer, in order, and
// appends the assistant message and one tool message per call.
// depth is the model step that asked, sent downstream as X-AITF-Depth.
func (r *run) runTools(ctx context.Context, choice *llms.ContentChoice, depth int) {
	assistant := llms.MessageContent{Role: llms.ChatMessageTypeAI}
	if choice.Content != "" {
		assistant.Parts = append(assistant.Parts, llms.TextContent{Text: choice.Content})
	}
	for _, tc := range choice.ToolCalls {
		assistant.Parts = append(assistant.Parts, tc)
	}
	r.msgs = append(r.msgs, assistant)
	for _, tc := range choice.ToolCalls {
		name, args := "", ""
		if tc.FunctionCall != nil {
			name, args = tc.FunctionCall.Name, tc.FunctionCall.Arguments
		}
		obs := r.toolCall(ctx, tc.ID, name, args, depth)
		r.msgs = append(r.msgs, llms.MessageContent{Role: llms.ChatMessageTypeTool,
			Parts: []llms.ContentPart{llms.ToolCallResponse{ToolCallID: tc.ID, Name: name, Content: obs.Text}}})
	}
}

// toolCall answers one tool call: from the task's memory when repeated
// (a third identical call is a loop and withdraws the tools), refused past
// the tool-call bound, else executed.
func (r *run) toolCall(ctx context.Context, id, name, args string, depth int) tools.Observation {
	t, ok := r.tools[name]
	if !ok {
		st := r.startStep("tool", name, "")
		obs := tools.Observation{Text: fmt.Sprintf("Unknown tool %q. Available tools: %s.", name, strings.Join(r.toolNames(), ", ")), Failed: true}
		r.endStep(st, "failed", "unknown tool")
		return obs
	}
	key := name + " " + canonicalArgs(args)
	if m, ok := r.memory[key]; ok {
		m.count++
		st := r.startStep("tool", name, argsDetail(args))
		detail := "answered from this task's memory"
		if m.count >= 3 {
			// The model is looping on one call: stop offering tools.
			r.noTools = true
			r.warn(WarnToolLoop)
			detail = "repeated call: tools withdrawn"
		}
		r.endStep(st, "cached", detail)
		return m.obs
	}
	if r.executed >= r.w.cfg.MaxToolCalls {
		r.noTools = true
		r.warn(WarnToolLimit)
		st := r.startStep("tool", name, argsDetail(args))
		r.endStep(st, "failed", "tool-call limit reached")
		return tools.Observation{Text: "Tool-call limit reached for this task; answer from what you have.", Failed: true}
	}
	r.executed++
	st := r.startStep("tool", name, argsDetail(args))
	callCtx := outbound.WithCall(ctx, id, depth)
	obs := t.Call(callCtx, args)
	if obs.Warning != "" {
		r.warn(obs.Warning)
	}
	status, detail := "ok", summarize(obs.Text)
	if obs.Failed {
		status = "failed"
	}
	r.endStep(st, status, detail)
	r.memory[key] = &memo{obs: obs, count: 1}
	return obs
}

func (r *run) toolNames() []string {
	var out []string
	for n := range r.tools {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// canonicalArgs makes equal arguments compare equal whatever their key order
// or spacing; invalid JSON compares as its trimmed text.
func canonicalArgs(args string) string {
	var v any
	if err := json.Unmarshal([]byte(args), &v); err != nil {
		return strings.TrimSpace(args)
	}
	v = normalizeStrings(v)
	out, _ := json.Marshal(v) // map keys are sorted by encoding/json
	return string(out)
}

// normalizeStrings trims and lower-cases strings: "Lisbon " and "lisbon"
// ask a tool the same question.
func normalizeStrings(v any) any {
	switch t := v.(type) {
	case string:
		return strings.ToLower(strings.TrimSpace(t))
	case map[string]any:
		for k, x := range t {
			t[k] = normalizeStrings(x)
		}
	case []any:
		for i, x := range t {
			t[i] = normalizeStrings(x)
		}
	}
	return v
}

func argsDetail(args string) string { return clip(strings.Join(strings.Fields(args), " "), 160) }
func summarize(s string) string     { return clip(strings.Join(strings.Fields(s), " "), 160) }

// warn records a warning code once.
func (r *run) warn(code string) {
	r.mu.Lock()
	r.rec.Warnings = addWarning(r.rec.Warnings, code)
	r.mu.Unlock()
}

// startStep records and publishes a started step.
func (r *run) startStep(kind, name, detail string) *stepTimer {
	r.mu.Lock()
	seq := len(r.rec.Steps) + 1
	s := Step{Seq: seq, Kind: kind, Name: name, Status: "started", Detail: detail}
	r.rec.Steps = append(r.rec.Steps, s)
	r.mu.Unlock()
	r.publish(s)
	return &stepTimer{seq: seq, start: time.Now()}
}

type stepTimer struct {
	seq   int
	start time.Time
}

// endStep records the step's final status and duration.
func (r *run) endStep(st *stepTimer, status, detail string) {
	r.mu.Lock()
	s := &r.rec.Steps[st.seq-1]
	s.Status = status
	s.DurationMS = time.Since(st.start).Milliseconds()
	if detail != "" {
		s.Detail = detail
	}
	cp := *s
	r.mu.Unlock()
	r.publish(cp)
}

func (r *run) publish(s Step) {
	data, _ := json.Marshal(s)
	if err := r.progress(r.rec, Event{Type: EventStep, Data: data}); err != nil {
		// Progress is best effort for the live view; the final save reports
		// store failures. A run is not abandoned because one event was lost.
		r.lg.Warn("progress not saved", "err", err)
	}
}

// errBudgetRefused: the token budget cannot afford the next call.
var errBudgetRefused = errors.New("agent: token budget refused the call")

// errCut stops a streaming call from inside its callback.
var errCut = errors.New("agent: stream cut")

// call makes one model call: reserve, stream with cut-offs, settle, record.
func (r *run) call(ctx context.Context, offerTools bool, label string) (*llms.ContentChoice, error) {
	var defs []llms.Tool
	if offerTools {
		defs = r.defs
	}
	prompt := estimatePrompt(r.msgs, defs)
	maxTokens := int64(r.w.cfg.MaxTokens)

	st := r.startStep("model", label, "")
	// Reserve before the breaker sees the call: a budget refusal is not a
	// provider failure and must never count towards opening it.
	res, err := r.reserve(ctx, prompt, &maxTokens, offerTools)
	var choice *llms.ContentChoice
	var used Model
	var fellBack bool
	if err == nil {
		used, fellBack, err = r.w.models.Do(ctx, r.lowPrec, func(ctx context.Context, mdl Model) error {
			cur := res
			if cur.ID == "" {
				// A second attempt (the fallback after a failed primary) needs
				// its own reservation; the first one was settled.
				if cur, err = r.reserve(ctx, prompt, &maxTokens, offerTools); err != nil {
					return err
				}
			}
			res = budget.Reservation{}
			c, err := r.attempt(ctx, mdl, cur, prompt, maxTokens, defs)
			if err != nil {
				return err
			}
			choice = c
			return nil
		})
	}
	if err != nil {
		status := "failed"
		detail := "model call failed"
		code := CodeModelUnavailable
		var f *failure
		switch {
		case errors.Is(err, errBudgetRefused):
			detail = "token budget exhausted"
			r.warn(WarnBudgetExhausted)
		case ctx.Err() != nil:
			detail = "stopped: time limit"
		case errors.As(err, &f):
			detail = f.msg
		}
		r.endStep(st, status, detail)
		if errors.Is(err, errBudgetRefused) || ctx.Err() != nil || f != nil {
			return nil, err
		}
		r.lg.Warn("model call failed", "model", used.Name, "err", err)
		return nil, &failure{code, "the model provider did not answer; please try again later"}
	}
	if fellBack && !r.lowPrec {
		r.warn(WarnFallbackModel)
	}
	r.lastModel = used
	detail := used.Name
	if len(choice.ToolCalls) > 0 {
		names := make([]string, 0, len(choice.ToolCalls))
		for _, tc := range choice.ToolCalls {
			if tc.FunctionCall != nil {
				names = append(names, tc.FunctionCall.Name)
			}
		}
		detail += ": calls " + strings.Join(names, ", ")
	}
	r.endStep(st, "ok", detail)
	return choice, nil
}

// reserve books prompt + max_tokens in every budget scope. When the budget
// cannot afford that, a closing call (no tools) may still go ahead with a
// smaller max_tokens that fits what is left, so a run ends with what it has;
// *maxTokens is lowered accordingly.
func (r *run) reserve(ctx context.Context, prompt int64, maxTokens *int64, offerTools bool) (budget.Reservation, error) {
	req := budget.Request{Day: r.rec.Day, Visitor: r.rec.Visitor, Task: r.rec.ID, Amount: prompt + *maxTokens}
	res, err := r.w.budget.Reserve(ctx, req)
	var ex *budget.ExhaustedError
	if errors.As(err, &ex) && !offerTools && ex.Remaining-prompt >= minClosingTokens {
		*maxTokens = ex.Remaining - prompt
		req.Amount = ex.Remaining
		res, err = r.w.budget.Reserve(ctx, req)
	}
	switch {
	case err == nil:
		return res, nil
	case errors.Is(err, budget.ErrExhausted):
		return res, fmt.Errorf("%w: %v", errBudgetRefused, err)
	}
	// The budget store failing is not the model's fault, and spending
	// without a reservation is not allowed: fail closed.
	return res, &failure{CodeAgentFailed, "the token budget could not be checked; please try again later"}
}

// minClosingTokens is the smallest completion worth asking for a final answer.
const minClosingTokens = 256

// attempt is one call on one model under reservation res, which it settles.
func (r *run) attempt(ctx context.Context, mdl Model, res budget.Reservation, prompt, maxTokens int64, defs []llms.Tool) (*llms.ContentChoice, error) {
	reserved := res.Amount

	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		buf     bytes.Buffer
		cut     string
		outToks int64
	)
	detector := repetition.New(0, 0, r.w.cfg.LoopThreshold)
	opts := []llms.CallOption{
		llms.WithMaxTokens(int(maxTokens)),
		llms.WithStreamingFunc(func(_ context.Context, chunk []byte) error {
			if prompt+EstimateTokens(buf.String()+string(chunk)) > reserved {
				// Keep only what fits the reservation: what is kept is what
				// is counted and settled, so the cap is exact.
				for _, r := range string(chunk) {
					if prompt+EstimateTokens(buf.String()+string(r)) > reserved {
						break
					}
					buf.WriteRune(r)
				}
				outToks = EstimateTokens(buf.String())
				cut = WarnOutputTruncated
				cancel()
				return errCut
			}
			buf.Write(chunk)
			outToks = EstimateTokens(buf.String())
			if prompt+outToks >= reserved {
				cut = WarnOutputTruncated
				cancel()
				return errCut
			}
			// Tool-call deltas arrive as JSON arrays of call fragments whose
			// framing repeats by nature; only text is checked for loops.
			if !(len(defs) > 0 && bytes.HasPrefix(chunk, []byte("[{"))) && detector.Write(chunk) {
				cut = WarnOutputLoop
				cancel()
				return errCut
			}
			return nil
		}),
	}
	if len(defs) > 0 {
		opts = append(opts, llms.WithTools(defs))
	}
	opts = append(opts, mdl.CallOptions...)
	start := time.Now()
	resp, err := mdl.GenerateContent(callCtx, r.msgs, opts...)
	latency := time.Since(start)

	var choice *llms.ContentChoice
	outcome := "ok"
	switch {
	case cut != "":
		// Keep the partial text; the stream was ours to stop.
		r.warn(cut)
		outcome = cut
		choice = &llms.ContentChoice{Content: buf.String(), StopReason: cut}
	case err != nil:
		outcome = "error"
	case resp == nil || len(resp.Choices) == 0:
		outcome = "error"
		err = errors.New("model returned no choices")
	default:
		choice = resp.Choices[0]
	}

	// Settle with what the provider reported, else what we counted (a
	// failed or cut call is charged what it streamed).
	promptUsed, completion := prompt, outToks
	if choice != nil && cut == "" {
		if p, c, ok := reportedUsage(choice); ok {
			promptUsed, completion = p, c
		} else if completion == 0 {
			completion = EstimateTokens(choice.Content) + toolCallTokens(choice)
		}
	}
	charged, serr := r.w.budget.Settle(context.WithoutCancel(ctx), res, promptUsed+completion)
	if serr != nil {
		r.lg.Warn("budget settle failed", "err", serr)
	}
	r.rec.Usage.PromptTokens += promptUsed
	r.rec.Usage.CompletionTokens += completion
	if r.w.ledger != nil {
		entry := budget.Entry{Task: r.rec.ID, Model: mdl.Name, PromptTokens: promptUsed, CompletionTokens: completion,
			Reserved: reserved, LatencyMS: latency.Milliseconds(), Outcome: outcome}
		if lerr := r.w.ledger.Append(context.WithoutCancel(ctx), entry); lerr != nil {
			r.lg.Warn("usage ledger append failed", "err", lerr)
		}
	}
	r.lg.Debug("model call", "model", mdl.Name, "outcome", outcome, "reserved", reserved, "charged", charged, "latency_ms", latency.Milliseconds())
	if choice == nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	return choice, nil
}

// reportedUsage reads token usage the way langchaingo's openai provider
// reports it (and the offline model mirrors).
func reportedUsage(c *llms.ContentChoice) (prompt, completion int64, ok bool) {
	p, pok := asInt(c.GenerationInfo["PromptTokens"])
	cc, cok := asInt(c.GenerationInfo["CompletionTokens"])
	if !pok || !cok || (p == 0 && cc == 0) {
		return 0, 0, false
	}
	return p, cc, true
}

func asInt(v any) (int64, bool) {
	switch n := v.(type) {
	case int:
		return int64(n), true
	case int64:
		return n, true
	case int32:
		return int64(n), true
	case float64:
		return int64(n), true
	}
	return 0, false
}

func toolCallTokens(c *llms.ContentChoice) int64 {
	var n int64
	for _, tc := range c.ToolCalls {
		if tc.FunctionCall != nil {
			n += EstimateTokens(tc.FunctionCall.Name) + EstimateTokens(tc.FunctionCall.Arguments) + 4
		}
	}
	return n
}
