package budget

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// redisCPU is the redis-server's CPU so far (INFO cpu: user + system).
func redisCPU(b *testing.B, rdb *redis.Client) time.Duration {
	info, err := rdb.Info(context.Background(), "cpu").Result()
	if err != nil {
		b.Fatal(err)
	}
	var total float64
	for line := range strings.Lines(info) {
		k, v, ok := strings.Cut(strings.TrimSpace(line), ":")
		if ok && (k == "used_cpu_sys" || k == "used_cpu_user") {
			f, _ := strconv.ParseFloat(v, 64)
			total += f
		}
	}
	return time.Duration(total * float64(time.Second))
}

// BenchmarkReserveSettle is one model call's budget, a reserve and a
// settle with its ledger entry, on one private redis-server, the ways a
// day can run side by side: the day layout's two scripts (the baseline),
// the principals' layout per call, and with leased blocks; one caller at
// a time and 32 at once (where group commit shares scripts). It reports
// the redis-server's CPU per call (redis-cpu-µs/op) and the scripts a
// call cost (scripts/op).
func BenchmarkReserveSettle(b *testing.B) {
	redistest.Require(b)
	srv := redistest.Start(b)
	rdb := srv.Client(b)
	ctx := context.Background()
	for _, way := range []struct {
		name   string
		layout int
		lease  LeaseOptions
	}{
		{"day-layout", layoutDay, LeaseOptions{}},
		{"per-call", layoutPrincipals, LeaseOptions{}},
		{"leased", layoutPrincipals, LeaseOptions{Calls: DefaultLeaseCalls}},
	} {
		for _, workers := range []int{1, 32} {
			b.Run(fmt.Sprintf("%s/%d", way.name, workers), func(b *testing.B) {
				if err := rdb.FlushDB(ctx).Err(); err != nil {
					b.Fatal(err)
				}
				d := time.Now().UTC().Format(time.DateOnly)
				if way.layout == layoutDay {
					rdb.HSet(ctx, dayPrefix(d)+"site", "outstanding", 0)
				}
				bud := New(rdb, Options{Limits: Limits{Site: 1 << 40, Principal: 1 << 40, Task: 1 << 40}, Lease: way.lease})
				b.Cleanup(func() { _ = bud.Close(ctx) })
				call := func(i int) error {
					req := Request{Day: d, Principal: "v_" + strconv.Itoa(i%4), Task: "t_" + strconv.Itoa(i%64), Tier: "public",
						TierLimit: 1 << 40, Model: "m", PromptTokens: 30, MaxTokens: 200}
					r, err := bud.Reserve(ctx, req)
					if err == nil {
						_, err = bud.SettleCall(ctx, r, Call{PromptTokens: 20, CompletionTokens: 10,
							Ledger: &Entry{Task: req.Task, Model: req.Model, Principal: req.Principal, Outcome: OutcomeOK}})
					}
					return err
				}
				if err := call(0); err != nil { // the layout, the scripts, the first lease
					b.Fatal(err)
				}
				scripts := func() int64 {
					info := rdb.Info(ctx, "commandstats").Val()
					var n int64
					for line := range strings.Lines(info) {
						if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "cmdstat_evalsha:calls="); ok {
							n, _ = strconv.ParseInt(rest[:strings.IndexByte(rest, ',')], 10, 64)
						}
					}
					return n
				}
				var next atomic.Int64
				b.ResetTimer()
				cpu0, s0 := redisCPU(b, rdb), scripts()
				var wg sync.WaitGroup
				for range workers {
					wg.Go(func() {
						for {
							i := int(next.Add(1))
							if i > b.N {
								return
							}
							if err := call(i); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
				b.StopTimer()
				b.ReportMetric(float64((redisCPU(b, rdb)-cpu0).Microseconds())/float64(b.N), "redis-cpu-µs/op")
				b.ReportMetric(float64(scripts()-s0)/float64(b.N), "scripts/op")
			})
		}
	}
}
