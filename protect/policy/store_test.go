package policy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// reloadPromise is the bound the operator's manual sets on a reload becoming visible.
const reloadPromise = 2 * time.Second

// partnerFile is a valid policy whose partner tier allows tasks per day.
func partnerFile(tasks int) string {
	return fmt.Sprintf(`tiers:
  partner: {tasks_per_day: %d, tokens_per_day: 2000000, requests_per_minute: 600}
keys:
  - {id: acme, sha256: "%s", tier: partner}
`, tasks, hashA)
}

func partnerTasks(p *Policy) int64 {
	t, _ := p.Tier("partner")
	return t.TasksPerDay
}

// syncBuffer is a log sink shared by Run's goroutine and the test.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// storeRun is a Store running in the background with its events on
// channels.
type storeRun struct {
	s       *Store
	changes chan [2]*Policy
	errs    chan error
	reload  chan struct{}
	log     *syncBuffer
}

func startStore(t *testing.T, path string, noWatch bool) *storeRun {
	t.Helper()
	r := &storeRun{
		changes: make(chan [2]*Policy, 16),
		errs:    make(chan error, 16),
		reload:  make(chan struct{}),
		log:     &syncBuffer{},
	}
	s, err := NewStore(Options{
		Path:       path,
		Defaults:   envDefaults,
		Reload:     r.reload,
		OnChange:   func(old, new *Policy) { r.changes <- [2]*Policy{old, new} },
		OnError:    func(err error) { r.errs <- err },
		NoWatch:    noWatch,
		Logger:     slog.New(slog.NewTextHandler(r.log, nil)),
		Registerer: prometheus.NewRegistry(),
	})
	if err != nil {
		t.Fatal(err)
	}
	r.s = s
	ready := make(chan struct{})
	s.watching = func() { close(ready) }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	<-ready
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return r
}

