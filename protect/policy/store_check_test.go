package policy

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestStoreCheck: Options.Check refuses a policy at NewStore (with or
// without a file) and on reload, where the last good policy stays and
// OnError hears why; and OnChange, then each subscriber, has run before
// the reload is counted, so a caller that sees the counter move sees what
// they put in force.
func TestStoreCheck(t *testing.T) {
	atMost := func(n int64) func(*Policy) error {
		return func(p *Policy) error {
			if partnerTasks(p) > n {
				return errors.New("partner: too many tasks for this test")
			}
			return nil
		}
	}
	dir := t.TempDir()
	path := plainFile(t, dir, partnerFile(900))
	if _, err := NewStore(Options{Path: path, Defaults: envDefaults, Check: atMost(800)}); err == nil ||
		!strings.Contains(err.Error(), "too many tasks") || !strings.Contains(err.Error(), path) {
		t.Fatalf("NewStore with a policy Check refuses: %v", err)
	}
	if _, err := NewStore(Options{Defaults: envDefaults, Check: func(p *Policy) error {
		if p.Public().TokensPerDay < 50000 {
			return errors.New("FAREGATE_IP_DAILY_TOKENS: too small")
		}
		return nil
	}}); err == nil || strings.Contains(err.Error(), "policy") {
		t.Fatalf("without a file the check's own error, unprefixed: %v", err)
	}

	writeFile(t, path, partnerFile(500))
	errs := make(chan error, 4)
	var countedAtChange []float64
	changed := make(chan struct{}, 4)
	var s *Store
	s, err := NewStore(Options{Path: path, Defaults: envDefaults, Check: atMost(800), NoWatch: true,
		Reload:  make(chan struct{}),
		OnError: func(err error) { errs <- err },
		OnChange: func(old, new *Policy) {
			countedAtChange = append(countedAtChange, testutil.ToFloat64(s.reloads))
			changed <- struct{}{}
		},
		Registerer: prometheus.NewRegistry(),
	})
	if err != nil {
		t.Fatal(err)
	}
	var subscribed []float64
	s.Subscribe(func(old, new *Policy) {
		if len(countedAtChange) != 1 {
			t.Error("a subscriber ran before OnChange")
		}
		subscribed = append(subscribed, testutil.ToFloat64(s.reloads))
	})
	good := s.Current()
	writeFile(t, path, partnerFile(900))
	s.reload("test", false)
	select {
	case err := <-errs:
		if !strings.Contains(err.Error(), "too many tasks") {
			t.Fatalf("reload error %v", err)
		}
	case <-time.After(time.Second):
		t.Fatal("a refused policy did not reach OnError")
	}
	if s.Current() != good || testutil.ToFloat64(s.errors) != 1 || testutil.ToFloat64(s.reloads) != 0 {
		t.Fatalf("a policy Check refused was put in force (or not counted as an error)")
	}
	writeFile(t, path, partnerFile(700))
	s.reload("test", false)
	<-changed
	if partnerTasks(s.Current()) != 700 || testutil.ToFloat64(s.reloads) != 1 {
		t.Fatalf("good file not in force: %d tasks, %v reloads", partnerTasks(s.Current()), testutil.ToFloat64(s.reloads))
	}
	if len(countedAtChange) != 1 || countedAtChange[0] != 0 {
		t.Fatalf("the reload counter read %v inside OnChange, want 0: counted before OnChange ran", countedAtChange)
	}
	if len(subscribed) != 1 || subscribed[0] != 0 {
		t.Fatalf("the reload counter read %v inside the subscriber, want 0", subscribed)
	}
}
