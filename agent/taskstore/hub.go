package taskstore

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"faregate/agent/task"
	"faregate/protect/kit/pause"
	"faregate/protect/kit/promreg"
)

// ErrShutdown ends a follower whose process is shutting down before its
// task finished here: the client resumes on another replica.
var ErrShutdown = errors.New("taskstore: shutting down")

// errTooSlow ends a follower that fell behind its task's events; the
// client resumes with Last-Event-ID.
var errTooSlow = errors.New("taskstore: follower fell behind")

// HubOptions tune a Hub.
type HubOptions struct {
	// Block is how long one XREAD waits for new events (default 5 s).
	Block time.Duration
	// KeepAlive is how often an idle follower gets a keep-alive (15 s).
	KeepAlive time.Duration
	// Buffer is how many events a follower may lag behind (256); one
	// further behind is closed and resumes with Last-Event-ID.
	Buffer     int
	Logger     *slog.Logger
	Registerer prometheus.Registerer
}

// Hub fans each task's events out to every follower in this process: one
// Redis reader per followed task, however many follow it, blocking in
// XREAD instead of polling, on a connection pool of its own (rdb) so
// followers can never make the gate wait.
type Hub struct {
	store *Store
	rdb   redis.UniversalClient
	o     HubOptions

	mu       sync.Mutex
	readers  map[string]*reader
	shutdown bool

	active  prometheus.Gauge
	started prometheus.Counter
}

// NewHub returns a Hub reading with rdb (the stream readers' own pool).
func NewHub(store *Store, rdb redis.UniversalClient, o HubOptions) *Hub {
	if o.Block <= 0 {
		o.Block = 5 * time.Second
	}
	if o.KeepAlive <= 0 {
		o.KeepAlive = 15 * time.Second
	}
	if o.Buffer <= 0 {
		o.Buffer = 256
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	return &Hub{
		store: store, rdb: rdb, o: o, readers: map[string]*reader{},
		active: promreg.Register(o.Registerer, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "faregate_event_readers", Help: "Redis readers of task event streams in this process (one per followed task).",
		})),
		started: promreg.Register(o.Registerer, prometheus.NewCounter(prometheus.CounterOpts{
			Name: "faregate_event_readers_started_total", Help: "Redis readers of task event streams started.",
		})),
	}
}

// Readers reports the readers running now.
func (h *Hub) Readers() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.readers)
}

// reader is the one XREAD loop of one task in this process.
type reader struct {
	id   string
	mu   sync.Mutex
	subs map[*sub]struct{}
	// from is the stream id the reader reads after; set before any
	// follower replays, so replay and live reading always overlap.
	from   string
	final  bool // the done event was read: nothing more will come
	cancel context.CancelFunc
}

// sub is one follower's mailbox, guarded by its reader's mutex: the events
// the follower has yet to send, and a doorbell. The events themselves are
// shared by every follower (only the slice of references is per follower).
type sub struct {
	queue  []task.Event
	closed bool
	err    error // why the hub closed it; the queue is still delivered first
	notify chan struct{}
}

