package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/protect/budget"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/quota"
)

// The Redis Cluster tests of issue #8. The shared cluster that .ci/run
// starts serves the tests that leave it standing; the failover test kills
// a master, so it starts a cluster of its own.

// clusterEnv is the environment of a replica on cluster cl.
func clusterEnv(t *testing.T, url string, extra map[string]string) map[string]string {
	env := realRedisEnv(url, map[string]string{"FAREGATE_REDIS_CLUSTER": "true", "FAREGATE_TRUSTED_PROXIES": "127.0.0.1",
		"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t), "FAREGATE_LOG_LEVEL": "warn"})
	for k, v := range extra {
		env[k] = v
	}
	return env
}

// visitorXFF is a distinct visitor (its own IPv6 /64) for each i.
func visitorXFF(i int) map[string]string {
	return map[string]string{"X-Forwarded-For": fmt.Sprintf("2001:db8:%x::1", i)}
}

// TestClusterTwoReplicas: two replicas on the cluster. 400 concurrent
// creations from 200 visitors (one task each per day) against a site limit
// of 40 admit exactly 40; every admitted task's budget settles (nothing
// left outstanding, settled = what the tasks report = what the ledger
// says); a task's events stream from the replica that did not admit it;
// `faregate usage` reads the ledger on the cluster.
func TestClusterTwoReplicas(t *testing.T) {
	redistest.WantCluster(t, false)
	cl := redistest.SharedCluster(t)
	const site = 40
	env := clusterEnv(t, cl.URL, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "1", "FAREGATE_GLOBAL_DAILY_LIMIT": strconv.Itoa(site),
		"FAREGATE_DAILY_TOKEN_BUDGET": "100000000", "FAREGATE_IP_DAILY_TOKENS": "1000000",
		// 400 at once wait for pooled Redis connections; on a busy machine
		// under -race longer than the default 3 s, and a request that times
		// out is refused with 503. Exactness is the point here, not speed.
		"FAREGATE_REDIS_TIMEOUT": "10s",
		// The test's own reads (40 tasks polled, then an event stream,
		// all from 127.0.0.1) are not what it is about: the per-second
		// window answered the stream 429 one run in three.
		"FAREGATE_REQUESTS_PER_SECOND": "0"})
	a, b := startServer(t, env), startServer(t, env)
	var mu sync.Mutex
	admitted := map[string]*server{}
	codes := hammer(t, 400, func(i int) reply {
		s := a
		if i%2 == 1 {
			s = b
		}
		r := do(t, "POST", s.URL+"/api/tasks", taskBody("Lisbon"), visitorXFF(i%200))
		if r.Status == 202 {
			mu.Lock()
			admitted[r.Body["id"].(string)] = s
			mu.Unlock()
		}
		return r
	})
	if codes["202"] != site || len(admitted) != site {
		t.Fatalf("admitted %d (%d ids), want exactly %d: %v", codes["202"], len(admitted), site, codes)
	}
	for k := range codes {
		if k != "202" && k != "429 demo_ip_limit_reached" && k != "429 demo_global_limit_reached" {
			t.Fatalf("unexpected answers: %v", codes)
		}
	}
	ctx := context.Background()
	cc := cl.Client(t)
	day := quota.Day(time.Now())
	if g, err := cc.Get(ctx, quota.GlobalKey(day)).Int(); err != nil || g != site {
		t.Fatalf("global counter %d (%v), want %d", g, err, site)
	}
	visitors, total := visitorCounters(t, cc, day)
	if total != site {
		t.Fatalf("visitor counters sum to %d over %d visitors, want %d", total, len(visitors), site)
	}
	for k, n := range visitors {
		if n > 1 {
			t.Fatalf("%s = %d, above the visitor limit 1", k, n)
		}
	}

	// Budgets settle: what the tasks report is what was settled, nothing
	// is held any more, and the ledger says the same.
	var used int64
	var some string   // a task admitted by one replica,
	var other *server // and the replica that did not admit it
	for id, s := range admitted {
		task := waitTask(t, s.URL, id)
		if task["status"] != "succeeded" {
			t.Fatalf("task %s: %v %v", id, task["status"], task["error"])
		}
		u := task["usage"].(map[string]any)
		used += int64(u["prompt_tokens"].(float64)) + int64(u["completion_tokens"].(float64))
		if some == "" {
			// Which replica admits which task is the race's to decide
			// (on a busy machine one may take all 40): any will do.
			some, other = id, a
			if s == a {
				other = b
			}
		}
	}
	rep, err := budget.New(cc, budget.Options{}).Usage(ctx, budget.UsageQuery{Day: day})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Site.Outstanding != 0 || rep.Reservations != 0 || rep.Site.Settled != used || used == 0 {
		t.Fatalf("site budget: settled %d, outstanding %d, %d open reservations; the tasks report %d tokens",
			rep.Site.Settled, rep.Site.Outstanding, rep.Reservations, used)
	}

	// Events: a task admitted by one replica streams, to its end, from
	// the other.
	evs := readSSE(t, other.URL+"/api/tasks/"+some+"/events", "", 0)
	assertFinalEvents(t, evs, "succeeded", "")

	// faregate usage on the cluster: the ledger's tokens are the settled ones.
	var out bytes.Buffer
	if err := run(ctx, []string{"faregate", "usage", "-format", "csv"},
		envOf(map[string]string{"FAREGATE_REDIS_URL": cl.URL, "FAREGATE_REDIS_CLUSTER": "true"}), &out); err != nil {
		t.Fatalf("faregate usage: %v\n%s", err, out.String())
	}
	rows, err := csv.NewReader(strings.NewReader(out.String())).ReadAll()
	if err != nil || len(rows) != 2 || rows[1][1] != "offline-demo-planner" {
		t.Fatalf("usage csv (%v):\n%s", err, out.String())
	}
	// Columns are read by their header's names: the report gains columns.
	col := slices.Index(rows[0], "total_tokens")
	if col < 0 {
		t.Fatalf("usage csv without total_tokens:\n%s", out.String())
	}
	if tokens, _ := strconv.ParseInt(rows[1][col], 10, 64); tokens != used {
		t.Fatalf("usage reports %d tokens, the tasks %d:\n%s", tokens, used, out.String())
	}
	t.Logf("cluster, two replicas, 400 concurrent creations: %v; %d tokens settled, none outstanding", codes, used)
}

// visitorCounters reads today's visitor counters from every master (they
// share the day's hash tag, so one master holds them all).
func visitorCounters(t *testing.T, cc *redis.ClusterClient, day string) (map[string]int, int) {
	t.Helper()
	var mu sync.Mutex
	out, total := map[string]int{}, 0
	err := cc.ForEachMaster(context.Background(), func(ctx context.Context, m *redis.Client) error {
		keys, err := m.Keys(ctx, "faregate:quota:{"+day+"}:ip:*").Result()
		if err != nil {
			return err
		}
		for _, k := range keys {
			n, err := m.Get(ctx, k).Int()
			if err != nil {
				return err
			}
			mu.Lock()
			out[k] = n
			total += n
			mu.Unlock()
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out, total
}

// TestReadyzSingleNodeOnClusterURL: a cluster node configured as a single
// Redis (FAREGATE_REDIS_CLUSTER=false) answers the readiness probe's
// key-bound read of the day's protection keys with MOVED, unless it owns
// their slot: /readyz is 503 on a node that does not, 200 on the one that
// does (so a PING would not have told the difference).
func TestReadyzSingleNodeOnClusterURL(t *testing.T) {
	redistest.WantCluster(t, false)
	cl := redistest.SharedCluster(t)
	owner := cl.MasterOf(t, quota.GlobalKey(quota.Day(time.Now())))
	var other string
	for _, n := range cl.Nodes(t) {
		if n != owner {
			other = n
			break
		}
	}
	if other == "" {
		t.Fatalf("every node is %s", owner)
	}
	for _, tc := range []struct {
		name, addr string
		status     int
	}{{"node without the slot", other, 503}, {"node that owns the slot", owner, 200}} {
		t.Run(tc.name, func(t *testing.T) {
			s := startServer(t, realRedisEnv("redis://"+tc.addr, map[string]string{"FAREGATE_REDIS_CLUSTER": "false"}))
			r := do(t, "GET", s.URL+"/readyz", "", nil)
			if r.Status != tc.status {
				t.Fatalf("/readyz on %s: %d %s, want %d", tc.addr, r.Status, r.Raw, tc.status)
			}
			if tc.status == 503 && r.code() != "demo_protection_unavailable" {
				t.Fatalf("/readyz: %s", r.Raw)
			}
		})
	}
}

// probe is one answer the failover poller got.
type probe struct {
	at     time.Time // when the answer arrived
	kind   string    // "create" or "ready"
	status int       // 0: no answer
}

// TestClusterFailover kills the master that serves the day's quota slot of
// a private cluster and measures, from the replica's promotion, the time
// to the first admitted task (202), while polling creations (distinct
// visitors) and /readyz every ~100 ms. The documented target is 5 s; CI
// asserts a generous 15 s and the log gives the real number. /readyz must
// have been 503 while the slot had no master.
func TestClusterFailover(t *testing.T) {
	redistest.WantCluster(t, true)
	cl := redistest.StartCluster(t)
	s := startServer(t, clusterEnv(t, cl.URL, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "5",
		"FAREGATE_GLOBAL_DAILY_LIMIT": "1000000", "FAREGATE_DAILY_TOKEN_BUDGET": "100000000", "FAREGATE_IP_DAILY_TOKENS": "1000000",
		"FAREGATE_LOG_LEVEL": "info"}))
	if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), visitorXFF(0)); r.Status != 202 {
		t.Fatalf("before the failover: %d %s", r.Status, r.Raw)
	}
	if r := do(t, "GET", s.URL+"/readyz", "", nil); r.Status != 200 {
		t.Fatalf("/readyz before the failover: %d %s", r.Status, r.Raw)
	}
	key := quota.GlobalKey(quota.Day(time.Now()))
	dead := cl.MasterOf(t, key)

	var mu sync.Mutex
	var probes []probe
	stop := make(chan struct{})
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		hc := &http.Client{Timeout: 10 * time.Second}
		call := func(kind, method, path, body string, h map[string]string) {
			req, _ := http.NewRequest(method, s.URL+path, strings.NewReader(body))
			if body != "" {
				req.Header.Set("Content-Type", "application/json")
			}
			for k, v := range h {
				req.Header.Set(k, v)
			}
			p := probe{kind: kind}
			if resp, err := hc.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				p.status = resp.StatusCode
			}
			p.at = time.Now()
			mu.Lock()
			probes = append(probes, p)
			mu.Unlock()
		}
		for i := 1; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond): // the poll's pace
			}
			call("create", "POST", "/api/tasks", taskBody("Rome"), visitorXFF(i))
			call("ready", "GET", "/readyz", "", nil)
		}
	}()
	defer func() { close(stop); <-polled }()

	killedAt := time.Now()
	cl.Kill(t, dead)
	promoted := cl.WaitPromoted(t, key, dead, 60*time.Second)

	// The first 202 after the promotion, within the CI bound.
	const bound = 15 * time.Second
	var first time.Time
	clocktest.Poll(time.Until(promoted.Add(bound+time.Second)), func() bool {
		mu.Lock()
		defer mu.Unlock()
		for _, p := range probes {
			if p.kind == "create" && p.status == 202 && p.at.After(promoted) {
				first = p.at
				return true
			}
		}
		return false
	})
	mu.Lock()
	var ready503, created503, during int
	var lastReady503 time.Time
	for _, p := range probes {
		if !p.at.After(killedAt) {
			continue
		}
		if p.at.Before(promoted) {
			during++
		}
		switch {
		case p.kind == "ready" && p.status == 503:
			ready503++
			lastReady503 = p.at
		case p.kind == "create" && p.status == 503:
			created503++
		}
	}
	mu.Unlock()
	if first.IsZero() {
		t.Fatalf("no 202 within %v of the promotion (promoted %v after the kill; %d readyz 503, %d creations 503)",
			bound, promoted.Sub(killedAt).Round(time.Millisecond), ready503, created503)
	}
	if ready503 == 0 {
		t.Fatalf("/readyz never answered 503 while the slot's master was dead (%d probes before the promotion)", during)
	}
	if first.Sub(promoted) > bound {
		t.Fatalf("first 202 came %v after the promotion, want at most %v", first.Sub(promoted), bound)
	}
	t.Logf("failover: kill → promotion %v; promotion → first 202 %v; /readyz 503 ×%d (last %v after the promotion), creations 503 ×%d",
		promoted.Sub(killedAt).Round(time.Millisecond), first.Sub(promoted).Round(time.Millisecond), ready503,
		lastReady503.Sub(promoted).Round(time.Millisecond), created503)
}
