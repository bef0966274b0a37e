package budget

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"sort"
	"strings"
)

var (
	// ErrPrice reports a malformed FAREGATE_MODEL_PRICES entry or amount.
	ErrPrice = errors.New("budget: invalid price")
	// ErrUnpriced reports a model without a price while a spend limit is
	// set: its calls could not be charged, so they must not be made.
	ErrUnpriced = errors.New("budget: model has no price")
)

// microPerUnit is how many micro-units make one unit of the prices'
// currency. Money is counted in integer micro-units everywhere (Go and
// Redis) so that sums are exact and scripts never see a float.
const microPerUnit = 1_000_000

// tokensPerPrice is the token count a Price is quoted for: providers quote
// per million tokens.
const tokensPerPrice = 1_000_000

// Price is what one model costs, in micro-units of the currency per
// million tokens: $0.15 per million input tokens is InputMicroPerMTok 150000.
//
// A provider with a prompt cache (Anthropic) bills the prompt in three
// parts: the tokens it read as usual (input), those it wrote to its cache
// and those it read from it. The cache prices are 0 when not given, which
// means their defaults: a cache write at DefaultCacheWrite times the input
// price, a cache read at DefaultCacheRead times it; a write cached for an
// hour at CacheWrite1hPercent, never below the five-minute write.
type Price struct {
	InputMicroPerMTok, OutputMicroPerMTok int64
	// CacheWriteMicroPerMTok is a five-minute cache write; 0: the default.
	CacheWriteMicroPerMTok int64
	// CacheReadMicroPerMTok is a cache read; 0: the default.
	CacheReadMicroPerMTok int64
}

// Anthropic's cache multipliers of the input price, in percent (its
// pricing page): a five-minute cache write 125, an hour's 200, a cache
// read 10.
const (
	DefaultCacheWritePercent = 125
	CacheWrite1hPercent      = 200
	DefaultCacheReadPercent  = 10
)

// percentOf is pct percent of micro, rounded up (a price that rounds down
// would under-charge), saturating.
func percentOf(micro, pct int64) int64 {
	if micro <= 0 {
		return 0
	}
	if micro > math.MaxInt64/pct {
		return math.MaxInt64
	}
	return (micro*pct + 99) / 100
}

// CacheWrite is the price of a million tokens written to a five-minute
// cache.
func (p Price) CacheWrite() int64 {
	if p.CacheWriteMicroPerMTok > 0 {
		return p.CacheWriteMicroPerMTok
	}
	return percentOf(p.InputMicroPerMTok, DefaultCacheWritePercent)
}

// CacheWrite1h is the price of a million tokens written to an hour's
// cache: twice the input price, and never less than a five-minute write.
func (p Price) CacheWrite1h() int64 {
	return max(percentOf(p.InputMicroPerMTok, CacheWrite1hPercent), p.CacheWrite())
}

// CacheRead is the price of a million tokens read from the cache.
func (p Price) CacheRead() int64 {
	if p.CacheReadMicroPerMTok > 0 {
		return p.CacheReadMicroPerMTok
	}
	return percentOf(p.InputMicroPerMTok, DefaultCacheReadPercent)
}

// Tokens is a call's usage in the parts a provider with a prompt cache
// bills apart. The prompt is Input + CacheWrite + CacheRead (Anthropic's
// input_tokens excludes what it wrote to or read from the cache);
// CacheWrite1h is the part of CacheWrite cached for an hour.
type Tokens struct {
	Input, CacheWrite, CacheWrite1h, CacheRead, Output int64
}

// Cost is what prompt input and completion output tokens cost in
// micro-units, rounded up: a budget that rounds down would let many small
// calls together spend more than the cap. The product is computed in 128
// bits and saturates at math.MaxInt64; negative counts count as zero.
func (p Price) Cost(prompt, completion int64) int64 {
	return costOf([][2]int64{{prompt, p.InputMicroPerMTok}, {completion, p.OutputMicroPerMTok}})
}

