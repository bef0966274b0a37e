package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"faregate/agent/alert"
	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/tools"
	"faregate/protect/budget"
	"faregate/protect/ratelimit"
)

// Fakes in the style of wtf's mock package: each behaviour is a function
// field a test sets, and each fake records what it was asked.

// fakeModel is a chat.Model.
type fakeModel struct {
	// GenerateFn answers call number n (1-based).
	GenerateFn func(ctx context.Context, n int, t chat.Turn) (chat.Reply, error)

	mu    sync.Mutex
	turns []chat.Turn
}

func (m *fakeModel) Generate(ctx context.Context, t chat.Turn) (chat.Reply, error) {
	m.mu.Lock()
	t.Messages = slices.Clone(t.Messages)
	m.turns = append(m.turns, t)
	n := len(m.turns)
	m.mu.Unlock()
	return m.GenerateFn(ctx, n, t)
}

// Turns returns the turns the model was given, in order.
func (m *fakeModel) Turns() []chat.Turn {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.turns)
}

// fakeBudget is the workflow's Budget. By default it is an in-memory
// budget of Left tokens: a reservation takes its tokens, a settle gives
// back what was not used (or takes the excess, as overage). Prices, when
// set, give each model a cost per token in micro-units.
type fakeBudget struct {
	ReserveFn func(ctx context.Context, req budget.Request) (budget.Reservation, error)
	SettleFn  func(ctx context.Context, r budget.Reservation, prompt, completion int64) (budget.Settlement, error)

	mu        sync.Mutex
	Left      int64
	Prices    map[string]int64
	reserved  []budget.Request
	settled   []settlement
	open      map[string]int64 // granted and not yet settled: id → tokens
	withdrawn []budget.Request
}

// settlement is one Settle call.
type settlement struct {
	Reservation        budget.Reservation
	Prompt, Completion int64
}

// Actual is the tokens the settle charged.
func (s settlement) Actual() int64 { return s.Prompt + s.Completion }

func newBudget(left int64) *fakeBudget { return &fakeBudget{Left: left} }

func (b *fakeBudget) Reserve(ctx context.Context, req budget.Request) (budget.Reservation, error) {
	b.mu.Lock()
	b.reserved = append(b.reserved, req)
	n := len(b.reserved)
	b.mu.Unlock()
	if b.ReserveFn != nil {
		return b.ReserveFn(ctx, req)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	tokens := req.PromptTokens + req.MaxTokens
	if tokens > b.Left {
		return budget.Reservation{}, &budget.ExhaustedError{Scope: budget.ScopeTask, Remaining: b.Left}
	}
	b.Left -= tokens
	id := req.ID
	if id == "" {
		id = fmt.Sprintf("r%d", n)
	}
	if b.open == nil {
		b.open = map[string]int64{}
	}
	b.open[id] = tokens
	return budget.Reservation{ID: id, Day: req.Day, Principal: req.Principal, Tier: req.Tier,
		Task: req.Task, Model: req.Model, PrincipalLimit: req.PrincipalLimit, TierLimit: req.TierLimit,
		Tokens: tokens, CostMicro: tokens * b.Prices[req.Model]}, nil
}

// ceiling is a real budget's charging rule (its default ceiling); it
// never reaches Redis.
var ceiling = budget.New(nil, budget.Options{})

func (b *fakeBudget) Charged(r budget.Reservation, call budget.Call) (int64, int64, bool) {
	return ceiling.Charged(r, call)
}

func (b *fakeBudget) SettleCall(ctx context.Context, r budget.Reservation, call budget.Call) (budget.Settlement, error) {
	p, c, _ := b.Charged(r, call)
	return b.Settle(ctx, r, p, c)
}

func (b *fakeBudget) Settle(ctx context.Context, r budget.Reservation, prompt, completion int64) (budget.Settlement, error) {
	b.mu.Lock()
	b.settled = append(b.settled, settlement{r, prompt, completion})
	b.mu.Unlock()
	if b.SettleFn != nil {
		return b.SettleFn(ctx, r, prompt, completion)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	used := prompt + completion
	delete(b.open, r.ID)
	b.Left += r.Tokens - used
	s := budget.Settlement{Tokens: used, CostMicro: used * b.Prices[r.Model]}
	if used > r.Tokens {
		s.OverageTokens = used - r.Tokens
		s.OverageCostMicro = s.OverageTokens * b.Prices[r.Model]
	}
	return s, nil
}

// Withdraw gives back an open reservation of req.ID, as *budget.Budget does.
func (b *fakeBudget) Withdraw(_ context.Context, req budget.Request) (bool, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.withdrawn = append(b.withdrawn, req)
	tokens, ok := b.open[req.ID]
	if ok {
		delete(b.open, req.ID)
		b.Left += tokens
	}
	return ok, nil
}

// Withdrawn returns the reserves withdrawn, in order.
func (b *fakeBudget) Withdrawn() []budget.Request {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.withdrawn)
}

// Open is how many reservations are granted and neither settled nor
// withdrawn.
func (b *fakeBudget) Open() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.open)
}

