package aitf

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"faregate/protect/kit/testkit/clocktest"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// visitorHash stands in for the HMAC visitor key the lead's clientip
// package computes; the raw address below must never show up anywhere.
const (
	visitorHash = "3c9a0e5b7d1f2a4c6e8b0d2f4a6c8e0b2d4f6a8c0e2b4d6f8a0c2e4b6d8f0a2c"
	rawIP       = "203.0.113.77"
)

// logSink is a slog.Handler that keeps records for assertions.
type logSink struct {
	mu      sync.Mutex
	records []slog.Record
}

func (s *logSink) Enabled(context.Context, slog.Level) bool { return true }
func (s *logSink) Handle(_ context.Context, r slog.Record) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.records = append(s.records, r.Clone())
	return nil
}
func (s *logSink) WithAttrs([]slog.Attr) slog.Handler { return s }
func (s *logSink) WithGroup(string) slog.Handler      { return s }

// lines renders the records at level as text lines.
func (s *logSink) lines(level slog.Level) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, r := range s.records {
		if r.Level != level {
			continue
		}
		var b strings.Builder
		b.WriteString(r.Message)
		r.Attrs(func(a slog.Attr) bool {
			b.WriteString(" " + a.String())
			return true
		})
		out = append(out, b.String())
	}
	return out
}

// clock is a settable clock for the behaviour memory and alert windows.
type clock = clocktest.Clock

// fixture is a Guard with its registry, log sink and clock.
type fixture struct {
	g   *Guard
	reg *prometheus.Registry
	log *logSink
	clk *clock
}

// newFixture builds a Guard whose visitor key is visitorHash and whose
// route label is "tasks"; edit lets a test change the options.
func newFixture(t *testing.T, edit func(*Options)) *fixture {
	t.Helper()
	f := &fixture{reg: prometheus.NewRegistry(), log: &logSink{}, clk: clocktest.New(time.Unix(1_800_000_000, 0))}
	o := Options{
		VisitorKey: func(*http.Request) string { return visitorHash },
		Route:      func(*http.Request) string { return "tasks" },
		Logger:     slog.New(f.log),
		Registerer: f.reg,
		Now:        f.clk.Now,
	}
	if edit != nil {
		edit(&o)
	}
	f.g = New(o)
	return f
}

// post builds a POST /api/tasks request from rawIP with body.
func post(body string) *http.Request {
	r := httptest.NewRequest(http.MethodPost, "/api/tasks", strings.NewReader(body))
	r.RemoteAddr = rawIP + ":41234"
	r.Header.Set("Content-Type", "application/json")
	return r
}

const toolBody = `{"tool_call_id":"call_abc","content":"42","destination":"Lisbon"}`

func TestMiddlewareHandsBodyOn(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.MaxBody = 64 })
	tests := []struct {
		name string
		body string
	}{
		{"small", `{"destination":"Lisbon"}`},
		{"exactly the limit", `{"d":"` + strings.Repeat("x", 64-8) + `"}`},
		{"over the limit", `{"tool_call_id":"c","d":"` + strings.Repeat("x", 500) + `"}`},
		{"empty", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var got []byte
			var res Result
			var ok bool
			h := f.g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				got, _ = io.ReadAll(r.Body)
				res, ok = FromContext(r.Context())
			}))
			h.ServeHTTP(httptest.NewRecorder(), post(tc.body))
			if string(got) != tc.body {
				t.Errorf("handler read %d bytes %.40q, want the %d bytes sent", len(got), got, len(tc.body))
			}
			if !ok {
				t.Fatal("no Result in the context")
			}
			// The first 64 bytes of the oversized body still carry the id.
			if strings.Contains(tc.name, "over") && res.ToolCallID != "c" {
				t.Errorf("ToolCallID = %q, want c", res.ToolCallID)
			}
		})
	}

	t.Run("read error reaches the handler after the same bytes", func(t *testing.T) {
		boom := errors.New("connection reset")
		r := post("")
		r.Body = io.NopCloser(io.MultiReader(strings.NewReader(`{"a":1`), errorReader{boom}))
		var got []byte
		var err error
		f.g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			got, err = io.ReadAll(r.Body)
		})).ServeHTTP(httptest.NewRecorder(), r)
		if string(got) != `{"a":1` || !errors.Is(err, boom) {
			t.Errorf("handler read %q, %v; want the bytes then %v", got, err, boom)
		}
	})
}

type errorReader struct{ err error }

func (e errorReader) Read([]byte) (int, error) { return 0, e.err }

