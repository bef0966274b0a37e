// Package redistest gives tests a Redis to talk to: the embedded miniredis,
// a real redis-server process the test owns (so it may stop and restart it),
// or a logical database of the shared real server that .ci/run starts and
// names in FAREGATE_TEST_REDIS_URL.
//
// Without a real Redis a test that needs one is skipped on a developer's
// machine and fails when CI=true, so CI can never pass by skipping.
package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// EnvURL names the shared real Redis that .ci/run starts for the test run.
const EnvURL = "FAREGATE_TEST_REDIS_URL"

// EnvServer may name the redis-server binary; otherwise PATH is searched.
const EnvServer = "FAREGATE_TEST_REDIS_SERVER"

// Backend is one Redis a conformance test runs against.
type Backend struct {
	Name   string
	Client *redis.Client
	URL    string
	// Mini is set for the embedded backend so tests can move its clock.
	Mini *miniredis.Miniredis
}

// Probe is a client of its own on the backend with one connection,
// closed when the test ends: a checker that samples while a test's workers
// queue for the shared pool is never starved by them.
func (b Backend) Probe(t testing.TB) *redis.Client {
	t.Helper()
	opt, err := redis.ParseURL(b.URL)
	if err != nil {
		t.Fatal(err)
	}
	opt.PoolSize = 1
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Mini starts an embedded miniredis for the test.
func Mini(t testing.TB) Backend {
	t.Helper()
	m := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return Backend{Name: "miniredis", Client: c, URL: "redis://" + m.Addr(), Mini: m}
}

// Real returns a real Redis for the test: a private logical database of the
// shared server named by FAREGATE_TEST_REDIS_URL, or else a private
// redis-server process. It skips (fails in CI) when neither is available.
func Real(t testing.TB) Backend {
	t.Helper()
	if u := os.Getenv(EnvURL); u != "" {
		return sharedDB(t, u)
	}
	s := Start(t)
	return Backend{Name: "redis", Client: s.Client(t), URL: s.URL()}
}

// Private returns a redis-server process of the test's own as a Backend:
// for tests that stop, flood or time Redis, which must not share the
// server other packages' tests use. Skips (fails in CI) without the binary.
func Private(t testing.TB) Backend {
	t.Helper()
	s := Start(t)
	return Backend{Name: "redis", Client: s.Client(t), URL: s.URL()}
}

// Both returns the embedded and the real backend, for conformance suites.
// The real one is left out (or fails the test in CI) when unavailable.
func Both(t *testing.T) []Backend {
	t.Helper()
	out := []Backend{Mini(t)}
	if Available() {
		out = append(out, Real(t))
	} else {
		Require(t)
	}
	return out
}

// Available reports whether a real Redis can be had.
func Available() bool {
	if os.Getenv(EnvURL) != "" {
		return true
	}
	_, err := serverBinary()
	return err == nil
}

// Require skips the test, or fails it under CI=true, when no real Redis can be had.
func Require(t testing.TB) {
	t.Helper()
	if Available() {
		return
	}
	msg := "no real Redis: install redis-server or set " + EnvURL
	if os.Getenv("CI") == "true" {
		t.Fatal(msg)
	}
	t.Skip(msg)
}

func serverBinary() (string, error) {
	if p := os.Getenv(EnvServer); p != "" {
		return p, nil
	}
	return exec.LookPath("redis-server")
}

// sharedDB claims one of databases 1..15 of the shared server for the test,
// so packages running in parallel never see each other's keys. The claim is
// a lock key in database 0, released (after FLUSHDB) when the test ends.
func sharedDB(t testing.TB, raw string) Backend {
	t.Helper()
	opt, err := redis.ParseURL(raw)
	if err != nil {
		t.Fatalf("%s: %v", EnvURL, err)
	}
	ctx := context.Background()
	ctl := redis.NewClient(&redis.Options{Addr: opt.Addr, Password: opt.Password, DB: 0})
	defer ctl.Close()
	token := fmt.Sprintf("%d-%d", os.Getpid(), time.Now().UnixNano())
	deadline := time.Now().Add(2 * time.Minute)
	for {
		for db := 1; db <= 15; db++ {
			lock := "faregate-test:lock:" + strconv.Itoa(db)
			ok, err := ctl.SetNX(ctx, lock, token, 10*time.Minute).Result()
			if err != nil {
				t.Fatalf("shared redis %s: %v", opt.Addr, err)
			}
			if !ok {
				continue
			}
			c := redis.NewClient(&redis.Options{Addr: opt.Addr, Password: opt.Password, DB: db})
			if err := c.FlushDB(ctx).Err(); err != nil {
				t.Fatalf("flushdb: %v", err)
			}
			t.Cleanup(func() {
				_ = c.FlushDB(context.Background()).Err()
				_ = c.Close()
				rel := redis.NewClient(&redis.Options{Addr: opt.Addr, Password: opt.Password})
				defer rel.Close()
				_ = rel.Del(context.Background(), lock).Err()
			})
			u := url.URL{Scheme: "redis", Host: opt.Addr, Path: "/" + strconv.Itoa(db)}
			if opt.Password != "" {
				u.User = url.UserPassword("", opt.Password)
			}
			return Backend{Name: "redis", Client: c, URL: u.String()}
		}
		if time.Now().After(deadline) {
			t.Fatal("no free database on the shared test Redis")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Server is a redis-server process owned by one test. Stop and Start keep
// the same port, so clients configured with its URL reconnect by themselves.
type Server struct {
	bin  string
	port int
	args []string // after the defaults; a later argument wins
	proc process
}

// Start launches a private redis-server on a free loopback port; it is
// killed when the test ends. Skips (fails in CI) without the binary.
func Start(t testing.TB) *Server {
	t.Helper()
	return StartWith(t)
}

// StartWith is Start with further redis-server arguments after the
// defaults (--save "" --appendonly no): a later argument wins, so
// StartWith(t, "--appendonly", "yes", "--dir", t.TempDir()) gives a server
// that persists.
func StartWith(t testing.TB, args ...string) *Server {
	t.Helper()
	bin, err := serverBinary()
	if err != nil {
		msg := "redis-server not found: install it (apt-get install redis-server) or set " + EnvServer
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	s := &Server{bin: bin, args: args}
	t.Cleanup(s.Stop) // before the start: one that fails may leave a process
	// A port free when freePort closed its listener can be taken before
	// redis-server binds it (another package's server, or an outgoing
	// connection's ephemeral port: the ranges overlap): then the server
	// exits at once, and a fresh port is tried.
	for range startTries {
		s.port = freePort(t)
		if err = s.Start(); !errors.Is(err, errExited) {
			break
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// startTries is how many ports a first start tries.
const startTries = 5

// errExited is a redis-server that exited before it answered: most often
// its port was taken by the time it bound it.
var errExited = errors.New("exited at start")

// URL is the redis:// address of the server.
func (s *Server) URL() string { return "redis://" + s.Addr() }

// Addr is host:port of the server.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Client returns a client closed at the end of the test.
func (s *Server) Client(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Start (re)launches the process on the server's port and waits until it answers PING.
func (s *Server) Start() error {
	args := append([]string{"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"}, s.args...)
	return s.proc.start(s.bin, "", s.Addr(), args)
}

// Stop kills the process (only this test's own) and waits for it to exit.
func (s *Server) Stop() { s.proc.kill() }

// process is one redis-server this package started, so the only kind it
// ever kills.
type process struct {
	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// start runs bin with args in dir ("": the current one), unless it runs
// already, and waits until addr answers PING; a process that exits first
// is an error at once.
func (p *process) start(bin, dir, addr string, args []string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd != nil {
		return nil
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("redistest: start %s for %s: %w", bin, addr, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	p.cmd, p.done = cmd, done
	c := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if c.Ping(context.Background()).Err() == nil {
			return nil
		}
		select {
		case <-done:
			p.cmd = nil
			return fmt.Errorf("redistest: redis-server for %s %w", addr, errExited)
		case <-time.After(20 * time.Millisecond):
		}
	}
	return fmt.Errorf("redistest: redis-server for %s did not answer", addr)
}

// kill kills the process, if it runs, and waits for it to exit.
func (p *process) kill() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil {
		return
	}
	_ = p.cmd.Process.Kill()
	<-p.done
	p.cmd = nil
}

// alive reports whether the process runs (it was started and not killed).
func (p *process) alive() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cmd != nil
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
