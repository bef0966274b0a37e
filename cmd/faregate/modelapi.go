package main

import (
	"context"
	"log/slog"
	"net/http"
	"time"

	"faregate/agent/gateway"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/api"
	"faregate/protect/ratelimit"
)

// mountModels puts the model endpoint (agent/gateway) on the /v1 surface
// (nothing with the built-in planner): every call governed by the one
// Governor (agent/govern) the built-in agent's calls go through, its task
// read from the task store, its step posted through the task key, each
// call counted in its principal's invalid ratio.
func (x *externalAgent) mountModels(cfg *config, lg *slog.Logger, sp *spending, rn *runs) {
	if x == nil {
		return
	}
	parts := modelEndpointParts{
		gov:       sp.workflow.Governor(),
		records:   rn.store.Get,
		keys:      x.keys,
		limits:    x.limits,
		models:    []string{sp.models.Primary.Name},
		fallbacks: fallbackNames(sp.models),
		embedding: cfg.EmbeddingModel,
		refTokens: int64(cfg.LLMMaxTokens),
		timeout:   cfg.LLMTimeout,
		legacy:    cfg.LLMLegacyMaxTokens,
		loop:      loopThreshold(cfg),
		lg:        lg,
	}
	if cfg.InvalidRatio > 0 && sp.limiter != nil {
		parts.invalid = sp.limiter
	}
	primary := sp.models.Primary
	parts.wire = cfg.LLMProvider
	if parts.wire == gateway.WireAnthropic {
		parts.count = &gateway.Upstream{BaseURL: primary.BaseURL, APIKey: primary.APIKey, Client: primary.HTTPClient}
	}
	switch {
	case cfg.EmbeddingBaseURL != "":
		parts.embeddings = &gateway.Upstream{BaseURL: cfg.EmbeddingBaseURL, APIKey: cfg.EmbeddingAPIKey, Client: primary.HTTPClient}
	case parts.wire == gateway.WireAnthropic:
		// Anthropic has no embeddings: without a server of its own,
		// /v1/embeddings is 404, as without an embedding model.
		parts.embedding = ""
	}
	x.v1.Gateway = func(errs gateway.ErrorWriter) gateway.Handlers { return modelEndpoint(parts, errs) }
}

// loopThreshold is the model endpoint's repetition cut: the planner's
// threshold, or 0 (off) with FAREGATE_LOOP_CUT=false.
func loopThreshold(cfg *config) float64 {
	if !cfg.LoopCut {
		return 0
	}
	return cfg.LoopThreshold
}

// fallbackNames is the fallback model's name, if m has one.
func fallbackNames(m *govern.Models) []string {
	if m == nil || m.Fallback == nil {
		return nil
	}
	return []string{m.Fallback.Name}
}

// modelEndpointParts is what the model endpoint is made of.
type modelEndpointParts struct {
	gov       *govern.Governor
	records   func(ctx context.Context, id string) (task.Record, error)
	keys      *taskkey.Keys
	limits    gateway.Limiter
	models    []string
	fallbacks []string // the Governor's fallback model, if any
	embedding string
	// refTokens holds a Responses item reference (FAREGATE_LLM_MAX_TOKENS).
	refTokens int64
	// invalid counts every call in the invalid ratio (nil: off).
	invalid *ratelimit.Limiter
	// timeout bounds a call (FAREGATE_LLM_TIMEOUT); legacy sends
	// max_tokens too (FAREGATE_LLM_LEGACY_MAX_TOKENS); loop is the
	// repetition cut's threshold (0: off).
	timeout time.Duration
	legacy  bool
	loop    float64
	lg      *slog.Logger
	// wire is the provider's (FAREGATE_LLM_PROVIDER); count answers
	// count_tokens with an anthropic one; embeddings is
	// FAREGATE_EMBEDDING_BASE_URL's server (nil: the primary's).
	wire       string
	count      *gateway.Upstream
	embeddings *gateway.Upstream
}

// modelEndpoint is the model endpoint's routes (the Messages routes among
// them) behind the task key's
// check (the request's context carries the grant), answering refusals
// through errs.
func modelEndpoint(p modelEndpointParts, errs gateway.ErrorWriter) gateway.Handlers {
	o := gateway.Options{
		Governor: p.gov,
		Limits:   p.limits,
		Task: func(r *http.Request) (gateway.Task, bool) {
			g, ok := taskkey.FromContext(r.Context())
			if !ok {
				return gateway.Task{}, false
			}
			return gateway.Task{ID: g.Task, Principal: g.Principal, Tier: g.Tier, Deadline: g.Deadline, Models: p.models}, true
		},
		Records:         p.records,
		Steps:           p.keys,
		Errors:          errs,
		RequestID:       func(r *http.Request) string { return api.RequestID(r.Context()) },
		EmbeddingModel:  p.embedding,
		FallbackModels:  p.fallbacks,
		ReferenceTokens: p.refTokens,
		CallTimeout:     p.timeout,
		LegacyMaxTokens: p.legacy,
		LoopThreshold:   p.loop,
		Logger:          p.lg,
		Wire:            p.wire,
		Embeddings:      p.embeddings,
	}
	if p.invalid != nil {
		o.Invalid = p.invalid
	}
	hs := gateway.New(o)
	ms := gateway.NewMessages(o, gateway.MessagesOptions{Wire: p.wire, CountUpstream: p.count})
	hs.Messages = &ms
	return hs
}
