package agent

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/tools"
	"faregate/protect/breaker"
	"faregate/protect/budget"
	"faregate/protect/codes"
)

var lisbon = task.Request{Destination: "Lisbon", Days: 2, Interests: []string{"food"}}

// toolNames lists the tools a turn offered.
func toolNames(t chat.Turn) []string {
	var out []string
	for _, d := range t.Tools {
		out = append(out, d.Name)
	}
	return out
}

// last is the last message of a turn.
func last(t chat.Turn) chat.Message { return t.Messages[len(t.Messages)-1] }

// TestAnswerFirstTime: a model that answers at once; the result, usage,
// settlement and ledger say what happened.
func TestAnswerFirstTime(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, _ int, turn chat.Turn) (chat.Reply, error) {
		rep := plan(2)
		rep.Usage = chat.Usage{PromptTokens: 500, CompletionTokens: 40, Reported: true}
		return rep, nil
	}}
	r := newRig(m, newTool("guide_search"))
	rec, err := r.run(t, task.Request{Destination: "Lisbon", Days: 2, Language: task.LangChinese})
	if err != nil {
		t.Fatal(err)
	}
	res := rec.Result
	if res == nil || len(res.Days) != 2 || res.Model != "primary" || res.Offline || res.Language != task.LangChinese {
		t.Fatalf("result %+v", res)
	}
	if rec.Usage != (task.Usage{PromptTokens: 500, CompletionTokens: 40}) {
		t.Fatalf("usage %+v", rec.Usage)
	}
	turn := m.Turns()[0]
	if turn.Request == nil || turn.Request.Destination != "Lisbon" || turn.MaxTokens != 1024 || turn.Stream == nil {
		t.Fatalf("turn %+v", turn)
	}
	if !strings.Contains(turn.Messages[1].Content, "Simplified Chinese") || strings.Contains(turn.Messages[1].Content, "Request JSON") {
		t.Fatalf("user prompt %q", turn.Messages[1].Content)
	}
	st := r.budget.Settled()
	if len(st) != 1 || st[0].Prompt != 500 || st[0].Completion != 40 || st[0].Reservation.Tokens != chat.EstimatePrompt(turn.Messages, turn.Tools)+1024 {
		t.Fatalf("settled %+v", st)
	}
	if e := r.ledger.Entries(); len(e) != 1 || e[0].Model != "primary" || e[0].PromptTokens != 500 || e[0].Outcome != "ok" || e[0].Task != rec.ID {
		t.Fatalf("ledger %+v", e)
	}
	steps := r.steps(t)
	if len(steps) != 2 || steps[1].Status != "ok" || steps[1].Kind != "model" || steps[1].Detail != "primary" {
		t.Fatalf("steps %+v", steps)
	}
	want := budget.Request{Day: rec.Day, Principal: visitor, PrincipalLimit: 40000, Tier: "public", TierLimit: 150000,
		Task: rec.ID, Model: "primary", PromptTokens: chat.EstimatePrompt(turn.Messages, turn.Tools), MaxTokens: 1024}
	got := r.budget.Reserved()
	if len(got) == 1 {
		got[0].ID = "" // the call's own random id (for a withdraw)
	}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("reservations %+v, want %+v", got, want)
	}
}

