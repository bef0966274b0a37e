package budget

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// ErrCorruptLedger reports a stream entry this package did not write.
var ErrCorruptLedger = errors.New("budget: corrupt ledger entry")

// OutcomeOK is the Entry.Outcome of a call that completed normally; any
// other outcome ("error", "timeout", "canceled", "loop", ...) counts as an
// error in the totals.
const OutcomeOK = "ok"

// ledgerMaxLen caps one day's stream; trimming is approximate (MAXLEN ~),
// which lets Redis drop whole nodes and keeps XADD cheap.
const ledgerMaxLen = 100000

// ledgerTTL keeps a day's stream for a week after its last entry, long
// enough for `faregate usage -day` to look back.
const ledgerTTL = 8 * 24 * time.Hour

// ledgerPage is how many entries one XRANGE fetches.
const ledgerPage = 1000

// Entry is one model call as the ledger records it. Reserved is what the
// budget held for the call, so reports can show how far estimates were off.
type Entry struct {
	Task, Model                                         string
	PromptTokens, CompletionTokens, Reserved, LatencyMS int64
	Outcome                                             string
}

// ModelTotal sums one model's entries of a day.
type ModelTotal struct {
	Model                                 string
	Calls, PromptTokens, CompletionTokens int64
	Reserved                              int64
	Errors                                int64
}

// Ledger appends model calls to a Redis Stream per UTC day and sums them.
// It is a prometheus.Collector for faregate_llm_tokens_total: register it
// where the other metrics are registered.
type Ledger struct {
	rdb    redis.Cmdable
	now    func() time.Time
	tokens *prometheus.CounterVec
}

// NewLedger returns a Ledger on rdb; now (default time.Now) picks the day.
func NewLedger(rdb redis.Cmdable, now func() time.Time) *Ledger {
	if now == nil {
		now = time.Now
	}
	return &Ledger{rdb: rdb, now: now, tokens: prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_llm_tokens_total",
		Help: "Tokens reported by the model provider, by model and kind (prompt or completion).",
	}, []string{"model", "kind"})}
}

// Describe implements prometheus.Collector.
func (l *Ledger) Describe(ch chan<- *prometheus.Desc) { l.tokens.Describe(ch) }

// Collect implements prometheus.Collector.
func (l *Ledger) Collect(ch chan<- prometheus.Metric) { l.tokens.Collect(ch) }

// UsageKey is the stream of one UTC day.
func UsageKey(day string) string { return "faregate:usage:{" + day + "}" }

// Append records e in today's stream (XADD and EXPIRE in one pipeline).
// The token counters move even when Redis fails: the tokens were spent
// whether or not the ledger could note it.
func (l *Ledger) Append(ctx context.Context, e Entry) error {
	l.tokens.WithLabelValues(e.Model, "prompt").Add(float64(max(e.PromptTokens, 0)))
	l.tokens.WithLabelValues(e.Model, "completion").Add(float64(max(e.CompletionTokens, 0)))
	key := UsageKey(Day(l.now()))
	_, err := l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.XAdd(ctx, &redis.XAddArgs{
			Stream: key,
			MaxLen: ledgerMaxLen,
			Approx: true,
			Values: []any{
				"task", e.Task,
				"model", e.Model,
				"prompt_tokens", e.PromptTokens,
				"completion_tokens", e.CompletionTokens,
				"reserved", e.Reserved,
				"latency_ms", e.LatencyMS,
				"outcome", e.Outcome,
			},
		})
		p.Expire(ctx, key, ledgerTTL)
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w: ledger append: %w", ErrUnavailable, err)
	}
	return nil
}

// Totals sums the day's stream per model, sorted by model name. It pages
// through the stream with XRANGE so a full day never arrives as one reply.
func (l *Ledger) Totals(ctx context.Context, day string) ([]ModelTotal, error) {
	if err := validDay(day); err != nil {
		return nil, err
	}
	key := UsageKey(day)
	by := map[string]*ModelTotal{}
	start := "-"
	for {
		msgs, err := l.rdb.XRangeN(ctx, key, start, "+", ledgerPage).Result()
		if err != nil {
			return nil, fmt.Errorf("%w: ledger read: %w", ErrUnavailable, err)
		}
		for _, m := range msgs {
			if err := add(by, m); err != nil {
				return nil, err
			}
		}
		if len(msgs) < ledgerPage {
			break
		}
		// "(" makes the next page start after the last id seen (Redis ≥ 6.2).
		start = "(" + msgs[len(msgs)-1].ID
	}
	out := make([]ModelTotal, 0, len(by))
	for _, t := range by {
		out = append(out, *t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Model < out[j].Model })
	return out, nil
}

// add folds one stream entry into the per-model totals.
func add(by map[string]*ModelTotal, m redis.XMessage) error {
	str := func(f string) string { s, _ := m.Values[f].(string); return s }
	num := func(f string) (int64, error) {
		n, err := strconv.ParseInt(str(f), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("%w: %s field %s", ErrCorruptLedger, m.ID, f)
		}
		return n, nil
	}
	var vals [3]int64
	for i, f := range []string{"prompt_tokens", "completion_tokens", "reserved"} {
		n, err := num(f)
		if err != nil {
			return err
		}
		vals[i] = n
	}
	model := str("model")
	t, ok := by[model]
	if !ok {
		t = &ModelTotal{Model: model}
		by[model] = t
	}
	t.Calls++
	t.PromptTokens += vals[0]
	t.CompletionTokens += vals[1]
	t.Reserved += vals[2]
	if str("outcome") != OutcomeOK {
		t.Errors++
	}
	return nil
}

// WriteTable prints totals as an aligned table with a total row, or a
// sentence saying the day had no model calls.
func WriteTable(w io.Writer, day string, totals []ModelTotal) error {
	if len(totals) == 0 {
		_, err := fmt.Fprintf(w, "no model calls recorded on %s\n", day)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "MODEL\tCALLS\tERRORS\tPROMPT\tCOMPLETION\tTOTAL\tRESERVED\n")
	var sum ModelTotal
	row := func(t ModelTotal) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\n", t.Model, t.Calls, t.Errors,
			t.PromptTokens, t.CompletionTokens, t.PromptTokens+t.CompletionTokens, t.Reserved)
	}
	for _, t := range totals {
		row(t)
		sum.Calls += t.Calls
		sum.Errors += t.Errors
		sum.PromptTokens += t.PromptTokens
		sum.CompletionTokens += t.CompletionTokens
		sum.Reserved += t.Reserved
	}
	sum.Model = "total (" + day + ")"
	row(sum)
	return tw.Flush()
}