// ring wakes the follower if it is not awake already.
func (s *sub) ring() {
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// Follow replays the task's events after the stream id after ("" = from
// the first one), then follows live ones until the done event, calling fn
// for each (and with EventKeepAlive while idle). It returns nil after done,
// task.ErrNotFound for an unknown task (before fn was ever called), ctx's error
// when the caller leaves or its time is up, ErrShutdown when this process
// stops, or fn's error.
func (h *Hub) Follow(ctx context.Context, id, after string, fn func(task.Event) error) error {
	rec, err := h.store.Get(ctx, id)
	if err != nil {
		return err
	}
	s, r, err := h.subscribe(ctx, id)
	if errors.Is(err, ErrShutdown) {
		// This process is stopping and starts no reader, but what Redis
		// holds is still delivered: a follower of a task that has ended (here,
		// in the shutdown's grace period, above all) gets its end, not a
		// stream cut without done. Only a task still running elsewhere is
		// closed, to resume on another replica.
		last, ended, err := h.replay(ctx, id, after, rec, fn)
		if err != nil || ended {
			return err
		}
		if cur, gerr := h.store.Get(ctx, id); gerr == nil && cur.Final() {
			_, _, err = h.replay(ctx, id, last, cur, fn)
			return err
		}
		return ErrShutdown
	}
	if err != nil {
		return err
	}
	defer h.unsubscribe(r, s)

	// Replay what is already there (after subscribing: anything the reader
	// read before we joined is in Redis for this replay to find).
	last, ended, err := h.replay(ctx, id, after, rec, fn)
	if err != nil || ended {
		return err
	}

	keep := time.NewTimer(h.o.KeepAlive)
	defer keep.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-keep.C:
			if err := fn(task.Event{Type: task.EventKeepAlive}); err != nil {
				return err
			}
			keep.Reset(h.o.KeepAlive)
		case <-s.notify:
			r.mu.Lock()
			batch, closed, why := s.queue, s.closed, s.err
			s.queue = nil
			r.mu.Unlock()
			for _, ev := range batch {
				if !streamAfter(ev.ID, last) {
					continue // already replayed
				}
				last = ev.ID
				if err := fn(ev); err != nil {
					return err
				}
				if ev.Type == task.EventDone {
					return nil
				}
			}
			if closed {
				return why
			}
			keep.Reset(h.o.KeepAlive)
		}
	}
}

// replay calls fn for the task's events after the stream id after ("" =
// from the first one), up to done, and reports the last id it delivered
// and whether the follower has reached the end. A task whose record (rec)
// is final but whose done event is gone (trimmed or expired) ends with a
// done made from the record, read again in case it finished after rec.
func (h *Hub) replay(ctx context.Context, id, after string, rec task.Record, fn func(task.Event) error) (last string, ended bool, err error) {
	last = after
	if last == "" {
		last = "0-0"
	}
	for {
		msgs, err := h.rdb.XRangeN(ctx, eventsKey(id), "("+last, "+", 500).Result()
		if err != nil {
			if ctx.Err() != nil {
				return last, false, ctx.Err()
			}
			return last, false, unavailable(err)
		}
		for _, m := range msgs {
			ev := toEvent(m)
			last = ev.ID
			if err := fn(ev); err != nil {
				return last, false, err
			}
			if ev.Type == task.EventDone {
				return last, true, nil
			}
		}
		if len(msgs) < 500 {
			break
		}
	}
	if !rec.Final() {
		return last, false, nil
	}
	if cur, err := h.store.Get(ctx, id); err == nil {
		rec = cur
	}
	data, _ := json.Marshal(rec.Task)
	return last, true, fn(task.Event{ID: last, Type: task.EventDone, Data: data})
}

// subscribe joins the task's reader, starting one (and fixing its start
// point) when this is the first follower.
func (h *Hub) subscribe(ctx context.Context, id string) (*sub, *reader, error) {
	s := &sub{notify: make(chan struct{}, 1)}
	h.mu.Lock()
	if h.shutdown {
		h.mu.Unlock()
		return nil, nil, ErrShutdown
	}
	r := h.readers[id]
	if r != nil {
		r.mu.Lock()
		r.subs[s] = struct{}{}
		r.mu.Unlock()
		h.mu.Unlock()
		return s, r, nil
	}
	r = &reader{id: id, subs: map[*sub]struct{}{s: {}}}
	h.readers[id] = r
	h.mu.Unlock()

	// The reader starts after the stream's last entry as of now: the
	// follower's replay, which runs after this, covers everything up to it.
	from := "0-0"
	last, err := h.rdb.XRevRangeN(ctx, eventsKey(id), "+", "-", 1).Result()
	if err != nil {
		h.unsubscribe(r, s)
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		return nil, nil, unavailable(err)
	}
	if len(last) == 1 {
		from = last[0].ID
	}
	rctx, cancel := context.WithCancel(context.Background())
	r.mu.Lock()
	r.from, r.cancel = from, cancel
	r.mu.Unlock()
	h.active.Inc()
	h.started.Inc()
	go h.read(rctx, r)
	return s, r, nil
}

