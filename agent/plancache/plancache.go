// Package plancache keeps the plans of succeeded tasks in Redis, keyed by a
// normalised request, so that a visitor who would otherwise be refused
// (budget exhausted, model down) can be answered with a plan already made
// for the same trip (#10).
//
// The key is built from the request alone (destination, days, interests,
// answer language), never from the visitor or principal who asked, so a
// stored plan says nothing about anyone. Whether and when a cached plan is
// served is the gate's decision; this package only parses the mode, builds
// the key and stores and loads plans. Any Redis failure is ErrUnavailable:
// the caller then answers as it would have without a cache, so a cache
// failure can never admit a request nor hide the refusal it replaced.
package plancache

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/protect/canon"
)

var (
	// ErrUnavailable reports that the cache could not answer: Redis failed
	// or the stored entry is unreadable. The caller must answer exactly as
	// it would have without a cache (refuse with the original refusal),
	// never admit.
	ErrUnavailable = errors.New("plancache: unavailable")
	// ErrNotCacheable reports a plan Put will not store: it has warnings, it
	// was itself served from the cache, its result is not a JSON object, its
	// entry would exceed MaxEntryBytes, or its request's text is not in the
	// canonical form the API gives the model (see CheckRequest).
	ErrNotCacheable = errors.New("plancache: plan not cacheable")
)

// DefaultTTL is how long a plan stays cached, the default of
// FAREGATE_PLAN_CACHE_TTL.
const DefaultTTL = 24 * time.Hour

// MaxEntryBytes bounds what one plan may occupy in Redis: the stored entry,
// which is the result plus the model name, the time and a few dozen bytes of
// framing. A day-by-day plan is a few KiB; anything near the bound is not a
// plan worth keeping.
const MaxEntryBytes = 64 << 10

// entryVersion is written into every entry; Get treats an entry of another
// version as a miss, so a change of the entry format needs no migration.
const entryVersion = 1

// Plan is a cached answer. It holds the result as JSON so that this package
// needs none of the agent's types.
type Plan struct {
	// Result is the JSON object of the task's result. Get returns it
	// compacted (insignificant whitespace removed).
	Result json.RawMessage
	// Warnings are the task's warnings. Only a plan without any is
	// cached; Get never returns any.
	Warnings []string
	// Model names what produced the plan.
	Model string
	// CachedAt is when Put stored the plan; Put sets it from Options.Now,
	// whatever the caller passed.
	CachedAt time.Time
}

// entry is a plan as stored in Redis. It carries no visitor, principal,
// task or request id: a cached plan is shared by everyone who asks the
// same, and must say nothing about who asked first.
type entry struct {
	V        int             `json:"v"`
	Result   json.RawMessage `json:"result"`
	Model    string          `json:"model,omitempty"`
	CachedAt time.Time       `json:"cached_at"`
}

// Options configure a Cache.
type Options struct {
	// TTL is how long a stored plan is served (FAREGATE_PLAN_CACHE_TTL);
	// zero or less takes DefaultTTL. Expiry is Redis's own: a plan is
	// stored once with this TTL and never touched again until it expires
	// or a newer plan for the same request replaces it.
	TTL time.Duration
	// Now stamps Plan.CachedAt; default time.Now.
	Now func() time.Time
	// Registerer receives faregate_plan_cache_total; nil leaves it
	// unregistered.
	Registerer prometheus.Registerer
}

// Cache stores and loads plans in Redis. It is safe for concurrent use.
type Cache struct {
	rdb   redis.StringCmdable
	ttl   time.Duration
	now   func() time.Time
	total *prometheus.CounterVec
}

