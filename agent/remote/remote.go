// Package remote runs a task on the operator's own agent
// (FAREGATE_AGENT_URL): it is the runner's Executor for that case. The
// worker that holds the task's lease mints the task key, POSTs the signed
// delivery, and holds the lease (the runner renews it) while the agent
// works; it takes the agent's answer from the delivery's 200, or from the
// task's inbox, where a result POSTed to any replica's result_url lands
// (fenced by the key's owner and epoch). Progress events the agent posts
// meanwhile reach the visitor's stream the same way: the lease holder is
// the task record's only writer, as with the built-in planner.
package remote

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync/atomic"
	"time"

	"faregate/agent"
	"faregate/agent/task"
	"faregate/agent/taskkey"
	"faregate/agent/taskstore"
	"faregate/protect/codes"
	"faregate/protect/kit/pause"
)

// Options configure an Executor.
type Options struct {
	// URL is FAREGATE_AGENT_URL; Secret signs every delivery.
	URL    string
	Secret string
	// Callback is the base URL at which the agent reaches faregate
	// (FAREGATE_AGENT_CALLBACK_URL), without a trailing slash: a func, as
	// the default is known only once faregate listens.
	Callback func() string
	// Model and EmbeddingModel are what the delivery names (the model is
	// also the result's).
	Model, EmbeddingModel string
	Keys                  *taskkey.Keys
	// Inbox reads the task's inbox, where what the agent posts lands. Its
	// waits pool (taskstore.Store.WithWaits) holds one connection per
	// running task while the lease holder waits on it: give it a pool of
	// the runner's concurrency.
	Inbox *taskstore.Store
	// Client sends deliveries; the run's deadline bounds each (default: a
	// client with no timeout of its own and no redirects).
	Client *http.Client
	// Retries is how often a delivery whose connection failed before any
	// byte was answered is sent again (default 2); RetryWait the first
	// wait between them (default 200 ms, doubled each time).
	Retries   int
	RetryWait time.Duration
	// UserAgent names faregate in deliveries.
	UserAgent string
	Logger    *slog.Logger
	Now       func() time.Time
}

// Executor delivers tasks to an external agent.
type Executor struct{ o Options }

// maxAnswer bounds the agent's synchronous answer: 64 KiB of text, even
// all of it escaped, fits.
const maxAnswer = 8 * task.MaxResultText