// unsubscribe leaves the reader; the last follower out stops it.
func (h *Hub) unsubscribe(r *reader, s *sub) {
	h.mu.Lock()
	defer h.mu.Unlock()
	r.mu.Lock()
	delete(r.subs, s)
	empty := len(r.subs) == 0
	cancel := r.cancel
	r.mu.Unlock()
	if empty && h.readers[r.id] == r {
		delete(h.readers, r.id)
		if cancel != nil {
			cancel()
		}
	}
}

// read is the reader's loop: XREAD BLOCK after the last id, broadcast,
// until the done event, no follower is left, or the hub shuts down.
func (h *Hub) read(ctx context.Context, r *reader) {
	defer h.active.Dec()
	// Waits between failed reads: Redis is away; jitter keeps the readers
	// of many tasks from coming back in one instant.
	backoff := pause.Policy{First: 100 * time.Millisecond, Max: 2 * time.Second, Jitter: 0.2}.Backoff()
	for ctx.Err() == nil {
		r.mu.Lock()
		from := r.from
		r.mu.Unlock()
		res, err := h.rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{eventsKey(r.id), from}, Count: 100, Block: h.o.Block}).Result()
		if errors.Is(err, redis.Nil) {
			continue
		}
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			// Redis is away: followers keep their keep-alives and wait.
			h.o.Logger.Debug("event reader retrying", "task", r.id, "err", err.Error())
			if backoff.Wait(ctx) != nil {
				return
			}
			continue
		}
		backoff.Reset()
		for _, st := range res {
			for _, m := range st.Messages {
				ev := toEvent(m)
				h.broadcast(r, ev)
				if ev.Type == task.EventDone {
					return
				}
			}
		}
	}
}

// broadcast hands ev to every follower; one whose mailbox is full has
// fallen behind and is closed (it resumes with Last-Event-ID), so a slow
// client never holds the others back.
func (h *Hub) broadcast(r *reader, ev task.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.from = ev.ID
	if ev.Type == task.EventDone {
		r.final = true
	}
	for s := range r.subs {
		if s.closed {
			continue
		}
		if len(s.queue) >= h.o.Buffer {
			s.closed, s.err, s.queue = true, errTooSlow, nil
		} else {
			s.queue = append(s.queue, ev)
		}
		s.ring()
	}
}

// Shutdown ends every stream of this process. Events already written (the
// final events of the tasks this process just finished, above all) are
// read once more and delivered first, so followers of a task that ended
// here see its end; followers of tasks that run elsewhere are closed with
// ErrShutdown and resume on another replica.
func (h *Hub) Shutdown(ctx context.Context) {
	h.mu.Lock()
	h.shutdown = true
	readers := make([]*reader, 0, len(h.readers))
	for _, r := range h.readers {
		readers = append(readers, r)
	}
	h.mu.Unlock()
	for _, r := range readers {
		r.mu.Lock()
		from, final := r.from, r.final
		r.mu.Unlock()
		if !final {
			res, err := h.rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{eventsKey(r.id), from}, Count: 1000, Block: -1}).Result()
			if err == nil {
				for _, st := range res {
					for _, m := range st.Messages {
						h.broadcast(r, toEvent(m))
					}
				}
			}
		}
		r.mu.Lock()
		for s := range r.subs {
			if !s.closed {
				s.closed, s.err = true, ErrShutdown
				s.ring()
			}
		}
		if r.cancel != nil {
			r.cancel()
		}
		r.mu.Unlock()
	}
}

func toEvent(m redis.XMessage) task.Event {
	typ, _ := m.Values["type"].(string)
	data, _ := m.Values["data"].(string)
	return task.Event{ID: m.ID, Type: typ, Data: json.RawMessage(data)}
}

// streamAfter reports whether stream id a comes after b ("ms-seq" ids).
func streamAfter(a, b string) bool {
	am, as := splitID(a)
	bm, bs := splitID(b)
	if am != bm {
		return am > bm
	}
	return as > bs
}

func splitID(id string) (uint64, uint64) {
	ms, seq, _ := strings.Cut(id, "-")
	m, _ := strconv.ParseUint(ms, 10, 64)
	s, _ := strconv.ParseUint(seq, 10, 64)
	return m, s
}
