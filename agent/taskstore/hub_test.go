package taskstore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"faregate/agent/task"
	"faregate/protect/kit/testkit/redistest"
)

// started writes a task that is running, under a lease, and returns what
// a test needs to write more of it.
func started(t *testing.T, s *Store) (task.Record, Lease) {
	t.Helper()
	ctx := context.Background()
	rec := newRecord()
	if err := s.Create(ctx, rec); err != nil {
		t.Fatal(err)
	}
	l, rec, err := s.Acquire(ctx, Entry{ID: "1-1", Task: rec.ID}, "w")
	if err != nil {
		t.Fatal(err)
	}
	rec.Status = task.StatusRunning
	if err := s.Save(ctx, l, rec, task.Event{Type: task.EventStatus, Data: []byte(`{"status":"running"}`)}); err != nil {
		t.Fatal(err)
	}
	return rec, l
}

// finish writes a step and the final events.
func finish(t *testing.T, s *Store, rec task.Record, l Lease) {
	t.Helper()
	rec.Status = task.StatusSucceeded
	if err := s.Save(context.Background(), l, rec,
		task.Event{Type: task.EventStep, Data: []byte(`{"seq":1}`)},
		task.Event{Type: task.EventStatus, Data: []byte(`{"status":"succeeded"}`)},
		task.Event{Type: task.EventDone, Data: doneData(t, rec)}); err != nil {
		t.Fatal(err)
	}
}

// collect follows a task into a slice.
type collect struct {
	mu     sync.Mutex
	events []task.Event
	first  chan struct{}
	once   sync.Once
}

func newCollect() *collect { return &collect{first: make(chan struct{})} }

func (c *collect) fn(e task.Event) error {
	c.mu.Lock()
	c.events = append(c.events, e)
	c.mu.Unlock()
	c.once.Do(func() { close(c.first) })
	return nil
}

func (c *collect) types() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []string
	for _, e := range c.events {
		out = append(out, e.Type)
	}
	return out
}

// TestHubFollow on both backends: replay from the start and after an id,
// live events as they are written, done ends it, an unknown task is
// ErrNotFound, a final task whose done event is gone still ends.
func TestHubFollow(t *testing.T) {
	for _, be := range redistest.Both(t) {
		t.Run(be.Name, func(t *testing.T) {
			ctx := context.Background()
			s := New(be.Client)
			h := NewHub(s, be.Client, HubOptions{Block: 50 * time.Millisecond})
			rec, l := started(t, s)

			c := newCollect()
			errc := make(chan error, 1)
			go func() { errc <- h.Follow(ctx, rec.ID, "", c.fn) }()
			<-c.first // the follower is live: what comes now arrives through the reader
			finish(t, s, rec, l)
			if err := <-errc; err != nil {
				t.Fatal(err)
			}
			want := []string{"status", "status", "step", "status", "done"}
			if fmt.Sprint(c.types()) != fmt.Sprint(want) {
				t.Fatalf("events %v, want %v", c.types(), want)
			}

			resumed := newCollect()
			if err := h.Follow(ctx, rec.ID, c.events[1].ID, resumed.fn); err != nil {
				t.Fatal(err)
			}
			if fmt.Sprint(resumed.types()) != fmt.Sprint(want[2:]) {
				t.Fatalf("resumed after %s: %v, want %v", c.events[1].ID, resumed.types(), want[2:])
			}

			if err := h.Follow(ctx, task.NewID(), "", newCollect().fn); !errors.Is(err, task.ErrNotFound) {
				t.Fatalf("unknown task: %v", err)
			}

			// A final task whose events were trimmed away ends from its record.
			if err := be.Client.Del(ctx, eventsKey(rec.ID)).Err(); err != nil {
				t.Fatal(err)
			}
			gone := newCollect()
			if err := h.Follow(ctx, rec.ID, "", gone.fn); err != nil || fmt.Sprint(gone.types()) != "[done]" {
				t.Fatalf("final task without events: %v %v", gone.types(), err)
			}
			if h.Readers() != 0 {
				t.Fatalf("%d readers left after every follower ended", h.Readers())
			}
		})
	}
}

// TestHubOneReaderForManyFollowers: a thousand followers of one running task
// cost one Redis reader, and all of them see every event.
func TestHubOneReaderForManyFollowers(t *testing.T) {
	be := redistest.Real(t)
	s := New(be.Client)
	reg := prometheus.NewRegistry()
	h := NewHub(s, be.Client, HubOptions{Block: time.Second, Registerer: reg})
	rec, l := started(t, s)

	const followers = 1000
	// However the test ends, the followers end before it does: a test that
	// failed before the task finished cancels them (their error then is
	// that, not a finding) and waits.
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	cs := make([]*collect, followers)
	for i := range cs {
		cs[i] = newCollect()
		wg.Add(1)
		go func(c *collect) {
			defer wg.Done()
			if err := h.Follow(ctx, rec.ID, "", c.fn); err != nil && ctx.Err() == nil {
				t.Error(err)
			}
		}(cs[i])
	}
	for _, c := range cs {
		<-c.first
	}
	if got := h.Readers(); got != 1 {
		t.Fatalf("%d readers for one task, want 1", got)
	}
	finish(t, s, rec, l)
	wg.Wait()
	for i, c := range cs {
		if got := c.types(); len(got) != 5 || got[4] != task.EventDone {
			t.Fatalf("follower %d saw %v", i, got)
		}
	}
	if got := testutil.ToFloat64(h.started); got != 1 {
		t.Fatalf("readers started = %v, want 1", got)
	}
}

