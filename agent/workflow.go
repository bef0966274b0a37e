// Package agent plans trips: a Runner takes each task through a Workflow,
// a tool-using loop on a chat.Model with budgets, a circuit breaker and
// cut-offs, and records every step in a Store so clients can follow the
// run. It depends on faregate's own interfaces only: the model adapters
// (agent/openai, agent/offline), the task store (agent/taskstore) and the
// tools are wired in by the caller.
package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"time"

	"faregate/agent/chat"
	"faregate/agent/outbound"
	"faregate/agent/task"
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
type Toolbox func(rec *task.Record, warn func(code, detail string)) []tools.Tool

// Workflow plans trips with a tool-using model loop on a chat.Model. It
// owns the loop rather than using a framework's agent executor (langchaingo's
// aborts on a tool error, does not check the context between steps and
// drops token usage).
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
	req := task.Request{Destination: strings.Repeat("x", 80), Days: 7, Language: task.LangChinese}
	for i := 0; i < 5; i++ {
		req.Interests = append(req.Interests, strings.Repeat("x", 32))
	}
	defs := tools.Definitions(w.tools(&task.Record{Task: task.Task{Request: req}}, func(string, string) {}))
	return chat.EstimatePrompt(initialMessages(req), defs) + int64(w.cfg.MaxTokens)
}

func initialMessages(r task.Request) []chat.Message {
	return []chat.Message{
		chat.Text(chat.RoleSystem, systemPrompt),
		chat.Text(chat.RoleUser, userPrompt(r)),
	}
}

// Progress receives every change of the run: the record after the change
// and the events to publish with it.
type Progress func(rec *task.Record, events ...task.Event) error

// failure is a run's terminal error with its task code.
type failure struct {
	code string
	msg  string
}

func (f *failure) Error() string { return f.code + ": " + f.msg }

