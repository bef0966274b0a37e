package aitf

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ErrMode is returned by ParseMode for an unknown mode.
var ErrMode = errors.New("aitf: unknown mode")

// Mode selects what the Guard does with a score.
type Mode string

// The modes of FAREGATE_AITF_MODE.
const (
	// ModeOff neither reads nor scores bodies.
	ModeOff Mode = "off"
	// ModeObserve scores, logs and counts, but never delays (the default).
	ModeObserve Mode = "observe"
	// ModeEnforce also applies the delay queue.
	ModeEnforce Mode = "enforce"
)

// ParseMode reads a FAREGATE_AITF_MODE value; empty means observe.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(strings.ToLower(strings.TrimSpace(s))); m {
	case "":
		return ModeObserve, nil
	case ModeOff, ModeObserve, ModeEnforce:
		return m, nil
	}
	return "", fmt.Errorf("%w %q (want off, observe or enforce)", ErrMode, s)
}

// Decisions recorded in Result.Decision.
const (
	DecisionPass     = "pass"
	DecisionDelayed  = "delayed"
	DecisionDegraded = "degraded"
	DecisionRefused  = "refused"
	DecisionObserved = "observed"
)

// Defaults applied by New to zero Options fields.
const (
	DefaultThreshold      = 0.6
	DefaultDegradeBacklog = 500
	DefaultMaxQueue       = 2000
	DefaultMaxBody        = 16384
	DefaultMemoryCap      = 100000
)

// Response and request headers.
const (
	HeaderScore    = "X-AITF-Score"
	HeaderVector   = "X-AITF-Vector"
	HeaderDecision = "X-AITF-Decision"
	HeaderDebug    = "X-AITF-Debug"
	HeaderOptIn    = "X-AITF-Opt-In"
)

// Result is the verdict on one request, kept in its context.
type Result struct {
	// Score is the combined score in [0,1].
	Score float64
	// Vector holds the body and behaviour dimensions.
	Vector Vector
	// ToolCallID is the body's tool_call_id (or tool_calls[].id), if any.
	ToolCallID string
	// OptIn is set when the client declared itself an agent (X-AITF-Opt-In: true).
	OptIn bool
	// Degraded asks the agent to run in low-precision mode.
	Degraded bool
	// Delayed is how long Admit held the request.
	Delayed time.Duration
	// Decision is "pass", "delayed", "degraded", "refused" or "observed".
	Decision string
}

// Options configures a Guard. Zero fields take the documented defaults.
type Options struct {
	// Mode is off, observe (default) or enforce.
	Mode Mode
	// Threshold is the score from which requests are delayed (default 0.6).
	Threshold float64
	// DegradeBacklog is the queue depth past which requests scoring above
	// 0.7 pass at once, degraded (default 500).
	DegradeBacklog int
	// MaxQueue is the queue depth at which requests are refused (default 2000).
	MaxQueue int
	// Debug allows X-AITF-Debug: true requests to see their score.
	Debug bool
	// MaxBody is the body limit; Middleware reads at most MaxBody+1 bytes
	// (default 16384).
	MaxBody int64
	// MemoryCap bounds the visitors (and tool call ids) the behaviour
	// memory keeps (default 100000).
	MemoryCap int
	// VisitorKey returns the hashed visitor key (never an IP); "" means
	// unknown, and then no behaviour is tracked.
	VisitorKey func(*http.Request) string
	// Route returns a low-cardinality route label; default "other". It is
	// called after routing (once the handler returned, or inside Admit), so
	// a chi route pattern is available.
	Route func(*http.Request) string
	// Refuse writes the 503 aitf_queue_full response for Delay: the
	// integrator's error table words it (faregate's api package passes its
	// own). Default: a bare 503 with Retry-After and no body, since this
	// package writes no error envelope of its own.
	Refuse func(w http.ResponseWriter, r *http.Request, retryAfter time.Duration)
	// Observed, when set, is called once for each request that scores at
	// least Threshold in observe mode (one enforce would have delayed),
	// after the handler returned, so the caller can aggregate them into a
	// periodic summary. Nothing is logged per request. It runs on the
	// request's goroutine and must not keep r.
	Observed func(r *http.Request, res Result)
	// ToolCallLoop, when set, is called once per tool_call_id per
	// 10-minute window, when that id is queued for the 16th time in it
	// (count is that count). The guard also logs one WARN line for it.
	ToolCallLoop func(ctx context.Context, toolCallID string, count int)
	// Logger receives the tool call alert; default discard.
	Logger *slog.Logger
	// Registerer receives the metrics; nil leaves them unregistered.
	Registerer prometheus.Registerer
	// Now is the clock of the behaviour memory and alert windows (the delay
	// itself uses real timers); default time.Now.
	Now func() time.Time
}

// Guard scores requests and runs the delay queue. It is safe for concurrent use.
type Guard struct {
	o      Options
	m      *metrics
	mem    *memory
	q      *queue
	alerts *alertBook
	seed   maphash.Seed
}