// TestHubKeepAlive: an idle follower gets keep-alives.
func TestHubKeepAlive(t *testing.T) {
	be := redistest.Mini(t)
	s := New(be.Client)
	h := NewHub(s, be.Client, HubOptions{Block: 20 * time.Millisecond, KeepAlive: 30 * time.Millisecond})
	rec, _ := started(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	keepalives := make(chan struct{}, 10)
	err := h.Follow(ctx, rec.ID, "", func(e task.Event) error {
		if e.Type == task.EventKeepAlive {
			keepalives <- struct{}{}
			if len(keepalives) == 2 {
				cancel()
			}
		}
		return nil
	})
	if !errors.Is(err, context.Canceled) || len(keepalives) != 2 {
		t.Fatalf("err %v after %d keep-alives", err, len(keepalives))
	}
}

// TestHubShutdown: on shutdown, a follower of a task that just finished
// here gets its final events; a follower of a task still running elsewhere
// is closed with ErrShutdown, to resume on another replica.
func TestHubShutdown(t *testing.T) {
	be := redistest.Real(t)
	ctx := context.Background()
	s := New(be.Client)
	// A long block: shutdown must not wait for the reader's XREAD.
	h := NewHub(s, be.Client, HubOptions{Block: 30 * time.Second})
	done, ld := started(t, s)
	other, _ := started(t, s)

	cDone, cOther := newCollect(), newCollect()
	errDone, errOther := make(chan error, 1), make(chan error, 1)
	go func() { errDone <- h.Follow(ctx, done.ID, "", cDone.fn) }()
	go func() { errOther <- h.Follow(ctx, other.ID, "", cOther.fn) }()
	<-cDone.first
	<-cOther.first

	// The task ends right before shutdown; the reader may not have read it yet.
	finish(t, s, done, ld)
	h.Shutdown(ctx)
	if err := <-errDone; err != nil {
		t.Fatalf("follower of the finished task: %v", err)
	}
	if got := cDone.types(); got[len(got)-1] != task.EventDone {
		t.Fatalf("follower of the finished task saw %v, want it to end with done", got)
	}
	if err := <-errOther; !errors.Is(err, ErrShutdown) {
		t.Fatalf("follower of a task running elsewhere: %v, want ErrShutdown", err)
	}
	if err := h.Follow(ctx, other.ID, "", newCollect().fn); !errors.Is(err, ErrShutdown) {
		t.Fatalf("follow after shutdown: %v", err)
	}
	// A follower that arrives while this process stops (its stream was
	// taken just before) still gets the end of a task that ended: the
	// replay, up to done, not a cut.
	late := newCollect()
	if err := h.Follow(ctx, done.ID, "", late.fn); err != nil {
		t.Fatalf("follow of the finished task after shutdown: %v (saw %v)", err, late.types())
	}
	if got := late.types(); len(got) == 0 || got[len(got)-1] != task.EventDone {
		t.Fatalf("late follower of the finished task saw %v, want it to end with done", got)
	}
}

// TestHubSlowFollowerIsDropped: a follower that does not keep up is closed
// (it resumes with Last-Event-ID) and never holds the others back.
func TestHubSlowFollowerIsDropped(t *testing.T) {
	be := redistest.Mini(t)
	ctx := context.Background()
	s := New(be.Client)
	// A mailbox of 4: the last save's three events fit; the slow follower's
	// thirteen do not.
	h := NewHub(s, be.Client, HubOptions{Block: 20 * time.Millisecond, Buffer: 4})
	rec, l := started(t, s)

	release := make(chan struct{})
	slow := make(chan error, 1)
	entered := make(chan struct{})
	var once sync.Once
	go func() {
		slow <- h.Follow(ctx, rec.ID, "", func(e task.Event) error {
			once.Do(func() { close(entered) })
			<-release
			return nil
		})
	}()
	<-entered
	// The fast follower keeps up: each event is written only once it has
	// seen the one before, so its mailbox never holds more than one.
	seen := make(chan string, 64)
	fastErr := make(chan error, 1)
	go func() {
		fastErr <- h.Follow(ctx, rec.ID, "", func(e task.Event) error {
			seen <- e.Type
			return nil
		})
	}()
	for i := 0; i < 2; i++ { // the replayed status events: queued, running
		if typ := <-seen; typ != task.EventStatus {
			t.Fatalf("replay began with %s", typ)
		}
	}
	for i := 0; i < 10; i++ {
		if err := s.Save(ctx, l, rec, task.Event{Type: task.EventStep, Data: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
		for typ := <-seen; typ != task.EventStep; typ = <-seen {
		}
	}
	finish(t, s, rec, l)
	if err := <-fastErr; err != nil {
		t.Fatalf("the fast follower: %v", err)
	}
	close(release)
	if err := <-slow; !errors.Is(err, errTooSlow) {
		t.Fatalf("the slow follower: %v, want errTooSlow", err)
	}
}
