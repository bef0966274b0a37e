package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"

	"faregate/agent/chat"
	"faregate/agent/govern"
	"faregate/agent/task"
	"faregate/protect/budget"
	"faregate/protect/policy"
	"faregate/protect/principal"
)

// minRun is one minimal run: what a task must be able to reserve for its
// first model call (the largest valid request's prompt, estimated, plus
// FAREGATE_LLM_MAX_TOKENS), on the model a first call goes to. A budget,
// tier or bucket that cannot hold it would refuse every task with a
// message that is not true ("Today's model budget is used up" with nothing
// spent), so faregate refuses to start, or a reload is refused, instead.
type minRun struct {
	tokens    int64
	maxTokens int
	// model is the model a first call goes to; models are every model
	// a call may go to (the primary and the fallback).
	model  string
	models []string
	// external: the first call is an external agent's, its prompt the
	// visitor's (at its shortest); else the planner's largest request.
	external bool
}

func newMinRun(models *govern.Models, tokens int64, maxTokens int) minRun {
	m := minRun{tokens: tokens, maxTokens: maxTokens, model: models.Next(false).Name, models: []string{models.Primary.Name}}
	if models.Fallback != nil {
		m.models = append(m.models, models.Fallback.Name)
	}
	return m
}

// cost is the run's money at ps (0 for an unpriced model).
func (m minRun) cost(ps budget.Prices) int64 {
	p, ok := ps[m.model]
	if !ok {
		return 0
	}
	return p.Cost(m.tokens-int64(m.maxTokens), int64(m.maxTokens))
}

// costAt is the run's money at the prices b holds now (0 for an unpriced
// model: with a spend limit set, checkPolicy refused that policy).
func (m minRun) costAt(b *budget.Budget) int64 {
	c, err := b.Cost(m.model, m.tokens-int64(m.maxTokens), int64(m.maxTokens))
	if err != nil {
		return 0
	}
	return c
}

// what says what a minimal run is, for the messages.
func (m minRun) what() string {
	if m.external {
		return fmt.Sprintf("one minimal run reserves %d tokens (the shortest visitor prompt to an external agent, estimated, plus FAREGATE_LLM_MAX_TOKENS=%d)",
			m.tokens, m.maxTokens)
	}
	return fmt.Sprintf("one minimal run reserves %d tokens (its first call's prompt, estimated for the largest request, plus FAREGATE_LLM_MAX_TOKENS=%d)",
		m.tokens, m.maxTokens)
}

// checkEnv names every variable whose value can never hold one run. The
// policy's tiers (the public one included) are checkPolicy's.
func (m minRun) checkEnv(cfg *config) error {
	var errs []error
	if cfg.DailyTokenBudget < m.tokens {
		errs = append(errs, fmt.Errorf("FAREGATE_DAILY_TOKEN_BUDGET=%d can never hold one run: %s; want at least %d",
			cfg.DailyTokenBudget, m.what(), m.tokens))
	}
	if cfg.TaskTokenLimit < m.tokens {
		errs = append(errs, fmt.Errorf("FAREGATE_TASK_TOKEN_LIMIT=%d can never hold one run: %s; want at least %d",
			cfg.TaskTokenLimit, m.what(), m.tokens))
	}
	if r := cfg.SiteTokensPerMinute; r > 0 && !bucketHolds(r, m.tokens) {
		errs = append(errs, fmt.Errorf("FAREGATE_SITE_TOKENS_PER_MINUTE=%d can never hold one run (the site bucket holds twice its rate): %s; want at least %d",
			r, m.what(), minRate(m.tokens)))
	}
	return errors.Join(errs...)
}

