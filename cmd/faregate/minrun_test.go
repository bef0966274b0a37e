package main

import (
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Configuration that can never work (issue 19, item 19): a budget, tier or
// bucket too small for one minimal run refuses to start, naming the
// variable and the minimum; the minimum is exact (it starts and admits).

// startErr runs faregate on env and returns its output and run's error; it
// fails the test when the server listened.
func startErr(t *testing.T, env map[string]string) (string, error) {
	t.Helper()
	env = mergeEnv(map[string]string{"FAREGATE_ADDR": "127.0.0.1:0"}, env)
	var out syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := run(ctx, []string{"faregate"}, envOf(env), &out)
	if strings.Contains(out.String(), "listening on") {
		t.Fatalf("%v: it listened:\n%s", env, out.String())
	}
	return out.String(), err
}

var wantAtLeast = regexp.MustCompile(`want at least (\d+)`)

// minimumIn is the "want at least N" of the message about variable.
func minimumIn(t *testing.T, err error, variable string) int64 {
	t.Helper()
	if err == nil {
		t.Fatalf("%s: started", variable)
	}
	for _, line := range strings.Split(err.Error(), "\n") {
		if !strings.Contains(line, variable) {
			continue
		}
		m := wantAtLeast.FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("%s: no minimum named in %q", variable, line)
		}
		n, _ := strconv.ParseInt(m[1], 10, 64)
		return n
	}
	t.Fatalf("no line names %s:\n%v", variable, err)
	return 0
}

// TestStartRefusesBudgetsThatCanNeverHoldOneRun: with
// FAREGATE_LLM_MAX_TOKENS=200 one minimal run reserves about 2,100 tokens.
// A site budget, task limit, visitor budget or site bucket below that
// refuses to start, each named (all at once) with the minimum; at exactly
// the minimum it starts and a task is admitted. Before the fix a 1,000
// token site budget started silently and refused every task with "Today's
// model budget is used up" and a budget_exhausted alert, nothing spent.
func TestStartRefusesBudgetsThatCanNeverHoldOneRun(t *testing.T) {
	base := map[string]string{"FAREGATE_LLM_MAX_TOKENS": "200"}
	_, err := startErr(t, mergeEnv(base, map[string]string{"FAREGATE_DAILY_TOKEN_BUDGET": "1000",
		"FAREGATE_TASK_TOKEN_LIMIT": "999", "FAREGATE_IP_DAILY_TOKENS": "998", "FAREGATE_SITE_TOKENS_PER_MINUTE": "500"}))
	site := minimumIn(t, err, "FAREGATE_DAILY_TOKEN_BUDGET")
	if need := minRunTokens(t, base); site != need {
		t.Fatalf("the minimum named is %d, one minimal run reserves %d", site, need)
	}
	if got := minimumIn(t, err, "FAREGATE_TASK_TOKEN_LIMIT"); got != site {
		t.Errorf("task limit minimum %d, site minimum %d: one run is one run", got, site)
	}
	if got := minimumIn(t, err, "FAREGATE_IP_DAILY_TOKENS"); got != site {
		t.Errorf("visitor budget minimum %d, want %d", got, site)
	}
	if got := minimumIn(t, err, "FAREGATE_SITE_TOKENS_PER_MINUTE"); got != (site+1)/2 {
		t.Errorf("site bucket minimum %d, want %d (it holds twice its rate)", got, (site+1)/2)
	}
	t.Logf("refused:\n%v", err)

	// One token short of the minimum: still refused; at it: starts and admits.
	n := strconv.FormatInt(site, 10)
	if _, err := startErr(t, mergeEnv(base, map[string]string{"FAREGATE_DAILY_TOKEN_BUDGET": strconv.FormatInt(site-1, 10)})); err == nil {
		t.Fatal("one token below the minimum started")
	}
	s := startServer(t, mergeEnv(base, map[string]string{"FAREGATE_DAILY_TOKEN_BUDGET": n, "FAREGATE_TASK_TOKEN_LIMIT": n,
		"FAREGATE_IP_DAILY_TOKENS": n, "FAREGATE_SITE_TOKENS_PER_MINUTE": strconv.FormatInt((site+1)/2, 10)}))
	if r := postTask(t, s.URL, "Rome", nil); r.Status != 202 {
		t.Fatalf("at exactly the minimum (%d tokens) a task is refused: %d %s", site, r.Status, r.Raw)
	}
}

