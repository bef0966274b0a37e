package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"faregate/protect/kit/testkit/redistest"
)

// TestSoakTwoReplicasExactQuota is the heavy version of the exactness test,
// run by .ci/run (FAREGATE_SOAK=1) on a redis-server of its own: 3000
// creations from 1000 visitors spread over two replicas sharing one Redis,
// 2 tasks per visitor, 1500 for the site. Every limit must hold exactly: 1500 admitted, no visitor above 2.
func TestSoakTwoReplicasExactQuota(t *testing.T) {
	if os.Getenv("FAREGATE_SOAK") != "1" {
		t.Skip("set FAREGATE_SOAK=1 for the soak tests (.ci/run does)")
	}
	be := redistest.Private(t) // a flood: a redis-server of its own
	env := realRedisEnv(be.URL, map[string]string{"FAREGATE_IP_DAILY_LIMIT": "2", "FAREGATE_GLOBAL_DAILY_LIMIT": "1500",
		"FAREGATE_TRUSTED_PROXIES": "127.0.0.1", "FAREGATE_DAILY_TOKEN_BUDGET": "100000000", "FAREGATE_IP_DAILY_TOKENS": "1000000",
		"FAREGATE_WEATHER_URL": deadURL(t), "FAREGATE_GEOCODING_URL": deadURL(t), "FAREGATE_LOG_LEVEL": "warn",
		// The test is about exactness, not speed: on a busy machine under
		// -race the flood waits for Redis connections far longer than the
		// default timeout (2 s, +1 s for a pooled connection), and a
		// request that times out is refused with 503 after fail-closed
		// checks, so the limit would never be reached.
		"FAREGATE_REDIS_TIMEOUT": "20s",
		// 1500 admitted tasks wait for workers; the queue's bound (503
		// server_busy) is not what this test measures.
		"FAREGATE_QUEUE_MAX": "100000"})
	a, b := startServer(t, env), startServer(t, env)
	// At most 200 requests in flight: a busy 2-core machine under -race
	// answers some 40 creations a second, so more would only queue.
	inflight := make(chan struct{}, 200)
	// A 503 (busy, or a check out of time) counts nothing: the client
	// retries it after Retry-After (capped, to keep the test short), as the
	// page does. A connection closed without an answer is a failure.
	var retried atomic.Int64
	codes := hammer(t, 3000, func(i int) reply {
		inflight <- struct{}{}
		defer func() { <-inflight }()
		base := a.URL
		if i%2 == 1 {
			base = b.URL
		}
		v := i % 1000
		for try := 0; ; try++ {
			r := doOn(t, http.DefaultClient, true, "POST", base+"/api/tasks", taskBody("Rome"),
				map[string]string{"X-Forwarded-For": fmt.Sprintf("2001:db8:%x::1", v)})
			if r.Status != 503 || try == 10 {
				return r
			}
			retried.Add(1)
			secs, _ := strconv.Atoi(r.Header.Get("Retry-After"))
			letTimePass(min(time.Duration(secs)*time.Second, 2*time.Second)) // a client honours Retry-After
		}
	})
	if codes["202"] != 1500 {
		t.Fatalf("admitted %d, want exactly 1500: %v", codes["202"], codes)
	}
	ctx := context.Background()
	keys, err := be.Client.Keys(ctx, "faregate:quota:*:ip:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	total := 0
	for _, k := range keys {
		n, _ := be.Client.Get(ctx, k).Int()
		if n > 2 {
			t.Fatalf("%s = %d, above the visitor limit", k, n)
		}
		total += n
	}
	if total != 1500 {
		t.Fatalf("visitor counters sum to %d, want 1500", total)
	}
	for k, n := range codes {
		if k != "202" && !strings.HasPrefix(k, "429 ") {
			t.Fatalf("unexpected answers %s × %d", k, n)
		}
	}
	t.Logf("soak: 3000 creations, 1000 visitors, 2 replicas: %v; %d visitor keys; %d answers 503 retried", codes, len(keys), retried.Load())
}
