package remote

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/taskstore"
	"faregate/protect/codes"
	"faregate/protect/kit/testkit/redistest"
)

const secret = "remote-test-secret-0123"

// fixture is one task ready to run under a lease, on miniredis.
type fixture struct {
	store *taskstore.Store
	keys  *taskkey.Keys
	rec   task.Record
	l     taskstore.Lease

	mu     sync.Mutex
	events []task.Event

	// agents are the goroutines a fake agent started to post for its task.
	agents sync.WaitGroup
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	be := redistest.Mini(t)
	s := taskstore.New(be.Client)
	now := time.Now().UTC()
	rec := task.Record{Task: task.Task{ID: task.NewID(), Status: task.StatusQueued, CreatedAt: now, UpdatedAt: now,
		Request: task.Request{Destination: "Lisbon", Days: 2, Interests: []string{"food"}},
		Steps:   []task.Step{}, Warnings: []string{}}, Principal: "v_abc", Tier: "public"}
	if err := s.Create(context.Background(), rec); err != nil {
		t.Fatal(err)
	}
	l, _, err := s.Acquire(context.Background(), taskstore.Entry{ID: "1-1", Task: rec.ID}, "me")
	if err != nil {
		t.Fatal(err)
	}
	f := &fixture{store: s, keys: taskkey.New(be.Client, taskkey.Options{}), rec: rec, l: l}
	// Registered after Redis's own cleanup, so it runs before it: an agent
	// goroutine's last post, and its report through t, are done before
	// Redis closes and the test ends. The agent server, started after the
	// fixture, is closed first: no handler starts another goroutine then.
	t.Cleanup(f.agents.Wait)
	return f
}

// agent runs post as a fake agent's work after its 202: on a goroutine of
// its own, which the test waits for before it ends.
func (f *fixture) agent(post func()) {
	f.agents.Add(1)
	go func() {
		defer f.agents.Done()
		post()
	}()
}

func (f *fixture) progress(rec *task.Record, evs ...task.Event) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, evs...)
	return nil
}

// run runs the executor against agentURL with a deadline life from now.
func (f *fixture) run(t *testing.T, agentURL string, life time.Duration, o Options) (*task.Record, error) {
	t.Helper()
	o.URL, o.Secret, o.Keys, o.Inbox = agentURL, secret, f.keys, f.store
	o.Callback = func() string { return "http://faregate.test/" }
	o.Model = "demo-model"
	if o.RetryWait == 0 {
		o.RetryWait = 10 * time.Millisecond
	}
	e := New(o)
	ctx, cancel := context.WithTimeout(taskstore.WithLease(context.Background(), f.l), life)
	defer cancel()
	rec := f.rec
	err := e.Run(ctx, &rec, f.progress)
	return &rec, err
}

// agentServer answers deliveries with h, keeping each delivery.
func agentServer(t *testing.T, h func(d Delivery, w http.ResponseWriter, r *http.Request)) (*httptest.Server, func() []Delivery) {
	var mu sync.Mutex
	var got []Delivery
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		raw, _ := io.ReadAll(r.Body)
		if sig := r.Header.Get("X-Faregate-Signature"); sig != Sign(secret, raw) {
			t.Errorf("signature %q does not match the body", sig)
		}
		var d Delivery
		if err := json.Unmarshal(raw, &d); err != nil {
			t.Errorf("delivery: %v", err)
		}
		mu.Lock()
		got = append(got, d)
		mu.Unlock()
		h(d, w, r)
	}))
	t.Cleanup(srv.Close)
	return srv, func() []Delivery { mu.Lock(); defer mu.Unlock(); return append([]Delivery(nil), got...) }
}

func code(err error) string {
	c, _, _ := task.FailureOf(err)
	return c
}