// TestToolRound: tool results go back as tool messages carrying the text
// and the typed data; a repeated call is answered from memory; an unknown
// tool gets an explanation; without a reported usage the call is charged
// what was counted.
func TestToolRound(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if n == 1 {
			return calls("guide_search", `{"query":"Lisbon"}`, "teleport", `{}`, "guide_search", `{ "query" : "lisbon " }`), nil
		}
		rep := plan(2)
		for _, c := range []string{rep.Content[:10], rep.Content[10:]} {
			if err := turn.Stream(chat.Chunk{Text: c}); err != nil {
				return chat.Reply{}, err
			}
		}
		return rep, nil
	}}
	gs := newTool("guide_search")
	r := newRig(m, gs)
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	if got := gs.Calls(); len(got) != 1 {
		t.Fatalf("guide_search ran %d times, want 1 (the repeat from memory)", len(got))
	}
	second := m.Turns()[1]
	msgs := second.Messages[len(second.Messages)-4:]
	if msgs[0].Role != chat.RoleAssistant || len(msgs[0].ToolCalls) != 3 {
		t.Fatalf("assistant message %+v", msgs[0])
	}
	if msgs[1].Role != chat.RoleTool || msgs[1].ToolCallID != "call_1" || msgs[1].Data != "guide_search data" || !strings.Contains(msgs[1].Content, "says hello") {
		t.Fatalf("tool message %+v", msgs[1])
	}
	if !strings.Contains(msgs[2].Content, `Unknown tool "teleport"`) || msgs[3].Content != msgs[1].Content || msgs[3].ToolCallID != "call_3" {
		t.Fatalf("unknown and remembered: %+v %+v", msgs[2], msgs[3])
	}
	var statuses []string
	for _, s := range r.steps(t) {
		if s.Kind == "tool" && s.Status != "started" {
			statuses = append(statuses, s.Name+":"+s.Status)
		}
	}
	if strings.Join(statuses, ",") != "guide_search:ok,teleport:failed,guide_search:cached" {
		t.Fatalf("tool steps %v", statuses)
	}
	// The second call reported no usage: it is charged the streamed text.
	st := r.budget.Settled()
	if want := chat.EstimatePrompt(second.Messages, second.Tools) + chat.EstimateTokens(plan(2).Content); st[1].Actual() != want {
		t.Fatalf("second call settled %d, want %d", st[1].Actual(), want)
	}
	// The first was charged its tool calls, having streamed nothing.
	first := m.Turns()[0]
	if want := chat.EstimatePrompt(first.Messages, first.Tools) + chat.EstimateToolCalls(calls("guide_search", `{"query":"Lisbon"}`, "teleport", `{}`, "guide_search", `{ "query" : "lisbon " }`).ToolCalls); st[0].Actual() != want {
		t.Fatalf("first call settled %d, want %d", st[0].Actual(), want)
	}
	if rec.Usage.PromptTokens+rec.Usage.CompletionTokens != st[0].Actual()+st[1].Actual() {
		t.Fatalf("usage %+v does not add up to %+v", rec.Usage, st)
	}
}

// closingTurn checks that turn is the closing call: no tools, the closing
// instruction as the last user message.
func closingTurn(t *testing.T, turn chat.Turn) {
	t.Helper()
	if len(turn.Tools) != 0 {
		t.Errorf("closing call offered tools %v", toolNames(turn))
	}
	if lm := last(turn); lm.Role != chat.RoleUser || lm.Content != closingPrompt {
		t.Errorf("closing call ends with %+v, want the closing prompt", lm)
	}
}

// TestStepLimit: a model that always wants more tools gets MaxSteps calls
// with tools, then one closing call that tells it to answer.
func TestStepLimit(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		return calls("guide_search", `{"query":"page `+string(rune('0'+n))+`"}`), nil
	}}
	r := newRig(m, newTool("guide_search"))
	r.cfg.MaxSteps = 3
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	turns := m.Turns()
	if len(turns) != 4 {
		t.Fatalf("%d model calls, want 3 with tools and 1 closing", len(turns))
	}
	for _, turn := range turns[:3] {
		if len(turn.Tools) != 1 || strings.Contains(last(turn).Content, closingPrompt) {
			t.Fatalf("a planning call without tools or with the closing prompt: %+v", turn)
		}
	}
	closingTurn(t, turns[3])
	if !slices.Contains(rec.Warnings, codes.StepLimit) || rec.Result == nil {
		t.Fatalf("warnings %v result %v", rec.Warnings, rec.Result)
	}
	if s := r.steps(t); s[len(s)-1].Name != "answer" {
		t.Fatalf("the closing step is named %q", s[len(s)-1].Name)
	}
}

// TestToolLoop: the third identical call withdraws the tools; the run goes
// straight to the closing call.
func TestToolLoop(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, _ int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		return calls("weather", `{"location":"Lisbon"}`), nil
	}}
	w := newTool("weather")
	r := newRig(m, w)
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	turns := m.Turns()
	if len(turns) != 4 || len(w.Calls()) != 1 {
		t.Fatalf("%d model calls, %d executions; want 4 and 1", len(turns), len(w.Calls()))
	}
	closingTurn(t, turns[3])
	if !slices.Contains(rec.Warnings, codes.ToolLoop) || slices.Contains(rec.Warnings, codes.StepLimit) {
		t.Fatalf("warnings %v", rec.Warnings)
	}
}

