package budget

import (
	"context"
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/protect/codes"
)

// ErrCorruptLedger reports a stream entry this package did not write.
var ErrCorruptLedger = errors.New("budget: corrupt ledger entry")

// OutcomeOK is the Entry.Outcome of a call that completed normally. A
// call cut by faregate (codes.OutputTruncated at its budget,
// codes.OutputLoop as a loop) answered what passed and is counted as cut;
// any other outcome ("error", "timeout", "client_closed", ...) counts as
// an error in the totals.
const OutcomeOK = "ok"

// cutOutcome reports an outcome of a call faregate cut: it answered, so it
// is no error.
func cutOutcome(o string) bool { return o == codes.OutputTruncated || o == codes.OutputLoop }

// Outcomes of a call whose request reached the provider (it was written
// whole) and that ended before the provider's answer did: it is charged at
// least its prompt, and the ledger says why.
const (
	// OutcomeClientClosed: the agent hung up on its own call.
	OutcomeClientClosed = "client_closed"
	// OutcomeTaskEnded: the call's task ended (its result posted, its
	// deadline passed, its key no longer valid) while the call was in
	// flight.
	OutcomeTaskEnded = "task_ended"
	// OutcomeTimeout: the call's own deadline (FAREGATE_LLM_TIMEOUT)
	// passed.
	OutcomeTimeout = "timeout"
)

// DefaultLedgerKeep is how many entries a day's stream keeps once they are
// exported, or at all without an export group: older ones are trimmed
// (approximately, MAXLEN ~, which lets Redis drop whole nodes and keeps
// XADD cheap).
const DefaultLedgerKeep = 100000

// DefaultLedgerMaxEntries is FAREGATE_LEDGER_MAX_ENTRIES's default: the
// most entries a day's stream holds while an export group has not
// acknowledged them.
const DefaultLedgerMaxEntries = 1000000

// ledgerTTL keeps a day's stream for a week after its last entry (with an
// export group, after its last acknowledgement), long enough for
// `faregate usage -day` to look back.
const ledgerTTL = 8 * 24 * time.Hour

// ledgerPage is how many entries one XRANGE fetches.
const ledgerPage = 1000

// groupsKey is the set of registered export groups. A day's stream gets
// each of them from its first entry, so nothing of it is trimmed before
// the group has read it.
const groupsKey = "faregate:ledger:groups"

// maxGroups bounds the export groups: every append names them all.
const maxGroups = 8

// Entry is one model call as the ledger records it. Reserved is what the
// budget held for the call, so reports can show how far estimates were
// off; the cost and overage fields are what Settle returned.
type Entry struct {
	// Principal is the visitor's (v_<hmac>) or API key's (k_<id>) id, Tier
	// its tier.
	Task, Model, Principal, Tier, RequestID             string
	PromptTokens, CompletionTokens, Reserved, LatencyMS int64
	// ReasoningTokens is the part of CompletionTokens the provider
	// reported as reasoning.
	ReasoningTokens int64
	// CacheCreationTokens and CacheReadTokens are prompt tokens the
	// provider reported as written to and read from its prompt cache
	// (Anthropic's cache_creation_input_tokens, cache_read_input_tokens);
	// 0 where it reports none.
	CacheCreationTokens, CacheReadTokens       int64
	CostMicro, OverageTokens, OverageCostMicro int64
	Outcome                                    string
	// Status is the provider's HTTP status: 200 when it answered, its
	// error status, 0 when no answer came (refused, timed out, cut off).
	Status int
	// Estimated is true when the tokens were counted by faregate because
	// the provider reported none (a cut stream, a failed call).
	Estimated bool
	// RawUsage is the provider's usage report as it came, when it was not
	// charged as it stood (Implausible): below zero, past the ceiling or
	// unreadable. The tokens fields are what was charged instead.
	RawUsage    string
	Implausible bool
}

// The groupings Totals offers.
const (
	ByModel     = "model"
	ByPrincipal = "principal"
)