// New returns a Cache on rdb. redis.StringCmdable (GET and SET) is the
// narrowest go-redis interface it needs; *redis.Client,
// *redis.ClusterClient and any redis.Cmdable satisfy it.
func New(rdb redis.StringCmdable, o Options) *Cache {
	if o.TTL <= 0 {
		o.TTL = DefaultTTL
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Cache{rdb: rdb, ttl: o.TTL, now: o.Now, total: newTotal(o.Registerer)}
}

// Get returns the plan cached for req. ok is false on a miss. A Redis
// failure or an unreadable entry is ErrUnavailable, never a hit.
func (c *Cache) Get(ctx context.Context, req Request) (plan Plan, ok bool, err error) {
	if CheckRequest(req) != nil {
		// No plan is ever stored for such text, and none may be served
		// for it under the key of a text it folds to.
		c.count(opGet, outcomeMiss)
		return Plan{}, false, nil
	}
	raw, err := c.rdb.Get(ctx, Key(req)).Bytes()
	if errors.Is(err, redis.Nil) {
		c.count(opGet, outcomeMiss)
		return Plan{}, false, nil
	}
	if err != nil {
		c.count(opGet, outcomeError)
		return Plan{}, false, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	var e entry
	if err := json.Unmarshal(raw, &e); err != nil {
		c.count(opGet, outcomeError)
		return Plan{}, false, fmt.Errorf("%w: stored plan unreadable: %w", ErrUnavailable, err)
	}
	if e.V != entryVersion {
		// Written by another version of this package: not ours to read.
		c.count(opGet, outcomeMiss)
		return Plan{}, false, nil
	}
	c.count(opGet, outcomeHit)
	return Plan{Result: e.Result, Model: e.Model, CachedAt: e.CachedAt}, true, nil
}

// Put stores plan as the answer to req for the TTL, replacing any plan
// stored for it before. Only the plan of a task that succeeded without
// warnings may be cached: a plan with warnings (in Plan.Warnings or in the
// result's "warnings" array), a plan whose result says it was itself
// served from the cache ("cached": true, which would renew it forever), a
// result that is not a JSON object, and an entry over MaxEntryBytes are
// refused with ErrNotCacheable and nothing is written. A Redis failure is
// ErrUnavailable.
func (c *Cache) Put(ctx context.Context, req Request, plan Plan) error {
	if err := CheckRequest(req); err != nil {
		c.count(opPut, outcomeSkipped)
		return err
	}
	val, err := c.encode(plan)
	if err != nil {
		c.count(opPut, outcomeSkipped)
		return err
	}
	if err := c.rdb.Set(ctx, Key(req), val, c.ttl).Err(); err != nil {
		c.count(opPut, outcomeError)
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	c.count(opPut, outcomeOK)
	return nil
}

// CheckRequest reports, as ErrNotCacheable, a request whose text a plan may
// not be cached or served for: text that canon.Check refuses (format or
// control characters, which the key keeps but no request may carry), or
// text that is not in NFKC, the form the API gives the model. A plan is
// cached only under a key derived from exactly the text the model saw; the
// key's own folding (case, accents, whitespace, order) then decides which
// other requests it answers.
func CheckRequest(req Request) error {
	check := func(field, s string) error {
		if err := canon.Check(field, s); err != nil {
			return fmt.Errorf("%w: %w", ErrNotCacheable, err)
		}
		if canon.NFKC(s) != s {
			return fmt.Errorf("%w: %s is not in NFKC", ErrNotCacheable, field)
		}
		return nil
	}
	if err := check("destination", req.Destination); err != nil {
		return err
	}
	for _, in := range req.Interests {
		if err := check("interests", in); err != nil {
			return err
		}
	}
	return nil
}

// encode checks that plan may be cached and returns its entry.
func (c *Cache) encode(plan Plan) ([]byte, error) {
	if len(plan.Warnings) > 0 {
		return nil, fmt.Errorf("%w: the task has %d warnings", ErrNotCacheable, len(plan.Warnings))
	}
	if !bytes.HasPrefix(bytes.TrimLeft(plan.Result, " \t\r\n"), []byte("{")) {
		return nil, fmt.Errorf("%w: the result is not a JSON object", ErrNotCacheable)
	}
	// The result's own flags are read, not trusted to the caller: the
	// task's warnings are also the result's, and a served cached plan is
	// marked in its result.
	var flags struct {
		Warnings []json.RawMessage `json:"warnings"`
		Cached   bool              `json:"cached"`
	}
	if err := json.Unmarshal(plan.Result, &flags); err != nil {
		return nil, fmt.Errorf("%w: the result is not a JSON object of a plan: %w", ErrNotCacheable, err)
	}
	if len(flags.Warnings) > 0 {
		return nil, fmt.Errorf("%w: the result has %d warnings", ErrNotCacheable, len(flags.Warnings))
	}
	if flags.Cached {
		return nil, fmt.Errorf("%w: the result was served from the cache", ErrNotCacheable)
	}
	val, err := json.Marshal(entry{V: entryVersion, Result: plan.Result, Model: plan.Model, CachedAt: c.now().UTC()})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotCacheable, err)
	}
	if len(val) > MaxEntryBytes {
		return nil, fmt.Errorf("%w: %d bytes, the bound is %d", ErrNotCacheable, len(val), MaxEntryBytes)
	}
	return val, nil
}
