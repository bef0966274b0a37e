package budget

import (
	"errors"
	"math"
	"reflect"
	"strings"
	"testing"
)

func TestParsePrices(t *testing.T) {
	cases := []struct {
		name string
		in   string
		want Prices
		errs []string // each must appear in the joined error
		n    int      // problems reported, one per bad entry
	}{
		{"blank", "  ", Prices{}, nil, 0},
		{"one", "gpt-4o-mini=0.15/0.60", Prices{"gpt-4o-mini": {InputMicroPerMTok: 150000, OutputMicroPerMTok: 600000}}, nil, 0},
		{"several with spaces", " gpt-4o-mini = 0.15 / 0.60 , gpt-4o=2.5/10 ",
			Prices{"gpt-4o-mini": {InputMicroPerMTok: 150000, OutputMicroPerMTok: 600000}, "gpt-4o": {InputMicroPerMTok: 2500000, OutputMicroPerMTok: 10000000}}, nil, 0},
		{"names with slash, colon and equals", "meta-llama/Llama-3=0.000001/0,qwen2.5:7b=0/0,a=b=1/2",
			Prices{"meta-llama/Llama-3": {InputMicroPerMTok: 1, OutputMicroPerMTok: 0}, "qwen2.5:7b": {InputMicroPerMTok: 0, OutputMicroPerMTok: 0}, "a=b": {InputMicroPerMTok: 1000000, OutputMicroPerMTok: 2000000}}, nil, 0},
		{"leading dot", "m=.5/1.", nil, []string{`entry 1 "m=.5/1.": output price`, "ends with a dot"}, 1},
		{"every problem at once",
			"gpt=0.15,=1/2,m=-1/2,n=1/0.0000001,,o=1/x,gpt-4o=1/1,gpt-4o=2/2,nothing",
			nil, []string{
				`entry 1 "gpt=0.15": want input/output`,
				`entry 2 "=1/2": model name is empty`,
				`entry 3 "m=-1/2": input price`,
				`entry 4 "n=1/0.0000001": output price`, "more than 6 decimal places",
				`entry 5 "": empty entry`,
				`entry 6 "o=1/x": output price`,
				`entry 8 "gpt-4o=2/2": model "gpt-4o" is priced twice`,
				`entry 9 "nothing": want model=input/output`,
			}, 8},
		{"too large", "m=99999999999999/1", nil, []string{"too large"}, 1},
		{"cache prices", "claude-sonnet-4-5=3/15/3.75/0.30,local=0/0/0/0",
			Prices{"claude-sonnet-4-5": {InputMicroPerMTok: 3000000, OutputMicroPerMTok: 15000000, CacheWriteMicroPerMTok: 3750000, CacheReadMicroPerMTok: 300000},
				"local": {}}, nil, 0},
		{"bad cache prices",
			"a=1/2/3,b=1/2/3/4/5,c=1/2/x/0.1,d=1/2/0/0.1,e=1/2/1.25/0",
			nil, []string{
				`entry 1 "a=1/2/3": want input/output`,
				`entry 2 "b=1/2/3/4/5": want input/output`,
				`entry 3 "c=1/2/x/0.1": cache_write price`,
				`entry 4 "d=1/2/0/0.1": cache_write price 0 stands for its default`,
				`entry 5 "e=1/2/1.25/0": cache_read price 0 stands for its default`,
			}, 5},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParsePrices(c.in)
			if c.errs == nil {
				if err != nil || !reflect.DeepEqual(got, c.want) {
					t.Fatalf("ParsePrices = %v, %v; want %v", got, err, c.want)
				}
				return
			}
			if err == nil || got != nil || !errors.Is(err, ErrPrice) {
				t.Fatalf("ParsePrices = %v, %v; want an ErrPrice", got, err)
			}
			for _, want := range c.errs {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error lacks %q:\n%v", want, err)
				}
			}
			if n := strings.Count(err.Error(), "budget: invalid price: entry"); n != c.n {
				t.Errorf("%d problems reported; want one per bad entry:\n%v", n, err)
			}
		})
	}
}

