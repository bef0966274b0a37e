package api

import (
	"encoding/json"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
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
// the two refusals the contract lets a cached plan answer.
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
