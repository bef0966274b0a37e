package agent

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/tmc/langchaingo/llms"
	"github.com/tmc/langchaingo/llms/openai"

	"faregate/protect/breaker"
)

// Model status values, as GET /api/config reports them.
const (
	ModelOK          = "ok"
	ModelDegraded    = "degraded"
	ModelUnavailable = "unavailable"
)

// ErrModelUnavailable: no model can take the call (primary failing or its
// breaker open, and no fallback).
var ErrModelUnavailable = errors.New("agent: model unavailable")

// Model is one model source with the name recorded in the ledger.
type Model struct {
	llms.Model
	Name string
	// Offline marks the built-in deterministic demo planner.
	Offline bool
	// CallOptions are added to every call (e.g. the legacy max_tokens field).
	CallOptions []llms.CallOption
}

// OpenAIOptions configures an OpenAI-compatible model.
type OpenAIOptions struct {
	BaseURL, APIKey, Model string
	LegacyMaxTokens        bool
	HTTPClient             *http.Client
}

// NewOpenAI builds a model on any OpenAI-compatible server through
// langchaingo's openai provider.
func NewOpenAI(o OpenAIOptions) (Model, error) {
	token := o.APIKey
	if token == "" {
		// The provider refuses an empty token even for local servers that
		// need none; a placeholder is what they expect.
		token = "faregate-no-key"
	}
	name := o.Model
	if name == "" {
		name = "gpt-3.5-turbo" // the provider's own default, named so the ledger says so
	}
	// Every call streams; the shim keeps servers that answer in one piece usable.
	hc := &http.Client{}
	if o.HTTPClient != nil {
		*hc = *o.HTTPClient
	}
	base := hc.Transport
	if base == nil {
		base = http.DefaultTransport
	}
	hc.Transport = streamShim{next: base}
	opts := []openai.Option{openai.WithBaseURL(o.BaseURL), openai.WithToken(token), openai.WithModel(name), openai.WithHTTPClient(hc)}
	m, err := openai.New(opts...)
	if err != nil {
		return Model{}, fmt.Errorf("agent: openai model %s: %w", o.BaseURL, err)
	}
	mdl := Model{Model: m, Name: name}
	if o.LegacyMaxTokens {
		// Ollama's /v1 and older vLLM and llama.cpp read max_tokens, not
		// max_completion_tokens.
		mdl.CallOptions = append(mdl.CallOptions, openai.WithLegacyMaxTokensField())
	}
	return mdl, nil
}

// Models routes calls to the primary model through its circuit breaker,
// and to the fallback (when configured) while the breaker is open, when the
// primary fails, or for runs marked low-precision.
type Models struct {
	Primary  Model
	Fallback *Model
	// Breaker guards Primary; nil means no breaker (the offline model cannot
	// fail like a provider does).
	Breaker *breaker.Breaker
}

// Status is ok, degraded (the breaker is not closed and calls may go to the
// fallback) or unavailable (open with no fallback).
func (m *Models) Status() string {
	if m.Breaker == nil {
		return ModelOK
	}
	switch m.Breaker.State() {
	case breaker.Open:
		if m.Fallback != nil {
			return ModelDegraded
		}
		return ModelUnavailable
	case breaker.HalfOpen:
		if m.Fallback != nil {
			return ModelDegraded
		}
		return ModelOK
	}
	return ModelOK
}

// Offline reports whether runs are planned by the built-in demo planner.
func (m *Models) Offline() bool { return m.Primary.Offline }

// Do runs call on the model this call should use. It reports which model
// answered and whether that was the fallback. call's error decides the
// breaker's verdict; a cancelled caller is not the provider's fault (the
// breaker excludes context.Canceled).
func (m *Models) Do(ctx context.Context, lowPrecision bool, call func(ctx context.Context, mdl Model) error) (used Model, fellBack bool, err error) {
	if lowPrecision && m.Fallback != nil {
		return *m.Fallback, true, call(ctx, *m.Fallback)
	}
	if m.Breaker == nil {
		return m.Primary, false, call(ctx, m.Primary)
	}
	err = m.Breaker.Do(ctx, func(ctx context.Context) error { return call(ctx, m.Primary) })
	if err == nil {
		return m.Primary, false, nil
	}
	if ctx.Err() != nil {
		return m.Primary, false, err
	}
	if m.Fallback == nil {
		if errors.Is(err, breaker.ErrOpen) {
			return m.Primary, false, fmt.Errorf("%w: %v", ErrModelUnavailable, err)
		}
		return m.Primary, false, err
	}
	return *m.Fallback, true, call(ctx, *m.Fallback)
}