// TestToolLimit: past MaxToolCalls executions a call is refused in words
// and the tools are withdrawn.
func TestToolLimit(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		if n == 1 {
			return calls("guide_search", `{"query":"a"}`, "guide_search", `{"query":"b"}`), nil
		}
		return calls("guide_search", `{"query":"c"}`), nil
	}}
	gs := newTool("guide_search")
	r := newRig(m, gs)
	r.cfg.MaxToolCalls = 2
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	turns := m.Turns()
	if len(gs.Calls()) != 2 || len(turns) != 3 {
		t.Fatalf("%d executions, %d model calls; want 2 and 3", len(gs.Calls()), len(turns))
	}
	closingTurn(t, turns[2])
	refusal := turns[2].Messages[len(turns[2].Messages)-2]
	if refusal.Role != chat.RoleTool || !strings.Contains(refusal.Content, "Tool-call limit reached") {
		t.Fatalf("refused call answered %+v", refusal)
	}
	if !slices.Contains(rec.Warnings, codes.ToolLimit) {
		t.Fatalf("warnings %v", rec.Warnings)
	}
}

// TestNoToolsAllowed: with MaxToolCalls 0 no tools are offered, and the one
// call is an ordinary planning call, not a closing one.
func TestNoToolsAllowed(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	r := newRig(m, newTool("guide_search"))
	r.cfg.MaxToolCalls = 0
	rec, err := r.run(t, lisbon)
	if err != nil || rec.Result == nil {
		t.Fatal(err)
	}
	turns := m.Turns()
	if len(turns) != 1 || len(turns[0].Tools) != 0 || last(turns[0]).Content == closingPrompt {
		t.Fatalf("turns %+v", turns)
	}
	if len(rec.Warnings) != 0 {
		t.Fatalf("warnings %v", rec.Warnings)
	}
}

// TestTimeLimit: a model that hangs while tools are on offer is stopped at
// the loop's share of the run's time, and the closing call still answers.
func TestTimeLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := &fakeModel{GenerateFn: func(ctx context.Context, n int, turn chat.Turn) (chat.Reply, error) {
			if len(turn.Tools) == 0 {
				return plan(2), nil
			}
			if n == 1 {
				return calls("guide_search", `{"query":"Lisbon"}`), nil
			}
			<-ctx.Done()
			return chat.Reply{}, ctx.Err()
		}}
		r := newRig(m, newTool("guide_search"))
		r.cfg.Timeout = 40 * time.Second
		start := time.Now()
		rec, err := r.run(t, lisbon)
		if err != nil {
			t.Fatal(err)
		}
		// 40s minus the closing call's reserve of a quarter.
		if took := time.Since(start); took != 30*time.Second {
			t.Fatalf("the loop ran %v, want 30s", took)
		}
		turns := m.Turns()
		if len(turns) != 3 {
			t.Fatalf("%d model calls", len(turns))
		}
		closingTurn(t, turns[2])
		if !slices.Contains(rec.Warnings, codes.TimeLimit) || rec.Result == nil {
			t.Fatalf("warnings %v result %v", rec.Warnings, rec.Result)
		}
		st := r.steps(t)
		if s := st[len(st)-3]; s.Name != "plan" || s.Status != "failed" || s.Detail != "stopped: time limit" {
			t.Fatalf("the hung call's step: %+v", s)
		}
	})
}

// TestRunOutOfTime: when the whole run's time is gone there is nothing to
// close with; the run fails with the context's error for the runner to map.
func TestRunOutOfTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		m := &fakeModel{GenerateFn: func(ctx context.Context, _ int, _ chat.Turn) (chat.Reply, error) {
			<-ctx.Done()
			return chat.Reply{}, ctx.Err()
		}}
		r := newRig(m)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		rec := record(lisbon)
		err := r.workflow().Run(ctx, rec, func(*task.Record, ...task.Event) error { return nil })
		if !errors.Is(err, context.DeadlineExceeded) || rec.Result != nil || slices.Contains(rec.Warnings, codes.TimeLimit) {
			t.Fatalf("err %v warnings %v", err, rec.Warnings)
		}
	})
}

