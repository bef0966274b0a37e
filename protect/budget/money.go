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
type Price struct {
	InputMicroPerMTok, OutputMicroPerMTok int64
}

// Cost is what prompt input and completion output tokens cost in
// micro-units, rounded up: a budget that rounds down would let many small
// calls together spend more than the cap. The product is computed in 128
// bits and saturates at math.MaxInt64; negative counts count as zero.
func (p Price) Cost(prompt, completion int64) int64 {
	hi1, lo1 := bits.Mul64(uint64(max(prompt, 0)), uint64(max(p.InputMicroPerMTok, 0)))
	hi2, lo2 := bits.Mul64(uint64(max(completion, 0)), uint64(max(p.OutputMicroPerMTok, 0)))
	lo, carry := bits.Add64(lo1, lo2, 0)
	hi, over := bits.Add64(hi1, hi2, carry)
	lo, carry = bits.Add64(lo, tokensPerPrice-1, 0)
	hi, over2 := bits.Add64(hi, 0, carry)
	// Div64 needs hi < divisor; anything larger is far past MaxInt64.
	if over != 0 || over2 != 0 || hi >= tokensPerPrice {
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
// `model=input/output`, each amount in currency units per million tokens,
// e.g. `gpt-4o-mini=0.15/0.60,gpt-4o=2.50/10`. Blank input is no prices.
// Every problem is reported at once (errors.Join), each wrapping ErrPrice.
// The model name is everything before the last "=", so names with "/" or
// ":" (meta-llama/Llama-3, qwen2.5:7b) work.
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
		in, out, ok := strings.Cut(val, "/")
		if !ok {
			bad("want input/output prices separated by \"/\"")
			continue
		}
		inM, errIn := ParseMicro(strings.TrimSpace(in))
		if errIn != nil {
			bad("input price: %v", errIn)
		}
		outM, errOut := ParseMicro(strings.TrimSpace(out))
		if errOut != nil {
			bad("output price: %v", errOut)
		}
		if model == "" || errIn != nil || errOut != nil {
			continue
		}
		if _, dup := ps[model]; dup {
			bad("model %q is priced twice", model)
			continue
		}
		ps[model] = Price{InputMicroPerMTok: inM, OutputMicroPerMTok: outM}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return ps, nil
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
