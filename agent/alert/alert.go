// Package alert tells operators when something needs them: a budget nearly
// or fully spent, the model breaker opening or closing, an anomaly, a tool
// call loop, a policy file that failed to reload, usage above a
// reservation, a principal whose requests are mostly invalid or who is
// throttled near its hourly tokens.
//
// Each alert is one JSON POST to a webhook,
//
//	{"event": "budget_exhausted", "severity": "critical", "text": "…",
//	 "at": "2026-08-31T12:00:00Z", "details": {…}}
//
// whose "text" field makes it a valid Slack incoming-webhook message. With a
// secret the body is signed, X-Faregate-Signature: sha256=<hex HMAC-SHA256
// of the exact body>. Without a URL alerts are log lines only.
//
// Notify never blocks its caller: alerts wait in bounded queues that
// workers (Run) empty, and an alert that finds its queue full is dropped
// and counted. There are two lanes, each with its own queue and worker
// (lanes.go): the operator's (policy, breaker, site budgets) and the
// traffic's (alerts whose scope a request chooses), so a flood of the one a
// visitor can cause never delays or drops the other. Each lane sends at
// most EventLimit alerts of one event per window (10 per 10 minutes) on
// top of the per-scope deduplication; the rest are counted, and the next
// one sent says how many were held back. A worker sends each alert at most four times (three
// retries on network errors, 5xx and 429, with exponential backoff and
// jitter, honouring Retry-After up to a cap) with a timeout per attempt.
// Only the first alert per event and scope within a window (10 minutes) is
// sent; a Redis-backed Deduper makes replicas agree on that, and when Redis
// fails the process's own memory decides, so an alert is never lost because
// deduplication is down.
package alert

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"faregate/protect/codes"
	"faregate/protect/kit/pause"
	"faregate/protect/kit/promreg"
)

// Events. The metric labels any other name "other". An event named like
// one of faregate's codes takes the code's constant: the word is defined
// once.
const (
	BudgetWarning      = "budget_warning"       // 80% of a daily budget; once per scope and day
	BudgetExhausted    = codes.BudgetExhausted  // a daily token or money budget is spent
	BreakerOpen        = "breaker_open"         // the model breaker opened
	BreakerClosed      = "breaker_closed"       // the model breaker closed again
	Anomaly            = "anomaly"              // an input spike or similar anomaly was refused
	ToolCallLoop       = "tool_call_loop"       // a run repeated a tool call
	PolicyReloadFailed = "policy_reload_failed" // an invalid policy file was kept out
	Overage            = "overage"              // usage settled above its reservation
	UsageImplausible   = "usage_implausible"    // a provider's usage report below zero, past the ceiling or unreadable
	InvalidRatio       = codes.InvalidRatio     // a principal's share of invalid requests in 10 minutes is past the ratio
	PrincipalThrottled = "principal_throttled"  // a principal passed the soft share of its hourly tokens
	LedgerBacklog      = "ledger_backlog"       // a day's unexported ledger entries reached 80% of FAREGATE_LEDGER_MAX_ENTRIES
	LedgerLost         = "ledger_lost"          // unexported ledger entries were dropped past FAREGATE_LEDGER_MAX_ENTRIES
)

// Severities, as the payload names them.
const (
	Info     = "info"
	Warning  = "warning"
	Critical = "critical"
)

var knownEvents = map[string]bool{
	BudgetWarning: true, BudgetExhausted: true, BreakerOpen: true, BreakerClosed: true,
	Anomaly: true, ToolCallLoop: true, PolicyReloadFailed: true, Overage: true, UsageImplausible: true,
	InvalidRatio: true, PrincipalThrottled: true,
	LedgerBacklog: true, LedgerLost: true,
}

// Alert is one thing to tell operators.
type Alert struct {
	// Event is one of the event constants.
	Event string
	// Scope says what the alert is about and, with Event, what is
	// deduplicated: "site", "principal:k_acme", "model:primary". It must not
	// hold a raw IP; a visitor's 64-hex hash is cut to its first 12 digits.
	Scope string
	// Severity is Info, Warning or Critical (default Warning).
	Severity string
	// Text is the human sentence (Slack shows it); default "<event> (<scope>)".
	Text string
	// Details are extra JSON fields; the same rules as Scope apply.
	Details map[string]any
	// Window overrides the Notifier's deduplication window for this alert.
	// A budget_warning is sent once per scope and UTC day by putting the day
	// in Scope ("site/2026-08-31") and a Window of 24h.
	Window time.Duration
}