// New returns an Executor.
func New(o Options) *Executor {
	if o.Client == nil {
		o.Client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if o.Retries <= 0 {
		o.Retries = 2
	}
	if o.RetryWait <= 0 {
		o.RetryWait = 200 * time.Millisecond
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Executor{o: o}
}

// Delivery is the body POSTed to the agent (the documented JSON).
type Delivery struct {
	Task      DeliveryTask      `json:"task"`
	OpenAI    DeliveryOpenAI    `json:"openai"`
	Anthropic DeliveryAnthropic `json:"anthropic"`
	Tools     DeliveryTools     `json:"tools"`
	EventsURL string            `json:"events_url"`
	ResultURL string            `json:"result_url"`
}

// DeliveryTask is the task as the agent sees it.
type DeliveryTask struct {
	ID       string          `json:"id"`
	Request  json.RawMessage `json:"request"`
	Deadline time.Time       `json:"deadline"`
	SentAt   time.Time       `json:"sent_at"`
	// Precision is PrecisionLow for a task AITF let through degraded (its
	// traffic looked automated while the delay queue was long): the
	// agent should do less (fewer steps, no page fetching), and its /v1
	// model calls go to the fallback model first. Absent otherwise.
	Precision string `json:"precision,omitempty"`
}

// PrecisionLow is DeliveryTask.Precision of a task run at low precision.
const PrecisionLow = "low"

// DeliveryOpenAI is what an OpenAI client needs to call the model endpoint.
type DeliveryOpenAI struct {
	BaseURL        string `json:"base_url"`
	APIKey         string `json:"api_key"`
	Model          string `json:"model"`
	EmbeddingModel string `json:"embedding_model"`
}

// DeliveryAnthropic is what an Anthropic client needs to call the model
// endpoint's Messages route: its base URL is the callback's root, as
// Anthropic's SDKs append /v1/messages themselves.
type DeliveryAnthropic struct {
	BaseURL string `json:"base_url"`
	APIKey  string `json:"api_key"`
	Model   string `json:"model"`
}

// DeliveryTools locates the tools.
type DeliveryTools struct {
	FetchURL string `json:"fetch_url"`
}

// deliveryRequest is the task's request as the agent gets it: the prompt
// form {"prompt","language"} when the visitor sent a prompt, else the trip
// request. Read through JSON so it follows whatever fields the request has.
func deliveryRequest(r task.Request) json.RawMessage {
	raw, _ := json.Marshal(r)
	var m map[string]any
	_ = json.Unmarshal(raw, &m)
	if p, ok := m["prompt"].(string); ok && p != "" {
		out, _ := json.Marshal(struct {
			Prompt   string `json:"prompt"`
			Language string `json:"language"`
		}{p, r.Lang()})
		return out
	}
	out, _ := json.Marshal(struct {
		Destination string   `json:"destination"`
		Days        int      `json:"days"`
		Interests   []string `json:"interests"`
		Language    string   `json:"language"`
	}{r.Destination, r.Days, r.Interests, r.Lang()})
	return out
}

// Sign is the X-Faregate-Signature value of body: sha256=<hex HMAC>.
func Sign(secret string, body []byte) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write(body)
	return "sha256=" + hex.EncodeToString(m.Sum(nil))
}

// outcome is how the delivery's POST ended.
type outcome struct {
	accepted bool         // 202: the result comes through the inbox
	answer   *task.Answer // 200
	err      error        // a task failure (agent.Fail) or the context's end
}

// Run delivers rec to the agent and waits for its result until the run's
// deadline (ctx's). It fills in rec.Result and the agent's steps, or
// returns a failure with the documented code.
func (e *Executor) Run(ctx context.Context, rec *task.Record, progress agent.Progress) error {
	l, ok := taskstore.LeaseFrom(ctx)
	if !ok {
		return errors.New("remote: the run carries no lease")
	}
	deadline, ok := ctx.Deadline()
	if !ok {
		return errors.New("remote: the run has no deadline")
	}
	deadline = deadline.UTC().Truncate(time.Millisecond)
	key, err := e.o.Keys.Mint(ctx, l, *rec, deadline)
	if err != nil {
		return err
	}
	r := &run{e: e, rec: rec, progress: progress, opened: map[int]time.Time{}, lg: e.o.Logger.With("task", rec.ID)}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := e.o.Keys.Revoke(rctx, rec.ID); err != nil {
			// It still expires at the deadline, and the lease fence holds.
			r.lg.Warn("task key not revoked", "err", err.Error())
		}
	}()

	body, err := e.delivery(rec, key, deadline)
	if err != nil {
		return err
	}
	final, failed := r.await(ctx, body)
	// Revoke first, then read what is left: whatever the key could still
	// write is in the inbox by now, and nothing comes after.
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := e.o.Keys.Revoke(rctx, rec.ID); err != nil {
		r.lg.Warn("task key not revoked", "err", err.Error())
	}
	if a := r.drain(rctx); a != nil && final == nil && (failed == nil || errors.Is(ctx.Err(), context.DeadlineExceeded)) {
		// Posted (and accepted by the key) before the deadline.
		final, failed = a, nil
	}
	return r.finish(final, failed)
}

// delivery is the signed body's JSON: the task, the endpoints in each
// client's terms with the task's key, the tools and the callbacks.
func (e *Executor) delivery(rec *task.Record, key string, deadline time.Time) ([]byte, error) {
	dt := DeliveryTask{ID: rec.ID, Request: deliveryRequest(rec.Request), Deadline: deadline, SentAt: e.o.Now().UTC().Truncate(time.Second)}
	if rec.AITF.Degraded {
		// As the planner's run does: the task says it ran at low precision.
		dt.Precision = PrecisionLow
		if !contains(rec.Warnings, codes.LowPrecision) {
			rec.Warnings = append(rec.Warnings, codes.LowPrecision)
		}
	}
	cb := strings.TrimRight(e.o.Callback(), "/")
	body, err := json.Marshal(Delivery{
		Task: dt,
		OpenAI: DeliveryOpenAI{BaseURL: cb + "/v1", APIKey: key, Model: e.o.Model,
			EmbeddingModel: e.o.EmbeddingModel},
		Anthropic: DeliveryAnthropic{BaseURL: cb, APIKey: key, Model: e.o.Model},
		Tools:     DeliveryTools{FetchURL: cb + "/v1/tools/fetch"},
		EventsURL: cb + "/v1/tasks/" + rec.ID + "/events",
		ResultURL: cb + "/v1/tasks/" + rec.ID + "/result",
	})
	return body, err
}

