package api

import (
	"context"
	"encoding/json"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"faregate/agent/plancache"
	"faregate/protect/budget"
	"faregate/protect/principal"
	"faregate/protect/turnstile"
)

// admissionReadme finds the numbered list under "How a task is admitted" in
// the README that holds it (the repository's, or the operator's manual once
// the README is split), and returns each step's name: its leading bold text,
// or the text before its colon.
func admissionReadme(t *testing.T) []string {
	t.Helper()
	for _, path := range []string{"../README.md", "../cmd/faregate/README.md"} {
		raw, err := os.ReadFile(path)
		if err != nil {
			continue
		}
		_, section, ok := strings.Cut(string(raw), "\n## How a task is admitted\n")
		if !ok {
			continue
		}
		if i := strings.Index(section, "\n## "); i >= 0 {
			section = section[:i]
		}
		item := regexp.MustCompile(`(?m)^(\d+)\. (.*)$`)
		bold := regexp.MustCompile(`^\*\*([^*]+)\*\*`)
		var names []string
		for i, m := range item.FindAllStringSubmatch(section, -1) {
			if m[1] != strconv.Itoa(i+1) {
				t.Fatalf("%s: step %s is numbered out of order (expected %d)", path, m[1], i+1)
			}
			if b := bold.FindStringSubmatch(m[2]); b != nil {
				names = append(names, b[1])
				continue
			}
			name, _, _ := strings.Cut(m[2], ":")
			names = append(names, strings.TrimSpace(name))
		}
		return names
	}
	t.Fatal("no README holds a \"How a task is admitted\" section")
	return nil
}

// TestAdmissionOrderDocumented: the README's numbered list of POST
// /api/tasks is exactly the order the server runs (front steps, the checks
// that can refuse, the tail), and the OpenAPI description names the same
// steps in the same order. A check added to createChecks fails this test
// until both documents say where it runs.
func TestAdmissionOrderDocumented(t *testing.T) {
	s := &server{}
	order := s.admissionOrder()
	if got := admissionReadme(t); !slices.Equal(got, order) {
		t.Errorf("README's admission order:\n  %q\nthe server's (api/admission.go createChecks):\n  %q", got, order)
	}

	var doc struct {
		Paths map[string]map[string]json.RawMessage `json:"paths"`
	}
	var post struct {
		Description string `json:"description"`
	}
	raw, err := os.ReadFile("openapi.json")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(doc.Paths["/api/tasks"]["post"], &post); err != nil {
		t.Fatal(err)
	}
	desc := post.Description
	at := 0
	for _, name := range order {
		i := strings.Index(desc[at:], name)
		if i < 0 {
			t.Errorf("the OpenAPI description of POST /api/tasks does not name %q after position %d:\n%s", name, at, desc)
			return
		}
		at += i + len(name)
	}
}

// TestAdmissionChecks: every check has a name and a function, names are
// unique, a cached plan has one place to resume, and the fallbacks are
// the two refusals the manual lets a cached plan answer.
func TestAdmissionChecks(t *testing.T) {
	s := &server{}
	list := s.createChecks()
	seen := map[string]bool{}
	resumes := 0
	var fallbacks []string
	for _, c := range list {
		if c.name == "" || c.run == nil || seen[c.name] {
			t.Errorf("check %q: empty, without a function, or named twice", c.name)
		}
		seen[c.name] = true
		if c.resume {
			resumes++
		}
		if c.fallback != nil {
			fallbacks = append(fallbacks, c.name)
		}
	}
	if resumes != 1 || resumeAt(list) != len(list)-1 {
		t.Errorf("%d resume points, at %d of %d: a cached plan must resume at the counting script, last", resumes, resumeAt(list), len(list))
	}
	if !slices.Equal(fallbacks, []string{"model health", "token and money budget"}) {
		t.Errorf("fallbacks %v", fallbacks)
	}
}

// countingLimiter records failed checks.
type countingLimiter struct {
	Limiter
	failed int
}

func (l *countingLimiter) RecordFailedCheck(context.Context, string, string, int64) (int64, time.Duration, error) {
	l.failed++
	return 1, 0, nil
}

// onePlan has a plan for every request.
type onePlan struct{}

func (onePlan) Get(context.Context, plancache.Request) (plancache.Plan, bool, error) {
	return plancache.Plan{Result: []byte(`{"summary":"cached"}`)}, true, nil
}

