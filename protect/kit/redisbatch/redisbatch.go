// Package redisbatch sends the Redis commands that a wave of goroutines
// makes at once as one pipeline per client: one write and one read on one
// connection instead of one round trip per goroutine, each on a
// connection of its own. It changes no command and no reply; the callers
// (the budget, the buckets, the task's limits) keep their own code and
// their own scripts, and a wave works unchanged, only unbatched, on a
// client without the Hook.
//
// The goroutines Run starts are one wave's participants. A command a participant
// sends through a client with the Hook waits until every live
// participant has either sent one too or returned; then they all go at
// once. A participant that sends a second command (a script's EVAL after
// NOSCRIPT) waits for the next such moment. A participant must therefore
// never wait for another participant, or for anything that waits for
// one, unless it has left the wave first (Leave): one whose Redis work
// goes another way (the budget batches its own, on goroutines of its own)
// leaves, and the others go without it.
package redisbatch

import (
	"context"
	"sync"

	"github.com/redis/go-redis/v9"
)

// Wave is one set of goroutines whose commands go together.
type Wave struct {
	mu      sync.Mutex
	live    int        // participants that have not returned
	pending []*pending // commands waiting for the flush
}

type pending struct {
	h    *Hook
	next redis.ProcessHook
	ctx  context.Context
	cmd  redis.Cmder
	err  error // the command's error (set by the flush)
	done chan struct{}
}

type waveKey struct{}

// member is one participant of a wave: the value its context carries.
type member struct {
	w    *Wave
	left bool // it has left the wave (Leave, or it returned); w.mu guards it
}

// Run runs fns, the first on the caller's goroutine and each other on
// one of its own, all as the participants of one wave, and returns when
// every one has returned: the commands each
// sends on the ctx it gets (and contexts derived from it) go together.
// With one fn it runs it on the caller's goroutine, unbatched.
func Run(ctx context.Context, fns ...func(ctx context.Context)) {
	switch len(fns) {
	case 0:
		return
	case 1:
		fns[0](ctx)
		return
	}
	// Every participant counts before any starts, or the first to send
	// would find itself alone.
	w := &Wave{live: len(fns)}
	var wg sync.WaitGroup
	for _, fn := range fns[1:] {
		m := &member{w: w}
		wctx := context.WithValue(ctx, waveKey{}, m)
		wg.Go(func() {
			defer m.leave()
			fn(wctx)
		})
	}
	// The first runs on the caller's goroutine, once the others have
	// been started.
	func() {
		m := &member{w: w}
		defer m.leave()
		fns[0](context.WithValue(ctx, waveKey{}, m))
	}()
	wg.Wait()
}

// Leave takes the participant whose context ctx is (or derives from) out
// of its wave, as if it had returned: for a participant whose Redis work
// goes another way (its own batching, on its own goroutine) and which
// would otherwise hold the others back until it returns. It returns ctx
// without the wave, for any command the participant still sends. Outside
// a wave it returns ctx unchanged.
func Leave(ctx context.Context) context.Context {
	m, _ := ctx.Value(waveKey{}).(*member)
	if m == nil {
		return ctx
	}
	m.leave()
	return unbatched(ctx)
}

// unbatched is ctx without its wave: what a flush sends on, so that a
// command the client makes on its own behalf meanwhile (a new
// connection's HELLO) goes straight on.
func unbatched(ctx context.Context) context.Context {
	return context.WithValue(ctx, waveKey{}, (*member)(nil))
}

// leave ends m's part in its wave, once.
func (m *member) leave() {
	w := m.w
	w.mu.Lock()
	if m.left {
		w.mu.Unlock()
		return
	}
	m.left = true
	w.live--
	batch := w.ready()
	w.mu.Unlock()
	flush(batch)
}

// ready takes the pending commands when every live participant has one
// (w.mu held).
func (w *Wave) ready() []*pending {
	if len(w.pending) == 0 || len(w.pending) < w.live {
		return nil
	}
	b := w.pending
	w.pending = nil
	return b
}

// flush sends a batch, one pipeline per client, and wakes its senders.
func flush(batch []*pending) {
	if len(batch) == 0 {
		return
	}
	byHook := map[*Hook][]*pending{}
	var order []*Hook
	for _, p := range batch {
		if _, ok := byHook[p.h]; !ok {
			order = append(order, p.h)
		}
		byHook[p.h] = append(byHook[p.h], p)
	}
	var wg sync.WaitGroup
	for _, h := range order {
		ps := byHook[h]
		send := func() {
			// The commands are the callers' own: each gets its own reply
			// or error. A cancelled caller's command still goes, as one
			// already written would; the client's timeouts bound it.
			if len(ps) == 1 {
				// The client sets the command's error from what its hooks
				// return.
				ps[0].err = ps[0].next(unbatched(ps[0].ctx), ps[0].cmd)
				return
			}
			ctx := unbatched(context.WithoutCancel(ps[0].ctx))
			pipe := h.c.Pipeline()
			for _, p := range ps {
				_ = pipe.Process(ctx, p.cmd)
			}
			_, _ = pipe.Exec(ctx)
			for _, p := range ps {
				p.err = p.cmd.Err() // a pipeline sets each command's own
			}
		}
		if len(order) == 1 {
			send()
			break
		}
		wg.Go(send)
	}
	wg.Wait()
	for _, p := range batch {
		close(p.done)
	}
}

// Hook batches a client's commands sent by a Wave's participants. Add it
// to the client it was made for, before any other hook
// (c.AddHook(redisbatch.New(c))): the hooks after it see a batch as the
// pipeline it is, one alone as itself.
type Hook struct {
	c redis.UniversalClient
}

// New returns the Hook of client c.
func New(c redis.UniversalClient) *Hook { return &Hook{c: c} }

// DialHook implements redis.Hook.
func (h *Hook) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook holds a participant's command for its wave's flush.
func (h *Hook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		m, _ := ctx.Value(waveKey{}).(*member)
		if m == nil {
			return next(ctx, cmd)
		}
		w := m.w
		p := &pending{h: h, next: next, ctx: ctx, cmd: cmd, done: make(chan struct{})}
		w.mu.Lock()
		if m.left {
			// A participant that left sends on its own.
			w.mu.Unlock()
			return next(ctx, cmd)
		}
		w.pending = append(w.pending, p)
		batch := w.ready()
		w.mu.Unlock()
		flush(batch)
		<-p.done
		return p.err
	}
}

// ProcessPipelineHook passes pipelines through: they are one write
// already.
func (h *Hook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