// await delivers body and applies what the task's key writes (events,
// a posted result) until the agent's answer, a posted result, a failure
// or the run's end: the answer, or why there is none.
func (r *run) await(ctx context.Context, body []byte) (final *task.Answer, failed error) {
	// The reader only reads; every entry is applied here, in order, so
	// the record has one writer and the run's end need not wait for a
	// blocked read to return.
	readCtx, stopReading := context.WithCancel(ctx)
	defer stopReading()
	batches := make(chan []taskstore.Message)
	go r.follow(readCtx, batches)
	delivered := make(chan outcome, 1)
	postCtx, stopPost := context.WithCancel(ctx)
	defer stopPost()
	go func() { delivered <- r.e.deliver(postCtx, body) }()

	accepted := false
	// ended is the failure of a run whose context ended first.
	ended := func() error {
		switch {
		case !errors.Is(ctx.Err(), context.DeadlineExceeded):
			return ctx.Err() // shutdown or a lost lease: the runner says which
		case accepted:
			return task.Fail(codes.AgentTimeout, "the agent accepted the task but sent no answer before the deadline")
		}
		return task.Fail(codes.AgentUnreachable, "the agent did not answer before the deadline")
	}
wait:
	for {
		select {
		case o := <-delivered:
			delivered = nil
			switch {
			case o.err != nil && ctx.Err() != nil:
				failed = ended()
				break wait
			case o.err != nil:
				failed = o.err
				break wait
			case o.answer != nil:
				final = o.answer
				break wait
			}
			accepted = true
		case msgs := <-batches:
			for _, m := range msgs {
				if a := r.apply(m); a != nil {
					final = a
					break wait
				}
				if r.ended != nil {
					failed = r.ended
					break wait
				}
			}
		case <-ctx.Done():
			failed = ended()
			break wait
		}
	}
	return final, failed
}

// finish is the run's end from the answer final, or the failure failed:
// the record's result, or the task's failure code.
func (r *run) finish(final *task.Answer, failed error) error {
	rec, e := r.rec, r.e
	if failed == nil && final == nil && r.ended != nil {
		failed = r.ended
	}
	if failed != nil {
		return failed
	}
	if final == nil {
		return task.Fail(codes.AgentFailed, "the agent sent no answer")
	}
	if final.Error != nil {
		r.lg.Info("agent reported an error", "agent_code", clip(final.Error.Code, 64))
		return task.Fail(codes.AgentFailed, "the agent reported an error and could not finish the task")
	}
	res := &task.Result{Text: final.Result.Text, Model: e.o.Model, Language: rec.Request.Lang(),
		Warnings: append([]string{}, rec.Warnings...)}
	if final.Result.Title != nil {
		res.Title = *final.Result.Title
	}
	rec.Result = res
	return nil
}

// deliver POSTs body to the agent: again, at most Retries times, when the
// connection failed before the delivery was written whole (refused while
// the agent restarts, reset while sending); never once it was written,
// since the agent may be running the task (its answer lost, or still to
// come), and a task is not delivered twice.
func (e *Executor) deliver(ctx context.Context, body []byte) outcome {
	wait := e.o.RetryWait
	for attempt := 0; ; attempt++ {
		var wrote atomic.Bool
		trace := &httptrace.ClientTrace{WroteRequest: func(i httptrace.WroteRequestInfo) {
			if i.Err == nil {
				wrote.Store(true)
			}
		}}
		req, err := http.NewRequestWithContext(httptrace.WithClientTrace(ctx, trace), http.MethodPost, e.o.URL, bytes.NewReader(body))
		if err != nil {
			return outcome{err: task.Fail(codes.AgentUnreachable, "the agent's address cannot be requested")}
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("X-Faregate-Signature", Sign(e.o.Secret, body))
		if e.o.UserAgent != "" {
			req.Header.Set("User-Agent", e.o.UserAgent)
		}
		resp, err := e.o.Client.Do(req)
		if err == nil {
			return e.answer(resp)
		}
		if ctx.Err() != nil {
			return outcome{err: ctx.Err()} // the run's end decides
		}
		if wrote.Load() || attempt >= e.o.Retries {
			e.o.Logger.Info("agent unreachable", "attempts", attempt+1, "err", redact(err))
			return outcome{err: task.Fail(codes.AgentUnreachable, "the agent could not be reached")}
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return outcome{err: ctx.Err()}
		case <-t.C:
		}
		wait *= 2
	}
}

// answer reads the agent's reply to a delivery.
func (e *Executor) answer(resp *http.Response) outcome {
	defer resp.Body.Close()
	switch resp.StatusCode {
	case http.StatusAccepted:
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return outcome{accepted: true}
	case http.StatusOK:
	default:
		e.o.Logger.Info("agent refused the delivery", "status", resp.StatusCode)
		return outcome{err: task.Fail(codes.AgentFailed, fmt.Sprintf("the agent answered %d", resp.StatusCode))}
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer+1))
	if err != nil {
		return outcome{err: task.Fail(codes.AgentFailed, "the agent's answer broke off")}
	}
	if len(body) > maxAnswer {
		return outcome{err: task.Fail(codes.AgentFailed, "the agent's answer is too large")}
	}
	a, err := task.ParseAnswer(body)
	if err != nil {
		e.o.Logger.Info("agent answered an invalid body", "why", err.Error())
		return outcome{err: task.Fail(codes.AgentFailed, "the agent's answer is not valid: "+err.Error())}
	}
	return outcome{answer: &a}
}

