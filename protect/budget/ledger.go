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
// budget held for the call, so reports can show how far estimates were
// off; the cost and overage fields are what Settle returned.
type Entry struct {
	// Principal is the visitor's (v_<hmac>) or API key's (k_<id>) id.
	Task, Model, Principal, RequestID                   string
	PromptTokens, CompletionTokens, Reserved, LatencyMS int64
	CostMicro, OverageTokens, OverageCostMicro          int64
	Outcome                                             string
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
	// Calls counts entries; Errors those whose outcome was not OutcomeOK;
	// Estimated those whose tokens were estimated.
	Calls, Errors, Estimated        int64
	PromptTokens, CompletionTokens  int64
	Reserved                        int64
	CostMicro                       int64
	OverageTokens, OverageCostMicro int64
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
		Help: "Tokens of model calls, by model, kind (prompt or completion) and source (provider: reported by the provider; estimate: counted by faregate).",
	}, []string{"model", "kind", "source"})}
}

// Describe implements prometheus.Collector.
func (l *Ledger) Describe(ch chan<- *prometheus.Desc) { l.tokens.Describe(ch) }

// Collect implements prometheus.Collector.
func (l *Ledger) Collect(ch chan<- prometheus.Metric) { l.tokens.Collect(ch) }

// UsageKey is the stream of one UTC day.
func UsageKey(day string) string { return "faregate:usage:{" + day + "}" }

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

// Append records e in today's stream (XADD and EXPIRE in one pipeline)
// and counts it. It is not idempotent: a model call's entry is written by
// Budget.SettleCall, which is; Append is for entries without a settle.
func (l *Ledger) Append(ctx context.Context, e Entry) error {
	l.Count(e)
	key := UsageKey(Day(l.now()))
	estimated := flag(e.Estimated)
	values := []any{
		"task", e.Task,
		"model", e.Model,
		"principal", e.Principal,
		"request_id", e.RequestID,
		"prompt_tokens", e.PromptTokens,
		"completion_tokens", e.CompletionTokens,
		"reserved", e.Reserved,
		"cost_micro", e.CostMicro,
		"overage_tokens", e.OverageTokens,
		"overage_cost_micro", e.OverageCostMicro,
		"latency_ms", e.LatencyMS,
		"outcome", e.Outcome,
		"estimated", estimated,
	}
	if e.Implausible {
		values = append(values, "usage_raw", e.RawUsage, "implausible", 1)
	}
	_, err := l.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.XAdd(ctx, &redis.XAddArgs{Stream: key, MaxLen: ledgerMaxLen, Approx: true, Values: values})
		p.Expire(ctx, key, ledgerTTL)
		return nil
	})
	if err != nil {
		return fmt.Errorf("%w: ledger append: %w", ErrUnavailable, err)
	}
	return nil
}

// Totals sums the day's stream by model or by principal (ByModel,
// ByPrincipal), sorted by key. It pages through the stream with XRANGE so
// a full day never arrives as one reply.
func (l *Ledger) Totals(ctx context.Context, day, by string) ([]Total, error) {
	if err := validDay(day); err != nil {
		return nil, err
	}
	if by != ByModel && by != ByPrincipal {
		return nil, fmt.Errorf("%w: totals by %q: want %q or %q", ErrInvalid, by, ByModel, ByPrincipal)
	}
	key := UsageKey(day)
	sums := map[string]*Total{}
	start := "-"
	for {
		msgs, err := l.rdb.XRangeN(ctx, key, start, "+", ledgerPage).Result()
		if err != nil {
			return nil, fmt.Errorf("%w: ledger read: %w", ErrUnavailable, err)
		}
		for _, m := range msgs {
			if err := add(sums, by, m); err != nil {
				return nil, err
			}
		}
		if len(msgs) < ledgerPage {
			break
		}
		// "(" makes the next page start after the last id seen (Redis ≥ 6.2).
		start = "(" + msgs[len(msgs)-1].ID
	}
	out := make([]Total, 0, len(sums))
	for _, t := range sums {
		out = append(out, *t)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
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
	if str("outcome") != OutcomeOK {
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
	fmt.Fprintf(tw, "%s\tCALLS\tERRORS\tESTIMATED\tPROMPT\tCOMPLETION\tTOTAL\tRESERVED\tCOST\tOVERAGE\tOVERAGE_COST\n", strings.ToUpper(by))
	row := func(key string, t Total) {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%d\t%s\n", key, t.Calls, t.Errors, t.Estimated,
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
	_ = cw.Write([]string{"day", by, "calls", "errors", "estimated_calls", "prompt_tokens", "completion_tokens",
		"total_tokens", "reserved_tokens", "cost", "overage_tokens", "overage_cost"})
	i := func(n int64) string { return strconv.FormatInt(n, 10) }
	for _, t := range totals {
		_ = cw.Write([]string{day, t.Key, i(t.Calls), i(t.Errors), i(t.Estimated), i(t.PromptTokens), i(t.CompletionTokens),
			i(satAdd(t.PromptTokens, t.CompletionTokens)), i(t.Reserved), FormatMicro(t.CostMicro), i(t.OverageTokens),
			FormatMicro(t.OverageCostMicro)})
	}
	cw.Flush()
	return cw.Error()
}
