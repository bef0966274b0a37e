package policy

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/kit/promreg"
	"faregate/protect/principal"
)

// Options configure a Store; zero fields take the defaults noted.
type Options struct {
	// Path is the policy file (FAREGATE_POLICY_FILE). Empty: Default,
	// and nothing to reload.
	Path string
	// Defaults are the public tier's values from the environment.
	Defaults principal.Tier
	// Reload asks for a re-read now, whether or not the file changed;
	// cmd feeds it from SIGHUP. May be nil.
	Reload <-chan struct{}
	// Check, when set, is asked about every policy before it is put in
	// force, at NewStore and on each reload: what the file alone cannot
	// know (a tier too small for one run of the configured agent, a model
	// without a price while a spend limit is set). An error refuses the
	// policy as a parse error would: no start, or the last good policy
	// stays.
	Check func(*Policy) error
	// OnChange is called after each successful reload, with the policy
	// replaced and the new one, from Run's goroutine, before the reload is
	// counted and logged: once faregate_policy_reloads_total moves, what
	// OnChange does (new prices, denials a raise made wrong forgotten:
	// RaisedTiers, RaisedKeys) is in force for the next request.
	OnChange func(old, new *Policy)
	// OnError is called after each failed reload (the old policy stays),
	// from Run's goroutine: for the policy_reload_failed alert.
	OnError func(err error)
	// NoWatch turns the file watcher off: reloads happen only on Reload.
	// For filesystems whose changes inotify does not see (NFS, some
	// container bind mounts).
	NoWatch bool
	// Quiet is how long the file must stay still after an event before it
	// is read, so an editor's burst of events gives one reload (100ms).
	Quiet time.Duration
	// MaxWait bounds that wait when events keep coming (500ms), so a busy
	// writer cannot postpone a reload past the 2 s promise.
	MaxWait time.Duration
	// Logger receives one line per reload (info) or failure (error).
	Logger *slog.Logger
	// Registerer receives faregate_policy_reloads_total and
	// faregate_policy_reload_errors_total; nil leaves them unregistered.
	Registerer prometheus.Registerer
}

// Store holds the current policy and replaces it when the file changes.
// Current is safe for concurrent use; Run is called once.
type Store struct {
	opts    Options
	lg      *slog.Logger
	cur     atomic.Pointer[Policy]
	reloads prometheus.Counter
	errors  prometheus.Counter

	// mu serialises reloads; seen is the SHA-256 of the content last
	// read, valid or not, so that events which change nothing (touch,
	// chmod, a second write of the same bytes) neither swap nor log.
	mu   sync.Mutex
	seen [32]byte
	// subscribers are called after OnChange (Subscribe).
	subscribers []func(old, new *Policy)

	// watching, when set (by tests), is called once Run watches the file
	// (or, without one, is about to wait), so a test's change cannot come
	// before the watch and be caught only by Run's first look.
	watching func()
}

// NewStore loads the policy file, or builds Default without one. An
// invalid file is an error naming every problem: faregate refuses to
// start rather than run without the policy its operator wrote.
func NewStore(opts Options) (*Store, error) {
	if opts.Quiet <= 0 {
		opts.Quiet = 100 * time.Millisecond
	}
	if opts.MaxWait <= 0 {
		opts.MaxWait = 500 * time.Millisecond
	}
	s := &Store{opts: opts, lg: opts.Logger}
	if s.lg == nil {
		s.lg = slog.New(slog.DiscardHandler)
	}
	s.reloads = promreg.Register(opts.Registerer, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "faregate_policy_reloads_total",
		Help: "Policy file reloads that replaced the policy.",
	}))
	s.errors = promreg.Register(opts.Registerer, prometheus.NewCounter(prometheus.CounterOpts{
		Name: "faregate_policy_reload_errors_total",
		Help: "Policy file reloads refused (unreadable or invalid file); the last good policy stayed.",
	}))
	if opts.Path == "" {
		p := Default(opts.Defaults)
		if err := s.check(p); err != nil {
			return nil, err
		}
		s.cur.Store(p)
		return s, nil
	}
	data, err := os.ReadFile(opts.Path)
	if err != nil {
		return nil, fmt.Errorf("policy: %w", err)
	}
	p, err := Parse(data, opts.Path, opts.Defaults)
	if err == nil {
		err = s.check(p)
	}
	if err != nil {
		return nil, err
	}
	s.seen = sha256.Sum256(data)
	s.cur.Store(p)
	return s, nil
}

// Subscribe adds fn to what each successful reload calls, after OnChange
// and in the order added, before the reload is counted. It is for what is
// built after the store and must follow its changes (the HTTP server's
// denial memory), so nothing has to capture a variable assigned later.
func (s *Store) Subscribe(fn func(old, new *Policy)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.subscribers = append(s.subscribers, fn)
}

// Current is the policy in force. Read it once per request and use that
// value throughout, so the request sees one policy.
func (s *Store) Current() *Policy { return s.cur.Load() }