// run is one task's delivery: the lease holder's view of what the agent
// posted.
type run struct {
	e        *Executor
	rec      *task.Record
	progress agent.Progress
	lg       *slog.Logger
	last     string            // the last inbox entry applied ("": none)
	opened   map[int]time.Time // seq → start of steps reported started
	answer   *task.Answer
	// ended is a failure the model endpoint reported for the task (an
	// input spike ends it): the run stops with it.
	ended error
	// embed is the record's step for the current block of embedding calls
	// (EmbeddingStepEvery of them); nil before the first.
	embed *embedBlock
}

// EmbeddingStepEvery is how many embedding calls share one step of the
// task record: an agent that embeds thousands of chunks adds a step per
// hundred calls, not one each, so the record and the visitor's stream stay
// small. Their tokens count on the task's usage as every model step's do.
const EmbeddingStepEvery = 100

// embedBlock is the step a block of embedding calls is summed up in.
type embedBlock struct {
	seq                   int // the step's Seq (its index is Seq-1)
	calls, failed, tokens int64
}

// follow reads the inbox as it fills and hands each batch over, until ctx
// ends. Its cursor is its own: a batch read but not taken when the run
// ends is read again by drain, from the last entry applied.
func (r *run) follow(ctx context.Context, batches chan<- []taskstore.Message) {
	cursor := "0"
	// Waits while Redis is away, as the runner's queue reader does.
	backoff := pause.Policy{First: 100 * time.Millisecond, Max: 2 * time.Second, Jitter: 0.2}.Backoff()
	for ctx.Err() == nil {
		msgs, err := r.e.o.Inbox.ReadInbox(ctx, r.rec.ID, cursor, time.Second)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			r.lg.Debug("task inbox not read", "err", err.Error())
			if backoff.Wait(ctx) != nil {
				return
			}
			continue
		}
		backoff.Reset()
		if len(msgs) == 0 {
			continue
		}
		cursor = msgs[len(msgs)-1].ID
		select {
		case batches <- msgs:
		case <-ctx.Done():
			return
		}
	}
}

// drain applies what is left in the inbox and returns a posted answer
// found there.
func (r *run) drain(ctx context.Context) *task.Answer {
	if r.last == "" {
		r.last = "0"
	}
	var found *task.Answer
	for {
		msgs, err := r.e.o.Inbox.ReadInbox(ctx, r.rec.ID, r.last, 0)
		if err != nil || len(msgs) == 0 {
			break
		}
		for _, m := range msgs {
			if a := r.apply(m); a != nil && found == nil {
				found = a
			}
		}
	}
	if found == nil && r.answer != nil {
		found = r.answer
	}
	return found
}

// apply takes one inbox entry: a step onto the record and the visitor's
// stream, or the posted answer (returned).
func (r *run) apply(m taskstore.Message) *task.Answer {
	r.last = m.ID
	switch m.Type {
	case taskkey.TypeResult:
		a, err := task.ParseAnswer(m.Data)
		if err != nil {
			a = task.Answer{Error: &task.AnswerError{Code: "invalid_result"}}
		}
		if r.answer == nil {
			r.answer = &a
		}
		return &a
	case taskkey.TypeEvent, taskkey.TypeStep:
		var p taskkey.Posted
		if err := json.Unmarshal(m.Data, &p); err != nil {
			return nil
		}
		if m.Type == taskkey.TypeStep && p.Fail == codes.InputSpike && r.ended == nil {
			// As documented: an input spike ends the task with its code.
			r.ended = task.Fail(codes.InputSpike, "a model call's prompt was far larger than usual for this visitor, so it was not made")
		}
		if m.Type == taskkey.TypeStep {
			// What a model call was charged counts on the task's usage;
			// an agent's own events carry no usage of any weight.
			r.rec.Usage.PromptTokens = addTokens(r.rec.Usage.PromptTokens, p.PromptTokens)
			r.rec.Usage.CompletionTokens = addTokens(r.rec.Usage.CompletionTokens, p.CompletionTokens)
			if p.Kind == stepKindModel && p.Name == stepEmbeddings {
				r.embedding(p)
				return nil
			}
		}
		p.PromptTokens, p.CompletionTokens, p.Fail = 0, 0, ""
		r.step(p)
	}
	return nil
}

