package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// EnvClusterURL names a shared Redis Cluster that .ci/run starts, in
// go-redis's cluster URL form: redis://h1:p1?addr=h2:p2&addr=h3:p3.
const EnvClusterURL = "FAREGATE_TEST_REDIS_CLUSTER"

// EnvClusterTests, set to 1, turns on the tests that start a cluster of
// their own (a failover test kills a master, so it cannot use the shared
// one). .ci/run sets it; plain `go test ./...` skips them, since six
// redis-server processes and a failover take many seconds.
const EnvClusterTests = "FAREGATE_CLUSTER_TESTS"

// WantCluster skips the test unless cluster tests were asked for: by
// FAREGATE_CLUSTER_TESTS=1, or (unless private, a test that needs a
// cluster of its own) by a shared cluster named in
// FAREGATE_TEST_REDIS_CLUSTER. It is a gate, not a dependency check: once
// asked for, a missing redis-server fails under CI=true (StartCluster).
func WantCluster(t testing.TB, private bool) {
	t.Helper()
	if os.Getenv(EnvClusterTests) == "1" || (!private && os.Getenv(EnvClusterURL) != "") {
		return
	}
	t.Skip("cluster test: set " + EnvClusterTests + "=1 (.ci/run does)")
}

// Cluster is a Redis Cluster of three masters, each with one replica, made
// of redis-server processes owned by one test (so the test may kill a
// master), or the shared one named by FAREGATE_TEST_REDIS_CLUSTER.
type Cluster struct {
	// URL is the go-redis cluster URL of the seed nodes.
	URL   string
	nodes []*clusterNode
}

type clusterNode struct {
	port int
	dir  string
	proc process
}

func (n *clusterNode) addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(n.port)) }

// NodeTimeout is the cluster-node-timeout of clusters StartCluster makes:
// how soon a dead master's replica is promoted.
const NodeTimeout = 2 * time.Second

// SharedCluster returns the shared cluster of FAREGATE_TEST_REDIS_CLUSTER,
// claimed for this test alone (tests of several packages take turns) and
// flushed, or else a private cluster like StartCluster's (without waiting
// for its replicas: nobody kills a node of a shared cluster).
func SharedCluster(t testing.TB) *Cluster {
	t.Helper()
	raw := os.Getenv(EnvClusterURL)
	if raw == "" {
		return startCluster(t, false)
	}
	opt, err := redis.ParseClusterURL(raw)
	if err != nil {
		t.Fatalf("%s: %v", EnvClusterURL, err)
	}
	c := redis.NewClusterClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	token := fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano())
	const lock = "faregate-test:cluster-lock"
	deadline := time.Now().Add(10 * time.Minute)
	for {
		ok, err := c.SetNX(ctx, lock, token, 10*time.Minute).Result()
		if err != nil {
			t.Fatalf("shared cluster: %v", err)
		}
		if ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("shared cluster: never free")
		}
		time.Sleep(100 * time.Millisecond)
	}
	flush := func() {
		_ = c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			return m.FlushAll(ctx).Err()
		})
	}
	flush()
	// The flush removed the lock; take it again so others keep waiting.
	if err := c.Set(ctx, lock, token, 10*time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		flush()
		_ = c.Del(context.Background(), lock).Err()
	})
	return &Cluster{URL: raw}
}

// StartCluster starts six redis-server processes on free loopback ports
// (their bus ports, +10000, free too) and joins them into a cluster of three
// masters with a replica each, and returns once every replica is in sync,
// so a test may kill a master. Skips (fails in CI) without redis-server.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	return startCluster(t, true)
}

