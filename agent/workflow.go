// Package agent plans trips: a Runner takes each task through a Workflow,
// a tool-using loop on a chat.Model with budgets, a circuit breaker and
// cut-offs, and records every step in a Store so clients can follow the
// run. It depends on faregate's own interfaces only: the model adapters
// (agent/openai, agent/offline), the task store (agent/taskstore) and the
// tools are wired in by the caller.
package agent

import (
	"github.com/prometheus/client_golang/prometheus"

	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	oteltrace "go.opentelemetry.io/otel/trace"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/tools"
	"faregate/protect/codes"
	"faregate/protect/kit/tracing"
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
	// TokenWait bounds how long one model call waits, in all, for its
	// principal's tokens-per-minute bucket (FAREGATE_TOKEN_WAIT); past it
	// the task ends with token_rate_limited. Zero takes DefaultTokenWait.
	TokenWait time.Duration
	// SiteTokensPerMinute is the site-wide token bucket's rate, sized to
	// the provider's tokens-per-minute limit
	// (FAREGATE_SITE_TOKENS_PER_MINUTE): every model call of every lane
	// and replica waits its turn for it instead of meeting the provider's
	// 429. 0 turns pacing off.
	SiteTokensPerMinute int64
	// SitePaceWait bounds the wait for a turn at the site bucket; a call
	// whose turn is further away ends the task with token_rate_limited.
	// Zero takes DefaultSitePaceWait; at most ratelimit.MaxPaceWait.
	SitePaceWait time.Duration
	// SettleTimeout bounds a settle's (and a withdraw's) retries once the
	// call is over. A settle that gives up leaves its reservation to
	// expire, and the expiry gives back tokens the provider billed, so it
	// must cover the budget's attempts at the store's own timeouts; a
	// settle that lands late is still charged (as overage). Zero takes
	// DefaultSettleTimeout.
	SettleTimeout time.Duration
}

// Toolbox builds the tools of one task. warn receives warnings raised below
// the tools (the outbound transport's downstream pushback).
type Toolbox func(rec *task.Record, warn func(code, detail string)) []tools.Tool

// Deps are what a Workflow works with. Models and Tools are required, and
// Budget for Run (a workflow asked only for MinRunTokens needs none); the
// rest may be left zero.
type Deps struct {
	Models *govern.Models
	Budget govern.Budget
	// Ledger, when set, records every model call that reached a model.
	Ledger govern.Ledger
	Tools  Toolbox
	// Limiter, when set, checks every model call for an input spike,
	// takes its tokens from the principal's bucket and, with
	// Config.SiteTokensPerMinute, paces it through the site's.
	Limiter govern.Limiter
	// Sleep waits d or until ctx ends (then it returns ctx.Err()): the
	// waits for the token buckets. Default: a timer.
	Sleep func(ctx context.Context, d time.Duration) error
	// Alert, when set, receives the alerts a run raises (overage,
	// budget_warning, budget_exhausted, anomaly), on the run's goroutine:
	// it must not block. Their Scope, Text and Details never show more of
	// a visitor's hash than its first 12 hex digits.
	Alert func(alert.Alert)
	// Logger defaults to one that discards.
	Logger *slog.Logger
	// Estimate counts a call's prompt tokens for the model it goes to;
	// default chat.EstimatePrompt, whatever the model.
	Estimate func(model string, msgs []chat.Message, tools []chat.ToolDef) int64
	// Tracer starts the spans of model calls, tool calls and settles
	// (nil: tracing off, at no cost).
	Tracer oteltrace.Tracer
	// Registerer receives the model-call histograms (nil: unregistered).
	Registerer prometheus.Registerer
}

// Workflow plans trips with a tool-using model loop on a chat.Model. It
// owns the loop rather than using a framework's agent executor (langchaingo's
// aborts on a tool error, does not check the context between steps and
// drops token usage).
//
// Each model call passes, in order: the principal's input spike check and
// tokens-per-minute bucket (Limiter.BeforeCall), the budget's reservation
// for the model the call goes to, the site's turn (Limiter.Pace), then the
// breaker and the provider. None of the checks before the breaker counts
// towards opening it, and a call refused by any of them spends nothing and
// leaves no ledger entry. Afterwards the budget, the site's turn and the
// principal's bucket are settled with what the call used.
type Workflow struct {
	cfg     Config
	d       Deps // defaults applied
	metrics *runMetrics
	// gov makes every model call of a run (agent/govern).
	gov *govern.Governor
}