// TestBudgetRefusalMidTask: when the budget cannot afford another call
// with tools, the run closes with a call that fits what is left.
func TestBudgetRefusalMidTask(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		return calls("guide_search", `{"query":"Lisbon"}`), nil
	}}
	r := newRig(m, newTool("guide_search"))
	// Room for the first call and its settlement, not for a second full one.
	first := chat.EstimatePrompt(initialMessages(lisbon), []chat.ToolDef{newTool("guide_search").Definition()}) + 1024
	r.budget.Left = first + 100
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	turns := m.Turns()
	if len(turns) != 2 {
		t.Fatalf("%d model calls, want the first and the closing one", len(turns))
	}
	closingTurn(t, turns[1])
	prompt := chat.EstimatePrompt(turns[1].Messages, nil)
	left := first + 100 - r.budget.Settled()[0].Actual()
	if int64(turns[1].MaxTokens) != left-prompt || turns[1].MaxTokens < govern.MinClosingTokens {
		t.Fatalf("closing max_tokens %d, want what is left: %d - %d", turns[1].MaxTokens, left, prompt)
	}
	if !slices.Contains(rec.Warnings, codes.BudgetExhausted) || rec.Result == nil {
		t.Fatalf("warnings %v result %v", rec.Warnings, rec.Result)
	}
}

// TestBudgetTooSmallToClose: with less than the minimal closing call left,
// the run fails and no model is asked.
func TestBudgetTooSmallToClose(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	r := newRig(m, newTool("guide_search"))
	r.budget.Left = 100
	_, err := r.run(t, lisbon)
	var f *task.Failure
	if !errors.As(err, &f) || f.Code != codes.AgentFailed || !strings.Contains(f.Message, "budget ran out") {
		t.Fatalf("err %v", err)
	}
	if len(m.Turns()) != 0 {
		t.Fatalf("the model was called %d times", len(m.Turns()))
	}
}

// TestBudgetRefusalNeverReachesBreaker: refusals happen before the breaker
// sees a call, so they never count towards opening it.
func TestBudgetRefusalNeverReachesBreaker(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	r := newRig(m)
	r.budget.Left = 0
	r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.01, OpenFor: time.Hour}, nil, nil)
	for range 5 {
		if _, err := r.run(t, lisbon); err == nil {
			t.Fatal("a run without budget succeeded")
		}
	}
	if st := r.models.Breaker.State(); st != breaker.Closed {
		t.Fatalf("breaker %s after budget refusals", st)
	}
}

// TestBudgetStoreDown: a budget that cannot be asked fails the run closed.
func TestBudgetStoreDown(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	r := newRig(m)
	r.budget.ReserveFn = func(context.Context, budget.Request) (budget.Reservation, error) {
		return budget.Reservation{}, budget.ErrUnavailable
	}
	_, err := r.run(t, lisbon)
	var f *task.Failure
	if !errors.As(err, &f) || f.Code != codes.AgentFailed || len(m.Turns()) != 0 {
		t.Fatalf("err %v after %d model calls", err, len(m.Turns()))
	}
}

// endless streams pieces until the stream refuses one.
func endless(pieces ...string) func(context.Context, int, chat.Turn) (chat.Reply, error) {
	return func(_ context.Context, _ int, turn chat.Turn) (chat.Reply, error) {
		if strings.HasPrefix(last(turn).Content, "That answer was not valid") {
			return plan(2), nil
		}
		for i := 0; ; i++ {
			if err := turn.Stream(chat.Chunk{Text: pieces[i%len(pieces)]}); err != nil {
				return chat.Reply{}, err
			}
		}
	}
}

// TestStreamCut: output is cut at the reservation, exactly: what is kept
// is what is counted, settled and recorded, and a piece that does not fit
// whole is kept up to its last code point that fits.
func TestStreamCut(t *testing.T) {
	// Pieces of mixed scripts, so a cut falls inside a piece.
	m := &fakeModel{GenerateFn: endless("Lisbon 里斯本 day ", "trams, 电车 and views; ", "x")}
	r := newRig(m)
	r.cfg.MaxTokens = 300
	r.cfg.LoopThreshold = 1 // only an exact loop, so the cap stops this one
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	turns := m.Turns()
	if len(turns) != 2 || !strings.HasPrefix(last(turns[1]).Content, "That answer was not valid") {
		t.Fatalf("%d calls; the cut answer was not repaired", len(turns))
	}
	kept := turns[1].Messages[len(turns[1].Messages)-2]
	if kept.Role != chat.RoleAssistant || chat.EstimateTokens(kept.Content) != 300 {
		t.Fatalf("kept %d tokens, want exactly 300: %q", chat.EstimateTokens(kept.Content), kept.Content)
	}
	prompt := chat.EstimatePrompt(turns[0].Messages, nil)
	st := r.budget.Settled()
	if st[0].Actual() != prompt+300 || st[0].Reservation.Tokens != prompt+300 {
		t.Fatalf("settled %+v, want prompt %d + 300", st[0], prompt)
	}
	e := r.ledger.Entries()[0]
	if e.Outcome != codes.OutputTruncated || e.CompletionTokens != 300 || e.PromptTokens != prompt {
		t.Fatalf("ledger %+v", e)
	}
	if !slices.Contains(rec.Warnings, codes.OutputTruncated) || rec.Result == nil {
		t.Fatalf("warnings %v", rec.Warnings)
	}
}

