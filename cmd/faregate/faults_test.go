package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/agent/taskstore"
	"faregate/protect/budget"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
	"faregate/protect/quota"
)

// The fault tests of issue #8, end to end. Each gets a redis-server of its
// own when it stops, cuts or times Redis; leases are 3 s or more, and every
// wait is a poll for a real event with a deadline.

// processLease is the lease of the process tests: the documented minimum,
// so a lost task is noticed soon.
const processLease = 3 * time.Second

// stalledModel is an OpenAI-compatible model that never answers: a task
// that calls it is mid-run (its reservation open) until the caller goes.
func stalledModel(t *testing.T) *fakeLLM {
	return newFakeLLM(t, func(chatRequest, int) fakeReply { return fakeReply{Delay: time.Hour} })
}

// waitModelCalls waits until the model got n requests.
func waitModelCalls(t *testing.T, llm *fakeLLM, n int, d time.Duration) {
	t.Helper()
	if !clocktest.Poll(d, func() bool { return len(llm.Requests()) >= n }) {
		t.Fatalf("the model got %d requests within %v, want %d", len(llm.Requests()), d, n)
	}
}

// storedRecord reads a task as stored, straight from Redis.
func storedRecord(t *testing.T, rdb redis.UniversalClient, id string) task.Record {
	t.Helper()
	rec, err := taskstore.New(rdb).Get(context.Background(), id)
	if err != nil {
		t.Fatalf("task %s: %v", id, err)
	}
	return rec
}

// taskOutstanding is what the task's open reservations hold, in its own
// budget scope and in its principal's, read on Redis.
func taskOutstanding(t *testing.T, rdb redis.UniversalClient, rec task.Record) (taskScope, principal, reservations int64) {
	t.Helper()
	u, err := budget.New(rdb, budget.Options{}).Usage(context.Background(),
		budget.UsageQuery{Day: rec.Day, Principal: rec.Principal, Task: rec.ID})
	if err != nil {
		t.Fatal(err)
	}
	return u.Task.Outstanding, u.Principal.Outstanding, u.Reservations
}