// TestAdmissionLoop: the loop runs the checks in order and stops at the
// first refusal, answering it once (nothing later runs); a 400 or 403
// counts as a failed check and other refusals do not; a public check is
// skipped for a key; a cached plan resumes at the counting script; a check
// whose client left is not answered.
func TestAdmissionLoop(t *testing.T) {
	lim := &countingLimiter{}
	s := &server{d: Deps{Limiter: lim, Limits: Limits{FailedChecksPerHour: 20}, PlanCache: onePlan{}, PlanCacheMode: plancache.ModeFallback},
		errors: newErrorTable(errorRows())}
	var ran []string
	step := func(name string, err error) func(*admission) error {
		return func(*admission) error { ran = append(ran, name); return err }
	}
	serve := func(kind string, list []check) (*httptest.ResponseRecorder, bool) {
		ran = nil
		st := &state{id: "req-1", principal: principal.Principal{Kind: kind, ID: "abc"}}
		r := httptest.NewRequest("POST", "/api/tasks", nil)
		r = r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
		w := httptest.NewRecorder()
		tailed := false
		s.admit(list, func(a *admission) { tailed = true; ran = append(ran, "tail") }).ServeHTTP(w, r)
		return w, tailed
	}

	for _, tc := range []struct {
		name   string
		kind   string
		list   []check
		ran    []string
		status int
		failed int
		tailed bool
	}{
		{"all pass", principal.KindVisitor, []check{{name: "a", run: step("a", nil)}, {name: "b", run: step("b", nil)}},
			[]string{"a", "b", "tail"}, 200, 0, true},
		{"refusal stops the order", principal.KindVisitor, []check{{name: "a", run: step("a", nil)},
			{name: "b", run: step("b", &retryError{ErrServerBusy, time.Second})}, {name: "c", run: step("c", nil)}},
			[]string{"a", "b"}, 503, 0, false},
		{"400 is a failed check", principal.KindVisitor, []check{{name: "a", run: step("a", invalid("days", "no"))}},
			[]string{"a"}, 400, 1, false},
		{"403 is a failed check", principal.KindVisitor, []check{{name: "a", run: step("a", turnstile.ErrRejected)}},
			[]string{"a"}, 403, 1, false},
		{"a key skips the public lane", principal.KindKey, []check{{name: "a", run: step("a", nil)},
			{name: "turnstile", run: step("turnstile", turnstile.ErrRejected), public: true}, {name: "c", run: step("c", nil)}},
			[]string{"a", "c", "tail"}, 200, 0, true},
		{"a cached plan resumes at the count", principal.KindVisitor, []check{{name: "cache", run: step("cache", errServeCached)},
			{name: "budget", run: step("budget", nil)}, {name: "count", run: step("count", nil), resume: true}},
			[]string{"cache", "count", "tail"}, 200, 0, true},
		{"a fallback refusal answered by a cached plan", principal.KindVisitor, []check{{name: "budget", run: step("budget", budget.ErrExhausted), fallback: budget.ErrExhausted},
			{name: "pacing", run: step("pacing", nil)}, {name: "count", run: step("count", nil), resume: true}},
			[]string{"budget", "count", "tail"}, 200, 0, true},
		{"another refusal of a fallback check is not", principal.KindVisitor, []check{{name: "budget", run: step("budget", budget.ErrUnavailable), fallback: budget.ErrExhausted},
			{name: "count", run: step("count", nil), resume: true}},
			[]string{"budget"}, 503, 0, false},
		{"client gone", principal.KindVisitor, []check{{name: "a", run: step("a", errGone)}, {name: "b", run: step("b", nil)}},
			[]string{"a"}, 200, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			lim.failed = 0
			w, tailed := serve(tc.kind, tc.list)
			if !slices.Equal(ran, tc.ran) || w.Code != tc.status || lim.failed != tc.failed || tailed != tc.tailed {
				t.Fatalf("ran %v, %d, failed checks %d, tail %v; want %v, %d, %d, %v", ran, w.Code, lim.failed, tailed, tc.ran, tc.status, tc.failed, tc.tailed)
			}
			if tc.status >= 400 && strings.Count(w.Body.String(), `"error"`) != 1 {
				t.Fatalf("answered %q", w.Body.String())
			}
		})
	}
}
