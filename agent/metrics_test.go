package agent

import (
	"context"
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/breaker"
)

// TestModelMetrics: every model call is timed by model and outcome, and
// a streamed answer's first token is timed too; a call that failed before
// any token is timed as an error and counts no tokens on the ledger.
func TestModelMetrics(t *testing.T) {
	calls := 0
	m := &fakeModel{GenerateFn: func(ctx context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		calls++
		if calls == 1 {
			return chat.Reply{}, errors.New("connection refused")
		}
		return answers(chat.Usage{PromptTokens: 300, CompletionTokens: 40, Reported: true}).GenerateFn(ctx, n, turn)
	}}
	r := newRig(m)
	streamed := &fakeModel{GenerateFn: func(ctx context.Context, n int, turn chat.Turn) (chat.Reply, error) {
		rep := plan(2)
		if err := turn.Stream(chat.Chunk{Text: rep.Content}); err != nil {
			return chat.Reply{}, err
		}
		rep.Usage = chat.Usage{PromptTokens: 300, CompletionTokens: 40, Reported: true}
		return rep, nil
	}}
	r.models.Fallback = &govern.Model{Model: streamed, Name: "cheap"}
	r.models.Breaker = breaker.New(breaker.Settings{}, nil, nil)
	reg := prometheus.NewRegistry()
	d := r.deps()
	d.Registerer = reg
	rec := record(lisbon)
	if err := NewWorkflow(r.cfg, d).Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil }); err != nil {
		t.Fatal(err)
	}
	NewWorkflow(r.cfg, d) // a second workflow on one registry shares the series
	count := func(name string, labels ...string) int {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != name {
				continue
			}
		next:
			for _, met := range mf.GetMetric() {
				for i := 0; i+1 < len(labels); i += 2 {
					found := false
					for _, lp := range met.GetLabel() {
						if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
							found = true
						}
					}
					if !found {
						continue next
					}
				}
				return int(met.GetHistogram().GetSampleCount())
			}
		}
		return 0
	}
	if n := count("faregate_model_call_duration_seconds", "model", "primary", "outcome", "error"); n != 1 {
		t.Errorf("primary errors timed %d, want 1", n)
	}
	if n := count("faregate_model_call_duration_seconds", "model", "cheap", "outcome", "ok"); n == 0 {
		t.Error("fallback calls not timed")
	}
	if n := count("faregate_model_time_to_first_token_seconds", "model", "cheap"); n == 0 {
		t.Error("no time to first token for a streamed answer")
	}
	if n := count("faregate_model_time_to_first_token_seconds", "model", "primary"); n != 0 {
		t.Errorf("a call that never streamed has a time to first token (%d)", n)
	}
	for _, e := range r.ledger.Entries() {
		if e.Model == "primary" && (e.PromptTokens != 0 || e.CompletionTokens != 0) {
			t.Fatalf("a call refused before any token counted tokens: %+v", e)
		}
	}
}
