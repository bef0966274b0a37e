package main

import (
	"net"
	"strings"
	"testing"
)

// TestAgentConfig: the external agent's variables, their defaults and
// their errors (each named).
func TestAgentConfig(t *testing.T) {
	c, err := loadConfig(envOf(nil))
	if err != nil {
		t.Fatal(err)
	}
	if c.AgentURL != "" || c.AgentConcurrency != defaultConcurrencyBuiltin || c.V1MaxBody != 2097152 ||
		c.AgentMaxCalls != 40 || c.AgentMaxParallel != 4 || c.AgentMaxEmbeddingCalls != 200 || c.EmbeddingModel != "" {
		t.Fatalf("defaults: %+v", c)
	}
	ext := map[string]string{"FAREGATE_AGENT_URL": "https://agent.example/run", "FAREGATE_AGENT_SECRET": "0123456789abcdef"}
	c, err = loadConfig(envOf(ext))
	if err != nil {
		t.Fatal(err)
	}
	if c.AgentConcurrency != defaultConcurrencyExternal {
		t.Fatalf("concurrency with an external agent %d, want %d", c.AgentConcurrency, defaultConcurrencyExternal)
	}
	ext["FAREGATE_AGENT_CONCURRENCY"] = "3"
	if c, _ = loadConfig(envOf(ext)); c.AgentConcurrency != 3 {
		t.Fatalf("explicit concurrency %d, want 3", c.AgentConcurrency)
	}
	for _, tc := range []struct {
		env  map[string]string
		want string
	}{
		{map[string]string{"FAREGATE_AGENT_URL": "ftp://x", "FAREGATE_AGENT_SECRET": "0123456789abcdef"}, "FAREGATE_AGENT_URL"},
		{map[string]string{"FAREGATE_AGENT_URL": "http://x"}, "FAREGATE_AGENT_SECRET"},
		{map[string]string{"FAREGATE_AGENT_URL": "http://x", "FAREGATE_AGENT_SECRET": "short"}, "FAREGATE_AGENT_SECRET"},
		{map[string]string{"FAREGATE_AGENT_CALLBACK_URL": "faregate:8080"}, "FAREGATE_AGENT_CALLBACK_URL"},
		{map[string]string{"FAREGATE_V1_MAX_BODY": "100"}, "FAREGATE_V1_MAX_BODY"},
		{map[string]string{"FAREGATE_AGENT_MAX_CALLS": "0"}, "FAREGATE_AGENT_MAX_CALLS"},
		{map[string]string{"FAREGATE_AGENT_MAX_PARALLEL": "65"}, "FAREGATE_AGENT_MAX_PARALLEL"},
		{map[string]string{"FAREGATE_AGENT_MAX_EMBEDDING_CALLS": "0"}, "FAREGATE_AGENT_MAX_EMBEDDING_CALLS"},
		{map[string]string{"FAREGATE_AGENT_CONCURRENCY": "-1"}, "FAREGATE_AGENT_CONCURRENCY"},
	} {
		if _, err := loadConfig(envOf(tc.env)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want an error naming %s", tc.env, err, tc.want)
		}
	}
}

// TestAgentCallback: the delivery's base URL: the configured one, else
// the listening address, a wildcard host as 127.0.0.1.
func TestAgentCallback(t *testing.T) {
	for _, tc := range []struct{ addr, listening, callback, want string }{
		{"127.0.0.1:0", "127.0.0.1:41234", "", "http://127.0.0.1:41234"},
		{"0.0.0.0:8080", "0.0.0.0:8080", "", "http://127.0.0.1:8080"},
		{"[::]:8080", "[::]:8080", "", "http://127.0.0.1:8080"},
		{":8080", "", "", "http://127.0.0.1:8080"},
		{"0.0.0.0:8080", "0.0.0.0:8080", "https://faregate.internal/base", "https://faregate.internal/base"},
	} {
		c := &config{Addr: tc.addr, AgentCallbackURL: tc.callback}
		var ln net.Addr
		if tc.listening != "" {
			ln, _ = net.ResolveTCPAddr("tcp", tc.listening)
		}
		if got := c.agentCallback(ln); got != tc.want {
			t.Errorf("%+v: %s, want %s", tc, got, tc.want)
		}
	}
}
