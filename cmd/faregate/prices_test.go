package main

import (
	"testing"

	"faregate/protect/budget"
	"faregate/protect/policy"
	"faregate/protect/principal"
)

// TestMergedPricesKeepCache: the policy file's cache prices reach the
// budget's prices (a merge that kept only input and output would charge
// cache writes at their defaults instead of the operator's figures).
func TestMergedPricesKeepCache(t *testing.T) {
	p, err := policy.Parse([]byte("models:\n  claude-x: {input: 3, output: 15, cache_write: 4, cache_read: 0.5}\n"), "test.yaml", principal.Tier{})
	if err != nil {
		t.Fatal(err)
	}
	env := budget.Prices{"gpt-4o-mini": {InputMicroPerMTok: 150000, OutputMicroPerMTok: 600000}}
	got := mergedPrices(env, p)
	want := budget.Price{InputMicroPerMTok: 3_000_000, OutputMicroPerMTok: 15_000_000, CacheWriteMicroPerMTok: 4_000_000, CacheReadMicroPerMTok: 500_000}
	if got["claude-x"] != want || got["gpt-4o-mini"] != env["gpt-4o-mini"] {
		t.Fatalf("merged %+v", got)
	}
}