// checkPolicy names every tier of p that can never hold one run, and,
// while a spend limit is set, every model without a price.
func (m minRun) checkPolicy(cfg *config, p *policy.Policy) error {
	var errs []error
	for _, t := range p.Tiers() {
		name := "tier " + t.Name
		if t.Name == principal.PublicTier {
			name = "tier public (FAREGATE_IP_DAILY_TOKENS, unless the policy file sets tiers.public)"
		}
		if t.TokensPerDay < m.tokens {
			errs = append(errs, fmt.Errorf("%s: tokens_per_day %d can never hold one run: %s; want at least %d",
				name, t.TokensPerDay, m.what(), m.tokens))
		}
		if t.TokensPerHour > 0 && t.TokensPerHour < m.tokens {
			hname := "tier " + t.Name
			if t.Name == principal.PublicTier {
				hname = "tier public (FAREGATE_IP_HOURLY_TOKENS, unless the policy file sets tiers.public)"
			}
			errs = append(errs, fmt.Errorf("%s: tokens_per_hour %d can never hold one run: %s; want at least %d",
				hname, t.TokensPerHour, m.what(), m.tokens))
		}
		if t.TokensPerMinute > 0 && !bucketHolds(t.TokensPerMinute, m.tokens) {
			errs = append(errs, fmt.Errorf("%s: tokens_per_minute %d can never hold one run (a bucket holds twice its rate): %s; want at least %d",
				name, t.TokensPerMinute, m.what(), minRate(m.tokens)))
		}
		if s := t.MaxSiteShare; s > 0 && s < 1 {
			// As the gate computes the tier's share (api tierTokens).
			if share := max(int64(math.Floor(s*float64(cfg.DailyTokenBudget))), 1); share < m.tokens {
				errs = append(errs, fmt.Errorf("%s: max_site_share %g of FAREGATE_DAILY_TOKEN_BUDGET=%d is %d tokens, which can never hold one run: %s",
					name, s, cfg.DailyTokenBudget, share, m.what()))
			}
		}
	}
	if cfg.spendMicro > 0 {
		prices := mergedPrices(cfg.prices, p)
		if err := prices.Check(m.models...); err != nil {
			errs = append(errs, fmt.Errorf("FAREGATE_DAILY_SPEND_LIMIT is set, so every model needs a price (FAREGATE_MODEL_PRICES or models: in the policy file): %w", err))
		} else if c := m.cost(prices); c > cfg.spendMicro {
			errs = append(errs, fmt.Errorf("FAREGATE_DAILY_SPEND_LIMIT=%s can never hold one run: %s, which costs %s at %s's price; want at least %s",
				cfg.DailySpendLimit, m.what(), budget.FormatMicro(c), m.model, budget.FormatMicro(c)))
		}
	}
	return errors.Join(errs...)
}

// bucketHolds reports whether a bucket of rate tokens a minute (capacity
// twice the rate) can ever hold amount.
func bucketHolds(rate, amount int64) bool { return rate >= minRate(amount) }

// minRate is the smallest rate whose bucket holds amount.
func minRate(amount int64) int64 { return (amount + 1) / 2 }

// mergedPrices is FAREGATE_MODEL_PRICES with the policy file's prices
// over it (the file wins), a new map.
func mergedPrices(env budget.Prices, p *policy.Policy) budget.Prices {
	out := budget.Prices{}
	for name, pr := range env {
		out[name] = pr
	}
	for name, pr := range p.Prices() {
		out[name] = budget.Price{InputMicroPerMTok: pr.InputMicroPerMTok, OutputMicroPerMTok: pr.OutputMicroPerMTok,
			CacheWriteMicroPerMTok: pr.CacheWriteMicroPerMTok, CacheReadMicroPerMTok: pr.CacheReadMicroPerMTok}
	}
	return out
}

// externalMinRun is one minimal run with an external agent (nil with the
// built-in planner, whose fixed first-call reservation stands): the
// estimated prompt of the visitor's request, as a user message on the
// primary model, plus FAREGATE_LLM_MAX_TOKENS, in tokens and in money.
func externalMinRun(cfg *config, b *budget.Budget, models *govern.Models) func(task.Request) (int64, int64) {
	if cfg.AgentURL == "" {
		return nil
	}
	estimate := estimator(models)
	model := models.Next(false).Name
	return func(r task.Request) (int64, int64) {
		text := r.Prompt
		if text == "" {
			// A trip delivered to the agent: its request as the agent reads it.
			raw, _ := json.Marshal(r)
			text = string(raw)
		}
		prompt := estimate(model, []chat.Message{chat.Text(chat.RoleUser, text)}, nil)
		tokens := prompt + int64(cfg.LLMMaxTokens)
		cost, err := b.Cost(model, prompt, int64(cfg.LLMMaxTokens))
		if err != nil {
			cost = 0
		}
		return tokens, cost
	}
}
