package agent

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"faregate/agent/chat"
	"faregate/agent/task"
	"faregate/protect/breaker"
)

// streamed is a model that streams plan(2) in two pieces: the first after
// before, the second after between.
func streamed(before, between time.Duration) *fakeModel {
	return &fakeModel{GenerateFn: func(ctx context.Context, _ int, t chat.Turn) (chat.Reply, error) {
		rep := plan(2)
		half := len(rep.Content) / 2
		time.Sleep(before)
		if err := t.Stream(chat.Chunk{Text: rep.Content[:half]}); err != nil {
			return chat.Reply{}, err
		}
		time.Sleep(between)
		if err := t.Stream(chat.Chunk{Text: rep.Content[half:]}); err != nil {
			return chat.Reply{}, err
		}
		return rep, nil
	}}
}

// TestBreakerTimesTheFirstChunk: the planner's call is slow when its first
// chunk comes after SlowCall, never because its stream is long.
func TestBreakerTimesTheFirstChunk(t *testing.T) {
	cases := []struct {
		name            string
		before, between time.Duration
		want            breaker.State
	}{
		{"first chunk after 21s: slow", 21 * time.Second, 0, breaker.Open},
		{"a 21s stream that began at once: not slow", 0, 21 * time.Second, breaker.Closed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				r := newRig(streamed(c.before, c.between))
				r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 1, MinPrincipals: 1, SlowRatio: 0.5, OpenFor: time.Hour}, nil, nil)
				if _, err := r.run(t, lisbon); err != nil {
					t.Fatal(err)
				}
				if st := r.models.Breaker.State(); st != c.want {
					t.Fatalf("breaker %s, want %s", st, c.want)
				}
			})
		})
	}
}

// TestBreakerNamesThePrincipal: the planner's failures are its visitor's;
// one visitor's failing runs never open the breaker, a second visitor's
// failure does.
func TestBreakerNamesThePrincipal(t *testing.T) {
	down := &fakeModel{GenerateFn: func(context.Context, int, chat.Turn) (chat.Reply, error) {
		return chat.Reply{}, errors.New("provider: 502")
	}}
	r := newRig(down)
	r.models.Breaker = breaker.New(breaker.Settings{MinCalls: 2, OpenFor: time.Hour}, nil, nil)
	for range 3 {
		if _, err := r.run(t, lisbon); err == nil {
			t.Fatal("a run on a failing model succeeded")
		}
	}
	if st := r.models.Breaker.State(); st != breaker.Closed {
		t.Fatalf("one visitor's failures: breaker %s", st)
	}
	rec := record(lisbon)
	rec.Principal = "v_" + "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210"
	_ = r.workflow().Run(context.Background(), rec, func(*task.Record, ...task.Event) error { return nil })
	if st := r.models.Breaker.State(); st != breaker.Open {
		t.Fatalf("a second visitor's failure: breaker %s", st)
	}
}
