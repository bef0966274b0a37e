package budget

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// Line is one ledger entry as an export hands it on (a JSON Lines line,
// or one element of a webhook batch). LedgerID is unique across days and
// streams and stable: a consumer that gets an entry twice (exports are at
// least once) drops the repeat by it.
type Line struct {
	LedgerID        string `json:"ledger_id"`
	Day             string `json:"day"`
	RequestID       string `json:"request_id"`
	Principal       string `json:"principal"`
	Tier            string `json:"tier"`
	Task            string `json:"task"`
	Model           string `json:"model"`
	InputTokens     int64  `json:"input_tokens"`
	OutputTokens    int64  `json:"output_tokens"`
	ReasoningTokens int64  `json:"reasoning_tokens"`
	// The prompt-cache fields are there when the provider reported them.
	CacheCreationInputTokens int64 `json:"cache_creation_input_tokens,omitempty"`
	CacheReadInputTokens     int64 `json:"cache_read_input_tokens,omitempty"`
	CostMicro                int64 `json:"cost_micro"`
	// Estimated: faregate counted the tokens (the provider reported none).
	Estimated bool   `json:"estimated"`
	Outcome   string `json:"outcome"`
	// Status is the provider's HTTP status (0: no answer came).
	Status int       `json:"status"`
	Time   time.Time `json:"time"`
	// Kind is absent on a model call's line. KindLeaseExpired marks what
	// a replica's leased block was charged when the replica stopped
	// reporting (LeaseExpiry): no call's line holds it.
	Kind string `json:"kind,omitempty"`
	// LeaseExpiry is there on a KindLeaseExpired line only.
	*LeaseExpiry
}

// KindLeaseExpired is the Line.Kind of a dead replica's lease charge.
const KindLeaseExpired = "lease_expired"

// LeaseExpiry is what the day's scope Scope (site, spend, or tier:<name>)
// was charged for lease Lease once it expired: Amount in the scope's unit
// (tokens; micro-units for spend). When the lease expired, Redis charged
// everything it still held, Overage 0: the calls it had admitted and not
// yet reported, whose own lines are in the feed, and what it never spent.
// Should the replica report after all, a second line says how much of
// what it reports that charge already covered (Explained) and charges the
// rest (Amount, all of it Overage).
type LeaseExpiry struct {
	Lease     string `json:"lease"`
	Scope     string `json:"scope"`
	Amount    int64  `json:"amount"`
	Overage   int64  `json:"overage"`
	Explained int64  `json:"explained"`
}

// DefaultExportGroup is the export group of `faregate ledger export` and
// of the billing webhook.
const DefaultExportGroup = "billing"

// DefaultExportBatch is how many entries one read (and one write) takes.
const DefaultExportBatch = 200

// DefaultClaimIdle is how long an entry another reader took and never
// acknowledged waits before an export takes it over: that reader died.
const DefaultClaimIdle = time.Minute

// ExportOptions configure an Exporter; zero fields take the defaults.
type ExportOptions struct {
	// Group is the export group (DefaultExportGroup): every reader of one
	// group shares its entries, each handed to one of them.
	Group string
	// Consumer names this reader in the group (default "export-" and the
	// host's name): a reader restarted under its name resumes the entries
	// it had read and not acknowledged at once; those of another name
	// wait ClaimIdle.
	Consumer string
	// Batch is DefaultExportBatch's number for this reader.
	Batch int
	// ClaimIdle is DefaultClaimIdle's time for this reader.
	ClaimIdle time.Duration
}

// Exporter reads a day's ledger through an export group (a Redis Stream
// consumer group) and acknowledges what its caller has written: an entry
// is handed on at least once, and is trimmed, or expires, only after that
// (luaLedger). It is used by one goroutine at a time.
type Exporter struct {
	l      *Ledger
	o      ExportOptions
	joined map[string]bool
}

// Exporter registers o.Group (Register) and returns a reader in it.
func (l *Ledger) Exporter(ctx context.Context, o ExportOptions) (*Exporter, error) {
	if o.Group == "" {
		o.Group = DefaultExportGroup
	}
	if o.Consumer == "" {
		host, _ := os.Hostname()
		o.Consumer = "export-" + host
	}
	if len(o.Consumer) > 128 || strings.ContainsAny(o.Consumer, " \r\n") {
		return nil, fmt.Errorf("%w: consumer name %q", ErrInvalid, o.Consumer)
	}
	if o.Batch <= 0 {
		o.Batch = DefaultExportBatch
	}
	if o.ClaimIdle <= 0 {
		o.ClaimIdle = DefaultClaimIdle
	}
	if err := l.Register(ctx, o.Group); err != nil {
		return nil, err
	}
	return &Exporter{l: l, o: o, joined: map[string]bool{}}, nil
}

