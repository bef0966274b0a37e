// The race detector's instrumentation enlarges every frame, so the stack
// an open stream keeps is a property of the build without it (the one
// operators run); under -race this file is left out rather than loosened.

//go:build !race

package main

import (
	"context"
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/protect/kit/redisbatch"
	"faregate/protect/kit/testkit/redistest"
)

// heldUpstream is a model provider in memory: each call's answer streams
// its events, then holds until release is closed (or the call's context
// ends), then sends end. No goroutine serves it: a held stream's only
// goroutine is its handler's.
type heldUpstream struct {
	events, end string
	// release and blocked are each round's: blocked is told once per
	// call, when its answer has been read to the hold.
	release chan struct{}
	blocked chan struct{}
}

func (u *heldUpstream) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		_ = req.Body.Close()
	}
	body := &heldBody{u: u, ctx: req.Context(), rest: u.events}
	return &http.Response{StatusCode: http.StatusOK, Status: "200 OK", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: body, ContentLength: -1, Request: req}, nil
}

type heldBody struct {
	u    *heldUpstream
	ctx  context.Context
	rest string
	held bool
}

func (b *heldBody) Read(p []byte) (int, error) {
	if b.rest == "" && !b.held {
		b.held = true
		b.u.blocked <- struct{}{}
		select {
		case <-b.u.release:
			b.rest = b.u.end
		case <-b.ctx.Done():
			return 0, b.ctx.Err()
		}
	}
	if b.rest == "" {
		return 0, io.EOF
	}
	n := copy(p, b.rest)
	b.rest = b.rest[n:]
	return n, nil
}

func (b *heldBody) Close() error { return nil }

// streamRecorder is a client's end of a stream, in memory.
type streamRecorder struct {
	h    http.Header
	code int
	mu   sync.Mutex
	body strings.Builder
}

func (r *streamRecorder) Header() http.Header { return r.h }
func (r *streamRecorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
}
func (r *streamRecorder) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.body.Write(p)
}
func (r *streamRecorder) Flush() {}

// padStack calls f under n bytes of frames (n a multiple of 512), as the
// server's connection loop and the production router's middleware put
// their frames under a handler.
//
//go:noinline
func padStack(n int, f func()) {
	var b [512]byte
	if n <= 0 {
		f()
		return
	}
	b[n%len(b)] = byte(n)
	padStack(n-len(b), f)
	if b[n%len(b)] != byte(n) {
		panic("padStack")
	}
}

// streamStacks opens streams of the governed chat endpoint through a rig
// whose provider is held in memory, each relayed by a handler called under
// pad bytes of frames.
type streamStacks struct {
	t   *testing.T
	rig *endpointRig
	up  *heldUpstream
	// responses: the streams are of /v1/responses (events are Responses
	// events), else of /v1/chat/completions.
	responses bool
}

func newStreamStacks(t *testing.T, events string) *streamStacks {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	rdb.AddHook(redisbatch.New(rdb))
	up := &heldUpstream{events: events, end: "data: [DONE]\n\n"}
	return &streamStacks{t: t, up: up, rig: newEndpointRigVia(t, rdb, answerJSON, 1<<20, up)}
}