// TestKilledProcess kills (SIGKILL) a faregate process the test started,
// mid-task, while another replica runs in-process on the same Redis. The
// binary is built once for both cases.
func TestKilledProcess(t *testing.T) {
	redistest.Require(t)
	bin := buildFaregate(t, t.TempDir())

	// A replica killed mid-task: the task fails with worker_lost within
	// lease + 5 s, seen from the other replica; the follower there gets the
	// final events; the reservation is given back at once; the other
	// replica says so in one log line.
	t.Run("mid-task", func(t *testing.T) {
		rs := redistest.Start(t)
		rdb := rs.Client(t)
		llm := stalledModel(t)
		env := realRedisEnv(rs.URL(), map[string]string{"FAREGATE_TASK_LEASE": processLease.String(),
			"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t)})
		a := startChild(t, bin, withEnv(env, "FAREGATE_LLM_BASE_URL", llm.BaseURL()))
		r := do(t, "POST", a.URL+"/api/tasks", taskBody("Lisbon"), nil)
		if r.Status != 202 {
			t.Fatalf("create: %d %s", r.Status, r.Raw)
		}
		id := r.Body["id"].(string)
		// Only the child runs yet, so the model's caller is the child.
		waitModelCalls(t, llm, 1, 30*time.Second)
		rec := storedRecord(t, rdb, id)
		if held, _, _ := taskOutstanding(t, rdb, rec); held <= 0 {
			t.Fatalf("no tokens reserved for the running task (outstanding %d): nothing to give back", held)
		}

		b := startServer(t, env) // the offline planner: it never runs this task
		f := follow(t, b.URL+"/api/tasks/"+id+"/events")
		f.waitStatus(t, "running", 20*time.Second)

		killedAt := time.Now()
		a.Kill()
		got, ok := pollTask(t, b.URL, id, processLease+5*time.Second, statusIs("failed"))
		took := time.Since(killedAt)
		if !ok {
			t.Fatalf("task not failed within lease + 5 s of the kill: %v", got)
		}
		// "At once": read before anything else happens.
		held, principal, open := taskOutstanding(t, rdb, rec)
		if held != 0 || principal != 0 || open != 0 {
			t.Fatalf("after worker_lost: task outstanding %d, principal outstanding %d, %d open reservations; want all 0", held, principal, open)
		}
		if e, _ := got["error"].(map[string]any); e["code"] != codes.WorkerLost {
			t.Fatalf("failed with %v, want worker_lost", got["error"])
		}
		assertFinalEvents(t, f.waitEnded(t, 10*time.Second), "failed", codes.WorkerLost)
		waitLog(t, b.Out, 5*time.Second, "task failed: worker lost", id)
		if n := countLines(b.Out.String(), "task failed: worker lost"); n != 1 {
			t.Fatalf("%d worker-lost lines on the surviving replica, want 1", n)
		}
		if n := scrapeMetric(t, b.URL, "faregate_tasks_lost_total"); n != 1 {
			t.Fatalf("faregate_tasks_lost_total = %v, want 1", n)
		}
		t.Logf("kill -9 → worker_lost seen on the other replica in %v (lease %v); reservation given back, follower got failed+done",
			took.Round(time.Millisecond), processLease)
	})

	// A replica with one worker dies with one task running and two queued:
	// the running one ends worker_lost, the queued ones run to succeeded on
	// the other replica.
	t.Run("one worker, two queued", func(t *testing.T) {
		rs := redistest.Start(t)
		rdb := rs.Client(t)
		llm := stalledModel(t)
		env := realRedisEnv(rs.URL(), map[string]string{"FAREGATE_TASK_LEASE": processLease.String(),
			"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t)})
		a := startChild(t, bin, withEnv(withEnv(env, "FAREGATE_LLM_BASE_URL", llm.BaseURL()), "FAREGATE_AGENT_CONCURRENCY", "1"))
		var ids []string
		for i := 0; i < 3; i++ {
			r := do(t, "POST", a.URL+"/api/tasks", taskBody("Porto"), nil)
			if r.Status != 202 {
				t.Fatalf("create %d: %d %s", i, r.Status, r.Raw)
			}
			ids = append(ids, r.Body["id"].(string))
			if i == 0 {
				waitModelCalls(t, llm, 1, 30*time.Second)
			}
		}
		running, queued := ids[0], ids[1:]
		if st := storedRecord(t, rdb, running).Status; st != task.StatusRunning {
			t.Fatalf("first task %s, want running", st)
		}
		for _, id := range queued {
			if st := storedRecord(t, rdb, id).Status; st != task.StatusQueued {
				t.Fatalf("task %s is %s, want queued behind the one worker", id, st)
			}
		}
		killedAt := time.Now()
		a.Kill()
		// The other replica starts after the kill, so the queued tasks can
		// only run there; no replica can reap before one runs.
		b := startServer(t, env)
		readyAt := time.Now()
		for _, id := range queued {
			if got, ok := pollTask(t, b.URL, id, 60*time.Second, statusIs("succeeded")); !ok {
				t.Fatalf("queued task %s: %v, want succeeded on the other replica", id, got)
			}
			waitLog(t, b.Out, 5*time.Second, "task succeeded", id)
		}
		got, ok := pollTask(t, b.URL, running, time.Until(readyAt.Add(processLease+5*time.Second)), statusIs("failed"))
		if !ok {
			t.Fatalf("running task not failed within lease + 5 s of the other replica's start: %v", got)
		}
		if e, _ := got["error"].(map[string]any); e["code"] != codes.WorkerLost {
			t.Fatalf("running task failed with %v, want worker_lost", got["error"])
		}
		if held, _, _ := taskOutstanding(t, rdb, storedRecord(t, rdb, running)); held != 0 {
			t.Fatalf("lost task still holds %d tokens", held)
		}
		if n := len(llm.Requests()); n != 1 {
			t.Fatalf("the dead replica's model got %d calls, want 1 (the queued tasks ran elsewhere)", n)
		}
		t.Logf("kill -9 → worker_lost in %v (other replica ready %v after the kill); two queued tasks succeeded there",
			time.Since(killedAt).Round(time.Millisecond), readyAt.Sub(killedAt).Round(time.Millisecond))
	})
}

func withEnv(env map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(env)+1)
	for key, val := range env {
		out[key] = val
	}
	out[k] = v
	return out
}

// TestFinalSaveAcrossRedisOutage: a task finishes while the link to Redis
// is cut (a proxy between faregate and its own redis-server). Its final
// save is retried and lands once the link is back: the task ends
// succeeded. Not worker_lost, by the timing: the outage lasts from the cut
// until the runner's first failed final save (plus one poll), a few
// seconds, while the lease is 30 s (renewed every 10 s, so at least 20 s
// are left at the cut), so the runner still holds the task when Redis
// answers again and its next retry, at most 2 s later, lands. Without the retry the save would be lost,
// and the only way left to end the task would be worker_lost after the lease.
func TestFinalSaveAcrossRedisOutage(t *testing.T) {
	const lease = 30 * time.Second
	rs := redistest.Start(t)
	px := redistest.StartProxy(t, rs.Addr())
	answer := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(answer) }) }
	llm := newFakeLLM(t, func(chatRequest, int) fakeReply {
		<-answer
		return fakeReply{Content: itinerary(1, "")}
	})
	t.Cleanup(release) // before the model server closes (cleanups run last-in first)
	s := startServer(t, realRedisEnv(px.URL(), map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		"FAREGATE_TASK_LEASE": lease.String(), "FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t),
		"FAREGATE_REDIS_TIMEOUT": "1s"}))
	r := do(t, "POST", s.URL+"/api/tasks", `{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","destination":"Rome","days":1}`, nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	waitModelCalls(t, llm, 1, 30*time.Second)

	cutAt := time.Now()
	px.Cut()
	release() // the model answers now: the run finishes during the outage
	// The runner met the outage at its final save (it retries from here).
	waitLog(t, s.Out, lease/2, "final task state not saved", id)
	px.Restore()
	outage := time.Since(cutAt)

	rdb := rs.Client(t)
	var rec task.Record
	clocktest.Poll(lease+10*time.Second, func() bool { rec = storedRecord(t, rdb, id); return rec.Final() })
	if rec.Status != task.StatusSucceeded {
		t.Fatalf("after an outage of %v (lease %v) the task is %s %+v, want succeeded", outage, lease, rec.Status, rec.Error)
	}
	evs := readSSE(t, s.URL+"/api/tasks/"+id+"/events", "", 0)
	assertFinalEvents(t, evs, "succeeded", "")
	t.Logf("final save across a Redis outage of %v: succeeded once the link was back (lease %v)", outage.Round(time.Millisecond), lease)
}