// waitChange waits, at most reloadPromise, for the next reload and
// returns the new policy and how long it took since since.
func (r *storeRun) waitChange(t *testing.T, since time.Time) (*Policy, time.Duration) {
	t.Helper()
	select {
	case ch := <-r.changes:
		took := time.Since(since)
		// OnChange runs inside the reload, before it is counted and
		// logged; the reload holds mu until it has done both.
		r.s.mu.Lock()
		r.s.mu.Unlock()
		return ch[1], took
	case err := <-r.errs:
		t.Fatalf("reload failed: %v", err)
	case <-time.After(reloadPromise):
		t.Fatalf("no reload within %v", reloadPromise)
	}
	return nil, 0
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestStoreReloadsOnChange changes the file the ways editors and
// deployments do and asserts each is visible within the 2 s promise.
func TestStoreReloadsOnChange(t *testing.T) {
	tests := []struct {
		name string
		// setup creates the policy file with content and returns the
		// path faregate is given; change rewrites it with content.
		setup  func(t *testing.T, dir, content string) string
		change func(t *testing.T, path, content string)
	}{
		{
			name:  "written in place",
			setup: plainFile,
			change: func(t *testing.T, path, content string) {
				writeFile(t, path, content)
			},
		},
		{
			name:  "renamed over (vim, VS Code, sed -i)",
			setup: plainFile,
			change: func(t *testing.T, path, content string) {
				tmp := filepath.Join(filepath.Dir(path), ".policy.yaml.tmp")
				writeFile(t, tmp, content)
				if err := os.Rename(tmp, path); err != nil {
					t.Fatal(err)
				}
			},
		},
		{
			name:  "deleted and created again",
			setup: plainFile,
			change: func(t *testing.T, path, content string) {
				if err := os.Remove(path); err != nil {
					t.Fatal(err)
				}
				writeFile(t, path, content)
			},
		},
		{
			name: "symlink whose target is edited",
			setup: func(t *testing.T, dir, content string) string {
				other := t.TempDir()
				writeFile(t, filepath.Join(other, "real.yaml"), content)
				link := filepath.Join(dir, "policy.yaml")
				if err := os.Symlink(filepath.Join(other, "real.yaml"), link); err != nil {
					t.Fatal(err)
				}
				return link
			},
			change: func(t *testing.T, path, content string) {
				target, err := filepath.EvalSymlinks(path)
				if err != nil {
					t.Fatal(err)
				}
				writeFile(t, target, content)
			},
		},
		{
			name: "Kubernetes ConfigMap swap of ..data",
			setup: func(t *testing.T, dir, content string) string {
				mustMkdir(t, filepath.Join(dir, "..v1"))
				writeFile(t, filepath.Join(dir, "..v1", "policy.yaml"), content)
				mustSymlink(t, "..v1", filepath.Join(dir, "..data"))
				mustSymlink(t, filepath.Join("..data", "policy.yaml"), filepath.Join(dir, "policy.yaml"))
				return filepath.Join(dir, "policy.yaml")
			},
			change: func(t *testing.T, path, content string) {
				dir := filepath.Dir(path)
				mustMkdir(t, filepath.Join(dir, "..v2"))
				writeFile(t, filepath.Join(dir, "..v2", "policy.yaml"), content)
				mustSymlink(t, "..v2", filepath.Join(dir, "..data_tmp"))
				if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
					t.Fatal(err)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := tt.setup(t, t.TempDir(), partnerFile(500))
			r := startStore(t, path, false)
			before := r.s.Current()
			if partnerTasks(before) != 500 {
				t.Fatalf("start: partner tasks = %d", partnerTasks(before))
			}

			began := time.Now()
			tt.change(t, path, partnerFile(600))
			p, took := r.waitChange(t, began)
			if partnerTasks(p) != 600 || partnerTasks(r.s.Current()) != 600 {
				t.Fatalf("after reload: partner tasks = %d, Current %d; want 600", partnerTasks(p), partnerTasks(r.s.Current()))
			}
			if took >= reloadPromise {
				t.Errorf("reload took %v, over the %v promise", took, reloadPromise)
			}
			t.Logf("reload visible after %v", took.Round(time.Millisecond))
			if partnerTasks(before) != 500 {
				t.Error("the policy held before the reload changed: policies must be immutable")
			}
			if got := testutil.ToFloat64(r.s.reloads); got != 1 {
				t.Errorf("faregate_policy_reloads_total = %v, want 1", got)
			}
			if got := testutil.ToFloat64(r.s.errors); got != 0 {
				t.Errorf("faregate_policy_reload_errors_total = %v, want 0", got)
			}
			if n := strings.Count(r.log.String(), `msg="policy reloaded"`); n != 1 {
				t.Errorf("%d reload log lines, want 1:\n%s", n, r.log)
			}
		})
	}
}

func plainFile(t *testing.T, dir, content string) string {
	path := filepath.Join(dir, "policy.yaml")
	writeFile(t, path, content)
	return path
}

func mustMkdir(t *testing.T, dir string) {
	t.Helper()
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
}

func mustSymlink(t *testing.T, target, link string) {
	t.Helper()
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
}

// TestStoreKeepsLastGoodPolicy: a broken file changes nothing but the
// error counter and one error line; fixing it reloads.
func TestStoreKeepsLastGoodPolicy(t *testing.T) {
	path := plainFile(t, t.TempDir(), partnerFile(500))
	r := startStore(t, path, false)
	good := r.s.Current()

	secret := NewKey()
	writeFile(t, path, partnerFile(0)+"  - {id: oops, sha256: "+secret+", tier: partner}\n")
	select {
	case err := <-r.errs:
		if !errors.Is(err, ErrInvalidPolicy) {
			t.Errorf("reload error %v is not ErrInvalidPolicy", err)
		}
	case ch := <-r.changes:
		t.Fatalf("a broken file was swapped in: %+v", ch[1])
	case <-time.After(reloadPromise):
		t.Fatal("no reload attempt within 2 s")
	}
	if r.s.Current() != good {
		t.Fatal("a failed reload replaced the policy")
	}
	if got := testutil.ToFloat64(r.s.errors); got != 1 {
		t.Errorf("faregate_policy_reload_errors_total = %v, want 1", got)
	}
	if got := testutil.ToFloat64(r.s.reloads); got != 0 {
		t.Errorf("faregate_policy_reloads_total = %v, want 0", got)
	}
	logged := r.log.String()
	if n := strings.Count(logged, "\n"); n != 1 || !strings.Contains(logged, "level=ERROR") ||
		!strings.Contains(logged, "tasks_per_day: must be at least 1") {
		t.Errorf("want one error line naming the problem, got:\n%s", logged)
	}
	if strings.Contains(logged, secret[3:]) {
		t.Error("the log line contains key material")
	}

	began := time.Now()
	writeFile(t, path, partnerFile(700))
	p, took := r.waitChange(t, began)
	if partnerTasks(p) != 700 || r.s.Current() != p {
		t.Fatalf("fixed file not loaded: partner tasks = %d", partnerTasks(p))
	}
	t.Logf("fixed file visible after %v", took.Round(time.Millisecond))
	if got := testutil.ToFloat64(r.s.errors); got != 1 {
		t.Errorf("faregate_policy_reload_errors_total = %v after the fix, want 1", got)
	}
}

// TestStoreReloadChannel: the SIGHUP path re-reads the file on its own,
// with the watcher off so that only the channel can have done it.
func TestStoreReloadChannel(t *testing.T) {
	path := plainFile(t, t.TempDir(), partnerFile(500))
	r := startStore(t, path, true)
	writeFile(t, path, partnerFile(800))

	began := time.Now()
	r.reload <- struct{}{}
	p, took := r.waitChange(t, began)
	if partnerTasks(p) != 800 {
		t.Fatalf("partner tasks = %d after the signal, want 800", partnerTasks(p))
	}
	t.Logf("signal reload visible after %v", took.Round(time.Millisecond))

	// A signal reloads even an unchanged file: the operator asked.
	r.reload <- struct{}{}
	if again, _ := r.waitChange(t, time.Now()); again == p || partnerTasks(again) != 800 {
		t.Errorf("second signal: got the same *Policy or another file (%d tasks)", partnerTasks(again))
	}
	if got := testutil.ToFloat64(r.s.reloads); got != 2 {
		t.Errorf("faregate_policy_reloads_total = %v, want 2", got)
	}
	if !strings.Contains(r.log.String(), "trigger=signal") {
		t.Errorf("log does not name the trigger:\n%s", r.log)
	}
}

// TestStoreSwapIsAtomic: readers racing with reloads always see one
// whole policy: the key's tier and the tier's limit come from the same
// file. Run with -race.
func TestStoreSwapIsAtomic(t *testing.T) {
	// Version n has tier tn with n tasks per day, and the key in it.
	version := func(n int) string {
		return fmt.Sprintf("tiers:\n  t%d: {tasks_per_day: %d, tokens_per_day: 1, requests_per_minute: 1}\nkeys:\n  - {id: acme, sha256: %s, tier: t%d}\n", n, n, hashA, n)
	}
	path := plainFile(t, t.TempDir(), version(1))
	r := startStore(t, path, true)

	// The readers stop and are waited for however the test ends: one may
	// report through t, so none outlives it.
	stop := make(chan struct{})
	var wg sync.WaitGroup
	t.Cleanup(func() { close(stop); wg.Wait() })
	var mixed sync.Once
	for range 4 {
		wg.Go(func() {
			for {
				select {
				case <-stop:
					return
				default:
				}
				p := r.s.Current()
				k := p.Keys()[0]
				tier, ok := p.Tier(k.Tier)
				if !ok || fmt.Sprintf("t%d", tier.TasksPerDay) != k.Tier {
					mixed.Do(func() { t.Errorf("mixed policy: key tier %s, tier %+v", k.Tier, tier) })
				}
			}
		})
	}
	for n := 2; n <= 30; n++ {
		writeFile(t, path, version(n))
		r.reload <- struct{}{}
		if p, _ := r.waitChange(t, time.Now()); p.Keys()[0].Tier != fmt.Sprintf("t%d", n) {
			t.Fatalf("version %d not loaded", n)
		}
	}
}

func TestStoreWithoutFile(t *testing.T) {
	r := startStore(t, "", false)
	p := r.s.Current()
	if p.Source() != SourceEnvironment || p.Public() != publicDefaults(envDefaults) {
		t.Fatalf("no file: %q %+v", p.Source(), p.Public())
	}
	r.reload <- struct{}{}
	// The send above returned, so Run took it; a second send waits until
	// the first was handled, and the log line is there.
	r.reload <- struct{}{}
	if !strings.Contains(r.log.String(), "no policy file") {
		t.Errorf("a signal without a file logged nothing:\n%s", r.log)
	}
	if r.s.Current() != p {
		t.Error("the policy changed without a file")
	}
}

func TestNewStoreRefusesBadFile(t *testing.T) {
	dir := t.TempDir()
	bad := plainFile(t, dir, "tiers:\n  partner: {tasks_per_day: 0}\n")
	_, err := NewStore(Options{Path: bad, Defaults: envDefaults})
	var ve *ValidationError
	if !errors.As(err, &ve) || !strings.Contains(err.Error(), "line 2: tiers.partner") {
		t.Errorf("bad file at start: %v, want a ValidationError naming line 2", err)
	}
	_, err = NewStore(Options{Path: filepath.Join(dir, "missing.yaml"), Defaults: envDefaults})
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing file at start: %v, want ErrNotExist", err)
	}
}