// Export hands write, a batch at a time, every entry of day that the group
// has not acknowledged: first those this reader had read before (a
// restart), then those another reader left for ClaimIdle, then new ones;
// each batch write returns nil for is acknowledged at once. It returns how
// many entries were handed on and acknowledged once none is left, or at
// the first error: an error of write leaves its batch unacknowledged, to
// be handed on again.
func (x *Exporter) Export(ctx context.Context, day string, write func([]Line) error) (int, error) {
	streams, err := x.l.Streams(ctx, day)
	if err != nil {
		return 0, err
	}
	total := 0
	for _, s := range streams {
		n, err := x.exportStream(ctx, s, write)
		total += n
		if err != nil {
			return total, err
		}
	}
	return total, nil
}

// Read phases: this reader's own unacknowledged entries, others' idle
// ones, new ones.
const (
	phaseOwn = iota
	phaseClaim
	phaseNew
)

// exportStream is Export of one stream.
func (x *Exporter) exportStream(ctx context.Context, stream string, write func([]Line) error) (int, error) {
	if ok, err := x.join(ctx, stream); err != nil || !ok {
		return 0, err
	}
	total := 0
	claimFrom := "0-0"
	for phase := phaseOwn; phase <= phaseNew; {
		msgs, next, err := x.read(ctx, stream, phase, claimFrom)
		if err != nil {
			return total, err
		}
		if len(msgs) > 0 {
			n, err := x.hand(ctx, stream, msgs, write)
			total += n
			if err != nil {
				return total, err
			}
		}
		switch phase {
		case phaseOwn:
			// Acknowledged entries leave the reader's pending list, so
			// reading it from the start again gives the next ones.
			if len(msgs) == 0 {
				phase++
			}
		case phaseClaim:
			claimFrom = next
			if next == "0-0" || next == "" {
				phase++
			}
		default:
			if len(msgs) < x.o.Batch {
				phase++
			}
		}
	}
	return total, nil
}

// join puts the group on stream (from its first entry) once per
// Exporter; false when the stream does not exist (nothing to export).
func (x *Exporter) join(ctx context.Context, stream string) (bool, error) {
	if x.joined[stream] {
		return true, nil
	}
	n, err := ledgerJoinScript.Run(ctx, x.l.rdb, []string{stream, sumsKey(stream)}, x.o.Group).Int()
	if err != nil {
		return false, fmt.Errorf("%w: export join: %w", ErrUnavailable, err)
	}
	if n == 1 {
		x.joined[stream] = true
	}
	return n == 1, nil
}

// read takes up to a batch of entries of phase; next is where the next
// claim starts.
func (x *Exporter) read(ctx context.Context, stream string, phase int, claimFrom string) ([]redis.XMessage, string, error) {
	var msgs []redis.XMessage
	var next string
	var err error
	switch phase {
	case phaseClaim:
		msgs, next, err = x.l.rdb.XAutoClaim(ctx, &redis.XAutoClaimArgs{Stream: stream, Group: x.o.Group,
			Consumer: x.o.Consumer, MinIdle: x.o.ClaimIdle, Start: claimFrom, Count: int64(x.o.Batch)}).Result()
	default:
		id := "0"
		if phase == phaseNew {
			id = ">"
		}
		var res []redis.XStream
		res, err = x.l.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: x.o.Group, Consumer: x.o.Consumer,
			Streams: []string{stream, id}, Count: int64(x.o.Batch), Block: -1}).Result()
		if len(res) > 0 {
			msgs = res[0].Messages
		}
	}
	switch {
	case errors.Is(err, redis.Nil):
		return nil, "0-0", nil
	case err != nil && strings.HasPrefix(err.Error(), "NOGROUP"):
		// The group or the stream went (destroyed, expired): join again
		// next time.
		delete(x.joined, stream)
		return nil, "0-0", nil
	case err != nil:
		return nil, "", fmt.Errorf("%w: export read: %w", ErrUnavailable, err)
	}
	return msgs, next, nil
}