// Total sums one model's or one principal's entries of a day.
type Total struct {
	// Key is the model name or the principal id.
	Key string
	// Calls counts entries; Cut those faregate cut at their budget or as
	// a loop; Errors the others whose outcome was not OutcomeOK;
	// Estimated those whose tokens were estimated.
	Calls, Errors, Cut, Estimated   int64
	PromptTokens, CompletionTokens  int64
	Reserved                        int64
	CostMicro                       int64
	OverageTokens, OverageCostMicro int64
}

// LedgerEvent reports a day's stream whose unexported entries crossed 80%
// of LedgerOptions.MaxEntries (Backlog, once until they fall below half of
// it) or that had to drop unexported entries past it (Lost): the moments
// for ledger_backlog and ledger_lost.
type LedgerEvent struct {
	Day string
	// Unexported is how many entries some export group has not
	// acknowledged (-1 when this write did not count them).
	Unexported, MaxEntries int64
	Backlog                bool
	Lost                   int64
}

// LedgerOptions shape a Ledger; zero fields take the defaults noted.
type LedgerOptions struct {
	// Now picks the day Append writes to (time.Now).
	Now func() time.Time
	// Keep is DefaultLedgerKeep's number for this ledger.
	Keep int64
	// MaxEntries bounds a day's stream while an export group has entries
	// to read (FAREGATE_LEDGER_MAX_ENTRIES, DefaultLedgerMaxEntries).
	MaxEntries int64
	// Watch hears of every LedgerEvent (nil: none); it must not block.
	Watch func(LedgerEvent)
	// Registerer takes the ledger's metrics besides the Collector's own
	// faregate_llm_tokens_total; nil leaves them unregistered.
	Registerer prometheus.Registerer
}

// Ledger reads and sums a day's model calls, hands them to export groups
// (Exporter) with acknowledgement, and appends entries that have no
// settle. A day's ledger is several streams (Streams): the settle of a
// model call writes its entry in its principal's bucket (StreamOf), and
// the day's own stream (UsageKey) holds the records of what leased blocks
// and direct reservations charged the day's scopes (entries with a "kind"
// field), besides the entries of a day of layout 1 and those of Append;
// each stream has its counters beside it (luaLedger). It is a
// prometheus.Collector for faregate_llm_tokens_total: register it where
// the other metrics are registered.
type Ledger struct {
	rdb    redis.Cmdable
	o      LedgerOptions
	tokens *prometheus.CounterVec
	// lost and exported count entries this process dropped unexported
	// and handed on through an export.
	lost, exported prometheus.Counter
	// groups are the registered export groups as last read (Run,
	// Register); a new day's stream gets them from its first entry.
	groups atomic.Pointer[[]string]
}

// NewLedger returns a Ledger on rdb with the default shape; now (default
// time.Now) picks the day.
func NewLedger(rdb redis.Cmdable, now func() time.Time) *Ledger {
	return OpenLedger(rdb, LedgerOptions{Now: now})
}

// OpenLedger returns a Ledger on rdb shaped by o.
func OpenLedger(rdb redis.Cmdable, o LedgerOptions) *Ledger {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Keep <= 0 {
		o.Keep = DefaultLedgerKeep
	}
	if o.MaxEntries <= 0 {
		o.MaxEntries = DefaultLedgerMaxEntries
	}
	l := &Ledger{rdb: rdb, o: o, tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_llm_tokens_total",
		Help: "Tokens of model calls, by model, kind (prompt or completion) and source (provider: reported by the provider; estimate: counted by faregate).",
	}, []string{"model", "kind", "source"}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_ledger_lost_entries_total",
			Help: "Ledger entries dropped before an export group acknowledged them, past FAREGATE_LEDGER_MAX_ENTRIES (by writes of this process).",
		}),
		exported: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_ledger_exported_entries_total",
			Help: "Ledger entries this process's exports handed on and acknowledged.",
		})}
	if o.Registerer != nil {
		o.Registerer.MustRegister(l.lost, l.exported)
	}
	l.groups.Store(&[]string{})
	return l
}

