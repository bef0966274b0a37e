package budget

import (
	"context"
	"fmt"
	"strconv"
	"sync"
)

// The principals' layout (layout 2). A model call's reservation touches
// two kinds of scope, and each kind lives in its own Redis Cluster slot:
//
//   - the day's scopes, shared by every call of the site, keep the
//     {<day>} hash tag: faregate:budget:{<day>}:
//     site, spend, tier:<tier>  hash  settled, outstanding, overage,
//     leased (the part of outstanding leased to
//     replicas), largest (the largest reservation
//     seen), warned, exhausted; site also layout
//     lease:<lease id>          hash  what one replica's lease holds per
//     scope (g:<scope>), what its expiry charged
//     (x:<scope>), its last sequence number, dead
//     leases                    zset  lease id → expiry, Redis's clock (ms)
//     dres, ddone               hash  direct (per-call) reservations of
//     the day's scopes, open and ended
//     and the stream faregate:usage:{<day>}: the records of what leases
//     and direct reservations charged them;
//   - a principal's scope, its tasks' scopes and their reservations carry
//     the tag of the principal's bucket, {<day>:b<xx>}, where xx is the
//     principal's bucket (bucketOf, 256 of them) in two hex digits:
//     faregate:budget:{<day>:b<xx>}:
//     p:<principal>   hash  tokens (settled, outstanding, overage) and money
//     (msettled, moutstanding, moverage), warned, exhausted
//     task:<task>     hash  the same, without the flags
//     res             hash  open reservation id → "expiry|tokens|cost|principal|tier|task|model"
//     done            hash  ended reservation id → "state|tokens|cost|ovtok|ovcost|late|info"
//     and the stream faregate:usage:{<day>:b<xx>}: the calls' ledger
//     entries, each written by its settle.
//
// Buckets rather than one tag per principal: a reader lists a day's
// ledger as a fixed set of 257 stream names (Ledger.Streams), and no
// registry of streams has to be written beside a settle in another slot.
// 256 buckets spread the per-call scripts over every master of any
// cluster a deployment runs; a call's scripts go to its principal's
// bucket, and the day's slot sees one script per lease, not per call.
//
// Layout 1 is the one before (every key under {<day>}, legacy.go). The
// first operation of a day decides the day's layout once, in Redis
// (layoutOf): a day a faregate of layout 1 had already begun stays in
// layout 1 for its rest, so replicas of both kinds running side by side
// on the day of an upgrade count every scope once; the next day begins
// in layout 2.

// buckets is how many slots the principals' keys are spread over. It is
// part of the key layout: changing it moves every principal's keys.
const buckets = 256

// bucketOf is the bucket of a principal: FNV-1a of its id, low byte.
func bucketOf(principal string) int {
	h := uint32(2166136261)
	for i := 0; i < len(principal); i++ {
		h ^= uint32(principal[i])
		h *= 16777619
	}
	return int(h % buckets)
}

// bucketHex is b as the two hex digits the keys use.
func bucketHex(b int) string {
	const digits = "0123456789abcdef"
	return string([]byte{digits[b>>4], digits[b&15]})
}

// bucketTag is the hash tag of a principal's bucket on day.
func bucketTag(day, principal string) string { return day + ":b" + bucketHex(bucketOf(principal)) }

// bucketPrefix is the prefix of a principal's keys on day.
func bucketPrefix(day, principal string) string {
	return "faregate:budget:{" + bucketTag(day, principal) + "}:"
}

// dayPrefix is the prefix of the day's scopes.
func dayPrefix(day string) string { return "faregate:budget:{" + day + "}:" }

// StreamOf is the ledger stream holding the entries of principal's model
// calls on day (in layout 2; a day of layout 1 keeps every entry in
// UsageKey(day)).
func StreamOf(day, principal string) string {
	return "faregate:usage:{" + bucketTag(day, principal) + "}"
}

// bucketStreams are the streams of every bucket of day.
func bucketStreams(day string) []string {
	out := make([]string, buckets)
	for b := range buckets {
		out[b] = "faregate:usage:{" + day + ":b" + bucketHex(b) + "}"
	}
	return out
}

// The layouts a day's keys may follow.
const (
	layoutDay        = 1 // every key under {<day>} (legacy.go)
	layoutPrincipals = 2 // principals' keys by bucket, leases of the day's scopes
)

// layouts remembers each day's layout once Redis has answered it.
type layouts struct {
	mu   sync.Mutex
	days map[string]int
}

// layoutOf is day's layout, asked of Redis the first time (op Y) and
// remembered: Redis decides it once, so it never changes for a day.
func (b *Budget) layoutOf(ctx context.Context, day string) (int, error) {
	b.layouts.mu.Lock()
	l, ok := b.layouts.days[day]
	b.layouts.mu.Unlock()
	if ok {
		return l, nil
	}
	o := b.newOp(opLayout, dayPrefix(day)+"site", day)
	o.hdr.str(day)
	b.send(o.end())
	v, err := o.wait(ctx)
	if err != nil {
		return 0, fmt.Errorf("%w: layout: %w", ErrUnavailable, err)
	}
	if v[0] != layoutDay && v[0] != layoutPrincipals {
		return 0, fmt.Errorf("%w: layout %s of %s", ErrUnavailable, strconv.FormatInt(v[0], 10), day)
	}
	b.layouts.mu.Lock()
	if b.layouts.days == nil {
		b.layouts.days = map[string]int{}
	}
	// A replica runs for days: keep the last few.
	if len(b.layouts.days) > 8 {
		clear(b.layouts.days)
	}
	b.layouts.days[day] = int(v[0])
	b.layouts.mu.Unlock()
	return int(v[0]), nil
}