// TestStreamedToolCallsAreCounted: tool-call output counts against the
// cap like text, though it is not kept.
func TestStreamedToolCallsAreCounted(t *testing.T) {
	m := &fakeModel{GenerateFn: func(_ context.Context, _ int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		for {
			if err := turn.Stream(chat.Chunk{ToolCall: `{"query":"more `}); err != nil {
				return chat.Reply{}, err
			}
		}
	}}
	r := newRig(m, newTool("guide_search"))
	r.cfg.MaxTokens = 256
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	if e := r.ledger.Entries()[0]; e.CompletionTokens != 256 || e.Outcome != codes.OutputTruncated {
		t.Fatalf("ledger %+v", e)
	}
	// Nothing of the cut answer is kept as text; the run closes.
	turns := m.Turns()
	if len(turns) < 2 || !slices.Contains(rec.Warnings, codes.OutputTruncated) {
		t.Fatalf("%d calls, warnings %v", len(turns), rec.Warnings)
	}
}

// TestRepetitionCut: a looping answer is cut long before the cap and
// charged what it streamed.
func TestRepetitionCut(t *testing.T) {
	m := &fakeModel{GenerateFn: endless("and then we walk to the castle again ")}
	r := newRig(m)
	rec, err := r.run(t, lisbon)
	if err != nil {
		t.Fatal(err)
	}
	e := r.ledger.Entries()[0]
	if e.Outcome != codes.OutputLoop || e.CompletionTokens >= 1024/2 || e.CompletionTokens == 0 {
		t.Fatalf("ledger %+v: not cut early", e)
	}
	kept := m.Turns()[1].Messages[len(m.Turns()[1].Messages)-2]
	if chat.EstimateTokens(kept.Content) != e.CompletionTokens {
		t.Fatalf("kept %d tokens, charged %d", chat.EstimateTokens(kept.Content), e.CompletionTokens)
	}
	if !slices.Contains(rec.Warnings, codes.OutputLoop) || rec.Result == nil {
		t.Fatalf("warnings %v", rec.Warnings)
	}
}

// TestInvalidAnswers: one invalid answer is repaired; two fail the run.
func TestInvalidAnswers(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{Content: "I cannot plan that."}, nil
	}}
	r := newRig(m)
	_, err := r.run(t, lisbon)
	var f *task.Failure
	if !errors.As(err, &f) || f.Code != codes.AgentFailed || !strings.Contains(f.Message, "valid itinerary") || len(m.Turns()) != 2 {
		t.Fatalf("err %v after %d calls", err, len(m.Turns()))
	}
}

// TestLowPrecisionRun: a degraded request runs on the fallback with at
// most two steps and without fetch_page.
func TestLowPrecisionRun(t *testing.T) {
	script := func(_ context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		if len(turn.Tools) == 0 {
			return plan(2), nil
		}
		return calls("guide_search", `{"query":"q`+string(rune('0'+n))+`"}`), nil
	}
	primary, cheap := &fakeModel{GenerateFn: script}, &fakeModel{GenerateFn: script}
	r := newRig(primary, newTool("guide_search"), newTool("weather"), newTool(tools.NameFetchPage))
	r.models.Fallback = &govern.Model{Model: cheap, Name: "cheap"}
	rec := record(lisbon)
	rec.AITF.Degraded = true
	if err := r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
		t.Fatal(err)
	}
	turns := cheap.Turns()
	if len(primary.Turns()) != 0 || len(turns) != 3 {
		t.Fatalf("primary %d calls, fallback %d; want 0 and 2 steps + closing", len(primary.Turns()), len(turns))
	}
	if got := toolNames(turns[0]); !slices.Equal(got, []string{"guide_search", "weather"}) {
		t.Fatalf("tools offered %v", got)
	}
	closingTurn(t, turns[2])
	if rec.Result.Model != "cheap" || !slices.Contains(rec.Warnings, codes.LowPrecision) ||
		!slices.Contains(rec.Warnings, codes.StepLimit) || slices.Contains(rec.Warnings, codes.FallbackModel) {
		t.Fatalf("result %+v warnings %v", rec.Result, rec.Warnings)
	}
}

