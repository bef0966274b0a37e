package main

import (
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestNewRedisOptions: one options value serves both modes: what the URL
// says (nodes, credentials, database, TLS, go-redis's parameters) reaches
// the client of its mode, and the pool's own tuning (timeouts, size)
// overrides it in both alike. No connection is made.
func TestNewRedisOptions(t *testing.T) {
	const timeout = 700 * time.Millisecond
	o := redisOptions{timeout: timeout, pool: 7}

	rc, err := newRedis("redis://u:p@127.0.0.1:6390/3?client_name=fg&read_timeout=9s&max_retries=5", false, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	c, ok := rc.(*redis.Client)
	if !ok {
		t.Fatalf("single node: a %T", rc)
	}
	so := c.Options()
	if so.Addr != "127.0.0.1:6390" || so.Username != "u" || so.Password != "p" || so.DB != 3 || so.ClientName != "fg" ||
		so.MaxRetries != 5 || so.TLSConfig != nil {
		t.Errorf("single node from the URL: %+v", so)
	}
	if so.DialTimeout != timeout || so.ReadTimeout != timeout || so.WriteTimeout != timeout || so.PoolTimeout != timeout+time.Second || so.PoolSize != 7 {
		t.Errorf("single node's tuning: dial %v read %v write %v pool %v×%d", so.DialTimeout, so.ReadTimeout, so.WriteTimeout, so.PoolTimeout, so.PoolSize)
	}

	rc, err = newRedis("rediss://u:p@10.0.0.1:7000?addr=10.0.0.2:7001&max_redirects=4", true, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	cc, ok := rc.(*redis.ClusterClient)
	if !ok {
		t.Fatalf("cluster: a %T", rc)
	}
	co := cc.Options()
	if !slices.Equal(co.Addrs, []string{"10.0.0.1:7000", "10.0.0.2:7001"}) || co.Username != "u" || co.Password != "p" ||
		co.MaxRedirects != 4 || co.TLSConfig == nil || co.TLSConfig.ServerName != "10.0.0.1" {
		t.Errorf("cluster from the URL: %+v", co)
	}
	if co.DialTimeout != timeout || co.ReadTimeout != timeout || co.WriteTimeout != timeout || co.PoolTimeout != timeout+time.Second || co.PoolSize != 7 {
		t.Errorf("cluster's tuning: dial %v read %v write %v pool %v×%d", co.DialTimeout, co.ReadTimeout, co.WriteTimeout, co.PoolTimeout, co.PoolSize)
	}

	// A single seed node is still a cluster when FAREGATE_REDIS_CLUSTER says so.
	rc, err = newRedis("redis://10.0.0.1:7000", true, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = rc.Close() })
	if _, ok := rc.(*redis.ClusterClient); !ok {
		t.Fatalf("one seed node in cluster mode: a %T", rc)
	}
	for _, bad := range []string{"redis://h:1/notadb", "redis://h:1?nonsense=1"} {
		if _, err := newRedis(bad, false, o); err == nil {
			t.Errorf("newRedis(%q) accepted it", bad)
		}
	}
}
