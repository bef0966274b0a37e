package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/redisbatch"
	"faregate/protect/quota"
)

// redisClients are the connection pools to the one Redis (or cluster).
// They share nothing, so one kind of traffic can never make another wait
// for a connection:
//   - main: the gate's checks, budget scripts and task writes;
//   - streams: the blocking XREAD of event-stream readers (one per followed
//     task), a bounded pool of its own;
//   - queue: the workers' blocking XREADGROUP, one connection per worker.
//
// Every counting script is idempotent (it carries an attempt id), so the
// clients may retry freely: a re-sent script is applied once.
type redisClients struct {
	main, streams, queue redis.UniversalClient
	// admissions carries the quota's counting scripts of concurrent
	// admissions in shared pipelines on main's connections (quota.Pipelined).
	admissions *redis.AutoPipeliner
	// embedded is set when the in-process miniredis serves.
	embedded bool
	url      string
	cluster  bool
}

func (c *redisClients) close() {
	if c.admissions != nil {
		_ = c.admissions.Close()
	}
	for _, rc := range []redis.UniversalClient{c.main, c.streams, c.queue} {
		if rc != nil {
			_ = rc.Close()
		}
	}
}

// streamPool bounds the connections the event-stream readers may hold:
// each followed task holds one while it blocks in XREAD.
const streamPool = 256

// openRedis connects to FAREGATE_REDIS_URL, or starts the embedded miniredis.
func openRedis(ctx context.Context, cfg *config, stdout io.Writer) (*redisClients, func(), error) {
	url := cfg.RedisURL
	cluster := cfg.RedisCluster
	var stopMini func()
	if url == "" {
		m := miniredis.NewMiniRedis()
		if err := m.Start(); err != nil {
			return nil, nil, fmt.Errorf("embedded redis: %w", err)
		}
		url, cluster, stopMini = "redis://"+m.Addr(), false, m.Close
	}
	c := &redisClients{embedded: stopMini != nil, url: url, cluster: cluster}
	var err error
	timeout := cfg.RedisTimeout
	if c.main, err = newRedis(url, cluster, redisOptions{timeout: timeout}); err != nil {
		return nil, nil, err
	}
	if c.admissions, err = c.main.AsyncAutoPipeline(); err != nil {
		c.close()
		return nil, nil, fmt.Errorf("redis pipeline: %w", err)
	}
	if c.streams, err = newRedis(url, cluster, redisOptions{timeout: timeout, pool: streamPool}); err != nil {
		c.close()
		return nil, nil, err
	}
	if c.queue, err = newRedis(url, cluster, redisOptions{timeout: timeout, pool: cfg.AgentConcurrency + 2}); err != nil {
		c.close()
		return nil, nil, err
	}
	closeAll := func() {
		c.close()
		if stopMini != nil {
			stopMini()
		}
	}
	if c.embedded {
		return c, closeAll, nil
	}
	// Not fatal: faregate starts and fails closed (503) until Redis answers,
	// and /readyz says so.
	pctx, cancel := context.WithTimeout(ctx, 2*timeout)
	defer cancel()
	if err := c.main.Ping(pctx).Err(); err != nil {
		fmt.Fprintf(stdout, "faregate: redis not answering yet (%v); refusing tasks with 503 until it does\n", redactURLError(err))
	} else {
		checkDurability(pctx, c.main, stdout)
	}
	return c, closeAll, nil
}

// redisOptions tune one pool.
type redisOptions struct {
	timeout time.Duration
	pool    int // 0: go-redis's default (10 per CPU)
	retries int // 0: go-redis's default (3); -1: none
}

// newRedis builds a client for a redis:// or rediss:// URL (a Cluster
// with cluster set; further nodes as ?addr=host:port). Short timeouts make a
// hung Redis a quick 503 rather than a hung request.
func newRedis(url string, cluster bool, o redisOptions) (redis.UniversalClient, error) {
	if o.timeout <= 0 {
		o.timeout = 2 * time.Second
	}
	opt, err := urlOptions(url, cluster)
	if err != nil {
		return nil, fmt.Errorf("FAREGATE_REDIS_URL: %w", err)
	}
	opt.DialTimeout, opt.ReadTimeout, opt.WriteTimeout, opt.PoolTimeout = o.timeout, o.timeout, o.timeout, o.timeout+time.Second
	if o.pool > 0 {
		opt.PoolSize = o.pool
	}
	if o.retries != 0 {
		opt.MaxRetries = o.retries
	}
	rc := redis.NewUniversalClient(opt)
	// First: a governed call's round trips go as one write (one pipeline
	// per node on a cluster: protect/kit/redisbatch).
	rc.AddHook(redisbatch.New(rc))
	if cc, ok := rc.(*redis.ClusterClient); ok {
		cc.AddHook(newReloadHook(cc))
	}
	return rc, nil
}

