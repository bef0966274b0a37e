package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"faregate/agent"
	"faregate/agent/chat"
	"faregate/agent/gateway"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/api"
	"faregate/protect/codes"
	"faregate/protect/memo"
	"faregate/protect/ratelimit"
)

// governedEndpoint makes the model endpoint's calls (agent/gateway) through
// the built-in agent's Governor: one implementation of every guarantee a
// model call has, whoever makes it. It translates between the two
// packages' small types and maps the Governor's refusals to the errors the
// api's one table answers.
type governedEndpoint struct {
	gov *agent.Governor
	// principal is the task's principal as the budget scopes need it (its
	// day, limits and tier share), read from the task's record.
	principal func(ctx context.Context, taskID string) (agent.Principal, error)
	// step records a model step on the task's event stream (nil: none).
	step func(ctx context.Context, st taskkey.Posted)
}

var _ gateway.Governor = (*governedEndpoint)(nil)

// Call governs one call of an external agent: the output may shrink to
// what the task can still afford, down to the least the provider takes
// (Closing, MinOutput: one token, 16 for OpenAI's Responses); a call that
// cannot afford its prompt and that is refused.
func (e *governedEndpoint) Call(ctx context.Context, s gateway.Spec, attempt func(context.Context, gateway.Attempt) (gateway.Outcome, error)) (gateway.Outcome, error) {
	p, err := e.principal(ctx, s.TaskID)
	if err != nil {
		return gateway.Outcome{}, err
	}
	started := time.Now()
	spec := agent.Spec{
		TaskID: s.TaskID, RequestID: s.RequestID, Principal: p, Kind: s.Kind, Model: s.Model,
		PromptTokens: s.PromptTokens, MaxOutput: s.MaxOutput, Closing: true, MinOutput: max(s.MinOutput, 1),
		Label: "v1 " + s.Kind,
	}
	// The task's slot rides in the Governor's round trip before the call,
	// and its release and the call's step in the settle's after it: the
	// endpoint adds no round trip of its own to the critical path.
	var attempted atomic.Bool
	spec.Hold = func(ctx context.Context) (agent.HoldEnd, error) {
		release := func(context.Context, bool) {}
		if s.Hold != nil {
			rel, err := s.Hold(ctx)
			if err != nil {
				return nil, err
			}
			release = rel
		}
		return func(ctx context.Context, _ agent.Outcome, _ error) { release(ctx, attempted.Load()) }, nil
	}
	spec.After = func(ctx context.Context, out agent.Outcome, err error) {
		e.record(ctx, s, out, err, time.Since(started))
	}
	var last gateway.Outcome
	_, err = e.gov.Call(ctx, spec, func(ctx context.Context, a agent.Attempt) (agent.Outcome, error) {
		attempted.Store(true)
		ga := gateway.Attempt{
			Model:    a.Model.Name,
			Upstream: gateway.Upstream{BaseURL: a.Model.BaseURL, APIKey: a.Model.APIKey, Client: a.Model.HTTPClient},
			Fallback: a.Fallback, MaxOutput: a.MaxOutput,
		}
		if s.Kind == gateway.KindEmbeddings {
			// The Governor's models are chat models: an embeddings call
			// asks FAREGATE_EMBEDDING_MODEL (the gateway checked the
			// request names it) on FAREGATE_LLM_BASE_URL, and has no
			// fallback: another provider's vectors are of another space.
			if a.Fallback {
				return agent.Outcome{}, fmt.Errorf("%w: embeddings have no fallback model", gateway.ErrUpstream)
			}
			ga.Model = s.Model
		}
		o, err := attempt(ctx, ga)
		last = o
		return agent.Outcome{
			Usage: chat.Usage{PromptTokens: o.Usage.Prompt, CompletionTokens: o.Usage.Completion, Reported: o.Usage.Reported,
				Unreadable: o.Usage.Unreadable, Raw: o.Usage.Raw},
			Counted: o.Counted, Truncated: o.Truncated, Started: o.Started,
			// Anything that reached the client, or was counted, was spent.
			FirstToken: o.Started || o.Counted > 0 || o.Usage.Reported,
		}, err
	})
	if err != nil {
		return last, endpointError(err)
	}
	return last, nil
}

// record writes the call's model step, as the planner's calls have theirs.
func (e *governedEndpoint) record(ctx context.Context, s gateway.Spec, out agent.Outcome, err error, took time.Duration) {
	if e.step == nil {
		return
	}
	st := taskkey.Posted{Kind: "model", Name: s.Kind, Status: "ok", DurationMS: took.Milliseconds(),
		PromptTokens: out.Charged.PromptTokens, CompletionTokens: out.Charged.CompletionTokens}
	switch {
	case err != nil:
		st.Status, st.Detail = "failed", "refused or failed: "+refusalWord(err)
		if code, _, ok := agent.FailureCode(err); ok && code == codes.InputSpike {
			st.Fail = code // the task ends with it (contract)
		}
	default:
		st.Detail = fmt.Sprintf("%s: %d prompt + %d output tokens", out.Model.Name, out.Charged.PromptTokens, out.Charged.CompletionTokens)
		if out.Truncated {
			st.Detail += " (cut at the task's budget)"
			st.Warning = codes.OutputTruncated
		}
	}
	e.step(context.WithoutCancel(ctx), st)
}

// refusalWord names a refusal for the step's detail (no error text, which
// may carry a provider's words).
func refusalWord(err error) string {
	if code, _, ok := agent.FailureCode(err); ok {
		return code
	}
	var re *ratelimit.RefusedError
	switch {
	case errors.As(err, &re):
		return string(re.Reason)
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "the call ended"
	case errors.Is(err, agent.ErrModelUnavailable):
		return "model unavailable"
	}
	return "budget or provider"
}

