package main

import (
	"fmt"
	"net"
	"net/url"
	"strings"
)

// Default FAREGATE_AGENT_CONCURRENCY: the built-in planner's slot runs the
// whole workflow in this process (model calls, tools, CPU for parsing),
// so a few per core; an external agent's slot only waits: one goroutine
// on the delivery's HTTP answer and one blocked read of the task's inbox
// (a connection of the queue pool), while the agent's model calls arrive
// as /v1 requests bounded by FAREGATE_AGENT_MAX_PARALLEL and the budgets.
// What a slot costs then is a Redis connection and a few KiB, so the
// default lets many tasks wait on agents at once.
const (
	defaultConcurrencyBuiltin  = 8
	defaultConcurrencyExternal = 64
)

// validateAgent checks the external agent's variables (FAREGATE_AGENT_URL
// and what goes with it) and fills in their derived defaults.
func (c *config) validateAgent(bad func(format string, a ...any)) {
	if c.AgentConcurrency == 0 {
		c.AgentConcurrency = defaultConcurrencyBuiltin
		if c.AgentURL != "" {
			c.AgentConcurrency = defaultConcurrencyExternal
		}
	}
	if c.AgentURL != "" {
		if u, err := url.Parse(c.AgentURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			bad("FAREGATE_AGENT_URL %q: want an http(s) URL", c.AgentURL)
		}
		if len(c.AgentSecret) < 16 {
			bad("FAREGATE_AGENT_SECRET is required with FAREGATE_AGENT_URL: at least 16 characters (32 random bytes recommended); it signs every delivery")
		}
	}
	if c.AgentCallbackURL != "" {
		c.AgentCallbackURL = strings.TrimRight(c.AgentCallbackURL, "/")
		if u, err := url.Parse(c.AgentCallbackURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
			bad("FAREGATE_AGENT_CALLBACK_URL %q: want an http(s) base URL (no query)", c.AgentCallbackURL)
		}
	}
	if c.V1MaxBody < 16384 || c.V1MaxBody > 64<<20 {
		bad("FAREGATE_V1_MAX_BODY: want 16384 to 67108864 bytes")
	}
	if c.AgentMaxCalls < 1 || c.AgentMaxCalls > 1000 {
		bad("FAREGATE_AGENT_MAX_CALLS: want 1 to 1000")
	}
	if c.AgentMaxParallel < 1 || c.AgentMaxParallel > 64 {
		bad("FAREGATE_AGENT_MAX_PARALLEL: want 1 to 64")
	}
}

// agentCallback is the base URL the agent reaches faregate at: the
// configured one, else http:// and the address faregate listens on (a
// wildcard host becomes 127.0.0.1, the agent being beside it).
func (c *config) agentCallback(listening net.Addr) string {
	if c.AgentCallbackURL != "" {
		return c.AgentCallbackURL
	}
	addr := c.Addr
	if listening != nil {
		addr = listening.String()
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "http://" + addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "127.0.0.1"
	}
	return fmt.Sprintf("http://%s", net.JoinHostPort(host, port))
}