// Run reloads the policy when its file changes and when Reload says so,
// until ctx ends. It watches the file's directory, not the file, so that
// an editor's rename-over-the-old-file is seen; with a symlinked file it
// also watches the target's directory and Kubernetes' ..data link. It
// returns an error only when the watcher cannot be set up.
func (s *Store) Run(ctx context.Context) error {
	if s.opts.Path == "" {
		if s.watching != nil {
			s.watching()
		}
		for {
			select {
			case <-ctx.Done():
				return nil
			case <-s.opts.Reload:
				s.lg.Info("policy reload asked for, but there is no policy file (FAREGATE_POLICY_FILE is empty)")
			}
		}
	}
	var events <-chan fsnotify.Event
	var watchErrs <-chan error
	names := map[string]bool{}
	if !s.opts.NoWatch {
		w, err := fsnotify.NewWatcher()
		if err != nil {
			return fmt.Errorf("policy: watch %s: %w", s.opts.Path, err)
		}
		defer w.Close()
		if names, err = s.watch(w); err != nil {
			return err
		}
		events, watchErrs = w.Events, w.Errors
		// The file may have changed between NewStore and the watch.
		s.reload("start", false)
	}
	if s.watching != nil {
		s.watching()
	}

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	var burst time.Time // when the first event of a pending burst came; zero: none
	arm := func() {
		now := time.Now()
		if burst.IsZero() {
			burst = now
		}
		// Wait for Quiet, but never past MaxWait after the burst began.
		timer.Reset(max(0, min(s.opts.Quiet, s.opts.MaxWait-now.Sub(burst))))
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case ev, ok := <-events:
			if !ok {
				return nil
			}
			if names[filepath.Clean(ev.Name)] {
				arm()
			}
		case err, ok := <-watchErrs:
			if !ok {
				return nil
			}
			// An overflowed queue may have lost the event that mattered.
			s.lg.Warn("policy file watcher error; re-reading the file", "err", err)
			arm()
		case <-timer.C:
			burst = time.Time{}
			s.reload("file", false)
		case <-s.opts.Reload:
			s.reload("signal", true)
		}
	}
}

// watch adds the directories to watch and returns the paths whose events
// matter.
func (s *Store) watch(w *fsnotify.Watcher) (map[string]bool, error) {
	// Events name files by the watched directory: absolute paths on both
	// sides make them comparable.
	path, err := filepath.Abs(s.opts.Path)
	if err != nil {
		return nil, fmt.Errorf("policy: watch %s: %w", s.opts.Path, err)
	}
	dir := filepath.Dir(path)
	names := map[string]bool{
		path: true,
		// Kubernetes updates a mounted ConfigMap by swapping this link.
		filepath.Join(dir, "..data"): true,
	}
	dirs := []string{dir}
	if target, err := filepath.EvalSymlinks(path); err == nil && filepath.Dir(target) != dir {
		names[target] = true
		dirs = append(dirs, filepath.Dir(target))
	}
	for _, d := range dirs {
		if err := w.Add(d); err != nil {
			return nil, fmt.Errorf("policy: watch %s: %w", d, err)
		}
	}
	return names, nil
}

// reload re-reads the file and swaps in the new policy if it is valid.
// Unless force, content already seen is skipped.
func (s *Store) reload(trigger string, force bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	data, err := os.ReadFile(s.opts.Path)
	if err != nil {
		s.fail(trigger, fmt.Errorf("policy: %w", err))
		return
	}
	sum := sha256.Sum256(data)
	if !force && sum == s.seen {
		return
	}
	s.seen = sum
	p, err := Parse(data, s.opts.Path, s.opts.Defaults)
	if err == nil {
		err = s.check(p)
	}
	if err != nil {
		s.fail(trigger, err)
		return
	}
	old := s.cur.Swap(p)
	if s.opts.OnChange != nil {
		s.opts.OnChange(old, p)
	}
	for _, fn := range s.subscribers {
		fn(old, p)
	}
	s.reloads.Inc()
	s.lg.Info("policy reloaded", "path", s.opts.Path, "trigger", trigger,
		"file_sha256", hex.EncodeToString(sum[:6]), "tiers", len(p.tiers), "keys", len(p.keys),
		"prompt_rules", len(p.rules), "models", len(p.prices))
}

// check asks Options.Check about p.
func (s *Store) check(p *Policy) error {
	if s.opts.Check == nil {
		return nil
	}
	err := s.opts.Check(p)
	if err != nil && p.source != SourceEnvironment {
		return fmt.Errorf("policy %s: %w", p.source, err)
	}
	return err
}

func (s *Store) fail(trigger string, err error) {
	s.errors.Inc()
	s.lg.Error("policy reload failed; keeping the last good policy", "path", s.opts.Path, "trigger", trigger, "err", err)
	if s.opts.OnError != nil {
		s.opts.OnError(err)
	}
}