// New returns a Guard for o, filling defaults. It panics only if o.Registerer
// already holds conflicting faregate_aitf_ metrics, a programming error.
func New(o Options) *Guard {
	if o.Mode == "" {
		o.Mode = ModeObserve
	}
	if o.Threshold <= 0 {
		o.Threshold = DefaultThreshold
	}
	if o.DegradeBacklog <= 0 {
		o.DegradeBacklog = DefaultDegradeBacklog
	}
	if o.MaxQueue <= 0 {
		o.MaxQueue = DefaultMaxQueue
	}
	if o.MaxBody <= 0 {
		o.MaxBody = DefaultMaxBody
	}
	if o.MemoryCap <= 0 {
		o.MemoryCap = DefaultMemoryCap
	}
	if o.VisitorKey == nil {
		o.VisitorKey = func(*http.Request) string { return "" }
	}
	if o.Route == nil {
		o.Route = func(*http.Request) string { return "other" }
	}
	if o.Refuse == nil {
		o.Refuse = refuseBare
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Guard{
		o:      o,
		m:      newMetrics(o.Registerer),
		mem:    newMemory(o.MemoryCap),
		q:      newQueue(),
		alerts: newAlertBook(o.MemoryCap),
		seed:   maphash.MakeSeed(),
	}
}

// ctxKey keys the request's entry in its context.
type ctxKey struct{}

// entry is the mutable verdict shared by Middleware, Admit and the handler,
// all on the request's goroutine.
type entry struct {
	res   Result
	debug bool
}

// FromContext returns the Result stored by Middleware (or NewContext).
func FromContext(ctx context.Context) (Result, bool) {
	e, ok := ctx.Value(ctxKey{}).(*entry)
	if !ok {
		return Result{}, false
	}
	return e.res, true
}

// NewContext returns ctx carrying r, for tests and for the agent.
func NewContext(ctx context.Context, r Result) context.Context {
	return context.WithValue(ctx, ctxKey{}, &entry{res: r})
}

// Middleware scores each request: it reads the body once (at most MaxBody+1
// bytes) and hands the handler the same bytes followed by whatever was left
// unread, so the handler's own size check still sees an oversized body. It
// stores the Result in the context, counts (in observe mode also through
// Options.Observed, never a log line per request), and sets the debug
// headers when allowed. It never waits; see Admit.
func (g *Guard) Middleware(next http.Handler) http.Handler {
	if g.o.Mode == ModeOff {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := g.readBody(r)
		if int64(len(body)) > g.o.MaxBody {
			// Only the part a valid request could have is scored.
			body = body[:g.o.MaxBody]
		}
		sr := scan(body)
		vec := sr.vec
		visitor := g.o.VisitorKey(r)
		if visitor != "" {
			g.mem.behaviour(&vec, sr, visitor, g.o.Now(), g.seed, body, r.URL.Path)
		}
		e := &entry{res: Result{
			Score:      combine(vec),
			Vector:     vec,
			ToolCallID: sr.toolID(body),
			OptIn:      strings.EqualFold(r.Header.Get(HeaderOptIn), "true"),
			Decision:   DecisionPass,
		}}
		observed := g.o.Mode == ModeObserve && e.res.Score >= g.o.Threshold
		if observed {
			e.res.Decision = DecisionObserved
		}
		e.debug = g.o.Debug && strings.EqualFold(r.Header.Get(HeaderDebug), "true")
		if e.debug {
			h := w.Header()
			h.Set(HeaderScore, strconv.FormatFloat(e.res.Score, 'f', 3, 64))
			h.Set(HeaderVector, vec.String())
			h.Set(HeaderDecision, e.res.Decision)
		}

		r = r.WithContext(context.WithValue(r.Context(), ctxKey{}, e))
		next.ServeHTTP(w, r)

		// Counted after the handler so a router has filled in the route
		// pattern the label is made of.
		route := g.o.Route(r)
		g.m.score.WithLabelValues(route).Observe(e.res.Score)
		if observed {
			g.m.observed.WithLabelValues(route).Inc()
			if g.o.Observed != nil {
				g.o.Observed(r, e.res)
			}
		}
	})
}

// readBody reads up to MaxBody+1 bytes and puts them back in front of the
// rest of the body, so the handler reads exactly what the client sent.
func (g *Guard) readBody(r *http.Request) []byte {
	if r.Body == nil || r.Body == http.NoBody {
		return nil
	}
	buf, err := io.ReadAll(io.LimitReader(r.Body, g.o.MaxBody+1))
	var rest io.Reader = r.Body
	if err != nil {
		// The handler meets the same read error after the same bytes.
		rest = errReader{err}
	}
	r.Body = replayBody{Reader: io.MultiReader(bytes.NewReader(buf), rest), Closer: r.Body}
	return buf
}

// replayBody replays the bytes Middleware read, then the unread rest; Close
// closes the original body.
type replayBody struct {
	io.Reader
	io.Closer
}

// errReader fails every read with err.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// lastSegment returns the path after its last slash ("/api/docs/doc_1" →
// "doc_1"), a candidate identifier when the body has none.
func lastSegment(p string) string {
	return p[strings.LastIndexByte(p, '/')+1:]
}

// QueueDepth returns how many requests wait in the delay queue now.
func (g *Guard) QueueDepth() int { return g.q.Depth() }

// refuseBare is the default Refuse: the status and Retry-After, no body.
func refuseBare(w http.ResponseWriter, _ *http.Request, retryAfter time.Duration) {
	secs := int((retryAfter + time.Second - 1) / time.Second)
	w.Header().Set("Retry-After", strconv.Itoa(max(secs, 1)))
	w.WriteHeader(http.StatusServiceUnavailable)
}