// TestFallback: a failing primary hands the call to the fallback, which
// gets its own reservation; without a fallback the task fails with
// model_unavailable.
func TestFallback(t *testing.T) {
	failing := func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{}, errors.New("503 from provider")
	}
	t.Run("with fallback", func(t *testing.T) {
		primary := &fakeModel{GenerateFn: failing}
		cheap := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
		r := newRig(primary)
		r.models.Fallback = &govern.Model{Model: cheap, Name: "cheap"}
		r.models.Breaker = breaker.New(breaker.Settings{OpenFor: time.Hour}, nil, nil)
		rec, err := r.run(t, lisbon)
		if err != nil {
			t.Fatal(err)
		}
		if rec.Result.Model != "cheap" || !slices.Contains(rec.Warnings, codes.FallbackModel) {
			t.Fatalf("result %+v warnings %v", rec.Result, rec.Warnings)
		}
		st := r.budget.Settled()
		if len(st) != 2 || st[0].Reservation.ID == st[1].Reservation.ID {
			t.Fatalf("settlements %+v: want one per attempt", st)
		}
		if e := r.ledger.Entries(); len(e) != 2 || e[0].Outcome != "error" || e[0].Model != "primary" || e[1].Model != "cheap" {
			t.Fatalf("ledger %+v", e)
		}
	})
	t.Run("without fallback", func(t *testing.T) {
		r := newRig(&fakeModel{GenerateFn: failing})
		r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
		_, err := r.run(t, lisbon)
		var f *task.Failure
		if !errors.As(err, &f) || f.Code != codes.ModelUnavailable {
			t.Fatalf("err %v", err)
		}
		if r.models.Status() != task.ModelUnavailable {
			t.Fatalf("status %s after the breaker opened", r.models.Status())
		}
		// While it is open, calls are refused without reaching the model.
		before := len(r.models.Primary.Model.(*fakeModel).Turns())
		_, err = r.run(t, lisbon)
		if !errors.As(err, &f) || f.Code != codes.ModelUnavailable || len(r.models.Primary.Model.(*fakeModel).Turns()) != before {
			t.Fatalf("while open: %v", err)
		}
	})
}

func TestModelsStatus(t *testing.T) {
	ms := &govern.Models{Primary: govern.Model{Name: "offline", Offline: true}}
	if ms.Status() != task.ModelOK || !ms.Offline() {
		t.Fatal("a model without a breaker is always ok")
	}
	ms.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, FailureRatio: 0.5, OpenFor: time.Hour}, nil, nil)
	if ms.Status() != task.ModelOK {
		t.Fatalf("closed: %s", ms.Status())
	}
	_ = ms.Breaker.Do(context.Background(), "v_test", func(context.Context, *breaker.Call) error { return errors.New("down") })
	if ms.Status() != task.ModelUnavailable {
		t.Fatalf("open without fallback: %s", ms.Status())
	}
	ms.Fallback = &govern.Model{Name: "cheap"}
	if ms.Status() != task.ModelDegraded {
		t.Fatalf("open with fallback: %s", ms.Status())
	}
}

// TestMinRunTokens is the first call of the largest valid request.
func TestMinRunTokens(t *testing.T) {
	r := newRig(&fakeModel{}, newTool("guide_search"), newTool("weather"))
	got := r.workflow().MinRunTokens()
	small := chat.EstimatePrompt(initialMessages(lisbon), tools.Definitions(r.tools)) + 1024
	if got <= small || got > small+400 {
		t.Fatalf("MinRunTokens %d, a small request's first call %d", got, small)
	}
}

// TestAccountingFailuresDoNotStopARun: a settle (and so its ledger write)
// that fails even after the budget's own retries is logged; the
// reservation expires on its own, the plan still counts and the tokens
// still move the token metric.
func TestAccountingFailuresDoNotStopARun(t *testing.T) {
	m := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) { return plan(2), nil }}
	r := newRig(m)
	r.budget.SettleFn = func(context.Context, budget.Reservation, int64, int64) (budget.Settlement, error) {
		return budget.Settlement{}, budget.ErrUnavailable
	}
	rec, err := r.run(t, lisbon)
	if err != nil || rec.Result == nil {
		t.Fatalf("err %v", err)
	}
	if len(r.budget.Settled()) != 1 || len(r.ledger.Entries()) != 1 {
		t.Fatalf("settle and ledger were not attempted")
	}
}