// TestShutdownFollowerGetsFinalEvents: a shutdown whose grace period is
// shorter than the running task fails the task, and the follower on the
// stopping process receives the failed and done events before its
// connection closes.
func TestShutdownFollowerGetsFinalEvents(t *testing.T) {
	be := redistest.Real(t) // Redis stays up: the shared server will do
	llm := stalledModel(t)
	s := startServer(t, realRedisEnv(be.URL, map[string]string{"FAREGATE_LLM_BASE_URL": llm.BaseURL(),
		"FAREGATE_SHUTDOWN_TIMEOUT": "1s", "FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t)}))
	r := do(t, "POST", s.URL+"/api/tasks", taskBody("Oslo"), nil)
	if r.Status != 202 {
		t.Fatalf("create: %d %s", r.Status, r.Raw)
	}
	id := r.Body["id"].(string)
	waitModelCalls(t, llm, 1, 30*time.Second)
	f := follow(t, s.URL+"/api/tasks/"+id+"/events")
	f.waitStatus(t, "running", 20*time.Second)

	stopped := make(chan error, 1)
	go func() { stopped <- s.Stop() }()
	evs := f.waitEnded(t, 30*time.Second)
	done := assertFinalEvents(t, evs, "failed", codes.AgentFailed)
	if e, _ := done["error"].(map[string]any); !strings.Contains(fmt.Sprint(e["message"]), "shut down") {
		t.Fatalf("the failure does not say the server shut down: %v", done["error"])
	}
	if err := <-stopped; err != nil {
		t.Fatalf("run: %v", err)
	}
}

// TestLostQuotaReplyCountsOnce: the reply to the quota script of an
// admission is lost on the way back (a proxy swallows it) after Redis
// applied it. The client times out (FAREGATE_REDIS_TIMEOUT) and sends the
// script again; the attempt id makes the repeat answer the first result.
// The visitor gets 202 and the counters move by exactly one per admitted task.
func TestLostQuotaReplyCountsOnce(t *testing.T) {
	rs := redistest.Start(t)
	px := redistest.StartProxy(t, rs.Addr())
	s := startServer(t, realRedisEnv(px.URL(), map[string]string{"FAREGATE_REDIS_TIMEOUT": "500ms",
		"FAREGATE_TRUSTED_PROXIES": "127.0.0.1", "FAREGATE_IP_DAILY_LIMIT": "5", "FAREGATE_GLOBAL_DAILY_LIMIT": "100",
		"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t)}))
	// A first admission loads the script, so the lost reply is the
	// counting one and not a NOSCRIPT answer.
	if r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), map[string]string{"X-Forwarded-For": "198.51.100.1"}); r.Status != 202 {
		t.Fatalf("warm-up: %d %s", r.Status, r.Raw)
	}
	day := quota.Day(time.Now())
	visitor := map[string]string{"X-Forwarded-For": "198.51.100.2"}
	for i := 1; i <= 2; i++ {
		// Only the counting script carries an attempt key; the read-only
		// check before it (which names the visitor's key too) is left alone.
		px.LoseNextReply("faregate:quota:{" + day + "}:att:")
		r := do(t, "POST", s.URL+"/api/tasks", taskBody("Rome"), visitor)
		if r.Status != 202 {
			t.Fatalf("admission %d after a lost reply: %d %s", i, r.Status, r.Raw)
		}
		q := r.Body["quota"].(map[string]any)
		if q["ip_remaining"] != float64(5-i) || q["global_remaining"] != float64(100-1-i) {
			t.Fatalf("admission %d answered remaining %v, want ip %d global %d", i, q, 5-i, 100-1-i)
		}
		if px.Lost() != int64(i) {
			t.Fatalf("%d replies lost after admission %d: the fault did not fire", px.Lost(), i)
		}
	}
	ctx := context.Background()
	rdb := rs.Client(t)
	keys, err := rdb.Keys(ctx, "faregate:quota:{"+day+"}:ip:*").Result()
	if err != nil || len(keys) != 2 {
		t.Fatalf("visitor counters %v %v, want two visitors", keys, err)
	}
	var counts []int
	for _, k := range keys {
		n, _ := rdb.Get(ctx, k).Int()
		counts = append(counts, n)
	}
	g, _ := rdb.Get(ctx, quota.GlobalKey(day)).Int()
	if !(counts[0] == 1 && counts[1] == 2 || counts[0] == 2 && counts[1] == 1) || g != 3 {
		t.Fatalf("counters visitor %v global %d after 1 + 2 admissions (2 replies lost), want {1,2} and 3", counts, g)
	}
	t.Logf("lost quota replies: %d; 3 admissions moved the counters by 3 (visitors %v, global %d)", px.Lost(), counts, g)
}

// TestDurabilityWarning: at start-up faregate prints one loud line when
// Redis would lose quotas on a restart or could evict them, and none when
// it persists (AOF) and never evicts.
func TestDurabilityWarning(t *testing.T) {
	for _, tc := range []struct {
		name string
		args func(t *testing.T) []string
		want []string // fragments of the one warning line; none: no line
	}{
		{"no persistence", func(*testing.T) []string { return nil }, []string{"has no persistence", "appendonly yes"}},
		{"aof and noeviction", func(t *testing.T) []string {
			return []string{"--appendonly", "yes", "--dir", t.TempDir(), "--maxmemory-policy", "noeviction"}
		}, nil},
		{"evicting", func(t *testing.T) []string {
			return []string{"--appendonly", "yes", "--dir", t.TempDir(), "--maxmemory-policy", "allkeys-lru"}
		}, []string{"maxmemory-policy allkeys-lru", "noeviction"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rs := redistest.StartWith(t, tc.args(t)...)
			s := startServer(t, realRedisEnv(rs.URL(), nil))
			out := s.Out.String()
			warnings := countLines(out, "faregate: WARNING: Redis")
			if tc.want == nil {
				if warnings != 0 {
					t.Fatalf("durable Redis, yet a warning:\n%s", findLine(out, "faregate: WARNING: Redis"))
				}
				return
			}
			if warnings != 1 || countLines(out, tc.want...) != 1 {
				t.Fatalf("%d warning lines, want one with %q:\n%s", warnings, tc.want, out)
			}
		})
	}
}