// NewWorkflow assembles a workflow from cfg and d, defaults applied, with
// a Governor of its own (agent/govern) for its model calls.
func NewWorkflow(cfg Config, d Deps) *Workflow {
	w := &Workflow{cfg: cfg, d: d, metrics: newRunMetrics(d.Registerer)}
	if w.d.Logger == nil {
		w.d.Logger = slog.New(slog.DiscardHandler)
	}
	if w.d.Estimate == nil {
		w.d.Estimate = func(_ string, msgs []chat.Message, tools []chat.ToolDef) int64 {
			return chat.EstimatePrompt(msgs, tools)
		}
	}
	if d.Budget == nil {
		// A workflow asked only for its minimal run (MinRunTokens) makes
		// no model call: it needs no Governor.
		return w
	}
	w.gov = govern.New(govern.Config{MaxTokens: cfg.MaxTokens, TokenWait: cfg.TokenWait,
		SiteTokensPerMinute: cfg.SiteTokensPerMinute, SitePaceWait: cfg.SitePaceWait, SettleTimeout: cfg.SettleTimeout},
		govern.Deps{Models: d.Models, Budget: d.Budget, Ledger: d.Ledger, Limiter: d.Limiter, Sleep: d.Sleep,
			Alert: d.Alert, Logger: w.d.Logger, Tracer: d.Tracer, Registerer: d.Registerer})
	return w
}

// Governor is the workflow's Governor, for other callers of governed
// model calls (the model endpoint of an operator's own agent): one
// Governor per process, sharing its metrics.
func (w *Workflow) Governor() *govern.Governor { return w.gov }

// Models returns the workflow's model router (for health and config).
func (w *Workflow) Models() *govern.Models { return w.d.Models }

// MinRunTokens is what one minimal run must be able to afford: the
// reservation of a first model call for the largest valid request, on the
// model a first call goes to.
func (w *Workflow) MinRunTokens() int64 {
	req := task.Request{Destination: strings.Repeat("x", 80), Days: 7, Language: task.LangChinese}
	for i := 0; i < 5; i++ {
		req.Interests = append(req.Interests, strings.Repeat("x", 32))
	}
	defs := tools.Definitions(w.d.Tools(&task.Record{Task: task.Task{Request: req}}, func(string, string) {}))
	return w.d.Estimate(w.d.Models.Next(false).Name, initialMessages(req), defs) + int64(w.cfg.MaxTokens)
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
	lastModel govern.Model
}

// memo is a tool call remembered by name and canonical arguments.
type memo struct {
	obs   tools.Observation
	count int
}

// Run executes the workflow for rec, reporting progress, and fills in
// rec.Result, rec.Usage, rec.Warnings, or returns an error whose task code
// FailureCode reads; a context's end is returned as it is.
func (w *Workflow) Run(ctx context.Context, rec *task.Record, progress Progress) error {
	r := &run{w: w, rec: rec, progress: progress, memory: map[string]*memo{},
		lg: tracing.Logger(ctx, w.d.Logger).With("task", rec.ID, "request_id", rec.RequestID)}
	r.lowPrec = rec.AITF.Degraded
	maxSteps := w.cfg.MaxSteps
	if r.lowPrec {
		// Low-precision mode for traffic the AITF queue let through degraded:
		// fewer steps, no page fetching, the cheaper model when there is one.
		maxSteps = min(maxSteps, 2)
		r.warn(codes.LowPrecision)
	}
	r.tools = map[string]tools.Tool{}
	for _, t := range w.d.Tools(rec, func(code, detail string) {
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
				r.warn(codes.StepLimit)
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
			if errors.Is(err, govern.ErrBudgetRefused) {
				break
			}
			if loopCtx.Err() != nil && ctx.Err() == nil {
				r.warn(codes.TimeLimit)
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
		if errors.Is(err, govern.ErrBudgetRefused) {
			return task.Fail(codes.AgentFailed, "the token budget ran out before an answer could be written")
		}
		return err
	}
	return r.finish(ctx, reply.Content)
}

func (r *run) warnTimeIfLoop(ctx context.Context) {
	if ctx.Err() == nil {
		r.warn(codes.TimeLimit)
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
			if errors.Is(cerr, govern.ErrBudgetRefused) {
				return task.Fail(codes.AgentFailed, "the token budget ran out before a valid answer was written")
			}
			return cerr
		}
		summary, days, err = parseAnswer(reply.Content, r.rec.Request.Days)
		if err != nil {
			return task.Fail(codes.AgentFailed, "the model did not produce a valid itinerary: "+err.Error())
		}
	}
	r.mu.Lock()
	warnings := append([]string{}, r.rec.Warnings...)
	r.mu.Unlock()
	r.rec.Result = &task.Result{Summary: summary, Days: days, Warnings: warnings,
		Model: r.lastModel.Name, Offline: r.lastModel.Offline, Language: r.rec.Request.Lang()}
	return nil
}

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

// addWarning appends code once.
func addWarning(ws []string, code string) []string {
	for _, w := range ws {
		if w == code {
			return ws
		}
	}
	return append(ws, code)
}
