package main

import (
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// TestMeasureHostileStreams measures #7's closing claim: "A hostile client
// on one IP can only hurt itself. While 3,000 streams from one visitor are
// attempted, that visitor holds at most 4, Redis serves at most a few
// hundred operations a second for all followers together, and other
// visitors' creations keep p95 under 250 ms."
//
// On the documented default limits and a private redis-server, one visitor
// attempts 3,000 concurrent event streams on a running task, twice: first
// alone (what the attack itself costs Redis), then while 200 other
// visitors (behind a trusted proxy) create tasks. A control runs the same
// creations with no attack. It reports the streams held and refused by
// code, Redis commands per second, creation p50/p95, and log bytes per
// 1,000 denials. Only the held count is asserted; the rest are numbers for
// the closing note, whatever the machine. The attacker runs in the
// server's process and shares its CPU, so the creation latencies are an
// upper bound. Run it by hand:
//
//	FAREGATE_MEASURE=1 go test ./cmd/faregate/ -run TestMeasureHostileStreams -v
func TestMeasureHostileStreams(t *testing.T) {
	if os.Getenv("FAREGATE_MEASURE") != "1" {
		t.Skip("set FAREGATE_MEASURE=1 to measure (never in CI)")
	}
	const attempts, creators = 3000, 200
	rs := redistest.Start(t)
	rc := rs.Client(t)
	const hold = "Held-Measure"
	llm, release := heldLLM(t, hold)
	s := startServer(t, realRedisEnv(rs.URL(), map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		// The documented defaults for the limits under test (the harness
		// opens the window and the failed-check throttle wide).
		"FAREGATE_REQUESTS_PER_MINUTE": "120", "FAREGATE_FAILED_CHECKS_PER_HOUR": "20",
		"FAREGATE_STREAMS_PER_VISITOR": "4", "FAREGATE_STREAMS_MAX": "2000", "FAREGATE_LOG_SUMMARY_INTERVAL": "10s",
		// Room for 400 creations: the site's day, its budget and queue.
		"FAREGATE_TRUSTED_PROXIES": "127.0.0.1", "FAREGATE_GLOBAL_DAILY_LIMIT": "100000",
		"FAREGATE_DAILY_TOKEN_BUDGET": "100000000", "FAREGATE_QUEUE_MAX": "1000", "FAREGATE_SHUTDOWN_TIMEOUT": "1s"}))
	id := startHeldTask(t, s, llm, hold, map[string]string{"X-Forwarded-For": "192.0.2.1"})
	path := "/api/tasks/" + id + "/events"
	hostile := map[string]string{"X-Forwarded-For": "192.0.2.66"}

	var held []*rawStream
	t.Cleanup(func() {
		for _, st := range held {
			st.close()
		}
	})
	// burst makes the hostile visitor's attempts, all at once when start
	// closes; it returns the answers, and keeps the streams it got.
	var dialErrs atomic.Int64
	burst := func(start <-chan struct{}) *answerTally {
		var answers answerTally
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := 0; i < attempts; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				// A sample of the answers is checked against the document:
				// checking all would compete with the server for the CPU.
				st, err := openStreamChecked(t, s.URL, path, hostile, i%100 == 0)
				if err != nil {
					dialErrs.Add(1)
					return
				}
				answers.add(st.resp.StatusCode, st.code())
				if st.held() {
					mu.Lock()
					held = append(held, st)
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		return &answers
	}
	c := keepAliveClient(t, 10)
	// creations has 200 other visitors create tasks, 10 at a time, and
	// returns their answers and latencies.
	creations := func(start <-chan struct{}, prefix string) (*answerTally, []time.Duration) {
		<-start
		var answers answerTally
		lat := make([]time.Duration, creators)
		runWorkers(creators, 10, func(i int) {
			t0 := time.Now()
			r := doOn(t, c, i%20 == 0, "POST", s.URL+"/api/tasks", oneDayBody("Rome"),
				map[string]string{"X-Forwarded-For": fmt.Sprintf("%s.%d", prefix, i)})
			lat[i] = time.Since(t0)
			answers.add(r.Status, r.code())
		})
		return &answers, lat
	}
	now := make(chan struct{})
	close(now)

	// The control: creations without an attack, on the same busy machine.
	calmCodes, calm := creations(now, "198.51.100")
	waitRuns(t, s, calmCodes.get("202"))

	// 1. The attack alone.
	logBase := len(s.Out.String())
	waits0 := serverSeries(t, s, `faregate_redis_pool_waits_total{pool="main"}`)
	meter := startOps(t, rc)
	t0 := time.Now()
	first := burst(now)
	firstTook := time.Since(t0)
	firstOps, firstN := meter.rate(t)
	heldN := len(held)
	if heldN > 4 {
		t.Errorf("the hostile visitor holds %d streams, want at most 4", heldN)
	}

	// 2. The attack again (its streams are held) while others create.
	ended0 := endedTasks(t, s)
	start := make(chan struct{})
	begin := sync.OnceFunc(func() { close(start) })
	var second *answerTally
	var attacking sync.WaitGroup
	// The attack reports through t: it ends before the test does, however
	// the test ends (once begun, its attempts all get an answer or a dial
	// error).
	t.Cleanup(func() { begin(); attacking.Wait() })
	attacking.Add(1)
	go func() { defer attacking.Done(); second = burst(start) }()
	meter = startOps(t, rc)
	t0 = time.Now()
	begin()
	created, lat := creations(now, "203.0.113")
	attacking.Wait()
	bothTook := time.Since(t0)
	bothOps, bothN := meter.rate(t)
	if len(held) > 4 {
		t.Errorf("the hostile visitor holds %d streams, want at most 4", len(held))
	}
	waits := serverSeries(t, s, `faregate_redis_pool_waits_total{pool="main"}`) - waits0

	// 3. What the held streams cost while they wait, once the runs are over.
	waitRuns(t, s, int(ended0)+created.get("202"))
	meter = startOps(t, rc)
	letTimePass(3 * time.Second) // a measurement interval, not synchronisation
	idleOps, idleN := meter.rate(t)

	// Denials: every answer but a held stream or a 202. Refusals (4xx) are
	// summarised; failures (5xx) log a line each. Wait for the summary (a
	// 10 s interval) to account for the refusals, then count their bytes.
	denied, refused := 0, 0
	for _, tl := range []*answerTally{first, second, created} {
		for k, n := range tl.m {
			if k == "200" || k == "202" {
				continue
			}
			denied += n
			if k[0] == '4' {
				refused += n
			}
		}
	}
	clocktest.Poll(30*time.Second, func() bool {
		total, _, _ := refusalSummary(s.Out.String()[logBase:])
		return total >= int64(refused)
	})
	added := s.Out.String()[logBase:]
	var denialBytes, otherBytes int
	for _, line := range strings.SplitAfter(added, "\n") {
		if strings.Contains(line, `"msg":"refused requests"`) || strings.Contains(line, `"msg":"request failed"`) {
			denialBytes += len(line)
			continue
		}
		otherBytes += len(line)
	}
	total, byCode, lines := refusalSummary(added)
	release()

	ms := func(d time.Duration) time.Duration { return d.Round(time.Millisecond) }
	t.Logf("attack alone: %d concurrent stream attempts in %s: %s; held %d; dial errors %d; Redis %d commands (%.0f/s)",
		attempts, ms(firstTook), first.String(), heldN, dialErrs.Load(), firstN, firstOps)
	t.Logf("attack again with %d creations: %s in %s; held %d; Redis %d commands (%.0f/s), main pool waits +%v",
		creators, second.String(), ms(bothTook), len(held), bothN, bothOps, waits)
	t.Logf("creations during the attack: %s; p50 %s p95 %s max %s; without an attack: %s; p50 %s p95 %s max %s",
		created.String(), ms(nearestRank(lat, 50)), ms(nearestRank(lat, 95)), ms(nearestRank(lat, 100)),
		calmCodes.String(), ms(nearestRank(calm, 50)), ms(nearestRank(calm, 95)), ms(nearestRank(calm, 100)))
	t.Logf("%d held streams waiting, after the runs: %.1f Redis commands/s (%d in 3s)", len(held), idleOps, idleN)
	t.Logf("log: %d denials (%d refused; the summary counted %d in %d lines %v): %d bytes = %.0f bytes per 1,000 denials "+
		"(round 1: ~330,000); %d bytes of other lines (admissions, runs)",
		denied, refused, total, lines, byCode, denialBytes, float64(denialBytes)*1000/float64(max(denied, 1)), otherBytes)
}

// endedTasks is how many tasks reached a final status in this process.
func endedTasks(t testing.TB, s *server) float64 {
	m := scrapeMetrics(t, s.URL)
	return seriesValue(m, `faregate_tasks_total{status="succeeded"}`) + seriesValue(m, `faregate_tasks_total{status="failed"}`)
}

// waitRuns polls until n tasks have ended in this process (2 min at most):
// a measurement of what waiting streams cost starts once the runs are over.
func waitRuns(t testing.TB, s *server, n int) {
	if !clocktest.Poll(2*time.Minute, func() bool { return endedTasks(t, s) >= float64(n) }) {
		t.Logf("only %v of %d tasks ended within 2 min", endedTasks(t, s), n)
	}
}