// TestDeliveryAndSyncResult: the delivery is the documented one, with a key
// that works while the task runs and not after; a 200 result becomes the
// task's text result.
func TestDeliveryAndSyncResult(t *testing.T) {
	f := newFixture(t)
	var during error
	srv, deliveries := agentServer(t, func(d Delivery, w http.ResponseWriter, r *http.Request) {
		_, during = f.keys.Authenticate(r.Context(), d.OpenAI.APIKey)
		_, _ = io.WriteString(w, `{"result":{"text":"# Hi","title":"  Greeting "}}`)
	})
	rec, err := f.run(t, srv.URL, 5*time.Second, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if during != nil {
		t.Fatalf("key refused during the run: %v", during)
	}
	d := deliveries()[0]
	if d.Task.ID != f.rec.ID || string(d.Task.Request) != `{"destination":"Lisbon","days":2,"interests":["food"],"language":"en"}` ||
		d.OpenAI.BaseURL != "http://faregate.test/v1" || d.Tools.FetchURL != "http://faregate.test/v1/tools/fetch" ||
		d.EventsURL != "http://faregate.test/v1/tasks/"+f.rec.ID+"/events" || d.ResultURL != "http://faregate.test/v1/tasks/"+f.rec.ID+"/result" ||
		d.OpenAI.Model != "demo-model" || !strings.HasPrefix(d.OpenAI.APIKey, taskkey.Prefix) ||
		d.Anthropic != (DeliveryAnthropic{BaseURL: "http://faregate.test", APIKey: d.OpenAI.APIKey, Model: "demo-model"}) {
		t.Fatalf("delivery %+v", d)
	}
	if left := d.Task.Deadline.Sub(d.Task.SentAt); left < 4*time.Second || left > 6*time.Second {
		t.Fatalf("deadline %v after sent_at", left)
	}
	if r := rec.Result; r == nil || r.Text != "# Hi" || r.Title != "Greeting" || r.Model != "demo-model" || r.Language != "en" {
		t.Fatalf("result %+v", rec.Result)
	}
	raw, _ := json.Marshal(rec.Result)
	if string(raw) != `{"text":"# Hi","title":"Greeting","warnings":[],"model":"demo-model","language":"en"}` {
		t.Fatalf("result JSON %s", raw)
	}
	// The run is over: its key says so (409 task_finished on /v1).
	if _, err := f.keys.Authenticate(context.Background(), d.OpenAI.APIKey); !errors.Is(err, taskkey.ErrFinished) {
		t.Fatalf("key after the run: %v, want ErrFinished", err)
	}
}

// TestLowPrecisionDelivery: a task AITF let through degraded is delivered
// with "precision": "low" inside task, and its result carries the
// low_precision warning as the planner's does; any other task's delivery
// has no precision member at all.
func TestLowPrecisionDelivery(t *testing.T) {
	for _, degraded := range []bool{false, true} {
		f := newFixture(t)
		f.rec.AITF.Degraded = degraded
		var raw []byte
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			raw, _ = io.ReadAll(r.Body)
			_, _ = io.WriteString(w, `{"result":{"text":"ok"}}`)
		}))
		t.Cleanup(srv.Close)
		rec, err := f.run(t, srv.URL, 5*time.Second, Options{})
		if err != nil {
			t.Fatal(err)
		}
		var d struct {
			Task map[string]json.RawMessage `json:"task"`
		}
		if err := json.Unmarshal(raw, &d); err != nil {
			t.Fatal(err)
		}
		p, has := d.Task["precision"]
		warned := slices.Contains(rec.Result.Warnings, codes.LowPrecision)
		if degraded && (string(p) != `"low"` || !warned) || !degraded && (has || warned) {
			t.Errorf("degraded %v: task.precision %s (present %v), result warnings %v", degraded, p, has, rec.Result.Warnings)
		}
	}
}

