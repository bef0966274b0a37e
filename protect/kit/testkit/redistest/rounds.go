package redistest

import (
	"context"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Rounds is a redis.Hook that counts a client's sequential round trips:
// a command's round is one more than the highest round of the commands
// that had finished when it started, so commands sent at once share a
// round, and one sent only after another's reply is a round later.
//
// "At once" must not depend on how fast a busy machine schedules
// goroutines, so a phase says how many commands it expects (Expect):
// every reply is held until that many have started, or Wait has passed.
// Commands that code sends without waiting for each other then always
// share a round, however late one of them is scheduled; a command that
// waits for another's reply cannot start before that reply is let go, so
// it is counted a round later, after Wait. The count depends on no time
// but Wait, which only a failing test waits out.
//
// A pipeline is one command of one round; each of its commands is named.
// A new connection's handshake (HELLO, AUTH, SELECT, READONLY, CLIENT) is
// no round of the caller's and passes uncounted.
type Rounds struct {
	// Wait bounds how long a reply is held for the phase's other
	// commands; 0 means 10 s.
	Wait time.Duration
	// Name names a command; nil means cmd.Name().
	Name func(redis.Cmder) string

	mu        sync.Mutex
	finished  int // highest round of the finished commands
	highest   int // highest round given
	base      int // highest at the last Mark
	names     []string
	pipelines int           // pipelines since the last Mark
	want      int           // commands the phase expects
	arrived   chan struct{} // closed once len(names) >= want
}

// Expect starts a phase of n commands (a pipeline's each counted): from
// now, each reply is held until n commands have started since the last
// Mark. Call it before the phase's first command can start.
func (h *Rounds) Expect(n int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.want = n
	h.arrived = make(chan struct{})
	h.check()
}

// check closes arrived once the phase's commands have all started (h.mu
// held).
func (h *Rounds) check() {
	if h.arrived == nil {
		return
	}
	select {
	case <-h.arrived:
	default:
		if len(h.names) >= h.want {
			close(h.arrived)
		}
	}
}

// Mark returns the rounds, the commands' names and the pipelines since
// the last Mark; every earlier command must have finished when it is
// called. It ends the phase: replies are no longer held until Expect.
func (h *Rounds) Mark() (rounds int, names []string, pipelines int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	rounds, names, pipelines = h.highest-h.base, h.names, h.pipelines
	h.base, h.names, h.pipelines = h.highest, nil, 0
	h.want, h.arrived = 0, nil
	return rounds, names, pipelines
}

// DialHook implements redis.Hook.
func (h *Rounds) DialHook(next redis.DialHook) redis.DialHook { return next }

// ProcessHook implements redis.Hook.
func (h *Rounds) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if handshake(cmd) {
			return next(ctx, cmd)
		}
		return h.round(func() error { return next(ctx, cmd) }, false, cmd)
	}
}

// ProcessPipelineHook implements redis.Hook.
func (h *Rounds) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		if len(cmds) > 0 && handshake(cmds[0]) {
			return next(ctx, cmds)
		}
		return h.round(func() error { return next(ctx, cmds) }, true, cmds...)
	}
}

// handshake reports whether cmd is one a client sends on a new
// connection before any of its caller's.
func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "hello", "auth", "select", "readonly", "client":
		return true
	}
	return false
}

// round runs one round trip carrying cmds, a pipeline's or one command.
func (h *Rounds) round(send func() error, pipeline bool, cmds ...redis.Cmder) error {
	h.mu.Lock()
	round := h.finished + 1
	h.highest = max(h.highest, round)
	if pipeline {
		h.pipelines++
	}
	for _, c := range cmds {
		if h.Name != nil {
			h.names = append(h.names, h.Name(c))
		} else {
			h.names = append(h.names, c.Name())
		}
	}
	h.check()
	arrived := h.arrived
	h.mu.Unlock()
	err := send()
	if arrived != nil {
		wait := h.Wait
		if wait <= 0 {
			wait = 10 * time.Second
		}
		t := time.NewTimer(wait)
		select {
		case <-arrived:
		case <-t.C:
		}
		t.Stop()
	}
	h.mu.Lock()
	h.finished = max(h.finished, round)
	h.mu.Unlock()
	return err
}