func TestParseMicro(t *testing.T) {
	cases := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"0", 0, true}, {"12", 12000000, true}, {"0.15", 150000, true}, {"2.500000", 2500000, true},
		{"0.000001", 1, true}, {".5", 500000, true},
		{"", 0, false}, {".", 0, false}, {"1.", 0, false}, {"-1", 0, false}, {"1e3", 0, false},
		{"1,5", 0, false}, {"0.1234567", 0, false}, {"9223372036855", 0, false},
	}
	for _, c := range cases {
		got, err := ParseMicro(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("ParseMicro(%q) = %d, %v; want %d ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}

func TestCost(t *testing.T) {
	mini := Price{InputMicroPerMTok: 150000, OutputMicroPerMTok: 600000} // gpt-4o-mini: 0.15/0.60 per million
	cases := []struct {
		name               string
		p                  Price
		prompt, completion int64
		want               int64
	}{
		{"exact", mini, 1_000_000, 1_000_000, 750000},
		{"rounds up", mini, 1, 0, 1},             // 0.15 micro → 1
		{"rounds up the sum", mini, 3, 1, 2},     // 0.45 + 0.6 = 1.05 → 2
		{"whole micro stays", mini, 20, 0, 3},    // exactly 3
		{"nothing costs nothing", mini, 0, 0, 0}, // no rounding from zero
		{"negative counts are zero", mini, -5, -5, 0},
		{"free model", Price{}, 1000, 1000, 0},
		{"saturates", Price{InputMicroPerMTok: math.MaxInt64, OutputMicroPerMTok: math.MaxInt64}, math.MaxInt64, math.MaxInt64, math.MaxInt64},
		{"large but exact", Price{InputMicroPerMTok: 10_000_000, OutputMicroPerMTok: 30_000_000}, 1 << 40, 1 << 40, (1 << 40) * 40},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := c.p.Cost(c.prompt, c.completion); got != c.want {
				t.Fatalf("Cost(%d, %d) = %d; want %d", c.prompt, c.completion, got, c.want)
			}
		})
	}
}

// TestCostOfCache: each part of a cached prompt is priced at its own rate,
// the defaults follow the input price (a five-minute write 1.25×, an
// hour's 2×, a read 0.1×), the sum is rounded up once, and Cost is CostOf
// of a prompt without cache.
func TestCostOfCache(t *testing.T) {
	sonnet := Price{InputMicroPerMTok: 3_000_000, OutputMicroPerMTok: 15_000_000} // 3/15, cache at its defaults
	given := Price{InputMicroPerMTok: 3_000_000, OutputMicroPerMTok: 15_000_000, CacheWriteMicroPerMTok: 4_000_000, CacheReadMicroPerMTok: 500_000}
	if sonnet.CacheWrite() != 3_750_000 || sonnet.CacheWrite1h() != 6_000_000 || sonnet.CacheRead() != 300_000 {
		t.Fatalf("defaults: write %d, 1h %d, read %d", sonnet.CacheWrite(), sonnet.CacheWrite1h(), sonnet.CacheRead())
	}
	// An operator's five-minute write above twice the input: the hour's is
	// never cheaper.
	if p := (Price{InputMicroPerMTok: 1_000_000, CacheWriteMicroPerMTok: 3_000_000}); p.CacheWrite1h() != 3_000_000 {
		t.Fatalf("1h write %d below the 5-minute one", p.CacheWrite1h())
	}
	const M = 1_000_000
	cases := []struct {
		name string
		p    Price
		u    Tokens
		want int64
	}{
		{"input and output", sonnet, Tokens{Input: M, Output: M}, 18_000_000},
		{"5-minute write", sonnet, Tokens{CacheWrite: M}, 3_750_000},
		{"hour write", sonnet, Tokens{CacheWrite: M, CacheWrite1h: M}, 6_000_000},
		{"half and half", sonnet, Tokens{CacheWrite: 2 * M, CacheWrite1h: M}, 9_750_000},
		{"1h above the total is all 1h", sonnet, Tokens{CacheWrite: M, CacheWrite1h: 5 * M}, 6_000_000},
		{"read", sonnet, Tokens{CacheRead: M}, 300_000},
		{"every part", sonnet, Tokens{Input: 10, CacheWrite: 1000, CacheWrite1h: 200, CacheRead: 5000, Output: 300}, 30 + 3000 + 1200 + 1500 + 4500},
		{"given prices", given, Tokens{Input: M, CacheWrite: M, CacheRead: M, Output: M}, 22_500_000},
		{"rounded up once", sonnet, Tokens{CacheRead: 1, Input: 1}, 4},
		{"negative parts are zero", sonnet, Tokens{Input: -M, CacheWrite: -1, CacheWrite1h: -1, CacheRead: -M, Output: -M}, 0},
		{"saturates", given, Tokens{Input: math.MaxInt64, CacheRead: math.MaxInt64}, math.MaxInt64},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := c.p.CostOf(c.u); got != c.want {
				t.Fatalf("CostOf(%+v) = %d; want %d", c.u, got, c.want)
			}
		})
	}
	// Cost is CostOf without cache.
	for _, n := range []int64{0, 1, 999_999, 12_345_678} {
		if a, b := sonnet.Cost(n, n), sonnet.CostOf(Tokens{Input: n, Output: n}); a != b {
			t.Fatalf("Cost(%d, %d) = %d, CostOf = %d", n, n, a, b)
		}
	}
	// A reservation of the whole prompt at the dearest input-side price
	// covers any split of it the provider reports.
	prompt, out := int64(40_000), int64(2_000)
	reserve := sonnet.ReserveCost(prompt, out)
	for _, u := range []Tokens{
		{Input: prompt, Output: out}, {CacheWrite: prompt, Output: out}, {CacheWrite: prompt, CacheWrite1h: prompt, Output: out},
		{CacheRead: prompt, Output: out}, {Input: prompt / 2, CacheWrite: prompt / 2, CacheWrite1h: prompt / 4, Output: out},
	} {
		if c := sonnet.CostOf(u); c > reserve {
			t.Fatalf("CostOf(%+v) = %d above ReserveCost %d", u, c, reserve)
		}
	}
	if reserve != sonnet.CostOf(Tokens{CacheWrite: prompt, CacheWrite1h: prompt, Output: out}) {
		t.Fatalf("ReserveCost %d is not the all-hour-write cost", reserve)
	}
}

func TestPricesCheck(t *testing.T) {
	ps := Prices{"a": {InputMicroPerMTok: 1, OutputMicroPerMTok: 1}, "b": {InputMicroPerMTok: 0, OutputMicroPerMTok: 0}}
	if err := ps.Check("a", "b"); err != nil {
		t.Fatalf("Check of priced models = %v", err)
	}
	err := ps.Check("a", "x", "y")
	if !errors.Is(err, ErrUnpriced) || !strings.Contains(err.Error(), `"x"`) || !strings.Contains(err.Error(), `"y"`) {
		t.Fatalf("Check = %v; want both unpriced models named", err)
	}
	if got := ps.Models(); !reflect.DeepEqual(got, []string{"a", "b"}) {
		t.Fatalf("Models = %v", got)
	}
}

func TestFormatMicro(t *testing.T) {
	cases := map[int64]string{
		0: "0.000000", 1: "0.000001", 1234567: "1.234567", 150000: "0.150000",
		-1: "-0.000001", -2500000: "-2.500000", math.MinInt64: "-9223372036854.775808",
	}
	for in, want := range cases {
		if got := FormatMicro(in); got != want {
			t.Errorf("FormatMicro(%d) = %q; want %q", in, got, want)
		}
	}
}
