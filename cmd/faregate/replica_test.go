package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"
)

// Helpers for the fault tests: faregate as a child process the test may
// kill -9, and an event-stream follower that runs beside the test.

// buildFaregate builds this package's binary into dir with `go build` (the
// build cache makes it cheap after the first time). It skips without a Go
// toolchain on PATH, and fails under CI=true.
func buildFaregate(t *testing.T, dir string) string {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal("go not on PATH: the process tests build the binary")
		}
		t.Skip("go not on PATH: the process tests build the binary")
	}
	bin := filepath.Join(dir, "faregate")
	// The test runs in the package's directory: "." is cmd/faregate.
	out, err := exec.Command(gobin, "build", "-o", bin, ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// child is a faregate process started by the test: the only kind of
// process a test may kill.
type child struct {
	URL  string
	Out  *syncBuffer
	cmd  *exec.Cmd
	done chan struct{}
}

// startChild runs bin serve with env (plus the defaults startServer uses)
// and waits until it listens and /healthz answers. The process is killed
// at the end of the test if it still runs.
func startChild(t *testing.T, bin string, env map[string]string) *child {
	t.Helper()
	full := map[string]string{"FAREGATE_ADDR": "127.0.0.1:0", "FAREGATE_LOG_FORMAT": "json", "FAREGATE_SHUTDOWN_TIMEOUT": "5s",
		"FAREGATE_REQUESTS_PER_MINUTE": "1000000", "FAREGATE_FAILED_CHECKS_PER_HOUR": "1000000"}
	for k, v := range env {
		full[k] = v
	}
	cmd := exec.Command(bin, "serve")
	// The child sees the test's FAREGATE_ variables only, never the
	// developer's own.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "FAREGATE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	for k, v := range full {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	out := &syncBuffer{addr: make(chan string, 1)}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &child{Out: out, cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(c.done) }()
	t.Cleanup(c.Kill)
	select {
	case c.URL = <-out.addr:
	case <-c.done:
		t.Fatalf("faregate exited before listening:\n%s", out.String())
	case <-time.After(60 * time.Second):
		t.Fatalf("faregate printed no listening line within 60s:\n%s", out.String())
	}
	waitHealthy(t, c.URL)
	return c
}

// Kill sends SIGKILL to the child (kill -9: no shutdown, no final save)
// and waits until it is gone.
func (c *child) Kill() {
	select {
	case <-c.done:
		return
	default:
	}
	_ = c.cmd.Process.Kill()
	<-c.done
}

// follower reads a task's event stream in the background, as a browser
// would, and keeps every event it got and how the stream ended.
type follower struct {
	mu     sync.Mutex
	events []sseEvent
	err    error
	ended  chan struct{}
	cancel context.CancelFunc
}

// follow opens url (a task's /events) and reads it until the server ends
// the stream or the test does.
func follow(t *testing.T, url string) *follower {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	f := &follower{ended: make(chan struct{}), cancel: cancel}
	t.Cleanup(func() { cancel(); <-f.ended })
	go func() {
		defer close(f.ended)
		err := f.read(ctx, url)
		f.mu.Lock()
		f.err = err
		f.mu.Unlock()
	}()
	return f
}

func (f *follower) read(ctx context.Context, url string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("events: %d", resp.StatusCode)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var cur sseEvent
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if cur.Type != "" {
				f.mu.Lock()
				f.events = append(f.events, cur)
				f.mu.Unlock()
			}
			cur = sseEvent{}
		case strings.HasPrefix(line, "id: "):
			cur.ID = line[4:]
		case strings.HasPrefix(line, "event: "):
			cur.Type = line[7:]
		case strings.HasPrefix(line, "data: "):
			cur.Data += line[6:]
		}
	}
	return sc.Err()
}

// Events is what the follower got so far.
func (f *follower) Events() []sseEvent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]sseEvent(nil), f.events...)
}

