package redisbatch

import (
	"context"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"faregate/protect/kit/testkit/redistest"
)

// sent records what reaches the server side of the hooks: single
// commands and pipelines with their sizes.
type sent struct {
	mu    sync.Mutex
	items []string
}

func (s *sent) DialHook(next redis.DialHook) redis.DialHook { return next }
func (s *sent) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		s.add(cmd.Name())
		return next(ctx, cmd)
	}
}
func (s *sent) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		var names []string
		for _, c := range cmds {
			if !connInit(c.Name()) {
				names = append(names, c.Name())
			}
		}
		if len(names) > 0 {
			s.add("pipeline(" + strings.Join(names, ",") + ")")
		}
		return next(ctx, cmds)
	}
}

// connInit: a command a new connection sends on its own behalf (its
// handshake, and SELECT on a database other than 0, as the shared test
// Redis of CI hands out), not one of the test's.
func connInit(name string) bool {
	switch name {
	case "hello", "client", "select", "auth":
		return true
	}
	return false
}

func (s *sent) add(x string) {
	if connInit(x) {
		return
	}
	s.mu.Lock()
	s.items = append(s.items, x)
	s.mu.Unlock()
}
func (s *sent) take() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.items
	s.items = nil
	return out
}

// TestWave: the commands a wave's participants send at once go in one
// pipeline, each with its own reply and error; a participant that sends
// nothing does not hold the others; a second command goes in the next
// batch; a script's NOSCRIPT fallback works; without the Hook the same
// wave simply runs.
func TestWave(t *testing.T) {
	for _, b := range redistest.Both(t) {
		t.Run(b.Name, func(t *testing.T) {
			ctx := context.Background()
			c := redis.NewClient(&redis.Options{Addr: b.Client.Options().Addr, DB: b.Client.Options().DB})
			t.Cleanup(func() { _ = c.Close() })
			c.AddHook(New(c))
			s := &sent{}
			c.AddHook(s)

			res := make([]int64, 3)
			var errWrong error
			var fns []func(context.Context)
			for i := range 3 {
				fns = append(fns, func(ctx context.Context) { res[i], _ = c.IncrBy(ctx, "n", int64(i+1)).Result() })
			}
			fns = append(fns, func(context.Context) {}, // sends nothing
				func(ctx context.Context) {
					c.Set(ctx, "s", "x", 0)
					errWrong = c.Incr(ctx, "s").Err() // a second command, and an error of its own
				})
			Run(ctx, fns...)
			got := s.take()
			if len(got) == 2 { // the order in a batch is the order of arrival
				got[0] = strings.NewReplacer("set,", "", ",set", "").Replace(got[0])
			}
			if len(got) != 2 || got[0] != "pipeline(incrby,incrby,incrby)" || got[1] != "incr" {
				t.Fatalf("sent %v; want the four first commands in one pipeline, then the second alone", got)
			}
			if res[0]+res[1]+res[2] == 0 || errWrong == nil {
				t.Fatalf("replies %v, %v", res, errWrong)
			}
			if n, _ := c.Get(ctx, "n").Int(); n != 6 {
				t.Fatalf("n = %d", n)
			}

			// A script not loaded yet: EVALSHA fails with NOSCRIPT in the
			// batch, its EVAL follows.
			script := redis.NewScript(`return tonumber(ARGV[1]) * 2`)
			twice := make([]int64, 2)
			Run(ctx, func(ctx context.Context) { twice[0], _ = script.Run(ctx, c, nil, 1).Int64() },
				func(ctx context.Context) { twice[1], _ = script.Run(ctx, c, nil, 2).Int64() })
			if twice[0] != 2 || twice[1] != 4 {
				t.Fatalf("script replies %v", twice)
			}
			s.take()

			// Without the hook: the same wave, unbatched.
			plain := redis.NewClient(&redis.Options{Addr: b.Client.Options().Addr, DB: b.Client.Options().DB})
			t.Cleanup(func() { _ = plain.Close() })
			incr := func(ctx context.Context) { plain.Incr(ctx, "m") }
			Run(ctx, incr, incr, incr)
			if n, _ := plain.Get(ctx, "m").Int(); n != 3 {
				t.Fatalf("m = %d", n)
			}
		})
	}
}

// TestLeave: a participant that leaves its wave (its Redis work goes
// another way) no longer holds the others back: here it waits for the
// other participants' commands to be answered, which, had it stayed,
// would wait for it forever. The others still go together; what the one
// that left sends afterwards goes on its own.
func TestLeave(t *testing.T) {
	b := redistest.Mini(t)
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: b.Client.Options().Addr})
	t.Cleanup(func() { _ = c.Close() })
	c.AddHook(New(c))
	s := &sent{}
	c.AddHook(s)
	answered := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	done := make(chan struct{})
	go func() {
		defer close(done)
		Run(ctx,
			func(ctx context.Context) {
				ctx = Leave(ctx)
				<-answered
				c.Incr(ctx, "late")
			},
			func(ctx context.Context) { defer wg.Done(); c.Incr(ctx, "a") },
			func(ctx context.Context) { defer wg.Done(); c.Incr(ctx, "b") },
		)
	}()
	wg.Wait()
	close(answered)
	<-done
	got := s.take()
	if len(got) != 2 || got[0] != "pipeline(incr,incr)" || got[1] != "incr" {
		t.Fatalf("sent %v; want the two that stayed in one pipeline, then the one that left alone", got)
	}
	// Outside a wave Leave changes nothing.
	if Leave(ctx) != ctx {
		t.Fatal("Leave outside a wave returned another context")
	}
}