// CostOf is what a call's usage costs, each part at its own price, in
// micro-units rounded up once over the sum (as Cost). A CacheWrite1h
// larger than CacheWrite is all an hour's write; negative counts count as
// zero.
func (p Price) CostOf(t Tokens) int64 {
	hour := min(max(t.CacheWrite1h, 0), max(t.CacheWrite, 0))
	return costOf([][2]int64{
		{t.Input, p.InputMicroPerMTok},
		{max(t.CacheWrite, 0) - hour, p.CacheWrite()},
		{hour, p.CacheWrite1h()},
		{t.CacheRead, p.CacheRead()},
		{t.Output, p.OutputMicroPerMTok},
	})
}

// ReserveCost is what a call of prompt and completion tokens may cost at
// the most, its prompt at the dearest of the input-side prices (a prompt
// the provider writes whole to an hour's cache costs twice its input): a
// reservation at this never falls short of CostOf the usage it settles
// with.
func (p Price) ReserveCost(prompt, completion int64) int64 {
	dearest := max(p.InputMicroPerMTok, p.CacheWrite1h(), p.CacheRead())
	return costOf([][2]int64{{prompt, dearest}, {completion, p.OutputMicroPerMTok}})
}

// costOf sums count × price over terms in 128 bits and divides by
// tokensPerPrice, rounding up once; it saturates at math.MaxInt64.
func costOf(terms [][2]int64) int64 {
	var hi, lo uint64
	for _, t := range terms {
		h, l := bits.Mul64(uint64(max(t[0], 0)), uint64(max(t[1], 0)))
		var carry, over uint64
		lo, carry = bits.Add64(lo, l, 0)
		hi, over = bits.Add64(hi, h, carry)
		if over != 0 {
			return math.MaxInt64
		}
	}
	lo, carry := bits.Add64(lo, tokensPerPrice-1, 0)
	hi, over := bits.Add64(hi, 0, carry)
	// Div64 needs hi < divisor; anything larger is far past MaxInt64.
	if over != 0 || hi >= tokensPerPrice {
		return math.MaxInt64
	}
	q, _ := bits.Div64(hi, lo, tokensPerPrice)
	if q > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(q)
}

// Prices maps a model name, exactly as sent to the provider, to its price.
type Prices map[string]Price

// Check reports every model in models that has no price, joined in one
// error wrapping ErrUnpriced, or nil. The caller runs it at start-up when a
// spend limit is set, so a model that could not be charged never serves.
func (ps Prices) Check(models ...string) error {
	var errs []error
	for _, m := range models {
		if _, ok := ps[m]; !ok {
			errs = append(errs, fmt.Errorf("%w: %q (add it to FAREGATE_MODEL_PRICES)", ErrUnpriced, m))
		}
	}
	return errors.Join(errs...)
}

// Models lists the priced models, sorted.
func (ps Prices) Models() []string {
	out := make([]string, 0, len(ps))
	for m := range ps {
		out = append(out, m)
	}
	sort.Strings(out)
	return out
}