// waitStatus waits until the stream carried a status event saying status.
func (f *follower) waitStatus(t *testing.T, status string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		if hasStatus(f.Events(), status) {
			return
		}
		select {
		case <-f.ended:
			if hasStatus(f.Events(), status) {
				return
			}
			t.Fatalf("stream ended (%v) without status %s: %v", f.err, status, f.Events())
		case <-time.After(20 * time.Millisecond):
		}
	}
	t.Fatalf("no status %s on the stream within %v: %v", status, d, f.Events())
}

// waitEnded waits until the server ended the stream and returns its events.
func (f *follower) waitEnded(t *testing.T, d time.Duration) []sseEvent {
	t.Helper()
	select {
	case <-f.ended:
		return f.Events()
	case <-time.After(d):
		t.Fatalf("the stream did not end within %v: %v", d, f.Events())
		return nil
	}
}

func hasStatus(evs []sseEvent, status string) bool {
	for _, e := range evs {
		var d struct{ Status string }
		if e.Type == "status" && json.Unmarshal([]byte(e.Data), &d) == nil && d.Status == status {
			return true
		}
	}
	return false
}

// assertFinalEvents checks that a stream ends with its task's final
// events: a status event saying status, then done carrying the task with
// that status (and errCode, when given). It returns the done event's task.
func assertFinalEvents(t *testing.T, evs []sseEvent, status, errCode string) map[string]any {
	t.Helper()
	if len(evs) < 2 {
		t.Fatalf("stream has %d events, want the final status and done: %v", len(evs), evs)
	}
	last, prev := evs[len(evs)-1], evs[len(evs)-2]
	if last.Type != "done" {
		t.Fatalf("stream did not end with done: %v", evs)
	}
	if !hasStatus([]sseEvent{prev}, status) {
		t.Fatalf("the event before done is %s %s, want status %s", prev.Type, prev.Data, status)
	}
	var done map[string]any
	if err := json.Unmarshal([]byte(last.Data), &done); err != nil {
		t.Fatalf("done event: %v %s", err, last.Data)
	}
	if done["status"] != status {
		t.Fatalf("done event says %v, want %s", done["status"], status)
	}
	if errCode != "" {
		e, _ := done["error"].(map[string]any)
		if e["code"] != errCode {
			t.Fatalf("done event's error %v, want code %s", done["error"], errCode)
		}
	}
	return done
}

// waitLog polls a process's output until a line contains every part.
func waitLog(t *testing.T, out *syncBuffer, d time.Duration, parts ...string) string {
	t.Helper()
	var l string
	if !clocktest.Poll(d, func() bool { l = findLine(out.String(), parts...); return l != "" }) {
		t.Fatalf("no log line with %q within %v", parts, d)
	}
	return l
}

// countLines counts the output lines that contain every part.
func countLines(out string, parts ...string) int {
	n := 0
	for _, l := range strings.Split(out, "\n") {
		if containsAll(l, parts) {
			n++
		}
	}
	return n
}

func findLine(out string, parts ...string) string {
	for _, l := range strings.Split(out, "\n") {
		if containsAll(l, parts) {
			return l
		}
	}
	return ""
}

func containsAll(s string, parts []string) bool {
	for _, p := range parts {
		if !strings.Contains(s, p) {
			return false
		}
	}
	return true
}

// pollTask polls base's GET /api/tasks/{id} until cond holds on the
// task or d passes; it returns the last task seen and whether cond held.
func pollTask(t *testing.T, base, id string, d time.Duration, cond func(task map[string]any) bool) (map[string]any, bool) {
	t.Helper()
	var last map[string]any
	// Politely, as waitTask: the looks count in the visitor's windows.
	held := clocktest.PollAt(d, 250*time.Millisecond, func() bool {
		r := do(t, "GET", base+"/api/tasks/"+id, "", nil)
		if r.Status != 200 {
			return false
		}
		last = r.Body
		return cond(last)
	})
	return last, held
}

func statusIs(s string) func(map[string]any) bool {
	return func(task map[string]any) bool { return task["status"] == s }
}