// step records a reported step: an ok or failed report ends the open
// started step of the same kind and name (its row on the page updates in
// place, with its duration); anything else is a new step.
func (r *run) step(p taskkey.Posted) {
	now := r.e.o.Now()
	if p.Kind == "" {
		p.Kind = task.KindAgent
	}
	for _, w := range append([]string{p.Warning}, p.Warnings...) {
		if w != "" && !contains(r.rec.Warnings, w) {
			r.rec.Warnings = append(r.rec.Warnings, w)
		}
	}
	var s *task.Step
	if p.Status != "started" {
		for i := len(r.rec.Steps) - 1; i >= 0; i-- {
			c := &r.rec.Steps[i]
			if c.Kind == p.Kind && c.Name == p.Name && c.Status == "started" {
				s = c
				break
			}
		}
	}
	if s == nil {
		r.rec.Steps = append(r.rec.Steps, task.Step{Seq: len(r.rec.Steps) + 1, Kind: p.Kind, Name: p.Name})
		s = &r.rec.Steps[len(r.rec.Steps)-1]
		if p.Status == "started" {
			r.opened[s.Seq] = now
		}
	} else if at, ok := r.opened[s.Seq]; ok {
		s.DurationMS = max(now.Sub(at).Milliseconds(), 0)
		delete(r.opened, s.Seq)
	}
	s.Status = p.Status
	if p.DurationMS > 0 {
		s.DurationMS = p.DurationMS
	}
	if p.Detail != "" {
		s.Detail = p.Detail
	}
	data, _ := json.Marshal(*s)
	if err := r.progress(r.rec, task.Event{Type: task.EventStep, Data: data}); err != nil {
		// Best effort for the live view, as the planner's steps are; the
		// final save carries the steps.
		r.lg.Warn("agent step not saved", "err", err.Error())
	}
}

// The model endpoint's steps (agent/gateway's record):
// kind model, named by the call's kind.
const (
	stepKindModel  = "model"
	stepEmbeddings = "embeddings"
)

// embedding sums an embedding call's step into its block's step: the
// first call of a block appends it, the others update it in place, and
// the visitor's stream is told when a block opens and when it is full
// (the final record carries the last block as it ended).
func (r *run) embedding(p taskkey.Posted) {
	if p.Warning != "" && !contains(r.rec.Warnings, p.Warning) {
		r.rec.Warnings = append(r.rec.Warnings, p.Warning)
	}
	b := r.embed
	if b == nil || b.calls >= EmbeddingStepEvery {
		r.rec.Steps = append(r.rec.Steps, task.Step{Seq: len(r.rec.Steps) + 1, Kind: stepKindModel, Name: stepEmbeddings})
		b = &embedBlock{seq: len(r.rec.Steps)}
		r.embed = b
	}
	b.calls++
	if p.Status == "failed" {
		b.failed++
	}
	b.tokens = addTokens(b.tokens, addTokens(p.PromptTokens, p.CompletionTokens))
	s := &r.rec.Steps[b.seq-1]
	s.Status = "ok"
	if b.failed == b.calls {
		s.Status = "failed"
	}
	s.DurationMS = addTokens(s.DurationMS, p.DurationMS)
	s.Detail = fmt.Sprintf("%d embedding calls, %d failed: %d tokens", b.calls, b.failed, b.tokens)
	if b.calls != 1 && b.calls != EmbeddingStepEvery {
		return
	}
	data, _ := json.Marshal(*s)
	if err := r.progress(r.rec, task.Event{Type: task.EventStep, Data: data}); err != nil {
		r.lg.Warn("agent step not saved", "err", err.Error())
	}
}

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}

func clip(s string, n int) string {
	s = strings.ToValidUTF8(s, "")
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// redact keeps a delivery error's URL out of logs (it may carry a secret
// in its query).
func redact(err error) string {
	var ue interface{ Unwrap() error }
	if errors.As(err, &ue) {
		if inner := ue.Unwrap(); inner != nil {
			return inner.Error()
		}
	}
	return err.Error()
}

// addTokens adds a charge to a usage total, never below zero and never
// past MaxInt64 (charges are bounded by the per-call ceiling already).
func addTokens(total, n int64) int64 {
	if n <= 0 {
		return total
	}
	if total > math.MaxInt64-n {
		return math.MaxInt64
	}
	return total + n
}
