// Package taskkey mints and checks task keys: the bearer credential an
// external agent gets with its delivery. A key is valid for its own task's
// /v1 paths, only while that task runs: it is stored in Redis only as its
// SHA-256, beside the run's lease owner and epoch and the task's deadline,
// and every check compares those with the task's lease hash in the same
// script. So a key stops working on every replica the moment its task
// ends (the key is marked ended), its deadline passes, or its replica
// loses the lease (the reaper bumps the epoch when it fails the task
// worker_lost), with nothing to broadcast.
//
// An ended task's key is kept (its hash, marked ended) for a day after
// the end, so that its agent is told ErrFinished (409 task_finished: your
// task is over) rather than ErrInvalid (401: this is no key), which only
// an unknown or forged key gets.
//
// # Keys
//
// A key names its task ("fgt_" + the task id's 32 hex digits + "_" + 130
// random bits), so its record lives in the task's hash slot with the lease
// and the inbox, and one script checks and writes them atomically, also on
// Redis Cluster:
//
//	faregate:task:{<id>}:key    {sha, owner, epoch, deadline, principal, tier, result, ended}
//	faregate:task:{<id>}:inbox  what the agent posted for the lease holder (events, steps, the result)
//
// What a key may do how often (its events, its fetches, its model calls)
// is counted by agent/tasklimits, not here.
package taskkey

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/agent/taskstore"
)

// Prefix starts every task key, so a leaked one is easy to recognise.
const Prefix = "fgt_"

// Inbox entry types.
const (
	TypeEvent  = "event"  // an agent's progress event (counted)
	TypeStep   = "step"   // a step of faregate's own on the agent's behalf (a model call)
	TypeResult = "result" // the agent's posted result or error
)

var (
	// ErrInvalid: no such key, forged, or of another task: 401.
	ErrInvalid = errors.New("taskkey: invalid task key")
	// ErrFinished: the key's task has ended (its result posted, the run
	// over, its deadline passed, its lease lost), on any replica within a
	// second of the end and for a day after it: 409 task_finished.
	ErrFinished = errors.New("taskkey: task finished")
	// ErrUnavailable: Redis failed; the caller fails closed.
	ErrUnavailable = errors.New("taskkey: unavailable")
)

// Grant is what a valid key allows: its task, whom it counts against, and
// the run (lease owner and epoch) it belongs to, until Deadline.
type Grant struct {
	Task      string
	Principal string
	Tier      string
	Owner     string
	Epoch     int64
	Deadline  time.Time
	sha       string
}

// Options configure Keys.
type Options struct {
	// CacheFor is how long this replica may answer a key's check from
	// memory (default 250 ms, at most 500 ms: a key must stop working on
	// every replica within 1 s of its task's end). Writes never use it.
	CacheFor time.Duration
	// WatchEvery is how often open requests' keys are checked again, to
	// cut them when the task ends (default 250 ms, at most 500 ms).
	WatchEvery time.Duration
	// CheckTimeout is how long one round of those checks may wait for
	// Redis (default 2 s; the binary passes FAREGATE_REDIS_TIMEOUT). A
	// slow answer is not a failure: on a saturated machine a round can
	// take longer than WatchEvery, and cutting every open request then
	// (as a fixed 2 × WatchEvery once did, under -race beside a busy
	// loop) fails legitimate streams while Redis is still answering.
	// Open requests fail closed (ErrUnavailable) when a round errs or
	// times out and the key has not been confirmed for a second.
	CheckTimeout time.Duration
	Now          func() time.Time
}

// Keys mints and checks task keys. It is safe for concurrent use.
type Keys struct {
	rdb redis.UniversalClient
	o   Options

	mu      sync.Mutex
	cache   map[string]cached // by sha
	watched map[string]*watch // by task id
	looping bool
}

type cached struct {
	g     Grant
	until time.Time
}

// watch is one task's open requests on this replica.
type watch struct {
	sha     string
	cancels map[int]context.CancelCauseFunc // a request's context, ended with why
	next    int
	okAt    time.Time // last time the key was seen valid
}

// maxCache bounds the cache; past it checks simply ask Redis.
const maxCache = 10000

