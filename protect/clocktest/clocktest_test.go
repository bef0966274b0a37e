package clocktest

import (
	"sync"
	"testing"
	"time"
)

func TestClock(t *testing.T) {
	start := time.Date(2026, 8, 31, 23, 59, 0, 0, time.FixedZone("CEST", 2*3600))
	c := New(start)
	if got := c.Now(); !got.Equal(start) || got.Location() != time.UTC {
		t.Fatalf("Now = %v, want %v in UTC", got, start)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 100 {
				c.Advance(time.Second)
			}
		}()
	}
	wg.Wait()
	if got, want := c.Now(), start.Add(800*time.Second); !got.Equal(want) {
		t.Fatalf("after 800 advances of 1s: %v, want %v", got, want)
	}
	c.Set(start)
	if !c.Now().Equal(start) {
		t.Fatalf("Set: %v", c.Now())
	}
}