// hand writes msgs' lines and acknowledges them all: an entry dropped
// past the cap after it was read (no fields) is acknowledged without a
// line; it was counted lost when it was dropped.
func (x *Exporter) hand(ctx context.Context, stream string, msgs []redis.XMessage, write func([]Line) error) (int, error) {
	lines := make([]Line, 0, len(msgs))
	ids := make([]any, 0, len(msgs))
	for _, m := range msgs {
		ids = append(ids, m.ID)
		if len(m.Values) == 0 || !exported(m) {
			continue
		}
		l, err := lineOf(stream, m)
		if err != nil {
			return 0, err
		}
		lines = append(lines, l)
	}
	if len(lines) > 0 {
		if err := write(lines); err != nil {
			return 0, err
		}
	}
	args := append([]any{x.o.Group, x.l.o.Keep, x.l.o.MaxEntries, int64(ledgerTTL / time.Second)}, ids...)
	v, err := ledgerAckScript.Run(ctx, x.l.rdb, []string{stream, sumsKey(stream)}, args...).Int64Slice()
	if err != nil {
		return 0, fmt.Errorf("%w: export acknowledge: %w", ErrUnavailable, err)
	}
	if len(v) == 4 {
		x.l.observe(dayOf(stream), v[1:])
	}
	x.l.exported.Add(float64(len(lines)))
	return len(lines), nil
}

// streamTag is what names stream among every day's streams: the day, and
// whatever follows it in the name.
func streamTag(stream string) string {
	return strings.NewReplacer("{", "", "}", "").Replace(strings.TrimPrefix(stream, "faregate:usage:"))
}

// dayOf is the day of stream (its hash tag).
func dayOf(stream string) string {
	_, rest, _ := strings.Cut(stream, "{")
	day, _, _ := strings.Cut(rest, "}")
	return day
}

// LedgerID is the id an export gives the entry id of stream.
func LedgerID(stream, id string) string { return streamTag(stream) + "/" + id }

// exported reports whether entry m becomes a line. Every model call's
// entry does. Of the records of what leased blocks and direct reservations
// charged the day's scopes (entries with a kind, layout.go), only a lease's
// expiry does: each other record sums charges of calls whose own lines are
// in the feed already (a lease's report of what its calls spent, a direct
// reservation's settle), and would count them twice; an expiry's charge
// is what no call's line holds.
func exported(m redis.XMessage) bool {
	kind, ok := m.Values["kind"]
	return !ok || (kind == "lease" && m.Values["expired"] == "1")
}

// lineOf reads one stream entry. Token fields every version wrote must be
// numbers; fields added later read as 0 (or "") when absent, and a
// present field that is not a number is reported, not exported as 0.
func lineOf(stream string, m redis.XMessage) (Line, error) {
	str := func(f string) string { s, _ := m.Values[f].(string); return s }
	var bad string
	num := func(f string, required bool) int64 {
		s, ok := m.Values[f].(string)
		if !ok && !required {
			return 0
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil && bad == "" {
			bad = f
		}
		return max(n, 0)
	}
	ms, _, _ := strings.Cut(m.ID, "-")
	at, err := strconv.ParseInt(ms, 10, 64)
	if err != nil {
		bad = "id"
	}
	if _, record := m.Values["kind"]; record && bad == "" {
		return expiryLineOf(stream, m, at)
	}
	l := Line{LedgerID: LedgerID(stream, m.ID), Day: dayOf(stream), RequestID: str("request_id"), Principal: str("principal"),
		Tier: str("tier"), Task: str("task"), Model: str("model"),
		InputTokens: num("prompt_tokens", true), OutputTokens: num("completion_tokens", true),
		ReasoningTokens: num("reasoning_tokens", false), CacheCreationInputTokens: num("cache_creation_input_tokens", false),
		CacheReadInputTokens: num("cache_read_input_tokens", false), CostMicro: num("cost_micro", false),
		Estimated: str("estimated") == "1", Outcome: str("outcome"), Status: int(min(num("status", false), 999)),
		Time: time.UnixMilli(at).UTC()}
	if bad != "" {
		return Line{}, fmt.Errorf("%w: %s field %s", ErrCorruptLedger, m.ID, bad)
	}
	return l, nil
}

// expiryLineOf reads a lease's expiry record (exported).
func expiryLineOf(stream string, m redis.XMessage, at int64) (Line, error) {
	str := func(f string) string { s, _ := m.Values[f].(string); return s }
	var bad string
	num := func(f string) int64 {
		n, err := strconv.ParseInt(str(f), 10, 64)
		if (err != nil || n < 0) && bad == "" {
			bad = f
		}
		return max(n, 0)
	}
	e := LeaseExpiry{Lease: str("lease"), Scope: str("scope"), Amount: num("amount"), Overage: num("overage"),
		Explained: num("explained")}
	if bad != "" {
		return Line{}, fmt.Errorf("%w: %s field %s", ErrCorruptLedger, m.ID, bad)
	}
	return Line{LedgerID: LedgerID(stream, m.ID), Day: dayOf(stream), Kind: KindLeaseExpired, LeaseExpiry: &e,
		Time: time.UnixMilli(at).UTC()}, nil
}