// TestPostedResultAndSteps: 202, then progress and the result through the
// inbox (as any replica's /v1 writes them): steps open and close in place
// with a duration; the posted result wins.
func TestPostedResultAndSteps(t *testing.T) {
	f := newFixture(t)
	srv, _ := agentServer(t, func(d Delivery, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		f.agent(func() {
			ctx := context.Background()
			g, err := f.keys.Authenticate(ctx, d.OpenAI.APIKey)
			if err != nil {
				t.Error(err)
				return
			}
			for _, p := range []taskkey.Posted{
				{Kind: task.KindAgent, Name: "search", Status: "started"},
				{Kind: task.KindAgent, Name: "search", Status: "ok", Detail: "2 hits"},
				{Kind: task.KindAgent, Name: "write", Status: "failed"},
			} {
				raw, _ := json.Marshal(p)
				if err := f.keys.Event(ctx, g, raw); err != nil {
					t.Error(err)
				}
			}
			step, _ := json.Marshal(taskkey.Posted{Kind: "model", Name: "gpt", Status: "ok", DurationMS: 12, Warning: codes.OutputTruncated,
				Warnings: []string{codes.Throttled, codes.Downgraded, codes.Throttled}})
			if err := f.keys.Step(ctx, g, step); err != nil {
				t.Error(err)
			}
			if err := f.keys.Result(ctx, g, []byte(`{"result":{"text":"posted"}}`)); err != nil {
				t.Errorf("result: %v", err)
			}
		})
	})
	rec, err := f.run(t, srv.URL, 5*time.Second, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Result == nil || rec.Result.Text != "posted" {
		t.Fatalf("result %+v", rec.Result)
	}
	if len(rec.Steps) != 3 || rec.Steps[0].Name != "search" || rec.Steps[0].Status != "ok" || rec.Steps[0].Detail != "2 hits" ||
		rec.Steps[1].Status != "failed" || rec.Steps[1].Seq != 2 || rec.Steps[2].Kind != "model" || rec.Steps[2].DurationMS != 12 {
		t.Fatalf("steps %+v", rec.Steps)
	}
	if !slices.Equal(rec.Result.Warnings, []string{codes.OutputTruncated, codes.Throttled, codes.Downgraded}) {
		t.Fatalf("warnings %v", rec.Result.Warnings)
	}
	f.mu.Lock()
	n := len(f.events)
	f.mu.Unlock()
	if n != 4 {
		t.Fatalf("%d step events published, want 4", n)
	}
}

// TestEmbeddingStepsBounded: embedding calls add a step per
// EmbeddingStepEvery to the record, not one each; every call's tokens
// count on the task's usage; the visitor's stream hears of a block when it
// opens and when it is full.
func TestEmbeddingStepsBounded(t *testing.T) {
	f := newFixture(t)
	const calls = 2*EmbeddingStepEvery + 50
	srv, _ := agentServer(t, func(d Delivery, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		f.agent(func() {
			ctx := context.Background()
			g, err := f.keys.Authenticate(ctx, d.OpenAI.APIKey)
			if err != nil {
				t.Error(err)
				return
			}
			for i := range calls {
				st := taskkey.Posted{Kind: "model", Name: "embeddings", Status: "ok", DurationMS: 2, PromptTokens: 3}
				if i%EmbeddingStepEvery == 7 {
					st.Status, st.PromptTokens = "failed", 0
				}
				raw, _ := json.Marshal(st)
				if err := f.keys.Step(ctx, g, raw); err != nil {
					t.Error(err)
					return
				}
			}
			chat, _ := json.Marshal(taskkey.Posted{Kind: "model", Name: "chat", Status: "ok", PromptTokens: 40, CompletionTokens: 9})
			if err := f.keys.Step(ctx, g, chat); err != nil {
				t.Error(err)
			}
			if err := f.keys.Result(ctx, g, []byte(`{"result":{"text":"done"}}`)); err != nil {
				t.Errorf("result: %v", err)
			}
		})
	})
	rec, err := f.run(t, srv.URL, 20*time.Second, Options{})
	if err != nil {
		t.Fatal(err)
	}
	var embeds []task.Step
	for _, s := range rec.Steps {
		if s.Name == "embeddings" {
			embeds = append(embeds, s)
		}
	}
	want := []string{"100 embedding calls, 1 failed: 297 tokens", "100 embedding calls, 1 failed: 297 tokens", "50 embedding calls, 1 failed: 147 tokens"}
	if len(rec.Steps) != 4 || len(embeds) != 3 {
		t.Fatalf("%d steps (%d of embeddings), want 3 for %d embedding calls and the chat call's: %+v", len(rec.Steps), len(embeds), calls, rec.Steps)
	}
	for i, s := range embeds {
		if s.Detail != want[i] || s.Status != "ok" || s.Kind != "model" || s.Seq != i+1 {
			t.Fatalf("embedding step %d: %+v, want %q", i, s, want[i])
		}
	}
	if embeds[0].DurationMS != 2*EmbeddingStepEvery {
		t.Fatalf("the block's duration %d, want the sum of its calls'", embeds[0].DurationMS)
	}
	if rec.Usage.PromptTokens != 3*(calls-3)+40 || rec.Usage.CompletionTokens != 9 {
		t.Fatalf("usage %+v", rec.Usage)
	}
	f.mu.Lock()
	n := len(f.events)
	f.mu.Unlock()
	// Three blocks opened, two filled, and the chat step.
	if n != 3+2+1 {
		t.Fatalf("%d step events published, want 6", n)
	}
}

// TestAgentFailures: each way the agent can fail ends the run with the
// documented code; a delivery whose connection failed before any answer
// is sent three times in all, the same body each time.
func TestAgentFailures(t *testing.T) {
	var resets atomic.Int64
	cases := []struct {
		name string
		h    func(d Delivery, w http.ResponseWriter, r *http.Request)
		life time.Duration
		code string
	}{
		{"500", func(d Delivery, w http.ResponseWriter, r *http.Request) { w.WriteHeader(500) }, 5 * time.Second, codes.AgentFailed},
		{"204", func(d Delivery, w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }, 5 * time.Second, codes.AgentFailed},
		{"redirect", func(d Delivery, w http.ResponseWriter, r *http.Request) { http.Redirect(w, r, "/x", http.StatusFound) }, 5 * time.Second, codes.AgentFailed},
		{"not JSON", func(d Delivery, w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, "ok") }, 5 * time.Second, codes.AgentFailed},
		{"empty text", func(d Delivery, w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"result":{"text":"  "}}`)
		}, 5 * time.Second, codes.AgentFailed},
		{"text too long", func(d Delivery, w http.ResponseWriter, r *http.Request) {
			raw, _ := json.Marshal(map[string]any{"result": map[string]string{"text": strings.Repeat("a", task.MaxResultText+1)}})
			_, _ = w.Write(raw)
		}, 5 * time.Second, codes.AgentFailed},
		{"answer too large", func(d Delivery, w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"result":{"text":"`+strings.Repeat(`\u0061`, maxAnswer/6+10)+`"}}`)
		}, 5 * time.Second, codes.AgentFailed},
		{"posted error", func(d Delivery, w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, `{"error":{"code":"mine","message":"no"}}`)
		}, 5 * time.Second, codes.AgentFailed},
		{"hang", func(d Delivery, w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }, 700 * time.Millisecond, codes.AgentUnreachable},
		{"silent 202", func(d Delivery, w http.ResponseWriter, r *http.Request) { w.WriteHeader(202) }, 700 * time.Millisecond, codes.AgentTimeout},
		{"reset", func(d Delivery, w http.ResponseWriter, r *http.Request) {
			resets.Add(1)
			c, _, _ := w.(http.Hijacker).Hijack()
			_ = c.Close()
		}, 5 * time.Second, codes.AgentUnreachable},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture(t)
			srv, deliveries := agentServer(t, c.h)
			rec, err := f.run(t, srv.URL, c.life, Options{})
			if code(err) != c.code {
				t.Fatalf("err %v (code %q), want %s", err, code(err), c.code)
			}
			if rec.Result != nil {
				t.Fatalf("a failed run has a result: %+v", rec.Result)
			}
			// Every case had the delivery written whole: it is never sent
			// again (a reset after it may be an agent still running it).
			if n := len(deliveries()); n != 1 {
				t.Fatalf("%d deliveries, want 1", n)
			}
		})
	}
	t.Run("refused", func(t *testing.T) {
		f := newFixture(t)
		srv := httptest.NewServer(http.NotFoundHandler())
		url := srv.URL
		srv.Close()
		if _, err := f.run(t, url, 5*time.Second, Options{}); code(err) != codes.AgentUnreachable {
			t.Fatalf("refused: %v", err)
		}
	})
}