// New returns Keys on rdb.
func New(rdb redis.UniversalClient, o Options) *Keys {
	if o.CacheFor <= 0 {
		o.CacheFor = 250 * time.Millisecond
	}
	o.CacheFor = min(o.CacheFor, 500*time.Millisecond)
	if o.WatchEvery <= 0 {
		o.WatchEvery = 250 * time.Millisecond
	}
	o.WatchEvery = min(o.WatchEvery, 500*time.Millisecond)
	if o.CheckTimeout <= 0 {
		o.CheckTimeout = 2 * time.Second
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Keys{rdb: rdb, o: o, cache: map[string]cached{}, watched: map[string]*watch{}}
}

func keyKey(id string) string   { return "faregate:task:{" + id + "}:key" }
func inboxKey(id string) string { return "faregate:task:{" + id + "}:inbox" }

// inboxMaxLen caps a task's inbox: 200 events, a step per model call, one
// result (agent/tasklimits bounds the events and calls far below it).
const inboxMaxLen = 2000

// inboxTTL keeps an inbox a little past any run.
const inboxTTL = 24 * time.Hour

// endedTTL is how long an ended task's key is kept, to be answered
// ErrFinished rather than ErrInvalid: an agent still calling a day after
// its task ended is told what is wrong.
const endedTTL = 24 * time.Hour

func sum(key string) string {
	s := sha256.Sum256([]byte(key))
	return hex.EncodeToString(s[:])
}

// TaskOf returns the task id a well-formed key names.
func TaskOf(key string) (string, bool) {
	rest, ok := strings.CutPrefix(key, Prefix)
	if !ok || len(rest) < 33 || rest[32] != '_' || len(rest) > 33+64 {
		return "", false
	}
	id := "t_" + rest[:32]
	if !task.ValidID(id) {
		return "", false
	}
	for _, c := range rest[33:] {
		if !(c >= 'A' && c <= 'Z' || c >= '2' && c <= '7') {
			return "", false
		}
	}
	return id, len(rest[33:]) >= 26
}

// mintScript stores a new key for the run that holds the lease, replacing
// any earlier key and inbox of the task. KEYS key, lease, inbox. ARGV sha,
// owner, epoch, deadline ms, principal, tier, expire-at ms.
var mintScript = redis.NewScript(`
local l = redis.call('HMGET', KEYS[2], 'owner', 'epoch')
if l[1] ~= ARGV[2] or l[2] ~= ARGV[3] then return 0 end
redis.call('DEL', KEYS[1], KEYS[3])
redis.call('HSET', KEYS[1], 'sha', ARGV[1], 'owner', ARGV[2], 'epoch', ARGV[3], 'deadline', ARGV[4], 'principal', ARGV[5], 'tier', ARGV[6])
redis.call('PEXPIREAT', KEYS[1], ARGV[7])
return 1
`)

// Mint makes the key of rec's run under lease l, valid until deadline.
// It fails with taskstore.ErrLeaseLost when the lease is no longer l's.
func (k *Keys) Mint(ctx context.Context, l taskstore.Lease, rec task.Record, deadline time.Time) (string, error) {
	key := Prefix + strings.TrimPrefix(rec.ID, "t_") + "_" + rand.Text()
	n, err := mintScript.Run(ctx, k.rdb, []string{keyKey(rec.ID), taskstore.LeaseKey(rec.ID), inboxKey(rec.ID)},
		sum(key), l.Owner, strconv.FormatInt(l.Epoch, 10), deadline.UnixMilli(), rec.Principal, rec.Tier,
		deadline.Add(endedTTL).UnixMilli()).Int()
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if n == 0 {
		return "", taskstore.ErrLeaseLost
	}
	return key, nil
}

// Revoke ends task id's key: from now on every replica answers it
// ErrFinished (this one at once, the others at their next check).
func (k *Keys) Revoke(ctx context.Context, id string) error {
	k.mu.Lock()
	for s, c := range k.cache {
		if c.g.Task == id {
			delete(k.cache, s)
		}
	}
	w := k.watched[id]
	delete(k.watched, id)
	k.mu.Unlock()
	if w != nil {
		for _, c := range w.cancels {
			c(ErrFinished)
		}
	}
	if err := endScript.Run(ctx, k.rdb, []string{keyKey(id)}, endedTTL.Milliseconds()).Err(); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	return nil
}

// endScript marks a task's key ended and keeps it endedTTL from now. KEYS
// key; ARGV ttl ms. A key already gone stays gone.
var endScript = redis.NewScript(`
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'ended', '1')
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
`)

// useScript checks a key against its record and the task's lease, and
// with it applies one op: "auth" (nothing more), "event" and "step"
// (append to the inbox), "result" (append, once).
// KEYS key, lease, inbox. ARGV sha, now ms, op, data, maxlen, ttl.
// Returns {0} invalid (no such key, or another), {3} the task has ended
// (marked ended, its lease no longer the run's, past its deadline, or, for
// a result, one already posted), or {1, owner, epoch, deadline, principal,
// tier}.
var useScript = redis.NewScript(`
local g = redis.call('HMGET', KEYS[1], 'sha', 'owner', 'epoch', 'deadline', 'principal', 'tier', 'result', 'ended')
if not g[1] or g[1] ~= ARGV[1] then return {0} end
if g[8] then return {3} end
local l = redis.call('HMGET', KEYS[2], 'owner', 'epoch')
if l[1] ~= g[2] or l[2] ~= g[3] then return {3} end
if tonumber(ARGV[2]) >= tonumber(g[4]) then return {3} end
local op = ARGV[3]
if op == 'result' then
  if g[7] then return {3} end
  redis.call('HSET', KEYS[1], 'result', '1')
end
if op == 'event' or op == 'step' or op == 'result' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[5], '*', 'type', op, 'data', ARGV[4])
  redis.call('EXPIRE', KEYS[3], ARGV[6])
end
return {1, g[2], g[3], g[4], g[5], g[6]}
`)

// use runs useScript for key (by its task and sha) with op.
func (k *Keys) use(ctx context.Context, id, sha, op string, data []byte) (Grant, error) {
	res, err := useScript.Run(ctx, k.rdb, []string{keyKey(id), taskstore.LeaseKey(id), inboxKey(id)},
		sha, k.o.Now().UnixMilli(), op, data, inboxMaxLen, int64(inboxTTL/time.Second)).Slice()
	if err != nil {
		return Grant{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	code, _ := res[0].(int64)
	switch code {
	case 1:
		if len(res) != 6 {
			return Grant{}, ErrInvalid
		}
		str := func(v any) string { s, _ := v.(string); return s }
		epoch, _ := strconv.ParseInt(str(res[2]), 10, 64)
		ms, _ := strconv.ParseInt(str(res[3]), 10, 64)
		return Grant{Task: id, Owner: str(res[1]), Epoch: epoch, Deadline: time.UnixMilli(ms),
			Principal: str(res[4]), Tier: str(res[5]), sha: sha}, nil
	case 3:
		return Grant{}, ErrFinished
	}
	return Grant{}, ErrInvalid
}

// Authenticate checks a bearer key and returns its grant. An unknown or
// forged key is ErrInvalid (the answer says nothing about why); the key
// of a task that has ended is ErrFinished.
func (k *Keys) Authenticate(ctx context.Context, bearer string) (Grant, error) {
	id, ok := TaskOf(bearer)
	if !ok {
		return Grant{}, ErrInvalid
	}
	sha := sum(bearer)
	now := k.o.Now()
	k.mu.Lock()
	c, hit := k.cache[sha]
	k.mu.Unlock()
	if hit && now.Before(c.until) && now.Before(c.g.Deadline) {
		return c.g, nil
	}
	g, err := k.use(ctx, id, sha, "auth", nil)
	if err != nil {
		return Grant{}, err
	}
	k.mu.Lock()
	if len(k.cache) >= maxCache {
		for s, c := range k.cache {
			if !now.Before(c.until) {
				delete(k.cache, s)
			}
		}
	}
	if len(k.cache) < maxCache {
		k.cache[sha] = cached{g: g, until: now.Add(k.o.CacheFor)}
	}
	k.mu.Unlock()
	return g, nil
}

// Event appends an agent's progress event (data: a task.Step as JSON) to
// the task's inbox for the lease holder. The caller has counted it
// against the task's events (agent/tasklimits).
func (k *Keys) Event(ctx context.Context, g Grant, data []byte) error {
	_, err := k.use(ctx, g.Task, g.sha, "event", data)
	return err
}

// Step appends a step faregate made on the agent's behalf (a model call
// through the endpoint; data: a task.Step as JSON) to the task's inbox.
func (k *Keys) Step(ctx context.Context, g Grant, data []byte) error {
	_, err := k.use(ctx, g.Task, g.sha, "step", data)
	return err
}

// Result posts the agent's result or error (data as the agent sent it,
// validated) for the lease holder: once; a second is ErrFinished.
func (k *Keys) Result(ctx context.Context, g Grant, data []byte) error {
	_, err := k.use(ctx, g.Task, g.sha, "result", data)
	return err
}

// Posted is a step reported through the inbox (the data of TypeEvent and
// TypeStep entries): by the agent (kind agent) or by the model endpoint
// on its behalf (kind model), with a task warning the run should carry
// (output_truncated). The lease holder numbers and times it.
type Posted struct {
	Kind       string `json:"kind"`
	Name       string `json:"name"`
	Status     string `json:"status"`
	Detail     string `json:"detail,omitempty"`
	DurationMS int64  `json:"duration_ms,omitempty"`
	Warning    string `json:"warning,omitempty"`
	// Warnings are more of the task's warnings (a model step of a
	// throttled principal: throttled, downgraded; steps the model endpoint
	// posts only).
	Warnings []string `json:"warnings,omitempty"`
	// PromptTokens and CompletionTokens are what a model step was charged
	// (steps the model endpoint posts, never an agent's events): the lease
	// holder adds them to the task's usage.
	PromptTokens     int64 `json:"prompt_tokens,omitempty"`
	CompletionTokens int64 `json:"completion_tokens,omitempty"`
	// Fail is a task code a model step ends the task with (input_spike;
	// steps the model endpoint posts only).
	Fail string `json:"fail,omitempty"`
}

// Message is one inbox entry.
type Message struct {
	ID   string
	Type string
	Data []byte
}

// Read returns task id's inbox entries after the entry id after ("0":
// from the start), waiting up to block for one (0: no wait), on rdb (a
// client whose pool may hold a blocked connection; nil: Keys' own).
func (k *Keys) Read(ctx context.Context, rdb redis.UniversalClient, id, after string, block time.Duration) ([]Message, error) {
	if rdb == nil {
		rdb = k.rdb
	}
	var res []redis.XStream
	var err error
	if block > 0 {
		res, err = rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{inboxKey(id), after}, Count: 100, Block: block}).Result()
	} else {
		start := "(" + after
		if after == "0" {
			start = "-"
		}
		var msgs []redis.XMessage
		msgs, err = rdb.XRangeN(ctx, inboxKey(id), start, "+", 1000).Result()
		res = []redis.XStream{{Messages: msgs}}
	}
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	var out []Message
	for _, st := range res {
		for _, m := range st.Messages {
			t, _ := m.Values["type"].(string)
			d, _ := m.Values["data"].(string)
			out = append(out, Message{ID: m.ID, Type: t, Data: []byte(d)})
		}
	}
	return out, nil
}

type grantKey struct{}

// WithGrant returns ctx carrying g (the /v1 handlers' request context).
func WithGrant(ctx context.Context, g Grant) context.Context {
	return context.WithValue(ctx, grantKey{}, g)
}

// FromContext returns the grant of the request's task key.
func FromContext(ctx context.Context) (Grant, bool) {
	g, ok := ctx.Value(grantKey{}).(Grant)
	return g, ok
}

// Watch returns a context that ends when g's task ends, on whichever
// replica: this one at once when it revokes the key, any other within
// WatchEvery (+ one Redis round trip, however long Redis takes to answer
// within CheckTimeout); at g's deadline in any case; and, failing closed,
// when a check failed and the key has gone a second unconfirmed. Call
// the CancelFunc when the request is done.
func (k *Keys) Watch(ctx context.Context, g Grant) (context.Context, context.CancelFunc) {
	ctx, cancelDeadline := context.WithDeadline(ctx, g.Deadline)
	ctx, cancel := context.WithCancelCause(ctx)
	k.mu.Lock()
	w := k.watched[g.Task]
	if w == nil {
		w = &watch{sha: g.sha, cancels: map[int]context.CancelCauseFunc{}, okAt: k.o.Now()}
		k.watched[g.Task] = w
	}
	n := w.next
	w.next++
	w.cancels[n] = cancel
	start := !k.looping
	k.looping = true
	k.mu.Unlock()
	if start {
		go k.watchLoop()
	}
	return ctx, func() {
		k.mu.Lock()
		if cur := k.watched[g.Task]; cur == w {
			delete(w.cancels, n)
			if len(w.cancels) == 0 {
				delete(k.watched, g.Task)
			}
		}
		k.mu.Unlock()
		cancel(nil)
		cancelDeadline()
	}
}

// watchLoop checks every watched task's key every WatchEvery, in one
// pipeline, and cancels the requests of the tasks whose key is no longer
// valid. It ends when nothing is watched.
func (k *Keys) watchLoop() {
	t := time.NewTicker(k.o.WatchEvery)
	defer t.Stop()
	for range t.C {
		k.mu.Lock()
		if len(k.watched) == 0 {
			k.looping = false
			k.mu.Unlock()
			return
		}
		ids := make([]string, 0, len(k.watched))
		shas := make([]string, 0, len(k.watched))
		for id, w := range k.watched {
			ids = append(ids, id)
			shas = append(shas, w.sha)
		}
		k.mu.Unlock()

		ctx, cancel := context.WithTimeout(context.Background(), k.o.CheckTimeout)
		now := k.o.Now()
		cmds, perr := k.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, id := range ids {
				// Eval, not EvalSha: a pipeline cannot fall back on NOSCRIPT.
				useScript.Eval(ctx, p, []string{keyKey(id), taskstore.LeaseKey(id), inboxKey(id)},
					shas[i], now.UnixMilli(), "auth", "", inboxMaxLen, int64(inboxTTL/time.Second))
			}
			return nil
		})
		cancel()
		// done: when the answer (or the failure) came; a failed round
		// fails closed once the key has gone a second unconfirmed,
		// counted to now, not to when the round began.
		done := k.o.Now()
		// ended: the requests to cancel, each with why (context.Cause):
		// ErrFinished for a key no longer valid, ErrUnavailable for one
		// that could not be checked (fail closed: 503, not 409).
		type end struct {
			cancel context.CancelCauseFunc
			why    error
		}
		var ended []end
		k.mu.Lock()
		for i, id := range ids {
			w := k.watched[id]
			if w == nil || w.sha != shas[i] {
				continue
			}
			valid, known := false, perr == nil || (i < len(cmds) && cmds[i].Err() == nil)
			if known && i < len(cmds) {
				if res, err := cmds[i].(*redis.Cmd).Slice(); err == nil && len(res) > 0 {
					code, _ := res[0].(int64)
					valid = code == 1
				} else if err != nil {
					known = false
				}
			}
			switch {
			case known && valid:
				w.okAt = now
				// The check is as good as Authenticate's: a key in use is
				// not checked again on a call's critical path while its
				// requests are open, and a cached answer is still never
				// older than CacheFor.
				if c, ok := k.cache[shas[i]]; ok && c.g.Task == id && c.until.Before(now.Add(k.o.CacheFor)) {
					c.until = now.Add(k.o.CacheFor)
					k.cache[shas[i]] = c
				}
				continue
			case !known && done.Sub(w.okAt) < time.Second:
				continue // Redis hiccup: fail closed only after a second
			}
			delete(k.watched, id)
			for s, c := range k.cache {
				if c.g.Task == id {
					delete(k.cache, s)
				}
			}
			why := ErrFinished
			if !known {
				why = ErrUnavailable
			}
			for _, c := range w.cancels {
				ended = append(ended, end{c, why})
			}
		}
		k.mu.Unlock()
		for _, e := range ended {
			e.cancel(e.why)
		}
	}
}
