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

// agentConcurrency fills in FAREGATE_AGENT_CONCURRENCY's automatic
// default (0) for the agent in use.
func agentConcurrency(c *config) string {
	switch {
	case c.AgentConcurrency < 0:
		return "want 0 (automatic) or more"
	case c.AgentConcurrency == 0 && c.AgentURL != "":
		c.AgentConcurrency = defaultConcurrencyExternal
	case c.AgentConcurrency == 0:
		c.AgentConcurrency = defaultConcurrencyBuiltin
	}
	return ""
}

// agentCallbackURL checks FAREGATE_AGENT_CALLBACK_URL: an http(s) base
// URL (a path prefix is kept, a trailing slash dropped).
func agentCallbackURL(c *config) string {
	if c.AgentCallbackURL == "" {
		return ""
	}
	c.AgentCallbackURL = strings.TrimRight(c.AgentCallbackURL, "/")
	if u, err := url.Parse(c.AgentCallbackURL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Sprintf("%q: want an http(s) base URL (no query)", c.AgentCallbackURL)
	}
	return ""
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