// perStream opens n streams and returns the goroutine stack memory each
// holds once all are open and read to their hold (the relay's steady
// state), after the GC (which shrinks a stack less than a quarter used);
// then it lets them finish and checks each answer whole.
func (s *streamStacks) perStream(n, pad int) int64 {
	t := s.t
	t.Helper()
	s.up.release, s.up.blocked = make(chan struct{}), make(chan struct{}, n)
	path, body, first := "/v1/chat/completions", strings.Replace(endpointBody, `"max_tokens"`, `"stream":true,"max_tokens"`, 1), `"first "`
	if s.responses {
		path, body, first = "/v1/responses", `{"model":"gpt-4o-mini","input":"Three days in Lisbon, food and history.","stream":true,"max_output_tokens":200}`, `"search"`
	}
	stackInUse := func() int64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return int64(m.StackInuse)
	}
	recs := make([]*streamRecorder, n)
	var served sync.WaitGroup
	ended := make(chan int, n)
	start := make(chan struct{})
	for i := range n {
		recs[i] = &streamRecorder{h: http.Header{}}
		req, _ := http.NewRequest(http.MethodPost, path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+s.rig.key)
		served.Go(func() {
			<-start
			padStack(pad, func() { s.rig.handler.ServeHTTP(recs[i], req) })
			ended <- i
		})
	}
	// Each goroutine waits on its first stack (8 KiB) for the base: what
	// the streams grow is measured, not what dead goroutines' cached
	// stacks give the new ones.
	for runtime.NumGoroutine() < n {
		runtime.Gosched()
	}
	base := stackInUse()
	close(start)
	timeout := time.After(time.Minute)
	for range n {
		select {
		case <-s.up.blocked:
		case i := <-ended:
			t.Fatalf("stream %d ended before it was held: %d %q", i, recs[i].code, recs[i].body.String())
		case <-timeout:
			t.Fatal("the streams were not all held in a minute")
		}
	}
	per := 8<<10 + (stackInUse()-base)/int64(n)
	close(s.up.release)
	served.Wait()
	for i, r := range recs {
		r.mu.Lock()
		got := r.body.String()
		r.mu.Unlock()
		end := "data: [DONE]\n\n"
		if s.responses {
			end = `"type":"response.completed"`
		}
		if r.code != http.StatusOK || !strings.Contains(got, first) || !strings.Contains(got, end) {
			t.Fatalf("stream %d: %d %q", i, r.code, got)
		}
	}
	return per
}

// TestGovernedStreamStack: an open stream of the governed endpoint (the
// Governor's chain, the gateway's relay, a chat chunk with a tool call or
// a Responses function call decoded and counted) keeps a handler goroutine
// stack of 16 KiB, not 32 KiB: the stack grows to the power of two over
// the deepest point the goroutine reached, and the GC never shrinks a
// stack more than a quarter used, so that point sets what each of a
// thousand open streams holds for its life. The handlers run under 2 KiB
// of frames, for what run's server puts under them (net/http's connection
// loop, 1.1 KiB, and the router's middleware). Stacks are counted over
// 200 streams against their goroutines' first stacks.
func TestGovernedStreamStack(t *testing.T) {
	redistest.Require(t)
	for _, responses := range []bool{false, true} {
		name, events, end := "chat", chatHeld, "data: [DONE]\n\n"
		if responses {
			name, events, end = "responses", respHeld, respEnd
		}
		t.Run(name, func(t *testing.T) {
			s := newStreamStacks(t, events)
			s.responses, s.up.end = responses, end
			s.perStream(20, 0) // first calls build the decoders' caches
			if per := s.perStream(200, 2048); per > 24<<10 {
				t.Fatalf("an open stream holds %d B of goroutine stack, want 16 KiB (under 24 KiB)", per)
			}
		})
	}
}

// chatHeld is a held stream's events: a chunk of content, then one of a
// tool call (the deepest the relay's decode goes).
const chatHeld = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"role":"assistant","content":"first "}}]}` + "\n\n" +
	`data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"gpt-4o-mini","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"search","arguments":"{\"q\":\"x\"}"}}]}}]}` + "\n\n"

// respHeld is a held Responses stream's events: the response begun, a
// function call's item and arguments; respEnd its end.
const respHeld = `event: response.created` + "\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","created_at":1,"status":"in_progress","model":"gpt-4o-mini","output":[]}}` + "\n\n" +
	`event: response.output_item.added` + "\n" + `data: {"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"fc_1","type":"function_call","status":"in_progress","call_id":"call_1","name":"search","arguments":""}}` + "\n\n" +
	`event: response.function_call_arguments.delta` + "\n" + `data: {"type":"response.function_call_arguments.delta","sequence_number":2,"item_id":"fc_1","output_index":0,"delta":"{\"q\":\"x\"}"}` + "\n\n"

const respEnd = `event: response.completed` + "\n" + `data: {"type":"response.completed","sequence_number":3,"response":{"id":"resp_1","object":"response","created_at":1,"status":"completed","model":"gpt-4o-mini","output":[{"id":"fc_1","type":"function_call","status":"completed","call_id":"call_1","name":"search","arguments":"{\"q\":\"x\"}"}],"usage":{"input_tokens":20,"output_tokens":5,"total_tokens":25}}}` + "\n\n"