// endpointError maps a Governor refusal to what the api's table answers:
// a budget refusal passes as it is (429 demo_budget_exhausted); a failure
// with a task code becomes its rate-limit refusal; a model that cannot
// take the call is the gateway's upstream failure (503 model_unavailable).
func endpointError(err error) error {
	if code, _, ok := agent.FailureCode(err); ok {
		switch code {
		case codes.InputSpike:
			// The step this refusal writes ends the task (record), which
			// cuts this very request: the refusal is still its answer.
			return fmt.Errorf("%w: %w: %w", ratelimit.ErrInputSpike, gateway.ErrEndsTask, err)
		case codes.TokenRateLimited:
			return &ratelimit.RefusedError{Reason: ratelimit.ReasonTokenRateLimited, After: time.Minute}
		}
		return fmt.Errorf("%w: %v", gateway.ErrUpstream, err)
	}
	if errors.Is(err, agent.ErrModelUnavailable) {
		return fmt.Errorf("%w: %v", gateway.ErrUpstream, err)
	}
	return err
}

// taskPrincipals reads a task's principal from its record once per task
// and replica: its limits do not change while it runs, and the key's
// check already made the round trip the call is allowed before it.
type taskPrincipals struct {
	get   func(ctx context.Context, id string) (task.Record, error)
	cache *memo.Memo[string, agent.Principal]
}

func newTaskPrincipals(get func(ctx context.Context, id string) (task.Record, error)) *taskPrincipals {
	return &taskPrincipals{get: get, cache: memo.New[string, agent.Principal](10_000, nil)}
}

func (t *taskPrincipals) principal(ctx context.Context, id string) (agent.Principal, error) {
	if p, _, ok := t.cache.Get(id); ok {
		return p, nil
	}
	rec, err := t.get(ctx, id)
	if err != nil {
		return agent.Principal{}, err
	}
	p := agent.PrincipalOf(&rec)
	// A task lives a day at the most; its record's limits are fixed.
	t.cache.Put(id, p, time.Now().Add(24*time.Hour))
	return p, nil
}

// mountModels puts the model endpoint on the /v1 surface (nothing with the
// built-in planner).
func (x *externalAgent) mountModels(cfg *config, lg *slog.Logger, st *storage, sp *spending, rn *runs) {
	if x == nil {
		return
	}
	h := modelEndpoint(modelEndpointParts{
		gov:       sp.workflow.Governor(),
		principal: newTaskPrincipals(rn.store.Get).principal,
		keys:      x.keys,
		limits: &gateway.RedisLimits{Client: st.redis.main, MaxCalls: cfg.AgentMaxCalls, MaxParallel: cfg.AgentMaxParallel,
			Logger: lg},
		models:    []string{sp.models.Primary.Name},
		fallbacks: fallbackNames(sp.models),
		embedding: cfg.EmbeddingModel,
		maxBody:   cfg.V1MaxBody,
		refTokens: int64(cfg.LLMMaxTokens),
		lg:        lg,
	})
	x.v1.Models = func(w http.ResponseWriter, r *http.Request) error {
		h.ServeHTTP(w, r)
		return nil
	}
}

// fallbackNames is the fallback model's name, if m has one.
func fallbackNames(m *agent.Models) []string {
	if m == nil || m.Fallback == nil {
		return nil
	}
	return []string{m.Fallback.Name}
}

// modelEndpointParts is what the model endpoint is made of.
type modelEndpointParts struct {
	gov       *agent.Governor
	principal func(ctx context.Context, taskID string) (agent.Principal, error)
	keys      *taskkey.Keys
	limits    gateway.Limiter
	models    []string
	fallbacks []string // the Governor's fallback model, if any
	embedding string
	maxBody   int64
	// refTokens holds a Responses item reference (FAREGATE_LLM_MAX_TOKENS).
	refTokens int64
	lg        *slog.Logger
}

// modelEndpoint is the model endpoint's handler, behind the task key's
// check (the request's context carries the grant): every call governed by
// the workflow's Governor, held to the task's call and parallelism limits
// across replicas, its step posted through the task key like the agent's
// own events (the lease holder numbers them and carries the warning).
func modelEndpoint(p modelEndpointParts) http.Handler {
	keys, lg, models := p.keys, p.lg, p.models
	gov := &governedEndpoint{
		gov:       p.gov,
		principal: p.principal,
		step: func(ctx context.Context, p taskkey.Posted) {
			g, ok := taskkey.FromContext(ctx)
			if !ok {
				return
			}
			raw, err := json.Marshal(p)
			if err == nil {
				err = keys.Step(ctx, g, raw)
			}
			if err != nil {
				// The task may have ended meanwhile: the step has nowhere to go.
				lg.Debug("model step not recorded", "task", g.Task, "err", err)
			}
		},
	}
	return gateway.New(gateway.Options{
		Governor: gov,
		Limits:   p.limits,
		Task: func(r *http.Request) (gateway.Task, bool) {
			g, ok := taskkey.FromContext(r.Context())
			if !ok {
				return gateway.Task{}, false
			}
			return gateway.Task{ID: g.Task, Principal: g.Principal, Tier: g.Tier, Deadline: g.Deadline, Models: models}, true
		},
		WriteError:      api.WriteV1Error,
		RequestID:       func(r *http.Request) string { return api.RequestID(r.Context()) },
		EmbeddingModel:  p.embedding,
		FallbackModels:  p.fallbacks,
		MaxBody:         p.maxBody,
		ReferenceTokens: p.refTokens,
		Logger:          lg,
	})
}
