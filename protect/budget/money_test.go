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
		{"one", "gpt-4o-mini=0.15/0.60", Prices{"gpt-4o-mini": {150000, 600000}}, nil, 0},
		{"several with spaces", " gpt-4o-mini = 0.15 / 0.60 , gpt-4o=2.5/10 ",
			Prices{"gpt-4o-mini": {150000, 600000}, "gpt-4o": {2500000, 10000000}}, nil, 0},
		{"names with slash, colon and equals", "meta-llama/Llama-3=0.000001/0,qwen2.5:7b=0/0,a=b=1/2",
			Prices{"meta-llama/Llama-3": {1, 0}, "qwen2.5:7b": {0, 0}, "a=b": {1000000, 2000000}}, nil, 0},
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
	mini := Price{150000, 600000} // gpt-4o-mini: 0.15/0.60 per million
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
		{"saturates", Price{math.MaxInt64, math.MaxInt64}, math.MaxInt64, math.MaxInt64, math.MaxInt64},
		{"large but exact", Price{10_000_000, 30_000_000}, 1 << 40, 1 << 40, (1 << 40) * 40},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := c.p.Cost(c.prompt, c.completion); got != c.want {
				t.Fatalf("Cost(%d, %d) = %d; want %d", c.prompt, c.completion, got, c.want)
			}
		})
	}
}

func TestPricesCheck(t *testing.T) {
	ps := Prices{"a": {1, 1}, "b": {0, 0}}
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