// run is the state of one task's run.
type run struct {
	w        *Workflow
	rec      *task.Record
	progress Progress
	lg       *slog.Logger

	mu       sync.Mutex // guards rec.Warnings against warnings from transport goroutines
	msgs     []chat.Message
	tools    map[string]tools.Tool
	defs     []chat.ToolDef
	memory   map[string]*memo
	executed int // tool executions
	// noTools: no tools are offered at all (none configured or allowed).
	noTools bool
	// withdrawn: tools were offered but taken away (a loop, the tool-call
	// bound); the run goes to its closing call.
	withdrawn bool
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
// whose code is task.CodeAgentFailed or task.CodeModelUnavailable.
func (w *Workflow) Run(ctx context.Context, rec *task.Record, progress Progress) error {
	r := &run{w: w, rec: rec, progress: progress, memory: map[string]*memo{},
		lg: w.lg.With("task", rec.ID, "request_id", rec.RequestID)}
	r.lowPrec = rec.AITF.Degraded
	maxSteps := w.cfg.MaxSteps
	if r.lowPrec {
		// Low-precision mode for traffic the AITF queue let through degraded:
		// fewer steps, no page fetching, the cheaper model when there is one.
		maxSteps = min(maxSteps, 2)
		r.warn(task.WarnLowPrecision)
	}
	r.tools = map[string]tools.Tool{}
	for _, t := range w.tools(rec, func(code, detail string) {
		r.lg.Info("tool warning", "code", code, "detail", detail)
		r.warn(code)
	}) {
		if r.lowPrec && t.Name() == tools.NameFetchPage {
			continue
		}
		r.tools[t.Name()] = t
		r.defs = append(r.defs, t.Definition())
	}
	r.msgs = initialMessages(rec.Request)
	// With no tool calls allowed, offering tools would only invite refusals.
	r.noTools = w.cfg.MaxToolCalls == 0 || len(r.defs) == 0

	// The loop gets the run's time minus a reserve for the closing call, so a
	// run that hits its wall clock still ends with an answer.
	reserve := min(w.cfg.Timeout/4, 20*time.Second)
	loopCtx, cancelLoop := context.WithTimeout(ctx, w.cfg.Timeout-reserve)
	defer cancelLoop()

	for step := 0; ; step++ {
		if r.withdrawn {
			break // warned when the tools were taken away
		}
		if step >= maxSteps {
			if !r.noTools {
				r.warn(task.WarnStepLimit)
			}
			break
		}
		if loopCtx.Err() != nil {
			r.warnTimeIfLoop(ctx)
			break
		}
		offer := !r.noTools
		reply, err := r.call(loopCtx, offer, "plan")
		if err != nil {
			if errors.Is(err, errBudgetRefused) {
				break
			}
			if loopCtx.Err() != nil && ctx.Err() == nil {
				r.warn(task.WarnTimeLimit)
				break
			}
			return err
		}
		if len(reply.ToolCalls) == 0 || !offer {
			return r.finish(ctx, reply.Content)
		}
		r.runTools(loopCtx, reply, step+1)
	}
	// A bound was hit: one closing call without tools, which is told so;
	// otherwise a model would go on asking for tools it is no longer offered.
	r.msgs = append(r.msgs, chat.Text(chat.RoleUser, closingPrompt))
	reply, err := r.call(ctx, false, "answer")
	if err != nil {
		if errors.Is(err, errBudgetRefused) {
			return &failure{task.CodeAgentFailed, "the token budget ran out before an answer could be written"}
		}
		return err
	}
	return r.finish(ctx, reply.Content)
}

func (r *run) warnTimeIfLoop(ctx context.Context) {
	if ctx.Err() == nil {
		r.warn(task.WarnTimeLimit)
	}
}

// finish validates the answer; an invalid one is repaired once by asking
// again without tools, then the run fails with agent_failed.
func (r *run) finish(ctx context.Context, text string) error {
	summary, days, err := parseAnswer(text, r.rec.Request.Days)
	if err != nil {
		r.lg.Info("invalid answer, asking once more", "problem", err.Error())
		r.msgs = append(r.msgs,
			chat.Text(chat.RoleAssistant, text),
			chat.Text(chat.RoleUser, repairPrompt(err.Error())))
		reply, cerr := r.call(ctx, false, "repair")
		if cerr != nil {
			if errors.Is(cerr, errBudgetRefused) {
				return &failure{task.CodeAgentFailed, "the token budget ran out before a valid answer was written"}
			}
			return cerr
		}
		summary, days, err = parseAnswer(reply.Content, r.rec.Request.Days)
		if err != nil {
			return &failure{task.CodeAgentFailed, "the model did not produce a valid itinerary: " + err.Error()}
		}
	}
	r.mu.Lock()
	warnings := append([]string{}, r.rec.Warnings...)
	r.mu.Unlock()
	r.rec.Result = &task.Result{Summary: summary, Days: days, Warnings: warnings,
		Model: r.lastModel.Name, Offline: r.lastModel.Offline, Language: r.rec.Request.Lang()}
	return nil
}

// runTools executes the tool calls of one model answer, in order, and
// appends the assistant message and one tool message per call: the text
// for the model, the typed data for planners that are not models.
// depth is the model step that asked, sent downstream as X-AITF-Depth.
func (r *run) runTools(ctx context.Context, reply chat.Reply, depth int) {
	r.msgs = append(r.msgs, chat.Message{Role: chat.RoleAssistant, Content: reply.Content, ToolCalls: reply.ToolCalls})
	for _, tc := range reply.ToolCalls {
		obs := r.toolCall(ctx, tc.ID, tc.Name, tc.Arguments, depth)
		r.msgs = append(r.msgs, chat.Message{Role: chat.RoleTool, ToolCallID: tc.ID, Name: tc.Name,
			Content: obs.Text, Data: obs.Data})
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
			r.withdrawn = true
			r.warn(task.WarnToolLoop)
			detail = "repeated call: tools withdrawn"
		}
		r.endStep(st, "cached", detail)
		return m.obs
	}
	if r.executed >= r.w.cfg.MaxToolCalls {
		r.withdrawn = true
		r.warn(task.WarnToolLimit)
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
	s := task.Step{Seq: seq, Kind: kind, Name: name, Status: "started", Detail: detail}
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

func (r *run) publish(s task.Step) {
	data, _ := json.Marshal(s)
	if err := r.progress(r.rec, task.Event{Type: task.EventStep, Data: data}); err != nil {
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
func (r *run) call(ctx context.Context, offerTools bool, label string) (chat.Reply, error) {
	var defs []chat.ToolDef
	if offerTools {
		defs = r.defs
	}
	prompt := chat.EstimatePrompt(r.msgs, defs)
	maxTokens := int64(r.w.cfg.MaxTokens)

	st := r.startStep("model", label, "")
	// Reserve before the breaker sees the call: a budget refusal is not a
	// provider failure and must never count towards opening it.
	res, err := r.reserve(ctx, prompt, &maxTokens, offerTools)
	var reply chat.Reply
	var used Model
	var fellBack bool
	if err == nil {
		used, fellBack, err = r.w.models.Do(ctx, r.lowPrec, func(ctx context.Context, mdl Model) error {
			cur := res
			if cur.ID == "" {
				// A second attempt (the fallback after a failed primary) needs
				// its own reservation; the first one was settled.
				var rerr error
				if cur, rerr = r.reserve(ctx, prompt, &maxTokens, offerTools); rerr != nil {
					return rerr
				}
			}
			res = budget.Reservation{}
			rep, aerr := r.attempt(ctx, mdl, cur, prompt, maxTokens, defs)
			if aerr != nil {
				return aerr
			}
			reply = rep
			return nil
		})
	}
	if err != nil {
		detail := "model call failed"
		var f *failure
		switch {
		case errors.Is(err, errBudgetRefused):
			detail = "token budget exhausted"
			r.warn(task.WarnBudgetExhausted)
		case ctx.Err() != nil:
			detail = "stopped: time limit"
		case errors.As(err, &f):
			detail = f.msg
		}
		r.endStep(st, "failed", detail)
		if errors.Is(err, errBudgetRefused) || ctx.Err() != nil || f != nil {
			return chat.Reply{}, err
		}
		r.lg.Warn("model call failed", "model", used.Name, "err", err)
		return chat.Reply{}, &failure{task.CodeModelUnavailable, "the model provider did not answer; please try again later"}
	}
	if fellBack && !r.lowPrec {
		r.warn(task.WarnFallbackModel)
	}
	r.lastModel = used
	detail := used.Name
	if len(reply.ToolCalls) > 0 {
		names := make([]string, 0, len(reply.ToolCalls))
		for _, tc := range reply.ToolCalls {
			names = append(names, tc.Name)
		}
		detail += ": calls " + strings.Join(names, ", ")
	}
	r.endStep(st, "ok", detail)
	return reply, nil
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
	return res, &failure{task.CodeAgentFailed, "the token budget could not be checked; please try again later"}
}

// minClosingTokens is the smallest completion worth asking for a final answer.
const minClosingTokens = 256

// outputCap holds a call's streamed output to what its reservation covers.
// It counts as it goes (time linear in the output, however it is chunked),
// and it keeps exactly what it counted: a piece that does not fit whole is
// taken up to the last code point that fits, so what is settled is what was
// kept. Tool-call output is counted like text but not kept: a partial tool
// call cannot be run.
type outputCap struct {
	limit int64 // completion tokens the reservation covers
	count chat.Counter
	text  strings.Builder
}

// take adds piece (reply text when keep, else tool-call output) and reports
// whether the stream may go on: false once the limit is reached.
func (c *outputCap) take(piece string, keep bool) bool {
	whole := c.count
	whole.Add(piece)
	if whole.Tokens() <= c.limit {
		c.count = whole
		if keep {
			c.text.WriteString(piece)
		}
		return whole.Tokens() < c.limit
	}
	for _, ch := range piece {
		if c.count.With(ch) > c.limit {
			break
		}
		c.count.AddRune(ch)
		if keep {
			c.text.WriteRune(ch)
		}
	}
	return false
}

// attempt is one call on one model under reservation res, which it settles.
func (r *run) attempt(ctx context.Context, mdl Model, res budget.Reservation, prompt, maxTokens int64, defs []chat.ToolDef) (chat.Reply, error) {
	reserved := res.Amount

	callCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := &outputCap{limit: reserved - prompt}
	var cut string
	stop := func(why string) error {
		cut = why
		cancel()
		return errCut
	}
	detector := repetition.New(0, 0, r.w.cfg.LoopThreshold)
	stream := func(c chat.Chunk) error {
		if c.ToolCall != "" && !out.take(c.ToolCall, false) {
			return stop(task.WarnOutputTruncated)
		}
		if c.Text == "" {
			return nil
		}
		if !out.take(c.Text, true) {
			return stop(task.WarnOutputTruncated)
		}
		// Only text is checked for loops: tool-call arguments repeat
		// their own framing by nature.
		if detector.Write([]byte(c.Text)) {
			return stop(task.WarnOutputLoop)
		}
		return nil
	}
	turn := chat.Turn{Messages: r.msgs, Tools: defs, MaxTokens: int(maxTokens), Stream: stream, Request: &r.rec.Request}
	start := time.Now()
	reply, err := mdl.Generate(callCtx, turn)
	latency := time.Since(start)

	outcome := "ok"
	ok := true
	switch {
	case cut != "":
		// Keep the partial text; the stream was ours to stop.
		r.warn(cut)
		outcome = cut
		reply = chat.Reply{Content: out.text.String(), StopReason: cut}
	case err != nil:
		outcome = "error"
		ok = false
	}

	// Settle with what the provider reported, else what we counted (a
	// failed or cut call is charged what it streamed).
	promptUsed, completion := prompt, out.count.Tokens()
	if ok && cut == "" {
		if reply.Usage.Reported {
			promptUsed, completion = reply.Usage.PromptTokens, reply.Usage.CompletionTokens
		} else if completion == 0 {
			completion = chat.EstimateTokens(reply.Content) + chat.EstimateToolCalls(reply.ToolCalls)
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
	if !ok {
		if ctx.Err() != nil {
			return chat.Reply{}, ctx.Err()
		}
		return chat.Reply{}, err
	}
	return reply, nil
}

// addWarning appends code once.
func addWarning(ws []string, code string) []string {
	for _, w := range ws {
		if w == code {
			return ws
		}
	}
	return append(ws, code)
}