func (b *fakeBudget) Settled() []settlement {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.settled)
}

func (b *fakeBudget) Reserved() []budget.Request {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.reserved)
}

// fakeLedger records entries.
type fakeLedger struct {
	mu      sync.Mutex
	entries []budget.Entry
}

func (l *fakeLedger) Count(e budget.Entry) {
	l.mu.Lock()
	l.entries = append(l.entries, e)
	l.mu.Unlock()
}

func (l *fakeLedger) Entries() []budget.Entry {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.entries)
}

// fakeLimiter is the workflow's govern.Limiter. By default every call is taken,
// every turn is now, and Settle reports the overage (AfterCallFn, when
// set, answers a Settle).
type fakeLimiter struct {
	BeforeCallFn func(ctx context.Context, r ratelimit.CallRequest) (ratelimit.CallDecision, error)
	AfterCallFn  func(ctx context.Context, scope string, tpm, reserved, actual int64, op string) (int64, error)
	PaceFn       func(ctx context.Context, scope string, rate, amount int64, maxWait time.Duration, op string) (time.Duration, error)

	mu      sync.Mutex
	before  []ratelimit.CallRequest
	after   []afterCall
	settles []ratelimit.SettleRequest
	paces   []paceCall
}

// paceCall is one Pace.
type paceCall struct {
	Scope        string
	Rate, Amount int64
	MaxWait      time.Duration
	Op           string
}

func (l *fakeLimiter) Pace(ctx context.Context, scope string, rate, amount int64, maxWait time.Duration, op string) (time.Duration, error) {
	l.mu.Lock()
	l.paces = append(l.paces, paceCall{scope, rate, amount, maxWait, op})
	l.mu.Unlock()
	if l.PaceFn != nil {
		return l.PaceFn(ctx, scope, rate, amount, maxWait, op)
	}
	return 0, nil
}

func (l *fakeLimiter) Paces() []paceCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.paces)
}

// AfterOf returns the AfterCalls of scope.
func (l *fakeLimiter) AfterOf(scope string) []afterCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []afterCall
	for _, a := range l.after {
		if a.Scope == scope {
			out = append(out, a)
		}
	}
	return out
}

// afterCall is one Settle, as the bucket sees it.
type afterCall struct {
	Scope                 string
	TPM, Reserved, Actual int64
	Op                    string
}

func (l *fakeLimiter) BeforeCall(ctx context.Context, r ratelimit.CallRequest) (ratelimit.CallDecision, error) {
	l.mu.Lock()
	l.before = append(l.before, r)
	l.mu.Unlock()
	if l.BeforeCallFn != nil {
		return l.BeforeCallFn(ctx, r)
	}
	return ratelimit.CallDecision{Taken: true}, nil
}

func (l *fakeLimiter) Settle(ctx context.Context, r ratelimit.SettleRequest) (int64, error) {
	l.mu.Lock()
	l.after = append(l.after, afterCall{r.Scope, r.TokensPerMinute, r.Reserved, r.Actual, r.Op})
	l.settles = append(l.settles, r)
	l.mu.Unlock()
	if l.AfterCallFn != nil {
		return l.AfterCallFn(ctx, r.Scope, r.TokensPerMinute, r.Reserved, r.Actual, r.Op)
	}
	return max(r.Actual-r.Reserved, 0), nil
}

func (l *fakeLimiter) Before() []ratelimit.CallRequest {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.before)
}

func (l *fakeLimiter) After() []afterCall {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.after)
}

// emaSpikes is a BeforeCallFn with the limiter's input spike rule in
// memory: an EMA (α 0.3) of the prompts of calls that proceed; after 5
// samples a prompt over 10× the EMA is an anomaly.
func emaSpikes() func(context.Context, ratelimit.CallRequest) (ratelimit.CallDecision, error) {
	var ema float64
	var n, anomalies int64
	return func(_ context.Context, r ratelimit.CallRequest) (ratelimit.CallDecision, error) {
		p := float64(r.PromptTokens)
		if n >= 5 && p > 10*ema {
			anomalies++
			return ratelimit.CallDecision{Anomaly: true, AnomaliesInHour: anomalies, EMA: ema, Samples: n}, nil
		}
		if n == 0 {
			ema = p
		} else {
			ema = 0.3*p + 0.7*ema
		}
		n++
		return ratelimit.CallDecision{Taken: true, EMA: ema, Samples: n}, nil
	}
}

// sleepLog is a Deps.Sleep that returns at once and records each wait.
type sleepLog struct {
	mu    sync.Mutex
	waits []time.Duration
}

func (s *sleepLog) Sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	s.waits = append(s.waits, d)
	s.mu.Unlock()
	return ctx.Err()
}

func (s *sleepLog) Waits() []time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.waits)
}

// fakeTool is a tools.Tool.
type fakeTool struct {
	name   string
	CallFn func(ctx context.Context, args string) tools.Observation

	mu    sync.Mutex
	calls []string
}