func TestMiddlewareResult(t *testing.T) {
	tests := []struct {
		name         string
		mode         Mode
		body         string
		optIn        string
		wantDecision string
		wantTool     string
		wantOptIn    bool
		wantMin      float64
		wantMax      float64
	}{
		{"observe tool call", ModeObserve, toolBody, "", DecisionObserved, "call_abc", false, 0.6, 1},
		{"observe opt-in", ModeObserve, toolBody, "true", DecisionObserved, "call_abc", true, 0.6, 1},
		{"observe page body", ModeObserve, pageBody(9), "", DecisionPass, "", false, 0, 0.2},
		{"enforce before Admit", ModeEnforce, toolBody, "", DecisionPass, "call_abc", false, 0.6, 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, func(o *Options) { o.Mode = tc.mode })
			var res Result
			f.g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				res, _ = FromContext(r.Context())
			})).ServeHTTP(httptest.NewRecorder(), withHeader(post(tc.body), HeaderOptIn, tc.optIn))
			if res.Decision != tc.wantDecision || res.ToolCallID != tc.wantTool || res.OptIn != tc.wantOptIn {
				t.Errorf("Result = %+v; want decision %q, tool %q, opt-in %v", res, tc.wantDecision, tc.wantTool, tc.wantOptIn)
			}
			if res.Score < tc.wantMin || res.Score >= tc.wantMax {
				t.Errorf("score %.3f, want in [%.1f, %.1f)", res.Score, tc.wantMin, tc.wantMax)
			}
			if s, _ := Score([]byte(tc.body)); res.Score < s {
				t.Errorf("score %.3f below the body's own %.3f", res.Score, s)
			}
		})
	}
}

func withHeader(r *http.Request, k, v string) *http.Request {
	if v != "" {
		r.Header.Set(k, v)
	}
	return r
}

func TestMiddlewareDebugHeaders(t *testing.T) {
	tests := []struct {
		name        string
		serverDebug bool
		header      string
		want        bool
	}{
		{"debug server, debug request", true, "true", true},
		{"debug server, plain request", true, "", false},
		{"debug server, other value", true, "1", false},
		{"plain server, debug request", false, "true", false},
		{"plain server, plain request", false, "", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, func(o *Options) { o.Debug = tc.serverDebug; o.Mode = ModeEnforce })
			w := httptest.NewRecorder()
			h := f.g.Middleware(f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusAccepted)
			})))
			r := withHeader(post(`{"destination":"Lisbon","days":2}`), HeaderDebug, tc.header)
			h.ServeHTTP(w, r)
			for _, k := range []string{HeaderScore, HeaderVector, HeaderDecision} {
				if got := w.Header().Get(k) != ""; got != tc.want {
					t.Errorf("%s present = %v, want %v (headers %v)", k, got, tc.want, w.Header())
				}
			}
			if tc.want {
				if v := w.Header().Get(HeaderVector); strings.Count(v, ",") != dimCount-1 {
					t.Errorf("%s = %q, want %d values", HeaderVector, v, dimCount)
				}
				if d := w.Header().Get(HeaderDecision); d != DecisionPass {
					t.Errorf("%s = %q, want pass", HeaderDecision, d)
				}
			}
		})
	}
}

func TestMiddlewareOff(t *testing.T) {
	f := newFixture(t, func(o *Options) { o.Mode = ModeOff; o.Debug = true })
	var got []byte
	var ok bool
	w := httptest.NewRecorder()
	f.g.Middleware(f.g.Delay(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, _ = io.ReadAll(r.Body)
		_, ok = FromContext(r.Context())
	}))).ServeHTTP(w, withHeader(post(toolBody), HeaderDebug, "true"))
	if ok || string(got) != toolBody || w.Header().Get(HeaderScore) != "" {
		t.Errorf("off mode: Result present %v, body %q, score header %q", ok, got, w.Header().Get(HeaderScore))
	}
	if n := testutil.CollectAndCount(f.g.m.score); n != 0 {
		t.Errorf("off mode observed %d score series", n)
	}
}

func TestMiddlewareObserveCountsAndCallsBack(t *testing.T) {
	type call struct {
		path string
		res  Result
	}
	var calls []call
	f := newFixture(t, func(o *Options) {
		o.Observed = func(r *http.Request, res Result) { calls = append(calls, call{r.URL.Path, res}) }
	})
	h := f.g.Middleware(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	h.ServeHTTP(httptest.NewRecorder(), post(toolBody))
	h.ServeHTTP(httptest.NewRecorder(), post(pageBody(5)))

	if n, err := testutil.GatherAndCount(f.reg, "faregate_aitf_score"); err != nil || n != 1 {
		t.Errorf("score series = %d, %v; want 1 (route tasks)", n, err)
	}
	if got := testutil.ToFloat64(f.g.m.observed.WithLabelValues("tasks")); got != 1 {
		t.Errorf("observed_total = %v, want 1", got)
	}
	if len(calls) != 1 || calls[0].path != "/api/tasks" || calls[0].res.Decision != DecisionObserved ||
		calls[0].res.ToolCallID != "call_abc" || calls[0].res.Score < DefaultThreshold {
		t.Errorf("Observed calls = %+v, want one for the tool call body", calls)
	}
	if n := len(f.log.records); n != 0 {
		t.Errorf("%d log lines for two requests, want none: %q", n, f.log.lines(slog.LevelInfo))
	}

	t.Run("nil Observed", func(t *testing.T) {
		f := newFixture(t, nil)
		f.g.Middleware(http.NotFoundHandler()).ServeHTTP(httptest.NewRecorder(), post(toolBody))
		if got := testutil.ToFloat64(f.g.m.observed.WithLabelValues("tasks")); got != 1 || len(f.log.records) != 0 {
			t.Errorf("observed_total = %v, %d log lines; want 1 and none", got, len(f.log.records))
		}
	})
}

func TestScoreBucketLabels(t *testing.T) {
	f := newFixture(t, nil)
	f.g.Middleware(http.NotFoundHandler()).ServeHTTP(httptest.NewRecorder(), post(toolBody))
	var out strings.Builder
	mfs, err := f.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "faregate_aitf_score" {
			continue
		}
		for _, b := range mf.GetMetric()[0].GetHistogram().GetBucket() {
			out.WriteString(strconv.FormatFloat(b.GetUpperBound(), 'g', -1, 64) + " ")
		}
	}
	if got, want := out.String(), "0.1 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 1 "; got != want {
		t.Errorf("bucket bounds %q, want %q", got, want)
	}
}

