package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent"
	"faregate/agent/govern"
	"faregate/agent/outbound"
	"faregate/agent/remote"
	"faregate/agent/taskkey"
	"faregate/agent/tasklimits"
	"faregate/agent/taskstore"
	"faregate/agent/tools"
	"faregate/api"
)

// callbackURL is the base URL an external agent reaches faregate at: known
// once faregate listens, unless FAREGATE_AGENT_CALLBACK_URL names it.
type callbackURL struct{ v atomic.Pointer[string] }

func (c *callbackURL) get() string {
	if p := c.v.Load(); p != nil {
		return *p
	}
	return ""
}

func (c *callbackURL) set(s string) { c.v.Store(&s) }

// externalAgent is what FAREGATE_AGENT_URL adds: the executor that
// delivers tasks, and the /v1 surface the agent calls back, with the
// task's limits every replica shares.
type externalAgent struct {
	exec     *remote.Executor
	keys     *taskkey.Keys
	limits   *tasklimits.Store
	v1       *api.V1
	callback *callbackURL
}

// maxEvents is how many progress events one task may post.
const maxEvents = 200

// taskLimits are an external task's limits, one table for all of them
// (the manual's "Per-task limits").
func taskLimits(cfg *config) tasklimits.Limits {
	return tasklimits.Limits{
		Calls: int64(cfg.AgentMaxCalls), Embeddings: int64(cfg.AgentMaxEmbeddingCalls),
		Parallel: int64(cfg.AgentMaxParallel), Tools: int64(cfg.AgentMaxToolCalls), Events: maxEvents,
	}
}

// buildExternalAgent wires FAREGATE_AGENT_URL, or returns nil with the
// built-in planner (the plan cache is off with it: configRules).
func buildExternalAgent(cfg *config, rdb, queue redis.UniversalClient, models *govern.Models, lg *slog.Logger) *externalAgent {
	if cfg.AgentURL == "" {
		return nil
	}
	keys := taskkey.New(rdb, taskkey.Options{CheckTimeout: cfg.RedisTimeout})
	limits := tasklimits.New(rdb, tasklimits.Options{Limits: taskLimits(cfg), Logger: lg})
	cb := &callbackURL{}
	if cfg.AgentCallbackURL != "" {
		cb.set(cfg.AgentCallbackURL)
	}
	exec := remote.New(remote.Options{
		URL: cfg.AgentURL, Secret: cfg.AgentSecret, Callback: cb.get,
		Model: models.Primary.Name, EmbeddingModel: cfg.EmbeddingModel,
		Keys: keys, Inbox: taskstore.New(rdb).WithWaits(queue), UserAgent: "faregate/" + versionString(), Logger: lg,
	})
	// The same construction as fetch_page's: an outbound transport on
	// SafeTransport (public addresses only, honest identity, capped
	// retries), with a session per task for its once-per-task answers.
	pages := outbound.New(outbound.Options{Version: versionString(), PublicURL: cfg.PublicURL, Logger: lg,
		Base: tools.SafeTransport(tools.Policy{})})
	return &externalAgent{exec: exec, keys: keys, limits: limits, callback: cb, v1: &api.V1{
		Keys: keys, Limits: limits, Fetch: &v1Fetcher{pages: pages, sessions: map[string]*fetchSession{}, now: time.Now},
		MaxBody: cfg.V1MaxBody, MaxFetchBytes: tools.MaxPageBytes,
		// A dead holder's task ends worker_lost within 4/3 of the lease.
		ResultWait: 2*cfg.TaskLease + 5*time.Second,
	}}
}

// executor is what runs tasks: the external agent's, else builtin.
func (x *externalAgent) executor(builtin agent.Executor) agent.Executor {
	if x == nil {
		return builtin
	}
	return x.exec
}

// surface is the /v1 surface (nil with the built-in planner).
func (x *externalAgent) surface() *api.V1 {
	if x == nil {
		return nil
	}
	return x.v1
}

// callbackURL is the deliveries' base URL (nil with the built-in planner).
func (x *externalAgent) callbackURL() *callbackURL {
	if x == nil {
		return nil
	}
	return x.callback
}

// v1Fetcher serves /v1/tools/fetch: one outbound session per task on this
// replica, dropped after the task's deadline.
type v1Fetcher struct {
	pages *outbound.Transport
	now   func() time.Time

	mu       sync.Mutex
	sessions map[string]*fetchSession
}

type fetchSession struct {
	c     *http.Client
	until time.Time
}

// Fetch implements api.Fetcher.
func (f *v1Fetcher) Fetch(ctx context.Context, g taskkey.Grant, url string, maxBytes int64) (api.Fetched, error) {
	page, err := tools.Fetch(ctx, f.session(g), url, maxBytes)
	if err != nil {
		if errors.Is(err, tools.ErrFetchRefused) {
			return api.Fetched{}, fmt.Errorf("%w: %v", api.ErrFetchRefused, err)
		}
		return api.Fetched{}, err
	}
	return api.Fetched(page), nil
}

// Check implements api.Fetcher.
func (f *v1Fetcher) Check(url string) error {
	if err := tools.CheckFetchURL(url); err != nil {
		return fmt.Errorf("%w: %v", api.ErrFetchRefused, err)
	}
	return nil
}

// session is g's task's client, new for its first fetch here.
func (f *v1Fetcher) session(g taskkey.Grant) *http.Client {
	now := f.now()
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, s := range f.sessions {
		if now.After(s.until) {
			delete(f.sessions, id)
		}
	}
	s := f.sessions[g.Task]
	if s == nil {
		s = &fetchSession{c: f.pages.Session(outbound.SessionOptions{}).Client(), until: g.Deadline}
		f.sessions[g.Task] = s
	}
	return s.c
}