// ParsePrices reads FAREGATE_MODEL_PRICES: comma-separated entries
// `model=input/output[/cache_write/cache_read]`, each amount in currency
// units per million tokens, e.g. `gpt-4o-mini=0.15/0.60,gpt-4o=2.50/10`
// or `claude-sonnet-4-5=3/15/3.75/0.30`. Without the cache prices they
// are their defaults (Price). Blank input is no prices. Every problem is
// reported at once (errors.Join), each wrapping ErrPrice. The model name
// is everything before the last "=", so names with "/" or ":"
// (meta-llama/Llama-3, qwen2.5:7b) work.
func ParsePrices(s string) (Prices, error) {
	ps := Prices{}
	if strings.TrimSpace(s) == "" {
		return ps, nil
	}
	var errs []error
	for i, raw := range strings.Split(s, ",") {
		entry := strings.TrimSpace(raw)
		bad := func(format string, a ...any) {
			errs = append(errs, fmt.Errorf("%w: entry %d %q: %s", ErrPrice, i+1, entry, fmt.Sprintf(format, a...)))
		}
		if entry == "" {
			bad("empty entry")
			continue
		}
		eq := strings.LastIndex(entry, "=")
		if eq < 0 {
			bad("want model=input/output")
			continue
		}
		model, val := strings.TrimSpace(entry[:eq]), strings.TrimSpace(entry[eq+1:])
		if model == "" {
			bad("model name is empty")
		}
		amounts := strings.Split(val, "/")
		if len(amounts) != 2 && len(amounts) != 4 {
			bad("want input/output prices separated by \"/\", optionally followed by /cache_write/cache_read")
			continue
		}
		var micro [4]int64
		ok := model != ""
		for j, a := range amounts {
			m, err := ParseMicro(strings.TrimSpace(a))
			if err != nil {
				bad("%s price: %v", priceNames[j], err)
				ok = false
			}
			micro[j] = m
		}
		p := Price{InputMicroPerMTok: micro[0], OutputMicroPerMTok: micro[1], CacheWriteMicroPerMTok: micro[2], CacheReadMicroPerMTok: micro[3]}
		if len(amounts) == 4 && ok {
			if err := p.checkCache(); err != nil {
				bad("%v", err)
				ok = false
			}
		}
		if !ok {
			continue
		}
		if _, dup := ps[model]; dup {
			bad("model %q is priced twice", model)
			continue
		}
		ps[model] = p
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return ps, nil
}

// priceNames name the amounts of an entry, in order.
var priceNames = [4]string{"input", "output", "cache_write", "cache_read"}

// checkCache refuses a cache price given as 0 where its default is not:
// 0 stands for the default (Price), so it cannot also mean "free", and
// an operator who wrote it would be charged otherwise than they said.
func (p Price) checkCache() error {
	if p.CacheWriteMicroPerMTok == 0 && p.CacheWrite() > 0 {
		return errors.New("cache_write price 0 stands for its default (1.25 × input); give the real price or leave both cache prices out")
	}
	if p.CacheReadMicroPerMTok == 0 && p.CacheRead() > 0 {
		return errors.New("cache_read price 0 stands for its default (0.1 × input); give the real price or leave both cache prices out")
	}
	return nil
}

// ParseMicro reads a non-negative decimal amount of currency ("0.15",
// "12", "2.500000") as integer micro-units, exactly: no float is involved,
// and more than six decimal places is an error rather than a silent
// rounding. FAREGATE_DAILY_SPEND_LIMIT is read with it.
func ParseMicro(s string) (int64, error) {
	whole, frac, hasDot := strings.Cut(s, ".")
	if whole == "" && frac == "" {
		return 0, fmt.Errorf("%w: %q is not an amount", ErrPrice, s)
	}
	if hasDot && frac == "" {
		return 0, fmt.Errorf("%w: %q ends with a dot", ErrPrice, s)
	}
	if len(frac) > 6 {
		return 0, fmt.Errorf("%w: %q has more than 6 decimal places", ErrPrice, s)
	}
	var w int64
	for _, c := range []byte(whole) {
		if c < '0' || c > '9' {
			return 0, fmt.Errorf("%w: %q is not a non-negative decimal number", ErrPrice, s)
		}
		if w > (math.MaxInt64/microPerUnit-9)/10 {
			return 0, fmt.Errorf("%w: %q is too large", ErrPrice, s)
		}
		w = w*10 + int64(c-'0')
	}
	var f int64
	for i := range 6 {
		f *= 10
		if i < len(frac) {
			c := frac[i]
			if c < '0' || c > '9' {
				return 0, fmt.Errorf("%w: %q is not a non-negative decimal number", ErrPrice, s)
			}
			f += int64(c - '0')
		}
	}
	return w*microPerUnit + f, nil
}

// FormatMicro writes micro-units as currency units with all six decimals,
// "1.234567", so a report never hides a rounding.
func FormatMicro(m int64) string {
	sign := ""
	u := uint64(m)
	if m < 0 {
		sign, u = "-", uint64(-(m+1))+1 // MinInt64 has no positive twin
	}
	return fmt.Sprintf("%s%d.%06d", sign, u/microPerUnit, u%microPerUnit)
}