// TestPageBodyWithBehaviour: a person submitting the page's form a few
// times a minute (a fresh Turnstile token each time, page polling between)
// stays well below 0.2 with the behaviour dimensions included.
func TestPageBodyWithBehaviour(t *testing.T) {
	f := newFixture(t, nil)
	var scores []float64
	h := f.g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if res, ok := FromContext(r.Context()); ok && r.Method == http.MethodPost {
			scores = append(scores, res.Score)
		}
	}))
	for i := range 5 {
		h.ServeHTTP(httptest.NewRecorder(), post(pageBody(100+i)))
		// The page then polls its task and follows events.
		for range 3 {
			f.clk.Advance(300 * time.Millisecond)
			h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/api/tasks/t_q2ZbX0c4mWq9vF3kT7hYpA", nil))
		}
		f.clk.Advance(12 * time.Second)
	}
	for i, s := range scores {
		if s >= 0.2 {
			t.Errorf("submission %d scores %.3f, want < 0.2", i+1, s)
		}
	}
	if len(scores) != 5 {
		t.Fatalf("%d scores recorded, want 5", len(scores))
	}
}

func TestMiddlewareBehaviourRaisesScore(t *testing.T) {
	tests := []struct {
		name string
		dim  int
		send func(h http.Handler, clk *clock)
	}{
		{"enumeration through the path", dimEnumeration, func(h http.Handler, clk *clock) {
			for _, id := range []string{"doc_78901", "doc_78903", "doc_78907", "doc_78910", "doc_78912"} {
				h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest(http.MethodGet, "/api/docs/"+id, nil))
				clk.Advance(3 * time.Second)
			}
		}},
		{"identical bodies", dimRepeat, func(h http.Handler, clk *clock) {
			for range 5 {
				h.ServeHTTP(httptest.NewRecorder(), post(`{"q":"lisbon"}`))
				clk.Advance(5 * time.Second)
			}
		}},
		{"burst", dimBurst, func(h http.Handler, clk *clock) {
			for i := range 12 {
				h.ServeHTTP(httptest.NewRecorder(), post(`{"q":"`+strings.Repeat("x", i)+`"}`))
				clk.Advance(50 * time.Millisecond)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, nil)
			var last Result
			h := f.g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				last, _ = FromContext(r.Context())
			}))
			tc.send(h, f.clk)
			if last.Vector[tc.dim] != 1 {
				t.Errorf("%s = %.2f, want 1 (vector %s)", Dimensions[tc.dim], last.Vector[tc.dim], last.Vector)
			}
			// One full behaviour signal alone is set to score 0.5.
			if last.Score < 0.49 || last.Score >= DefaultThreshold {
				t.Errorf("score %.3f, want about 0.5", last.Score)
			}
		})
	}
	t.Run("no visitor key, no behaviour", func(t *testing.T) {
		f := newFixture(t, func(o *Options) { o.VisitorKey = nil })
		var last Result
		h := f.g.Middleware(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			last, _ = FromContext(r.Context())
		}))
		for range 12 {
			h.ServeHTTP(httptest.NewRecorder(), post(`{"q":"lisbon"}`))
		}
		if last.Score != 0 || f.g.mem.Len() != 0 {
			t.Errorf("score %.3f, memory %d entries; want 0 and 0", last.Score, f.g.mem.Len())
		}
	})
}

func TestNewContext(t *testing.T) {
	want := Result{Score: 0.7, ToolCallID: "x", Decision: DecisionPass}
	got, ok := FromContext(NewContext(context.Background(), want))
	if !ok || got != want {
		t.Errorf("FromContext = %+v, %v; want %+v", got, ok, want)
	}
	if _, ok := FromContext(context.Background()); ok {
		t.Error("empty context has a Result")
	}
}

func TestTwoGuardsShareARegistry(t *testing.T) {
	reg := prometheus.NewRegistry()
	a := New(Options{Registerer: reg})
	b := New(Options{Registerer: reg})
	for _, g := range []*Guard{a, b} {
		g.Middleware(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})).ServeHTTP(httptest.NewRecorder(), post(toolBody))
	}
	if got := testutil.ToFloat64(a.m.observed.WithLabelValues("other")); got != 2 {
		t.Errorf("shared observed_total = %v, want 2", got)
	}
}