// Options configure a Notifier; zero fields take the defaults noted.
type Options struct {
	// URL is the webhook (FAREGATE_ALERT_WEBHOOK_URL). Empty: log lines only.
	URL string
	// Secret signs bodies (FAREGATE_ALERT_WEBHOOK_SECRET). Empty: unsigned.
	Secret string
	// Client sends the POSTs (a client that does not follow redirects).
	Client *http.Client
	// QueueSize bounds the alerts waiting for each lane's worker (256).
	QueueSize int
	// EventLimit bounds the alerts of one event that each lane lets
	// through per Window, whatever their scopes (10).
	EventLimit int
	// Dedupe is shared by every replica (RedisDeduper); nil: this process's
	// memory only.
	Dedupe Deduper
	// Window is how long an event and scope stay deduplicated (10m).
	Window time.Duration
	// Timeout bounds one delivery attempt (5s).
	Timeout time.Duration
	// MaxRetryAfter caps the wait a Retry-After header asks for (30s).
	MaxRetryAfter time.Duration
	// DrainTimeout bounds how long Close keeps delivering queued alerts (5s).
	DrainTimeout time.Duration
	// Logger receives one line per alert sent or logged and one per final
	// failure (slog.Default()).
	Logger *slog.Logger
	// Registerer takes faregate_alerts_total; nil leaves it unregistered.
	Registerer prometheus.Registerer
	// Now is the clock (time.Now).
	Now func() time.Time
	// Backoff is the wait before retry number attempt (1, 2, 3); by default
	// a random time up to 500ms, 1s, 2s (exponential, full jitter:
	// defaultBackoff).
	Backoff func(attempt int) time.Duration
}

// Outcomes, the values of the metric's outcome label.
const (
	outcomeSent         = "sent"
	outcomeFailed       = "failed"
	outcomeDropped      = "dropped"
	outcomeDeduplicated = "deduplicated"
	outcomeLogged       = "logged"
	outcomeLimited      = "limited"
)

// maxAttempts is one try and three retries.
const maxAttempts = 4

// queued is an alert with the time it was raised.
type queued struct {
	a   Alert
	at  time.Time
	win time.Duration
}

// Notifier delivers alerts. Notify may be called from any goroutine; Run
// must be running for alerts to leave the queue.
type Notifier struct {
	o     Options
	lg    *slog.Logger
	total *prometheus.CounterVec
	local *memory

	queues  [laneCount]chan queued
	limits  [laneCount]*limiter
	closing chan struct{}
	done    chan struct{}
	closed  atomic.Bool
	started atomic.Bool
	once    sync.Once

	// poster sends the webhook's POSTs; wait sleeps between their
	// attempts (tests replace it to see the waits).
	poster *Poster
	wait   func(ctx context.Context, d time.Duration) error
}