// Describe implements prometheus.Collector.
func (l *Ledger) Describe(ch chan<- *prometheus.Desc) { l.tokens.Describe(ch) }

// Collect implements prometheus.Collector.
func (l *Ledger) Collect(ch chan<- prometheus.Metric) { l.tokens.Collect(ch) }

// UsageKey is the day's own stream (see Ledger).
func UsageKey(day string) string { return "faregate:usage:{" + day + "}" }

// sumsKey is the counters hash beside a stream (luaLedger), in its slot.
func sumsKey(stream string) string { return stream + ":sums" }

// Streams are the day's ledger streams that exist, the day's own first:
// every reader of a day's ledger (Totals, an export) reads all of them.
// There are at most 257, one per principal bucket and the day's own, so
// they are listed by name, not found by a scan: a settle in one slot never
// has to write a registry in another.
func (l *Ledger) Streams(ctx context.Context, day string) ([]string, error) {
	if err := validDay(day); err != nil {
		return nil, err
	}
	all := append([]string{UsageKey(day)}, bucketStreams(day)...)
	exists := make([]*redis.IntCmd, len(all))
	_, err := l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range all {
			exists[i] = p.Exists(ctx, k)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("%w: ledger streams: %w", ErrUnavailable, err)
	}
	var out []string
	for i, c := range exists {
		if c.Val() == 1 {
			out = append(out, all[i])
		}
	}
	return out, nil
}

// Count moves faregate_llm_tokens_total by e's tokens. Budget.SettleCall
// writes the entry itself (in the settle's script, once); its caller
// counts it here, whether or not Redis took it: the tokens were spent
// either way.
func (l *Ledger) Count(e Entry) {
	source := "provider"
	if e.Estimated {
		source = "estimate"
	}
	l.tokens.WithLabelValues(e.Model, "prompt", source).Add(float64(max(e.PromptTokens, 0)))
	l.tokens.WithLabelValues(e.Model, "completion", source).Add(float64(max(e.CompletionTokens, 0)))
}

// Append records e in today's stream and counts it. It is not idempotent:
// a model call's entry is written by Budget.SettleCall, which is; Append
// is for entries without a settle.
func (l *Ledger) Append(ctx context.Context, e Entry) error {
	l.Count(e)
	day := Day(l.o.Now())
	stream := UsageKey(day)
	prompt, completion := bound(e.PromptTokens), bound(e.CompletionTokens)
	raw := ""
	if e.Implausible {
		raw = clipRaw(e.RawUsage)
	}
	args := append([]any{bound(e.CostMicro), bound(e.OverageTokens), bound(e.OverageCostMicro)},
		l.argv(e, prompt, completion, bound(e.Reserved), raw, e.Implausible)...)
	v, err := ledgerAppendScript.Run(ctx, l.rdb, []string{stream, sumsKey(stream)}, args...).Int64Slice()
	if err != nil {
		return fmt.Errorf("%w: ledger append: %w", ErrUnavailable, err)
	}
	l.observe(day, v)
	return nil
}

// argv is the entry's block of a script's ARGV, in luaLedger's order:
// the stream's shape, the entry's fields, bounded (provider numbers and
// agent strings are hostile), and the registered export groups.
func (l *Ledger) argv(e Entry, prompt, completion, reserved int64, raw string, implausible bool) []any {
	groups := *l.groups.Load()
	args := make([]any, 0, 23+len(groups))
	args = append(args, l.o.Keep, l.o.MaxEntries, int64(ledgerTTL/time.Second),
		clipText(e.Task, 128), clipText(e.Model, 256), clipText(e.Principal, 128), clipText(e.Tier, 128),
		clipText(e.RequestID, 128), prompt, completion, min(bound(e.ReasoningTokens), completion),
		bound(e.CacheCreationTokens), bound(e.CacheReadTokens), reserved, bound(e.LatencyMS),
		clipText(e.Outcome, 64), min(max(e.Status, 0), 999), flag(e.Estimated), raw, flag(implausible),
		flag(e.Outcome != OutcomeOK && !cutOutcome(e.Outcome)), flag(cutOutcome(e.Outcome)), len(groups))
	for _, g := range groups {
		args = append(args, g)
	}
	return args
}