// TestStartRefusesTiersThatCanNeverHoldOneRun: a policy file's tier whose
// tokens_per_day, token bucket or site share is below one run refuses to
// start naming the tier; a reload that makes a tier so small is refused
// (policy_reload_failed, the last good policy stays); and a spend limit
// below one run's cost refuses to start.
func TestStartRefusesTiersThatCanNeverHoldOneRun(t *testing.T) {
	acme := newAPIKey("acme")
	base := map[string]string{"FAREGATE_LLM_MAX_TOKENS": "200"}
	pf := newPolicyFile(t, "tiers:\n"+
		"  small: {tasks_per_day: 10, tokens_per_day: 500, requests_per_minute: 60}\n"+
		"  slow: {tasks_per_day: 10, tokens_per_day: 100000, tokens_per_minute: 100, requests_per_minute: 60}\n"+
		"  thin: {tasks_per_day: 10, tokens_per_day: 100000, requests_per_minute: 60, max_site_share: 0.001}\n"+
		"keys:\n"+acme.line("small"))
	_, err := startErr(t, mergeEnv(base, map[string]string{"FAREGATE_POLICY_FILE": pf.Path}))
	if err == nil {
		t.Fatal("started with tiers that can never hold one run")
	}
	for _, want := range []string{"tier small: tokens_per_day 500", "tier slow: tokens_per_minute 100", "tier thin: max_site_share 0.001"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal does not name %q:\n%v", want, err)
		}
	}

	// A good file, then a reload that shrinks a tier: refused, alerted, kept.
	good := "tiers:\n  small: {tasks_per_day: 10, tokens_per_day: 100000, requests_per_minute: 60}\nkeys:\n" + acme.line("small")
	pf.write(good)
	hook := newAlertReceiver(t, "hook-secret")
	s := startServer(t, mergeEnv(base, hook.env(), map[string]string{"FAREGATE_POLICY_FILE": pf.Path}))
	errs := metricValue(t, s.URL, "faregate_policy_reload_errors_total")
	pf.write(strings.Replace(good, "tokens_per_day: 100000", "tokens_per_day: 500", 1))
	pollUntil(t, 5*time.Second, "reload refused", func() bool {
		return metricValue(t, s.URL, "faregate_policy_reload_errors_total") > errs
	})
	if a := hook.waitEvent(t, "policy_reload_failed"); !strings.Contains(a.Text, "tier small: tokens_per_day 500") {
		t.Errorf("policy_reload_failed does not say why: %q", a.Text)
	}
	u := do(t, "GET", s.URL+"/api/usage", "", acme.auth())
	if got := u.Body["limits"].(map[string]any)["tokens_per_day"]; got != 100000.0 {
		t.Fatalf("after the refused reload the key's tokens_per_day is %v, want the last good 100000", got)
	}
	if r := do(t, "POST", s.URL+"/api/tasks", `{"destination":"Rome","days":1}`, acme.auth()); r.Status != 202 {
		t.Fatalf("key after the refused reload: %d %s", r.Status, r.Raw)
	}

	// Money: 0.000001 a day cannot pay one run at 10 per million tokens.
	_, err = startErr(t, mergeEnv(base, map[string]string{"FAREGATE_MODEL_PRICES": "offline-demo-planner=10/10", "FAREGATE_DAILY_SPEND_LIMIT": "0.000001"}))
	if err == nil || !strings.Contains(err.Error(), "FAREGATE_DAILY_SPEND_LIMIT=0.000001 can never hold one run") {
		t.Fatalf("spend limit below one run's cost: %v", err)
	}
}