// urlOptions reads url with go-redis's parser for the mode (a cluster's
// takes further nodes as ?addr=) into the one options value both modes are
// built from: what a URL can say (nodes, credentials, database, TLS and
// go-redis's query parameters). IsClusterMode makes NewUniversalClient
// build a cluster client even from a single seed node.
func urlOptions(url string, cluster bool) (*redis.UniversalOptions, error) {
	if cluster {
		c, err := redis.ParseClusterURL(url)
		if err != nil {
			return nil, err
		}
		return &redis.UniversalOptions{IsClusterMode: true, Addrs: c.Addrs,
			ClientName: c.ClientName, Protocol: c.Protocol, Username: c.Username, Password: c.Password, TLSConfig: c.TLSConfig,
			MaxRetries: c.MaxRetries, MinRetryBackoff: c.MinRetryBackoff, MaxRetryBackoff: c.MaxRetryBackoff,
			DialTimeout: c.DialTimeout, DialerRetries: c.DialerRetries, DialerRetryTimeout: c.DialerRetryTimeout,
			ReadTimeout: c.ReadTimeout, WriteTimeout: c.WriteTimeout,
			PoolFIFO: c.PoolFIFO, PoolSize: c.PoolSize, MaxConcurrentDials: c.MaxConcurrentDials, PoolTimeout: c.PoolTimeout,
			MinIdleConns: c.MinIdleConns, MaxIdleConns: c.MaxIdleConns, MaxActiveConns: c.MaxActiveConns,
			PipelinePoolSize: c.PipelinePoolSize, PipelineReadBufferSize: c.PipelineReadBufferSize, PipelineWriteBufferSize: c.PipelineWriteBufferSize,
			ConnMaxIdleTime: c.ConnMaxIdleTime, ConnMaxLifetime: c.ConnMaxLifetime, ConnMaxLifetimeJitter: c.ConnMaxLifetimeJitter,
			MaxRedirects: c.MaxRedirects, ReadOnly: c.ReadOnly, RouteByLatency: c.RouteByLatency,
			RouteByLatencyTolerance: c.RouteByLatencyTolerance, RouteRandomly: c.RouteRandomly,
			FailingTimeoutSeconds: c.FailingTimeoutSeconds,
		}, nil
	}
	c, err := redis.ParseURL(url)
	if err != nil {
		return nil, err
	}
	return &redis.UniversalOptions{Addrs: []string{c.Addr}, DB: c.DB,
		ClientName: c.ClientName, Protocol: c.Protocol, Username: c.Username, Password: c.Password, TLSConfig: c.TLSConfig,
		MaxRetries: c.MaxRetries, MinRetryBackoff: c.MinRetryBackoff, MaxRetryBackoff: c.MaxRetryBackoff,
		DialTimeout: c.DialTimeout, DialerRetries: c.DialerRetries, DialerRetryTimeout: c.DialerRetryTimeout,
		ReadTimeout: c.ReadTimeout, WriteTimeout: c.WriteTimeout,
		PoolFIFO: c.PoolFIFO, PoolSize: c.PoolSize, MaxConcurrentDials: c.MaxConcurrentDials, PoolTimeout: c.PoolTimeout,
		MinIdleConns: c.MinIdleConns, MaxIdleConns: c.MaxIdleConns, MaxActiveConns: c.MaxActiveConns,
		PipelinePoolSize: c.PipelinePoolSize, PipelineReadBufferSize: c.PipelineReadBufferSize, PipelineWriteBufferSize: c.PipelineWriteBufferSize,
		ConnMaxIdleTime: c.ConnMaxIdleTime, ConnMaxLifetime: c.ConnMaxLifetime, ConnMaxLifetimeJitter: c.ConnMaxLifetimeJitter,
	}, nil
}

// reloadHook makes a cluster client notice a failover in seconds. go-redis
// refreshes its slot map on MOVED/ASK replies or every 60 s, and a dead
// master answers neither: it refuses connections or times out. On such a
// connection error the hook asks for a reload (go-redis's own ReloadState,
// which coalesces concurrent requests), at most once per reloadEvery, so
// the first command after the replica's promotion already goes to it.
type reloadHook struct {
	cc   *redis.ClusterClient
	last atomic.Int64 // unix nanos of the last reload asked for
}

const reloadEvery = 250 * time.Millisecond

func newReloadHook(cc *redis.ClusterClient) *reloadHook { return &reloadHook{cc: cc} }

func (h *reloadHook) maybeReload(err error) {
	if err == nil || !connectionError(err) {
		return
	}
	now := time.Now().UnixNano()
	last := h.last.Load()
	if now-last < int64(reloadEvery) || !h.last.CompareAndSwap(last, now) {
		return
	}
	h.cc.ReloadState(context.Background())
}