// New returns a Notifier; start its worker with Run.
func New(o Options) *Notifier {
	if o.Client == nil {
		o.Client = &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	}
	if o.QueueSize <= 0 {
		o.QueueSize = 256
	}
	if o.EventLimit <= 0 {
		o.EventLimit = 10
	}
	if o.Window <= 0 {
		o.Window = 10 * time.Minute
	}
	if o.Timeout <= 0 {
		o.Timeout = 5 * time.Second
	}
	if o.MaxRetryAfter <= 0 {
		o.MaxRetryAfter = 30 * time.Second
	}
	if o.DrainTimeout <= 0 {
		o.DrainTimeout = 5 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Backoff == nil {
		o.Backoff = defaultBackoff
	}
	total := promreg.Register(o.Registerer, prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "faregate_alerts_total",
		Help: "Alerts by event and outcome (sent, failed, dropped, deduplicated, limited, logged).",
	}, []string{"event", "outcome"}))
	// Every series this Notifier can move exists at 0 from the start, so
	// rate() and increase() see the first alert of its kind.
	outcomes := []string{outcomeDropped, outcomeDeduplicated, outcomeLimited, outcomeLogged}
	if o.URL != "" {
		outcomes = []string{outcomeDropped, outcomeDeduplicated, outcomeLimited, outcomeSent, outcomeFailed}
	}
	for ev := range knownEvents {
		for _, oc := range outcomes {
			total.WithLabelValues(ev, oc)
		}
	}
	n := &Notifier{
		o:       o,
		lg:      o.Logger,
		total:   total,
		local:   newMemory(o.Now),
		closing: make(chan struct{}),
		done:    make(chan struct{}),
		wait:    pause.For,
		poster: &Poster{URL: o.URL, Secret: o.Secret, UserAgent: "faregate-alert", Client: o.Client, Timeout: o.Timeout,
			MaxRetryAfter: o.MaxRetryAfter, Backoff: o.Backoff, Now: o.Now},
	}
	for l := range laneCount {
		n.queues[l] = make(chan queued, o.QueueSize)
		n.limits[l] = newLimiter(o.EventLimit, o.Window)
	}
	return n
}

// defaultBackoff waits a random time up to 0.5s, 1s, 2s before retries
// 1–3: from 1 % to 100 % of that, so a retry never comes at once.
func defaultBackoff(attempt int) time.Duration { return retryWaits.Nth(max(attempt-1, 0)) }

var retryWaits = pause.Policy{First: 500 * time.Millisecond, Max: 2 * time.Second, Jitter: 0.99}

// Notify queues a in its lane and returns at once. An alert past its
// lane's EventLimit for the window is counted as limited; one whose event
// and scope were already raised within the window is counted as
// deduplicated; one that finds its queue full, or the Notifier closed, is
// dropped and counted.
func (n *Notifier) Notify(a Alert) {
	a = clean(a)
	win := a.Window
	if win <= 0 {
		win = n.o.Window
	}
	if n.closed.Load() {
		n.count(a.Event, outcomeDropped)
		return
	}
	l := laneOf(a)
	now := n.o.Now()
	// The rate bound comes before the deduplication memory, so a flood of
	// new scopes marks no more of them than the bound lets through.
	ok, suppressed, first := n.limits[l].take(a.Event, now)
	if !ok {
		if first {
			n.lg.Warn("alert: rate limit reached; further alerts of this event are counted, not sent, until the window ends",
				"event", a.Event, "lane", laneNames[l], "limit", n.o.EventLimit, "window", n.o.Window.String())
		}
		n.count(a.Event, outcomeLimited)
		return
	}
	if !n.local.first(a.Event, a.Scope, win) {
		n.limits[l].giveBack(a.Event, suppressed)
		n.count(a.Event, outcomeDeduplicated)
		return
	}
	if suppressed > 0 {
		if a.Details == nil {
			a.Details = map[string]any{}
		}
		a.Details["suppressed"] = suppressed
	}
	select {
	case n.queues[l] <- queued{a: a, at: now, win: win}:
	default:
		// Forget the mark so the next occurrence can still get through.
		n.local.forget(a.Event, a.Scope)
		n.limits[l].giveBack(a.Event, suppressed)
		n.count(a.Event, outcomeDropped)
	}
}

// Run delivers queued alerts, one worker per lane, until ctx ends or Close
// is called, then keeps delivering what is still queued. From that moment
// everything, the deliveries in flight included, gets DrainTimeout; what is
// left then is dropped and counted. Run returns nil after Close, ctx.Err()
// otherwise. Call it once.
func (n *Notifier) Run(ctx context.Context) error {
	if !n.started.CompareAndSwap(false, true) {
		return errors.New("alert: Run called twice")
	}
	defer close(n.done)
	// Deliveries run on wctx, which outlives ctx by at most DrainTimeout.
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	go func() {
		select {
		case <-n.closing:
		case <-ctx.Done():
		case <-wctx.Done():
			return
		}
		t := time.NewTimer(n.o.DrainTimeout)
		defer t.Stop()
		select {
		case <-t.C:
			cancel()
		case <-wctx.Done():
		}
	}()
	var wg sync.WaitGroup
	for _, q := range n.queues {
		wg.Go(func() { n.work(ctx, wctx, q) })
	}
	wg.Wait()
	select {
	case <-n.closing:
		return nil
	default:
		return ctx.Err()
	}
}