// observe reads a script's ledger answer {backlog, lost, unexported} for
// day: the lost are counted, and an event goes to Watch.
func (l *Ledger) observe(day string, v []int64) {
	if len(v) < 3 || (v[0] != 1 && v[1] <= 0) {
		return
	}
	if v[1] > 0 {
		l.lost.Add(float64(v[1]))
	}
	if l.o.Watch != nil {
		l.o.Watch(LedgerEvent{Day: day, Unexported: v[2], MaxEntries: l.o.MaxEntries, Backlog: v[0] == 1, Lost: max(v[1], 0)})
	}
}

// bound keeps an amount within what a script takes exactly: 0 to 2^53.
func bound(n int64) int64 { return min(max(n, 0), maxExact) }

// clipText cuts s to n bytes at a UTF-8 boundary.
func clipText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "")
}

// Register adds group to the export groups (at most maxGroups): from then
// on every new day's stream gets it from its first entry, on every
// replica once it has read the set again (Run). It does not put the
// group on streams that exist already; the Exporter does that.
func (l *Ledger) Register(ctx context.Context, group string) error {
	if !validID(group) || len(group) > 64 {
		return fmt.Errorf("%w: export group must be 1-64 characters of [A-Za-z0-9_-]", ErrInvalid)
	}
	n, err := registerScript.Run(ctx, l.rdb, []string{groupsKey}, group, maxGroups).Int()
	if err != nil {
		return fmt.Errorf("%w: register export group: %w", ErrUnavailable, err)
	}
	if n == 0 {
		return fmt.Errorf("%w: at most %d export groups; remove one from %s first", ErrInvalid, maxGroups, groupsKey)
	}
	return l.Refresh(ctx)
}

// registerScript adds ARGV[1] to the set KEYS[1] unless it already holds
// ARGV[2] other names; 1 when it is in the set.
var registerScript = redis.NewScript(`
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
`)

// Refresh reads the registered export groups again.
func (l *Ledger) Refresh(ctx context.Context) error {
	gs, err := l.rdb.SMembers(ctx, groupsKey).Result()
	if err != nil {
		return fmt.Errorf("%w: export groups: %w", ErrUnavailable, err)
	}
	valid := make([]string, 0, min(len(gs), maxGroups))
	for _, g := range gs {
		if validID(g) && len(g) <= 64 && len(valid) < maxGroups {
			valid = append(valid, g)
		}
	}
	sort.Strings(valid)
	l.groups.Store(&valid)
	return nil
}

// RefreshEvery is how often Run reads the export groups again.
const RefreshEvery = 30 * time.Second