// startCluster is StartCluster; without replicas it returns as soon as
// every slot is served, which is all a test that kills nothing needs.
func startCluster(t testing.TB, replicas bool) *Cluster {
	t.Helper()
	bin, err := serverBinary()
	if err != nil {
		msg := "redis-server not found: install it (apt-get install redis-server) or set " + EnvServer
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		msg := "redis-cli not found (package redis-tools)"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	base := t.TempDir()
	cl := &Cluster{}
	// Registered before the first node starts: a start that fails later
	// must not leave the earlier nodes running after the test.
	t.Cleanup(func() {
		for _, n := range cl.nodes {
			n.kill()
		}
	})
	for range 6 {
		// As StartWith: a port taken between the check and the bind makes
		// the node exit at once; it tries fresh ports.
		var n *clusterNode
		var err error
		for range startTries {
			port := clusterPorts(t, 1)[0]
			n = &clusterNode{port: port, dir: filepath.Join(base, strconv.Itoa(port))}
			if err := os.MkdirAll(n.dir, 0o755); err != nil {
				t.Fatal(err)
			}
			if err = n.start(bin); !errors.Is(err, errExited) {
				break
			}
		}
		cl.nodes = append(cl.nodes, n) // killed at cleanup, whatever err says
		if err != nil {
			t.Fatal(err)
		}
	}
	args := []string{"--cluster", "create"}
	for _, n := range cl.nodes {
		args = append(args, n.addr())
	}
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	seeds := cl.nodes[0].addr()
	q := url.Values{}
	for _, n := range cl.nodes[1:] {
		q.Add("addr", n.addr())
	}
	cl.URL = "redis://" + seeds + "?" + q.Encode()
	if !cl.waitOK(t, 30*time.Second) {
		t.Fatal("cluster never reported cluster_state:ok on every node")
	}
	// The cluster is ok before the replicas have attached: a master killed
	// then would have nobody to take over. Wait until every replica is in
	// sync with its master and every node names a replica for each range.
	if replicas && !cl.waitReplicas(t, 60*time.Second) {
		t.Fatal("the cluster's replicas never all attached to their masters")
	}
	return cl
}

// clusterPorts picks n free ports whose bus ports (+10000) are free too.
func clusterPorts(t testing.TB, n int) []int {
	t.Helper()
	var out []int
	for tries := 0; len(out) < n && tries < 200; tries++ {
		p := freePort(t)
		if p > 55000 || !portFree(p+10000) {
			continue
		}
		out = append(out, p)
	}
	if len(out) < n {
		t.Fatal("no free ports for a cluster")
	}
	return out
}

func portFree(p int) bool {
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
	if err != nil {
		return false
	}
	_ = l.Close()
	return true
}

func (n *clusterNode) start(bin string) error {
	return n.proc.start(bin, n.dir, n.addr(), []string{"--port", strconv.Itoa(n.port), "--bind", "127.0.0.1",
		"--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
		"--cluster-node-timeout", strconv.Itoa(int(NodeTimeout / time.Millisecond)),
		"--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"})
}

func (n *clusterNode) kill() { n.proc.kill() }

// waitOK waits until every live node reports cluster_state:ok and agrees
// that every slot is served.
func (c *Cluster) waitOK(t testing.TB, d time.Duration) bool {
	t.Helper()
	return waitFor(d, func() bool {
		return c.allLive(func(cc *redis.Client) bool {
			info, err := cc.ClusterInfo(context.Background()).Result()
			return err == nil && strings.Contains(info, "cluster_state:ok") && strings.Contains(info, "cluster_slots_ok:16384")
		})
	})
}

// allLive reports whether ok holds for every live node, asked through a
// client of its own.
func (c *Cluster) allLive(ok func(*redis.Client) bool) bool {
	for _, n := range c.nodes {
		if !n.proc.alive() {
			continue
		}
		cc := redis.NewClient(&redis.Options{Addr: n.addr(), MaxRetries: -1})
		good := ok(cc)
		_ = cc.Close()
		if !good {
			return false
		}
	}
	return true
}

// waitReplicas waits until every live replica's link to its master is up
// and every live node's CLUSTER SLOTS names a master and a replica for
// every range.
func (c *Cluster) waitReplicas(t testing.TB, d time.Duration) bool {
	t.Helper()
	return waitFor(d, func() bool {
		return c.allLive(func(cc *redis.Client) bool {
			info, ierr := cc.Info(context.Background(), "replication").Result()
			//lint:ignore SA1019 CLUSTER SHARDS needs Redis 7; apt still ships Redis 6 on some CI images, which has only CLUSTER SLOTS.
			slots, serr := cc.ClusterSlots(context.Background()).Result()
			if ierr != nil || serr != nil {
				return false
			}
			if strings.Contains(info, "role:slave") && !strings.Contains(info, "master_link_status:up") {
				return false
			}
			for _, s := range slots {
				if len(s.Nodes) < 2 {
					return false
				}
			}
			return true
		})
	})
}

// Client returns a cluster client on the cluster, closed when the test ends.
func (c *Cluster) Client(t testing.TB) *redis.ClusterClient {
	t.Helper()
	opt, err := redis.ParseClusterURL(c.URL)
	if err != nil {
		t.Fatal(err)
	}
	cc := redis.NewClusterClient(opt)
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// MasterOf returns the address of the master that serves key's slot now.
func (c *Cluster) MasterOf(t testing.TB, key string) string {
	t.Helper()
	cc := c.Client(t)
	ctx := context.Background()
	slot, err := cc.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		t.Fatal(err)
	}
	//lint:ignore SA1019 CLUSTER SHARDS needs Redis 7; apt still ships Redis 6 on some CI images, which has only CLUSTER SLOTS.
	slots, err := cc.ClusterSlots(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slots {
		if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 {
			return s.Nodes[0].Addr
		}
	}
	t.Fatalf("no node serves slot %d", slot)
	return ""
}

// Nodes lists the address of every node the cluster knows and does not
// consider failed, masters and replicas alike (CLUSTER NODES).
func (c *Cluster) Nodes(t testing.TB) []string {
	t.Helper()
	raw, err := c.Client(t).ClusterNodes(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(raw), "\n") {
		// <id> <ip:port@cport[,hostname]> <flags> ...
		f := strings.Fields(line)
		if len(f) < 3 || strings.Contains(f[2], "fail") || strings.Contains(f[2], "noaddr") {
			continue
		}
		addr, _, _ := strings.Cut(f[1], "@")
		out = append(out, addr)
	}
	return out
}

// Kill kills the node at addr with SIGKILL (a private cluster only) and
// returns when the process is gone.
func (c *Cluster) Kill(t testing.TB, addr string) {
	t.Helper()
	for _, n := range c.nodes {
		if n.addr() == addr {
			n.kill()
			return
		}
	}
	t.Fatalf("redistest: %s is not a node of this test's own cluster", addr)
}

// WaitPromoted waits until a node other than dead serves key's slot and the
// cluster is ok again, and returns when that was first seen.
func (c *Cluster) WaitPromoted(t testing.TB, key, dead string, d time.Duration) time.Time {
	t.Helper()
	var at time.Time
	ok := waitFor(d, func() bool {
		for _, n := range c.nodes {
			if n.addr() == dead {
				continue
			}
			cc := redis.NewClient(&redis.Options{Addr: n.addr(), MaxRetries: -1, DialTimeout: time.Second, ReadTimeout: time.Second})
			role, err := cc.Do(context.Background(), "ROLE").Slice()
			slot, serr := cc.ClusterKeySlot(context.Background(), key).Result()
			//lint:ignore SA1019 CLUSTER SHARDS needs Redis 7; apt still ships Redis 6 on some CI images, which has only CLUSTER SLOTS.
			slots, cerr := cc.ClusterSlots(context.Background()).Result()
			_ = cc.Close()
			if err != nil || serr != nil || cerr != nil || len(role) == 0 || role[0] != "master" {
				continue
			}
			for _, s := range slots {
				if int64(s.Start) <= slot && slot <= int64(s.End) && len(s.Nodes) > 0 && s.Nodes[0].Addr == n.addr() {
					at = time.Now()
					return true
				}
			}
		}
		return false
	})
	if !ok {
		t.Fatalf("no replica was promoted for %q within %v", key, d)
	}
	return at
}