// work is one lane's worker: it delivers from q until Close or ctx, then
// drains q.
func (n *Notifier) work(ctx, wctx context.Context, q chan queued) {
	for {
		select {
		case a := <-q:
			n.deliver(wctx, a)
		case <-n.closing:
			n.drain(wctx, q)
			return
		case <-ctx.Done():
			n.closed.Store(true)
			n.drain(wctx, q)
			return
		}
	}
}

// Close stops accepting alerts and waits for Run to deliver the queued ones
// (bounded by DrainTimeout) and return. Without a running Run it returns at
// once. It is safe to call more than once.
func (n *Notifier) Close() {
	n.once.Do(func() {
		n.closed.Store(true)
		close(n.closing)
	})
	if n.started.Load() {
		<-n.done
	}
}

// drain delivers what is queued until the queue is empty; once ctx has
// ended, the rest is dropped and counted.
func (n *Notifier) drain(ctx context.Context, queue chan queued) {
	for {
		select {
		case q := <-queue:
			if ctx.Err() != nil {
				n.count(q.a.Event, outcomeDropped)
				continue
			}
			n.deliver(ctx, q)
		default:
			return
		}
	}
}

// deliver asks the shared deduper, then logs or sends one alert.
func (n *Notifier) deliver(ctx context.Context, q queued) {
	a := q.a
	if n.o.Dedupe != nil {
		dctx, cancel := context.WithTimeout(ctx, time.Second)
		first, err := n.o.Dedupe.First(dctx, a.Event, a.Scope, q.win)
		cancel()
		switch {
		case err != nil:
			// This process's memory already judged it first: send it.
			n.lg.Warn("alert: shared deduplication unavailable, using local", "event", a.Event, "err", err)
		case !first:
			n.count(a.Event, outcomeDeduplicated)
			return
		}
	}
	body, err := json.Marshal(payload{
		Event:    a.Event,
		Severity: a.Severity,
		Text:     a.Text,
		At:       q.at.UTC().Format(time.RFC3339),
		Details:  a.Details,
	})
	if err != nil {
		// Details held something JSON cannot carry; say so rather than drop.
		body, _ = json.Marshal(payload{Event: a.Event, Severity: a.Severity, Text: a.Text,
			At: q.at.UTC().Format(time.RFC3339), Details: map[string]any{"error": "details not encodable: " + err.Error()}})
	}
	// Each outcome is logged before it is counted, so a counted alert
	// always has its line.
	if n.o.URL == "" {
		n.lg.Log(ctx, level(a.Severity), "alert", "event", a.Event, "scope", a.Scope, "severity", a.Severity,
			"text", a.Text, "at", q.at.UTC().Format(time.RFC3339), "details", a.Details)
		n.count(a.Event, outcomeLogged)
		return
	}
	attempts, err := n.poster.post(ctx, body, n.wait)
	if err != nil {
		n.lg.Warn("alert delivery failed", "event", a.Event, "scope", a.Scope, "attempts", attempts, "err", err)
		n.count(a.Event, outcomeFailed)
		return
	}
	n.lg.Log(ctx, level(a.Severity), "alert sent", "event", a.Event, "scope", a.Scope, "severity", a.Severity,
		"text", a.Text, "attempts", attempts)
	n.count(a.Event, outcomeSent)
}

// payload is the JSON body of a webhook POST.
type payload struct {
	Event    string         `json:"event"`
	Severity string         `json:"severity"`
	Text     string         `json:"text"`
	At       string         `json:"at"`
	Details  map[string]any `json:"details"`
}

func (n *Notifier) count(event, outcome string) {
	if !knownEvents[event] {
		event = "other"
	}
	n.total.WithLabelValues(event, outcome).Inc()
}

// level is the log level of an alert's line.
func level(severity string) slog.Level {
	switch severity {
	case Info:
		return slog.LevelInfo
	case Critical:
		return slog.LevelError
	}
	return slog.LevelWarn
}