// TestRunEnds: a run cancelled from outside (shutdown, a lost lease)
// returns the context's error for the runner to name; a run without its
// lease, or whose lease another replica took, does not start.
func TestRunEnds(t *testing.T) {
	f := newFixture(t)
	started := make(chan struct{})
	srv, _ := agentServer(t, func(d Delivery, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(202)
		close(started)
	})
	e := New(Options{URL: srv.URL, Secret: secret, Keys: f.keys, Inbox: f.store, Callback: func() string { return "http://x" }})
	ctx, cancel := context.WithTimeout(taskstore.WithLease(context.Background(), f.l), time.Minute)
	go func() { <-started; cancel() }()
	rec := f.rec
	if err := e.Run(ctx, &rec, f.progress); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled run: %v", err)
	}
	if err := e.Run(context.Background(), &rec, f.progress); err == nil {
		t.Fatal("a run without a lease started")
	}
	stale := f.l
	stale.Epoch++
	sctx, scancel := context.WithTimeout(taskstore.WithLease(context.Background(), stale), time.Minute)
	defer scancel()
	if err := e.Run(sctx, &rec, f.progress); !errors.Is(err, taskstore.ErrLeaseLost) {
		t.Fatalf("run under a lease it does not hold: %v", err)
	}
}

// TestModelStepsChargeAndEnd: the model endpoint's steps add what each call
// was charged to the task's usage, and one reporting an input spike ends
// the task with that code; an agent's own event carrying the same fields
// changes neither.
func TestModelStepsChargeAndEnd(t *testing.T) {
	f := newFixture(t)
	srv, _ := agentServer(t, func(d Delivery, w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusAccepted)
		f.agent(func() {
			ctx := context.Background()
			g, err := f.keys.Authenticate(ctx, d.OpenAI.APIKey)
			if err != nil {
				t.Error(err)
				return
			}
			forged, _ := json.Marshal(taskkey.Posted{Kind: task.KindAgent, Name: "x", Status: "ok",
				PromptTokens: 1 << 40, CompletionTokens: 1 << 40, Fail: codes.InputSpike})
			if err := f.keys.Event(ctx, g, forged); err != nil {
				t.Error(err)
			}
			for _, p := range []taskkey.Posted{
				{Kind: "model", Name: "chat", Status: "ok", PromptTokens: 100, CompletionTokens: 20},
				{Kind: "model", Name: "chat", Status: "failed", Fail: codes.InputSpike},
			} {
				raw, _ := json.Marshal(p)
				if err := f.keys.Step(ctx, g, raw); err != nil {
					t.Error(err)
				}
			}
		})
	})
	rec, err := f.run(t, srv.URL, 5*time.Second, Options{})
	if code, _, ok := task.FailureOf(err); !ok || code != codes.InputSpike {
		t.Fatalf("run ended %v, want the task code input_spike", err)
	}
	if rec.Usage.PromptTokens != 100 || rec.Usage.CompletionTokens != 20 {
		t.Fatalf("usage %+v, want the model step's 100 + 20 only", rec.Usage)
	}
}

// TestDeliveryRetriedOnlyUnsent: a delivery whose connection could not be
// made (the agent restarting) is sent again, and reaches the agent once;
// the "reset" case of TestAgentFailures is the other half: once written
// whole, it is never sent again.
func TestDeliveryRetriedOnlyUnsent(t *testing.T) {
	f := newFixture(t)
	srv, deliveries := agentServer(t, func(d Delivery, w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"result":{"text":"done"}}`)
	})
	var dials atomic.Int64
	tr := http.DefaultTransport.(*http.Transport).Clone()
	base := tr.DialContext
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if dials.Add(1) <= 2 {
			return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
		}
		return base(ctx, network, addr)
	}
	t.Cleanup(tr.CloseIdleConnections)
	rec, err := f.run(t, srv.URL, 10*time.Second, Options{Client: &http.Client{Transport: tr}})
	if err != nil {
		t.Fatalf("a delivery refused twice, then taken: %v", err)
	}
	if rec.Result == nil {
		t.Fatal("no result")
	}
	if n, d := len(deliveries()), dials.Load(); n != 1 || d != 3 {
		t.Fatalf("%d deliveries over %d dials, want 1 over 3", n, d)
	}
}