func newTool(name string) *fakeTool {
	return &fakeTool{name: name, CallFn: func(_ context.Context, args string) tools.Observation {
		return tools.Observation{Text: name + " says hello to " + args, Data: name + " data"}
	}}
}

func (f *fakeTool) Name() string { return f.name }

func (f *fakeTool) Definition() chat.ToolDef {
	return chat.ToolDef{Name: f.name, Description: "the " + f.name + " tool", Parameters: map[string]any{"type": "object"}}
}

func (f *fakeTool) Call(ctx context.Context, args string) tools.Observation {
	f.mu.Lock()
	f.calls = append(f.calls, args)
	f.mu.Unlock()
	return f.CallFn(ctx, args)
}

func (f *fakeTool) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.calls)
}

// The replies a fake model builds its scripts from.

// plan is a valid answer for a request of days days.
func plan(days int) chat.Reply {
	var ds []task.Day
	for d := 1; d <= days; d++ {
		ds = append(ds, task.Day{Day: d, Title: fmt.Sprintf("Day %d", d), Items: []string{"Morning walk", "Lunch"}})
	}
	raw, _ := json.Marshal(map[string]any{"summary": "A plan.", "days": ds})
	return chat.Reply{Content: string(raw), StopReason: "stop"}
}

// calls is a reply asking for tool calls, each given as name and args.
func calls(pairs ...string) chat.Reply {
	r := chat.Reply{StopReason: "tool_calls"}
	for i := 0; i+1 < len(pairs); i += 2 {
		r.ToolCalls = append(r.ToolCalls, chat.ToolCall{ID: fmt.Sprintf("call_%d", i/2+1), Name: pairs[i], Arguments: pairs[i+1]})
	}
	return r
}

// rig is a workflow on fakes.
type rig struct {
	cfg    Config
	models *govern.Models
	budget *fakeBudget
	ledger *fakeLedger
	tools  []tools.Tool
	events []task.Event
	alerts alertLog
	// limiter and sleeps are used when set.
	limiter *fakeLimiter
	sleeps  *sleepLog
}

// alertLog records the alerts a run raised.
type alertLog struct {
	mu  sync.Mutex
	all []alert.Alert
}

func (l *alertLog) add(a alert.Alert) {
	l.mu.Lock()
	l.all = append(l.all, a)
	l.mu.Unlock()
}

// Of returns the alerts of event, in order.
func (l *alertLog) Of(event string) []alert.Alert {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []alert.Alert
	for _, a := range l.all {
		if a.Event == event {
			out = append(out, a)
		}
	}
	return out
}

// All returns every alert, in order.
func (l *alertLog) All() []alert.Alert {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.all)
}

// newRig returns a rig whose primary model is m, with a generous budget and
// the tools given.
func newRig(m chat.Model, ts ...tools.Tool) *rig {
	return &rig{
		cfg:    Config{MaxSteps: 6, MaxToolCalls: 12, Timeout: 90 * time.Second, MaxTokens: 1024, LoopThreshold: 0.8},
		models: &govern.Models{Primary: govern.Model{Model: m, Name: "primary"}},
		budget: newBudget(1_000_000),
		ledger: &fakeLedger{},
		tools:  ts,
	}
}

func (r *rig) workflow() *Workflow {
	return NewWorkflow(r.cfg, r.deps())
}

// deps are the rig's fakes as a workflow's Deps.
func (r *rig) deps() Deps {
	d := Deps{
		Models: r.models,
		Budget: r.budget,
		Ledger: r.ledger,
		Tools:  func(*task.Record, func(code, detail string)) []tools.Tool { return r.tools },
		Alert:  r.alerts.add,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)),
	}
	if r.limiter != nil {
		d.Limiter = r.limiter
	}
	if r.sleeps != nil {
		d.Sleep = r.sleeps.Sleep
	}
	return d
}

// visitor is a visitor's principal id: "v_" and an HMAC's 64 hex digits.
const visitor = "v_0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

// record is a task record as the runner hands it to the workflow: a
// visitor of the public tier, with the tier's limits.
func record(req task.Request) *task.Record {
	return &task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusRunning, Request: req, Steps: []task.Step{}, Warnings: []string{}},
		Principal: visitor, Tier: "public", Limits: task.Limits{TokensPerDay: 40000, TokensPerMinute: 6000, TierTokens: 150000},
		Day: "2026-08-15", RequestID: "req-1"}
}

// run runs the workflow for req and returns the record and Run's error.
func (r *rig) run(t *testing.T, req task.Request) (*task.Record, error) {
	t.Helper()
	rec := record(req)
	err := r.workflow().Run(context.Background(), rec, func(_ *task.Record, evs ...task.Event) error {
		r.events = append(r.events, evs...)
		return nil
	})
	return rec, err
}

// steps decodes the step events the run published, in order.
func (r *rig) steps(t *testing.T) []task.Step {
	t.Helper()
	var out []task.Step
	for _, e := range r.events {
		var s task.Step
		if err := json.Unmarshal(e.Data, &s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	return out
}