// Run reads the registered export groups now and every RefreshEvery until
// ctx ends, so a group registered anywhere reaches this process's new
// streams. A failed read keeps the groups last read.
func (l *Ledger) Run(ctx context.Context) {
	t := time.NewTicker(RefreshEvery)
	defer t.Stop()
	for {
		_ = l.Refresh(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Totals sums the day's model calls by model or by principal (ByModel,
// ByPrincipal), sorted by key, over every stream of the day (Streams);
// the records of leases and direct reservations are not calls and are
// left out. It pages through each stream with XRANGE so a full day never
// arrives as one reply.
func (l *Ledger) Totals(ctx context.Context, day, by string) ([]Total, error) {
	return l.totals(ctx, day, by, nil)
}

// totals is Totals of the entries each stream's upTo (by stream; nil: no
// bound) numbers at most: those appended before the counters were read.
func (l *Ledger) totals(ctx context.Context, day, by string, upTo map[string]int64) ([]Total, error) {
	if by != ByModel && by != ByPrincipal {
		return nil, fmt.Errorf("%w: totals by %q: want %q or %q", ErrInvalid, by, ByModel, ByPrincipal)
	}
	streams, err := l.Streams(ctx, day)
	if err != nil {
		return nil, err
	}
	sums := map[string]*Total{}
	for _, key := range streams {
		if err := l.each(ctx, key, func(m redis.XMessage) error {
			if _, record := m.Values["kind"]; record {
				return nil
			}
			if upTo != nil && seqOf(m) > upTo[key] {
				return nil
			}
			return add(sums, by, m)
		}); err != nil {
			return nil, err
		}
	}
	out := make([]Total, 0, len(sums))
	for _, t := range sums {
		out = append(out, *t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

// each calls f on every entry of stream key, a page at a time.
func (l *Ledger) each(ctx context.Context, key string, f func(redis.XMessage) error) error {
	start := "-"
	for {
		msgs, err := l.rdb.XRangeN(ctx, key, start, "+", ledgerPage).Result()
		if err != nil {
			return fmt.Errorf("%w: ledger read: %w", ErrUnavailable, err)
		}
		for _, m := range msgs {
			if err := f(m); err != nil {
				return err
			}
		}
		if len(msgs) < ledgerPage {
			return nil
		}
		// "(" makes the next page start after the last id seen (Redis ≥ 6.2).
		start = "(" + msgs[len(msgs)-1].ID
	}
}

// seqOf is an entry's number in its stream (0 for entries written before
// they were numbered: the oldest).
func seqOf(m redis.XMessage) int64 {
	s, _ := m.Values["seq"].(string)
	n, _ := strconv.ParseInt(s, 10, 64)
	return n
}

// DayCounters are a day's counters (luaLedger): every entry ever
// appended, summed by model whatever was trimmed since, and how many
// entries were trimmed and lost. A day written before the counters
// existed has none.
type DayCounters struct {
	ByModel                 []Total
	Appended, Trimmed, Lost int64
	// seq is each stream's Appended.
	seq map[string]int64
}

// Counters reads the counters of day's streams.
func (l *Ledger) Counters(ctx context.Context, day string) (DayCounters, error) {
	streams, err := l.Streams(ctx, day)
	if err != nil {
		return DayCounters{}, err
	}
	c := DayCounters{seq: map[string]int64{}}
	models := map[string]*Total{}
	for _, s := range streams {
		h, err := l.rdb.HGetAll(ctx, sumsKey(s)).Result()
		if err != nil {
			return DayCounters{}, fmt.Errorf("%w: ledger counters: %w", ErrUnavailable, err)
		}
		for f, v := range h {
			if model, ok := strings.CutPrefix(f, "m|"); ok {
				if err := addCounters(models, model, v); err != nil {
					return DayCounters{}, err
				}
				continue
			}
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				continue // a flag, or a field of a later version
			}
			switch f {
			case "seq":
				c.seq[s] = n
				c.Appended = satAdd(c.Appended, max(n, 0))
			case "trimmed":
				c.Trimmed = satAdd(c.Trimmed, max(n, 0))
			case "lost":
				c.Lost = satAdd(c.Lost, max(n, 0))
			}
		}
	}
	for _, t := range models {
		c.ByModel = append(c.ByModel, *t)
	}
	sort.Slice(c.ByModel, func(i, j int) bool { return c.ByModel[i].Key < c.ByModel[j].Key })
	return c, nil
}

// addCounters adds one model's packed counters (luaLedger's m|<model>).
func addCounters(models map[string]*Total, model, packed string) error {
	f := strings.Fields(packed)
	if len(f) != 10 {
		return fmt.Errorf("%w: counters of %q: %q", ErrCorruptLedger, model, packed)
	}
	var v [10]int64
	for i, s := range f {
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 0 {
			return fmt.Errorf("%w: counters of %q: %q", ErrCorruptLedger, model, packed)
		}
		v[i] = n
	}
	t, ok := models[model]
	if !ok {
		t = &Total{Key: model}
		models[model] = t
	}
	*t = sum([]Total{*t, {Calls: v[0], Errors: v[1], Cut: v[2], Estimated: v[3], PromptTokens: v[4], CompletionTokens: v[5],
		Reserved: v[6], CostMicro: v[7], OverageTokens: v[8], OverageCostMicro: v[9]}})
	t.Key = model
	return nil
}

// RestKey names the row of a day's usage by principal that holds what
// its counters count beyond the entries still in the ledger (trimmed or
// lost): whose they were is no longer known.
const RestKey = "(trimmed)"

// DayUsage is a day's usage as `faregate usage` reports it: Rows sum to
// the day's total. Once entries left the ledger (Trimmed, Lost), the rows
// by model are the counters', and the rows by principal those of the
// entries kept plus a RestKey row with the rest of the counters' total.
type DayUsage struct {
	Rows          []Total
	Trimmed, Lost int64
}

// Usage reads day's usage by model or by principal (ByModel,
// ByPrincipal).
func (l *Ledger) Usage(ctx context.Context, day, by string) (DayUsage, error) {
	c, err := l.Counters(ctx, day)
	if err != nil {
		return DayUsage{}, err
	}
	gone := c.Trimmed > 0 || c.Lost > 0
	if gone && by == ByModel {
		return DayUsage{Rows: c.ByModel, Trimmed: c.Trimmed, Lost: c.Lost}, nil
	}
	var upTo map[string]int64
	if gone {
		// Entries appended after the counters were read are left out, so
		// that the rows add up to the counters' total.
		upTo = c.seq
	}
	rows, err := l.totals(ctx, day, by, upTo)
	if err != nil || !gone {
		return DayUsage{Rows: rows}, err
	}
	rest := difference(sum(c.ByModel), sum(rows))
	rest.Key = RestKey
	return DayUsage{Rows: append(rows, rest), Trimmed: c.Trimmed, Lost: c.Lost}, nil
}

// difference is a − b field by field, never below zero.
func difference(a, b Total) Total {
	d := func(x, y int64) int64 { return max(x-y, 0) }
	return Total{Calls: d(a.Calls, b.Calls), Errors: d(a.Errors, b.Errors), Cut: d(a.Cut, b.Cut),
		Estimated: d(a.Estimated, b.Estimated), PromptTokens: d(a.PromptTokens, b.PromptTokens),
		CompletionTokens: d(a.CompletionTokens, b.CompletionTokens), Reserved: d(a.Reserved, b.Reserved),
		CostMicro: d(a.CostMicro, b.CostMicro), OverageTokens: d(a.OverageTokens, b.OverageTokens),
		OverageCostMicro: d(a.OverageCostMicro, b.OverageCostMicro)}
}

// add folds one stream entry into the totals. The token fields every
// version wrote must be numbers; the fields added later (cost, overage,
// estimated) read as 0 when absent, so a day written partly by an older
// faregate still sums, but a present field that is not a number is
// reported rather than counted as zero.
func add(sums map[string]*Total, by string, m redis.XMessage) error {
	str := func(f string) string { s, _ := m.Values[f].(string); return s }
	num := func(f string, required bool) (int64, error) {
		s, ok := m.Values[f].(string)
		if !ok && !required {
			return 0, nil
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: %s field %s", ErrCorruptLedger, m.ID, f)
		}
		return n, nil
	}
	fields := []struct {
		name     string
		required bool
	}{
		{"prompt_tokens", true}, {"completion_tokens", true}, {"reserved", true},
		{"cost_micro", false}, {"overage_tokens", false}, {"overage_cost_micro", false}, {"estimated", false},
	}
	var v [7]int64
	for i, f := range fields {
		n, err := num(f.name, f.required)
		if err != nil {
			return err
		}
		// Entries written before provider numbers were bounded may hold
		// negatives; they charged nothing, and no total goes below zero.
		v[i] = max(n, 0)
	}
	key := str(by)
	t, ok := sums[key]
	if !ok {
		t = &Total{Key: key}
		sums[key] = t
	}
	t.Calls++
	t.PromptTokens = satAdd(t.PromptTokens, v[0])
	t.CompletionTokens = satAdd(t.CompletionTokens, v[1])
	t.Reserved = satAdd(t.Reserved, v[2])
	t.CostMicro = satAdd(t.CostMicro, v[3])
	t.OverageTokens = satAdd(t.OverageTokens, v[4])
	t.OverageCostMicro = satAdd(t.OverageCostMicro, v[5])
	if v[6] != 0 {
		t.Estimated++
	}
	switch o := str("outcome"); {
	case cutOutcome(o):
		t.Cut++
	case o != OutcomeOK:
		t.Errors++
	}
	return nil
}

// sum adds up totals for the table's last row.
func sum(totals []Total) Total {
	var s Total
	for _, t := range totals {
		s.Calls += t.Calls
		s.Errors += t.Errors
		s.Cut += t.Cut
		s.Estimated += t.Estimated
		s.PromptTokens = satAdd(s.PromptTokens, t.PromptTokens)
		s.CompletionTokens = satAdd(s.CompletionTokens, t.CompletionTokens)
		s.Reserved = satAdd(s.Reserved, t.Reserved)
		s.CostMicro = satAdd(s.CostMicro, t.CostMicro)
		s.OverageTokens = satAdd(s.OverageTokens, t.OverageTokens)
		s.OverageCostMicro = satAdd(s.OverageCostMicro, t.OverageCostMicro)
	}
	return s
}

// satAdd adds two non-negative amounts, stopping at math.MaxInt64 rather
// than wrapping to a negative total.
func satAdd(a, b int64) int64 {
	if b > math.MaxInt64-a {
		return math.MaxInt64
	}
	return a + b
}

// keyName shows an entry without a principal (written before principals
// were recorded) as "-" rather than as an empty cell.
func keyName(k string) string {
	if k == "" {
		return "-"
	}
	return k
}

// WriteTable prints totals (grouped by, ByModel or ByPrincipal) as an
// aligned table with a total row, or a sentence saying the day had no
// model calls. Money is in currency units with six decimals.
func WriteTable(w io.Writer, day, by string, totals []Total) error {
	if len(totals) == 0 {
		_, err := fmt.Fprintf(w, "no model calls recorded on %s\n", day)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "%s\tCALLS\tERRORS\tCUT\tESTIMATED\tPROMPT\tCOMPLETION\tTOTAL\tRESERVED\tCOST\tOVERAGE\tOVERAGE_COST\n", strings.ToUpper(by))
	row := func(key string, t Total) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%s\n", key, t.Calls, t.Errors, t.Cut, t.Estimated,
			t.PromptTokens, t.CompletionTokens, satAdd(t.PromptTokens, t.CompletionTokens), t.Reserved,
			FormatMicro(t.CostMicro), t.OverageTokens, FormatMicro(t.OverageCostMicro))
	}
	for _, t := range totals {
		row(keyName(t.Key), t)
	}
	row("total ("+day+")", sum(totals))
	return tw.Flush()
}

// WriteCSV writes totals as CSV with a header and one row per key, each
// naming the day, for spreadsheets and for joining several days; money is
// in currency units with six decimals. There is no total row.
func WriteCSV(w io.Writer, day, by string, totals []Total) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"day", by, "calls", "errors", "cut_calls", "estimated_calls", "prompt_tokens", "completion_tokens",
		"total_tokens", "reserved_tokens", "cost", "overage_tokens", "overage_cost"})
	i := func(n int64) string { return strconv.FormatInt(n, 10) }
	for _, t := range totals {
		_ = cw.Write([]string{day, t.Key, i(t.Calls), i(t.Errors), i(t.Cut), i(t.Estimated), i(t.PromptTokens), i(t.CompletionTokens),
			i(satAdd(t.PromptTokens, t.CompletionTokens)), i(t.Reserved), FormatMicro(t.CostMicro), i(t.OverageTokens),
			FormatMicro(t.OverageCostMicro)})
	}
	cw.Flush()
	return cw.Error()
}
