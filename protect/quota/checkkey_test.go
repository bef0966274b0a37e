package quota_test

import (
	"context"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/quota"
)

// TestCheckKeyBelowItsLimit: checking an API key that still has tasks left
// neither refuses it nor leaves a denial in memory, so the Take that
// follows (the order POST /api/tasks runs them in) admits it.
func TestCheckKeyBelowItsLimit(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			clk := clocktest.New(time.Date(2026, 8, 31, 12, 0, 0, 0, time.UTC))
			q := quota.New(be.Client, clk.Now)
			key := quota.Subject{Key: "acme", Limit: 3}
			for i, want := range []int64{2, 1, 0} {
				d, err := q.Check(ctx, key)
				if err != nil || d.Remaining != want+1 {
					t.Fatalf("check before take %d: %+v %v", i, d, err)
				}
				if err := q.Remembered(key); err != nil {
					t.Fatalf("check before take %d left a denial in memory: %v", i, err)
				}
				if d, err = q.Take(ctx, key); err != nil || d.Remaining != want {
					t.Fatalf("take %d: %+v %v", i, d, err)
				}
			}
		})
	}
}
