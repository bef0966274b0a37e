package budget

import "testing"

// TestSetPrices: a price replaced by SetPrices is what Cost charges next,
// and the caller's map is copied, not kept (a reload builds a new one).
func TestSetPrices(t *testing.T) {
	ps := Prices{"m": {InputMicroPerMTok: 1_000_000, OutputMicroPerMTok: 1_000_000}}
	b := New(nil, Options{Prices: ps, Limits: Limits{SpendMicro: 5_000_000}})
	if c, err := b.Cost("m", 1000, 1000); err != nil || c != 2000 {
		t.Fatalf("cost at 1/M: %d, %v", c, err)
	}
	ps["m"] = Price{} // the caller's map is not the budget's
	if c, _ := b.Cost("m", 1000, 1000); c != 2000 {
		t.Fatalf("the caller's later write changed the price: %d", c)
	}
	b.SetPrices(Prices{"m": {InputMicroPerMTok: 3_000_000, OutputMicroPerMTok: 3_000_000}})
	if c, err := b.Cost("m", 1000, 1000); err != nil || c != 6000 {
		t.Fatalf("cost after SetPrices to 3/M: %d, %v", c, err)
	}
	b.SetPrices(nil)
	if _, err := b.Cost("m", 1000, 1000); err == nil {
		t.Fatal("a model whose price was removed is priced while a spend limit is set")
	}
}