// connectionError reports errors that say a node is unreachable, not that a
// command was wrong.
func connectionError(err error) bool {
	if errors.Is(err, redis.Nil) || errors.Is(err, context.Canceled) {
		return false
	}
	var ne net.Error
	if errors.As(err, &ne) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, redis.ErrClosed) {
		return true
	}
	s := err.Error()
	return strings.Contains(s, "connection refused") || strings.Contains(s, "CLUSTERDOWN") ||
		strings.Contains(s, "connection reset") || strings.Contains(s, "i/o timeout") || strings.Contains(s, "broken pipe")
}

// DialHook implements redis.Hook.
func (h *reloadHook) DialHook(next redis.DialHook) redis.DialHook {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := next(ctx, network, addr)
		h.maybeReload(err)
		return c, err
	}
}

// ProcessHook implements redis.Hook.
func (h *reloadHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		h.maybeReload(err)
		return err
	}
}

// ProcessPipelineHook implements redis.Hook.
func (h *reloadHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		err := next(ctx, cmds)
		h.maybeReload(err)
		return err
	}
}

// checkDurability reads Redis's persistence and eviction settings and says
// loudly when quotas would not survive a restart or could be evicted, or
// that it could not tell (managed Redis and ACLs may refuse CONFIG).
func checkDurability(ctx context.Context, rdb redis.UniversalClient, stdout io.Writer) {
	var mu sync.Mutex
	var lines []string
	say := func(format string, a ...any) {
		mu.Lock()
		lines = append(lines, fmt.Sprintf(format, a...))
		mu.Unlock()
	}
	check := func(ctx context.Context, c *redis.Client) error {
		addr := c.Options().Addr
		vals := map[string]string{}
		for _, p := range []string{"appendonly", "save", "maxmemory-policy"} {
			m, err := c.ConfigGet(ctx, p).Result()
			if err != nil {
				say("faregate: WARNING: could not read Redis %s at %s (%v): make sure it persists (appendonly yes) and never evicts (maxmemory-policy noeviction)", p, addr, shortErr(err))
				return nil
			}
			vals[p] = m[p]
		}
		if vals["appendonly"] != "yes" && strings.TrimSpace(vals["save"]) == "" {
			say("faregate: WARNING: Redis at %s has no persistence (appendonly no, save \"\"): a restart erases every quota, budget and task; set appendonly yes", addr)
		}
		if pol := vals["maxmemory-policy"]; pol != "noeviction" {
			say("faregate: WARNING: Redis at %s has maxmemory-policy %s: quota counters could be evicted under memory pressure; set noeviction", addr, pol)
		}
		return nil
	}
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		_ = c.ForEachMaster(ctx, check)
	case *redis.Client:
		_ = check(ctx, c)
	}
	for _, l := range lines {
		fmt.Fprintln(stdout, l)
	}
}

func shortErr(err error) string {
	s := redactURLError(err)
	if len(s) > 120 {
		s = s[:120] + "…"
	}
	return s
}

// redactURLError keeps credentials that a URL error might quote out of logs.
func redactURLError(err error) string {
	s := err.Error()
	if i := strings.Index(s, "@"); i >= 0 {
		if j := strings.LastIndex(s[:i], "//"); j >= 0 {
			s = s[:j+2] + "***" + s[i:]
		}
	}
	return s
}

// prober is the readiness probe: a key-bound read of today's protection
// keys, so on a cluster it reaches the master that serves their slot (a bare
// PING would answer from any node). It also notices a Redis that lost its
// data while faregate ran: a marker written into the same slot disappears.
type prober struct {
	rdb    redis.UniversalClient
	now    func() time.Time
	warn   func(msg string)
	marked sync.Map // day → true once the marker was seen or set
}

func markerKey(day string) string { return "faregate:quota:{" + day + "}:alive" }

func (p *prober) probe(ctx context.Context) error {
	day := quota.Day(p.now())
	vals, err := p.rdb.MGet(ctx, quota.GlobalKey(day), markerKey(day)).Result()
	if err != nil {
		return fmt.Errorf("%w: readiness: %v", quota.ErrUnavailable, err)
	}
	if len(vals) == 2 && vals[1] == nil {
		if _, seen := p.marked.Load(day); seen {
			p.warn("faregate: WARNING: Redis lost its data while faregate ran (a restart without persistence?): today's quota and budget counters started again from zero")
		}
		if err := p.rdb.Set(ctx, markerKey(day), "1", quota.KeyTTL).Err(); err != nil {
			return fmt.Errorf("%w: readiness: %v", quota.ErrUnavailable, err)
		}
	}
	p.marked.Store(day, true)
	return nil
}
