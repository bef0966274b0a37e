package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/redis/go-redis/v9"

	"faregate/agent/tokens"
	"faregate/protect/kit/testkit/clocktest"
	"faregate/protect/kit/testkit/redistest"
)

// The exactness test of issue #21, through the real binary: many external
// tasks on two replicas sharing one redis-server, each agent (the official
// openai-go client, in this process) making concurrent streaming calls
// that each ask for far more output than the task can afford, against an
// upstream that streams exactly the output limit faregate sent it and
// reports exactly what it streamed. While it runs a sampler reads every
// budget counter in Redis and checks settled + outstanding − overage
// against the task, visitor and site caps at every sample; at the end the
// ledger's lines sum to the counters per task, visitor and site, the
// overage is 0, what the upstream streamed (what a provider bills) is what
// was settled, and every stream the client read ended well formed.

// exactScale is one run's size and caps. The visitors are "heavy"
// (enough tasks that the visitor's cap binds before their tasks' caps) and
// "light" (their tasks' caps bind first); the site cap is below what all
// of them would spend, so it binds too.
type exactScale struct {
	calls                   int // per task, all at once
	heavy, heavyTasks       int
	light, lightTasks       int
	maxTokens               int64 // FAREGATE_LLM_MAX_TOKENS
	taskCap, visitorCap     int64
	siteCap                 int64
	deadline, overallBudget time.Duration
	// kinds is the calls' kinds in turn: c chat (max_completion_tokens),
	// m chat (max_tokens), r Responses (max_output_tokens).
	kinds string
	// sequential: a task's calls one after another (to aim a call at a
	// remainder); else all at once.
	sequential bool
	// siteBinds: the visitors together ask for more than the site holds.
	siteBinds bool
	// hangUps: the agents hang up half their calls at a random point
	// (before the first event, or after some); underReport: the upstream
	// reports 0 tokens (prompt and output) for half its calls.
	hangUps, underReport bool
	// anthropic: the provider speaks Messages (FAREGATE_LLM_PROVIDER), the
	// agents' calls are kind a (exact_messages_test.go), priced with
	// cache prices.
	anthropic bool
}

func (s exactScale) tasks() int { return s.heavy*s.heavyTasks + s.light*s.lightTasks }

// TestExactSmall is the exactness test at a size plain `go test` runs in
// seconds: 6 tasks × 4 streaming calls on 2 replicas.
func TestExactSmall(t *testing.T) {
	exactRun(t, exactScale{calls: 4, heavy: 1, heavyTasks: 4, light: 2, lightTasks: 1,
		maxTokens: 200, taskCap: 500, visitorCap: 900, siteCap: 1800,
		deadline: 60 * time.Second, overallBudget: 90 * time.Second, kinds: "rcrm", siteBinds: true})
}

// TestExactSoak is the full size (FAREGATE_SOAK=1, run by .ci/run):
// 50 tasks × 10 streaming calls on 2 replicas, all at once, the agents
// hanging up half their calls at random points and the upstream reporting
// 0 tokens for half its answers.
func TestExactSoak(t *testing.T) {
	if os.Getenv("FAREGATE_SOAK") != "1" {
		t.Skip("set FAREGATE_SOAK=1 for the soak tests (.ci/run does)")
	}
	exactRun(t, exactScale{calls: 10, heavy: 5, heavyTasks: 8, light: 5, lightTasks: 2,
		maxTokens: 200, taskCap: 1000, visitorCap: 3000, siteCap: 24000,
		deadline: 180 * time.Second, overallBudget: 240 * time.Second, kinds: "rcrm", siteBinds: true,
		hangUps: true, underReport: true})
}

// TestExactHostile is TestExactSmall with the soak's hostile agents and
// upstream: half the calls hung up at a random point, half the answers
// reported as 0 tokens. Every call that reached the upstream is charged
// what it streamed (the agent's hang-up read on to the end, the report
// below faregate's count raised to it), and the caps hold at every sample.
func TestExactHostile(t *testing.T) {
	exactRun(t, exactScale{calls: 4, heavy: 1, heavyTasks: 4, light: 2, lightTasks: 1,
		maxTokens: 200, taskCap: 500, visitorCap: 900, siteCap: 1800,
		deadline: 60 * time.Second, overallBudget: 90 * time.Second, kinds: "rcrm", siteBinds: true,
		hangUps: true, underReport: true})
}

// TestExactResponsesFloor makes one task's calls one after another: a
// Responses stream at FAREGATE_LLM_MAX_TOKENS (200), then a Responses
// stream when the task's remainder affords its prompt and 8 output tokens,
// then a chat stream on that remainder. OpenAI refuses max_output_tokens
// under 16, so faregate cannot send 8: the second call must be reserved
// (and so refused) at 16, not sent with 16 while holding 8, which lets an
// honest provider stream, and bill, 8 tokens past the task's cap. The chat
// call then takes the 8 and ends with finish_reason "length": the task's
// cap is spent exactly.
func TestExactResponsesFloor(t *testing.T) {
	p := exactPromptTokens("gpt-4o-mini")
	res := exactRun(t, exactScale{calls: 3, heavy: 1, heavyTasks: 1, maxTokens: 200,
		taskCap: p[0] + 200 + p[2] + 8, visitorCap: 10000, siteCap: 20000,
		deadline: 60 * time.Second, overallBudget: 90 * time.Second, kinds: "rrc", sequential: true})
	want := map[int]string{0: "responses 200", 1: "responses refused", 2: "chat 8"}
	for _, r := range res {
		got := fmt.Sprintf("%s %d", r.kind, r.completion)
		if r.refused {
			got = r.kind + " refused"
		}
		if got != want[r.call] {
			t.Errorf("call %d: %s, want %s", r.call, got, want[r.call])
		}
	}
}

// exactPrompt is call i's prompt: the same few tokens for every task (the
// task's id travels in an extra field the upstream reads), so a test can
// aim a call at a remainder.
func exactPrompt(i int) string { return fmt.Sprintf("Call %d: write as long as you can.", i) }

// exactPromptTokens is what faregate and the upstream count for the first
// prompts (one user message; the same for chat and Responses).
func exactPromptTokens(model string) []int64 {
	var out []int64
	for i := range 10 {
		out = append(out, tokens.ForModel(model).Chat([]tokens.Message{{Role: "user", Content: exactPrompt(i)}}, ""))
	}
	return out
}

// exactRun runs sc and checks it; it returns what the clients read.
func exactRun(t *testing.T, sc exactScale) []exactResult {
	redistest.Require(t)
	be := redistest.Private(t) // KEYS over the whole store: a redis-server of its own
	const model = "gpt-4o-mini"
	up := newExactUpstream(t, model)
	up.underReport = sc.underReport
	ag := newExactAgent(t, sc, model)
	ag.up = up
	n := sc.tasks()
	env := realRedisEnv(be.URL, map[string]string{
		"FAREGATE_AGENT_URL": ag.srv.URL, "FAREGATE_AGENT_SECRET": agentSecret,
		"FAREGATE_AGENT_TIMEOUT": sc.deadline.String(),
		// Every task runs at once on whichever replica claims it, and
		// every call of a task is in flight at once.
		"FAREGATE_AGENT_CONCURRENCY": strconv.Itoa(n), "FAREGATE_AGENT_MAX_PARALLEL": strconv.Itoa(sc.calls),
		"FAREGATE_AGENT_MAX_CALLS": strconv.Itoa(sc.calls),
		"FAREGATE_LLM_BASE_URL":    up.srv.URL + "/v1", "FAREGATE_LLM_MODEL": model, "FAREGATE_LLM_API_KEY": "sk-upstream",
		"FAREGATE_LLM_MAX_TOKENS":   strconv.FormatInt(sc.maxTokens, 10),
		"FAREGATE_TASK_TOKEN_LIMIT": strconv.FormatInt(sc.taskCap, 10), "FAREGATE_IP_DAILY_TOKENS": strconv.FormatInt(sc.visitorCap, 10),
		"FAREGATE_DAILY_TOKEN_BUDGET": strconv.FormatInt(sc.siteCap, 10),
		"FAREGATE_TRUSTED_PROXIES":    "127.0.0.1", "FAREGATE_IP_DAILY_LIMIT": "100", "FAREGATE_GLOBAL_DAILY_LIMIT": "1000",
		"FAREGATE_QUEUE_MAX": "1000", "FAREGATE_LOG_LEVEL": "warn",
		// Exactness, not speed: a busy machine under -race must not turn
		// a slow Redis answer into a refusal.
		"FAREGATE_REDIS_TIMEOUT": "20s",
	})
	if sc.anthropic {
		env["FAREGATE_LLM_PROVIDER"], env["FAREGATE_MODEL_PRICES"] = "anthropic", model+"="+exactMessagesPrices
		env["FAREGATE_DAILY_SPEND_LIMIT"] = "1000"
	}
	a, b := startServer(t, env), startServer(t, env)
	ag.replicas = []string{a.URL, b.URL}
	t.Logf("caps: task %d, visitor %d, site %d tokens; FAREGATE_LLM_MAX_TOKENS=%d; %d tasks (%d visitors × %d, %d × %d) × %d calls; "+
		"FAREGATE_AGENT_CONCURRENCY=%d FAREGATE_AGENT_MAX_PARALLEL=%d FAREGATE_AGENT_MAX_CALLS=%d",
		sc.taskCap, sc.visitorCap, sc.siteCap, sc.maxTokens, n, sc.heavy, sc.heavyTasks, sc.light, sc.lightTasks, sc.calls,
		n, sc.calls, sc.calls)

	sampler := startExactSampler(be.Client, sc)
	defer sampler.stop()

	// Create every task (alternating replicas) before any call is made:
	// the agents wait until all are delivered, so the site cap cannot
	// refuse an admission and every call competes at once.
	visitorOf := map[string]string{}
	var ids []string
	vi := 0
	addVisitor := func(tasks int) {
		ip := fmt.Sprintf("2001:db8:e%x::1", vi)
		vi++
		for range tasks {
			base := ag.replicas[len(ids)%2]
			r := do(t, "POST", base+"/api/tasks",
				fmt.Sprintf(`{"turnstile_token":"XXXX.DUMMY.TOKEN.XXXX","prompt":"Write at length, task %d."}`, len(ids)),
				map[string]string{"X-Forwarded-For": ip})
			if r.Status != 202 {
				t.Fatalf("create task %d of visitor %s: %d %s", len(ids), ip, r.Status, r.Raw)
			}
			id := r.Body["id"].(string)
			ids, visitorOf[id] = append(ids, id), ip
		}
	}
	for range sc.heavy {
		addVisitor(sc.heavyTasks)
	}
	for range sc.light {
		addVisitor(sc.lightTasks)
	}
	started := time.Now()
	for i, id := range ids {
		got, ok := pollTask(t, ag.replicas[(i+1)%2], id, sc.overallBudget, func(m map[string]any) bool {
			return m["status"] == "succeeded" || m["status"] == "failed"
		})
		if !ok || got["status"] != "succeeded" {
			t.Fatalf("task %s: %v", id, got)
		}
	}
	took := time.Since(started)
	ag.wait()
	// A call its agent hung up on is read on to its end, which may come
	// after its task ended: the run is over once nothing is reserved and
	// every call the upstream served is on the ledger.
	if !clocktest.Poll(30*time.Second, func() bool {
		snap, err := exactSample(context.Background(), be.Client, sc)
		if err != nil {
			return false
		}
		for _, c := range snap.counters {
			if c.outstanding != 0 {
				return false
			}
		}
		return len(up.snapshot()) == exactLedgerLen(be.Client)
	}) {
		t.Errorf("30 s after the last task: reservations outstanding, or upstream calls not on the ledger")
	}
	sampler.stop()

	// What the sampler saw while the calls ran.
	s := sampler // read after stop
	for _, v := range s.violations {
		t.Errorf("sampled bound broken: %s", v)
	}
	if s.samples < 3 {
		t.Errorf("only %d samples taken", s.samples)
	}
	final, err := exactSample(context.Background(), be.Client, sc)
	if err != nil {
		t.Fatal(err)
	}
	for _, v := range final.violations {
		t.Errorf("final bound broken: %s", v)
	}

	// The ledger against the counters, per task, visitor and site.
	led := exactReadLedger(t, be.Client)
	if sc.anthropic {
		exactMessagesCosts(t, led)
	}
	principalOf := map[string]string{} // task → principal, from the ledger
	for _, e := range led.lines {
		if p, ok := principalOf[e.task]; ok && p != e.principal {
			t.Fatalf("task %s on the ledger under two principals %s and %s", e.task, p, e.principal)
		}
		principalOf[e.task] = e.principal
		if e.overage != 0 {
			t.Errorf("ledger line of task %s: overage %d", e.task, e.overage)
		}
	}
	visitorPrincipal := map[string]string{}
	for task, p := range principalOf {
		v := visitorOf[task]
		if v == "" {
			t.Fatalf("ledger line of a task this test did not create: %s", task)
		}
		if q, ok := visitorPrincipal[v]; ok && q != p {
			t.Fatalf("one visitor's tasks under two principals: %s, %s", q, p)
		}
		visitorPrincipal[v] = p
	}
	if len(visitorPrincipal) != sc.heavy+sc.light {
		t.Errorf("%d principals on the ledger, want one per visitor (%d)", len(visitorPrincipal), sc.heavy+sc.light)
	}
	for key, c := range final.counters {
		want, ok := led.sums[key]
		if exactClass(key) == "tier" {
			// One tier (public): its counter is the site's.
			want, ok = led.sums[key[:strings.Index(key, "|")+1]+"site"]
		}
		if !ok && c.settled == 0 {
			continue
		}
		if c.settled != want {
			t.Errorf("%s: settled %d, the ledger sums to %d", key, c.settled, want)
		}
		if c.outstanding != 0 || c.overage != 0 {
			t.Errorf("%s after the run: outstanding %d, overage %d, want 0 and 0", key, c.outstanding, c.overage)
		}
	}
	for key, sum := range led.sums {
		if _, ok := final.counters[key]; !ok {
			t.Errorf("the ledger sums %d for %s, which has no counter", sum, key)
		}
	}

	// What the upstream streamed is what was settled, call by call summed
	// per task: a provider bills what it generated.
	upCalls := up.snapshot()
	billed := map[string]int64{}
	for _, c := range upCalls {
		billed[c.task] += c.prompt + c.generated
		if c.limit > sc.maxTokens {
			t.Errorf("upstream asked for %d output tokens, above FAREGATE_LLM_MAX_TOKENS=%d", c.limit, sc.maxTokens)
		}
	}
	if len(upCalls) != len(led.lines) {
		t.Errorf("%d upstream calls, %d ledger lines: want one line per call", len(upCalls), len(led.lines))
	}
	for _, id := range ids {
		settled := final.byTask[id]
		if billed[id] != settled {
			t.Errorf("task %s: the upstream streamed (billed) %d tokens, faregate settled %d", id, billed[id], settled)
		}
		if billed[id] > sc.taskCap {
			t.Errorf("task %s: the upstream streamed %d tokens, above the task cap %d", id, billed[id], sc.taskCap)
		}
	}

	// The client's side: every stream well formed, every refusal the
	// budget's, the usage it was told equal to what the ledger charged,
	// and every call charged at least what the client read of it.
	res := ag.snapshot()
	for i := range res {
		// A call hung up on early may have been served after the agent
		// left: ask the upstream now that every call is over.
		res[i].under = up.wasUnder(res[i].task, res[i].call)
	}
	streams, refused, abandoned, closed, under, cutChat, cutResp, clientSum := exactClientChecks(t, res, led)
	if streams+refused+abandoned != n*sc.calls {
		t.Errorf("%d streams + %d refusals + %d hung up, want %d calls", streams, refused, abandoned, n*sc.calls)
	}
	if streams+abandoned != len(led.lines) {
		t.Errorf("%d streams read by the clients and %d hung up after their first event, %d ledger lines", streams, abandoned, len(led.lines))
	}
	if refused == 0 && sc.siteBinds {
		t.Errorf("no call was refused: the caps did not bind")
	}
	if sc.hangUps && abandoned == 0 || sc.underReport && under == 0 {
		t.Errorf("%d calls hung up, %d under-reported: the hostile cases did not happen", abandoned, under)
	}

	// How close each kind of cap came (the site must have bound: all the
	// visitors together ask for more than it holds).
	var siteUsed, outstanding, overage int64
	for key, c := range final.counters {
		if strings.HasSuffix(key, "|site") {
			siteUsed += c.settled
		}
		outstanding += c.outstanding
		overage += c.overage
	}
	if sc.siteBinds && siteUsed < sc.siteCap-sc.maxTokens && len(final.days) == 1 {
		t.Errorf("the site settled %d of its cap %d: it did not bind", siteUsed, sc.siteCap)
	}
	t.Logf("run: %d tasks done in %v; %d calls: %d streams ended well formed (%d chat finish_reason length, %d response.incomplete), %d refused demo_budget_exhausted, %d hung up by the agent (%d while faregate relayed: client_closed), %d reported as 0 by the upstream",
		n, took.Round(time.Millisecond), n*sc.calls, streams, cutChat, cutResp, refused, abandoned, closed, under)
	t.Logf("sampled %d times: max settled+outstanding−overage task %d/%d, visitor %d/%d, site %d/%d; overage seen %d",
		s.samples, s.max["task"], sc.taskCap, s.max["p"], sc.visitorCap, s.max["site"], sc.siteCap, s.overage)
	t.Logf("final: site settled %d/%d; max task %d/%d (%d tasks at their cap), max visitor %d/%d (%d visitors at their cap); outstanding %d, overage %d in all scopes",
		siteUsed, sc.siteCap, final.max["task"], sc.taskCap, final.atCap("task", sc.taskCap, 2*sc.maxTokens/10),
		final.max["p"], sc.visitorCap, final.atCap("p", sc.visitorCap, 2*sc.maxTokens/10), outstanding, overage)
	if t.Failed() {
		// What the replicas warned of says why (a settle that failed, a
		// lease that lapsed).
		for i, srv := range []*server{a, b} {
			n := 0
			for _, line := range strings.Split(srv.Out.String(), "\n") {
				if strings.Contains(line, `"level":"WARN"`) || strings.Contains(line, `"level":"ERROR"`) {
					if n++; n <= 20 {
						t.Logf("replica %d: %s", i, line)
					}
				}
			}
		}
	}
	t.Logf("ledger: %d lines summing to %d tokens (= site counter %d, = what the upstream streamed %d; %d of them told to the clients that read their usage); per task and per visitor sums equal their counters",
		len(led.lines), led.total, siteUsed, exactSum(billed), clientSum)
	return res
}

// exactClientChecks checks what the clients read against the ledger, by
// request id: a stream read whole and honestly reported was told what it
// was charged; every stream, hung up or under-reported, was charged at
// least its prompt and what the client read of it. It returns the counts
// of each kind of call (closed: hung up while faregate was still relaying)
// and the tokens the clients were told.
func exactClientChecks(t *testing.T, res []exactResult, led exactLedger) (streams, refused, abandoned, closed, under, cutChat, cutResp int, told int64) {
	t.Helper()
	for _, r := range res {
		line, onLedger := led.byRequest[r.requestID]
		switch {
		case r.err != "":
			t.Errorf("task %s call %d (%s): %s", r.task, r.call, r.kind, r.err)
			continue
		case r.refused:
			refused++
			continue
		case r.abandoned:
			abandoned++
		default:
			streams++
			if r.kind == "responses" {
				cutResp++
			} else {
				cutChat++
			}
		}
		if r.under {
			under++
		}
		if !onLedger {
			t.Errorf("task %s call %d (%s, request %q): no ledger line", r.task, r.call, r.kind, r.requestID)
			continue
		}
		if line.tokens < r.read {
			t.Errorf("task %s call %d: charged %d tokens, the client read %d", r.task, r.call, line.tokens, r.read)
		}
		if !r.abandoned && !r.under {
			told += r.prompt + r.completion
			if line.tokens != r.prompt+r.completion {
				t.Errorf("task %s call %d: told %d tokens, charged %d", r.task, r.call, r.prompt+r.completion, line.tokens)
			}
		}
		// A hang-up after the whole stream was written (into the socket's
		// buffers) is a call that ended well; one before says client_closed.
		if r.abandoned && line.outcome == "client_closed" {
			closed++
		}
	}
	return
}

func exactSum(m map[string]int64) int64 {
	var s int64
	for _, v := range m {
		s += v
	}
	return s
}

// ---- the upstream ----

// exactUpstream streams chat completions and Responses token by token:
// exactly the output limit it was sent (one vocabulary token per piece),
// then the usage it streamed, prompt counted with the model's tokenizer.
type exactUpstream struct {
	t       testing.TB
	srv     *httptest.Server
	counter tokens.Counter
	words   []string
	// underReport: every second call served reports 0 tokens (underOf).
	underReport bool

	mu      sync.Mutex
	calls   []exactUpCall
	served  int
	underOf map[string]bool // by task and call, what the upstream chose
}

// exactUpCall is one call as the upstream served it: generated is what it
// streamed (what a provider bills), counted as each piece is generated.
type exactUpCall struct {
	task, kind               string
	prompt, limit, generated int64
	// under: the usage reported is 0 tokens, prompt and output.
	under bool
}

// reported is what the call's usage says: what it used, or 0 for an
// under-reported call.
func (c *exactUpCall) reported() (prompt, output int64) {
	if c.under {
		return 0, 0
	}
	return c.prompt, c.generated
}

func newExactUpstream(t testing.TB, model string) *exactUpstream {
	u := &exactUpstream{t: t, counter: tokens.ForModel(model), underOf: map[string]bool{}}
	if !u.counter.Known() {
		t.Fatalf("no tokenizer for %s", model)
	}
	// Words that are one token each with their leading space: a stream of
	// them is as many tokens as pieces, by the provider's count and by
	// faregate's.
	for _, w := range strings.Fields("the and of to in is it that for on with as was at by be this from or an are not but have had one all were they can there more also time will when some if out so no only up into about") {
		if u.counter.Count(" "+w) == 1 {
			u.words = append(u.words, " "+w)
		}
	}
	if len(u.words) < 20 {
		t.Fatalf("only %d one-token words", len(u.words))
	}
	u.srv = httptest.NewServer(http.HandlerFunc(u.serve))
	t.Cleanup(u.srv.Close)
	return u
}

// chooseUnder says whether the upstream reports 0 tokens for call i of
// task id, which it is about to serve: every second call it serves. The
// choice is made where a call is sure to be served, not by the agent
// before it calls: a choice made beforehand could fall only on calls the
// caps then refuse, and a run would have no hostile case to check.
func (u *exactUpstream) chooseUnder(id string, i int) bool {
	if !u.underReport {
		return false
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	u.served++
	under := u.served%2 == 0
	u.underOf[fmt.Sprintf("%s/%d", id, i)] = under
	return under
}

// wasUnder says whether the upstream reported 0 tokens for call i of
// task id (false for a call it never served).
func (u *exactUpstream) wasUnder(id string, i int) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.underOf[fmt.Sprintf("%s/%d", id, i)]
}

func (u *exactUpstream) snapshot() []exactUpCall {
	u.mu.Lock()
	defer u.mu.Unlock()
	return append([]exactUpCall(nil), u.calls...)
}

type exactUpRequest struct {
	Model    string `json:"model"`
	Stream   bool   `json:"stream"`
	Messages []struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	} `json:"messages"`
	Task                string `json:"exact_task"` // the agent's extra fields, passed through
	Call                int    `json:"exact_call"`
	Instructions        string `json:"instructions"`
	Input               string `json:"input"`
	MaxTokens           *int64 `json:"max_tokens"`
	MaxCompletionTokens *int64 `json:"max_completion_tokens"`
	MaxOutputTokens     *int64 `json:"max_output_tokens"`
	StreamOptions       struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

func (u *exactUpstream) serve(w http.ResponseWriter, r *http.Request) {
	var kind string
	switch r.URL.Path {
	case "/v1/chat/completions":
		kind = "chat"
	case "/v1/responses":
		kind = "responses"
	case "/v1/messages":
		u.serveMessages(w, r)
		return
	default:
		http.NotFound(w, r)
		return
	}
	raw, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return // the caller cut the request before it was whole: nothing to serve
	}
	var req exactUpRequest
	if err := json.Unmarshal(raw, &req); err != nil || !req.Stream {
		u.t.Errorf("upstream: not a streaming request: %v %s", err, raw)
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	var limit int64 = -1
	for _, p := range []*int64{req.MaxTokens, req.MaxCompletionTokens, req.MaxOutputTokens} {
		if p != nil && (limit < 0 || *p < limit) {
			limit = *p
		}
	}
	if limit < 1 {
		u.t.Errorf("upstream: a call without an output limit: %s", raw)
		http.Error(w, "no limit", http.StatusBadRequest)
		return
	}
	var msgs []tokens.Message
	if kind == "chat" {
		for _, m := range req.Messages {
			msgs = append(msgs, tokens.Message{Role: m.Role, Content: m.Content})
		}
	} else {
		if req.Instructions != "" {
			msgs = append(msgs, tokens.Message{Role: "system", Content: req.Instructions})
		}
		msgs = append(msgs, tokens.Message{Role: "user", Content: req.Input})
	}
	if !strings.HasPrefix(req.Task, "t_") {
		u.t.Errorf("upstream: the agent's extra field did not pass through: %s", raw)
	}
	c := exactUpCall{task: req.Task, kind: kind, prompt: u.counter.Chat(msgs, ""), limit: limit,
		under: u.chooseUnder(req.Task, req.Call)}
	if kind == "chat" && !req.StreamOptions.IncludeUsage {
		u.t.Errorf("upstream: a chat stream without stream_options.include_usage")
	}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	send := func(event string, v any) bool {
		b, _ := json.Marshal(v)
		s := "data: " + string(b) + "\n\n"
		if event != "" {
			s = "event: " + event + "\n" + s
		}
		if _, err := io.WriteString(w, s); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	if kind == "chat" {
		u.streamChat(r.Context(), &c, req.Model, send, w)
	} else {
		u.streamResponses(r.Context(), &c, req.Model, send)
	}
	u.mu.Lock()
	u.calls = append(u.calls, c)
	u.mu.Unlock()
}

func (u *exactUpstream) word(i int64) string { return u.words[int(i*7)%len(u.words)] }

func (u *exactUpstream) streamChat(ctx context.Context, c *exactUpCall, model string, send func(string, any) bool, w io.Writer) {
	id := "chatcmpl-exact"
	chunk := func(choices any, usage any) map[string]any {
		m := map[string]any{"id": id, "object": "chat.completion.chunk", "created": 1764590000, "model": model, "choices": choices}
		if usage != nil {
			m["usage"] = usage
		}
		return m
	}
	if !send("", chunk([]any{map[string]any{"index": 0, "delta": map[string]any{"role": "assistant", "content": ""}, "finish_reason": nil}}, nil)) {
		return
	}
	for i := int64(0); i < c.limit; i++ {
		if ctx.Err() != nil {
			return
		}
		c.generated++
		if !send("", chunk([]any{map[string]any{"index": 0, "delta": map[string]any{"content": u.word(i)}, "finish_reason": nil}}, nil)) {
			return
		}
	}
	p, o := c.reported()
	_ = send("", chunk([]any{map[string]any{"index": 0, "delta": map[string]any{}, "finish_reason": "length"}}, nil)) &&
		send("", chunk([]any{}, map[string]any{"prompt_tokens": p, "completion_tokens": o, "total_tokens": p + o}))
	_, _ = io.WriteString(w, "data: [DONE]\n\n")
}

func (u *exactUpstream) streamResponses(ctx context.Context, c *exactUpCall, model string, send func(string, any) bool) {
	seq := 0
	ev := func(typ string, fields map[string]any) bool {
		fields["type"], fields["sequence_number"] = typ, seq
		seq++
		return send(typ, fields)
	}
	resp := func(status string) map[string]any {
		return map[string]any{"id": "resp_exact", "object": "response", "created_at": 1764590000, "model": model,
			"status": status, "output": []any{}}
	}
	item := map[string]any{"id": "msg_exact", "type": "message", "status": "in_progress", "role": "assistant", "content": []any{}}
	loc := func(m map[string]any) map[string]any {
		m["item_id"], m["output_index"], m["content_index"] = "msg_exact", 0, 0
		return m
	}
	if !ev("response.created", map[string]any{"response": resp("in_progress")}) ||
		!ev("response.output_item.added", map[string]any{"output_index": 0, "item": item}) ||
		!ev("response.content_part.added", loc(map[string]any{"part": map[string]any{"type": "output_text", "text": "", "annotations": []any{}}})) {
		return
	}
	var text strings.Builder
	for i := int64(0); i < c.limit; i++ {
		if ctx.Err() != nil {
			return
		}
		c.generated++
		text.WriteString(u.word(i))
		if !ev("response.output_text.delta", loc(map[string]any{"delta": u.word(i), "logprobs": []any{}})) {
			return
		}
	}
	part := map[string]any{"type": "output_text", "text": text.String(), "annotations": []any{}}
	done := map[string]any{"id": "msg_exact", "type": "message", "status": "incomplete", "role": "assistant", "content": []any{part}}
	final := resp("incomplete")
	final["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
	final["output"] = []any{done}
	p, o := c.reported()
	final["usage"] = map[string]any{"input_tokens": p, "input_tokens_details": map[string]any{"cached_tokens": 0},
		"output_tokens": o, "output_tokens_details": map[string]any{"reasoning_tokens": 0}, "total_tokens": p + o}
	_ = ev("response.output_text.done", loc(map[string]any{"text": text.String(), "logprobs": []any{}})) &&
		ev("response.content_part.done", loc(map[string]any{"part": part})) &&
		ev("response.output_item.done", map[string]any{"output_index": 0, "item": done}) &&
		ev("response.incomplete", map[string]any{"response": final})
}

// ---- the agents ----

// exactAgent answers every delivery: it waits until all tasks are
// delivered, then makes its task's calls at once through the official
// client (alternating replicas), and answers 200 with a result.
type exactAgent struct {
	t        testing.TB
	srv      *httptest.Server
	replicas []string
	sc       exactScale
	model    string

	mu        sync.Mutex
	delivered int
	all       chan struct{}
	results   []exactResult
	running   sync.WaitGroup
	// up tells which calls it reported as 0 tokens; started counts the
	// calls whose first event arrived (hangAt).
	up      *exactUpstream
	started atomic.Int64
}

// exactResult is one call as the client read it.
type exactResult struct {
	task, kind         string
	call               int
	requestID          string
	refused            bool
	prompt, completion int64 // the usage the client was told
	// read is the prompt (as the client was told it, or counted) and the
	// output tokens the client read; abandoned: the agent hung up on the
	// call; under: the upstream reported 0 tokens for it.
	read             int64
	abandoned, under bool
	err              string // why the call was not as it must be
}

// hangAt is the event after which the agent hangs up on call i of task id
// (-1: it reads the call to its end), chosen when the call's first event
// arrives: every second call that gets one, so that any run with two
// streams has a hang-up whichever calls the caps refused, at a point
// spread over the first 30 events. (FNV-1a's low bit is the parity of the
// bytes hashed, not a coin: the point is taken from higher bits.)
func (a *exactAgent) hangAt(id string, i int) int {
	if !a.sc.hangUps || a.started.Add(1)%2 == 1 {
		return -1
	}
	h := fnv.New32a()
	fmt.Fprintf(h, "%s/%d", id, i)
	return int(h.Sum32()>>8) % 30
}

// hanger is the test each event of call i of task id passes: true at the
// event after which the agent hangs up, chosen by hangAt when the first
// event arrives.
func (a *exactAgent) hanger(id string, i int) func(events int) bool {
	at := -1
	return func(events int) bool {
		if events == 0 {
			at = a.hangAt(id, i)
		}
		return events == at
	}
}

func newExactAgent(t testing.TB, sc exactScale, model string) *exactAgent {
	a := &exactAgent{t: t, sc: sc, model: model, all: make(chan struct{})}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *exactAgent) snapshot() []exactResult {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]exactResult(nil), a.results...)
}

// wait returns when every call has ended (the tasks succeeded, so their
// agents answered after their calls).
func (a *exactAgent) wait() { a.running.Wait() }

func (a *exactAgent) serve(w http.ResponseWriter, r *http.Request) {
	a.running.Add(1)
	defer a.running.Done()
	var d delivery
	if err := json.NewDecoder(r.Body).Decode(&d.Body); err != nil {
		a.t.Errorf("delivery: %v", err)
		return
	}
	a.mu.Lock()
	a.delivered++
	if a.delivered == a.sc.tasks() {
		close(a.all)
	}
	a.mu.Unlock()
	select {
	case <-a.all:
	case <-r.Context().Done():
		return
	}
	ctx, cancel := context.WithDeadline(r.Context(), d.Body.Task.Deadline)
	defer cancel()
	var wg sync.WaitGroup
	for i := range a.sc.calls {
		one := func() {
			res := a.call(ctx, d, i)
			a.mu.Lock()
			a.results = append(a.results, res)
			a.mu.Unlock()
		}
		if a.sc.sequential {
			one()
			continue
		}
		wg.Go(one)
	}
	wg.Wait()
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"result":{"text":"Written."}}`)
}

// call makes call i of the delivered task, of the kind sc.kinds gives
// it: a chat stream asking max_completion_tokens or max_tokens far above
// the task's cap, or a Responses stream asking max_output_tokens the same.
func (a *exactAgent) call(ctx context.Context, d delivery, i int) exactResult {
	base := a.replicas[i%2]
	id := d.Body.Task.ID
	c := openai.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey(d.Body.OpenAI.APIKey), option.WithMaxRetries(0),
		option.WithJSONSet("exact_task", id), option.WithJSONSet("exact_call", i))
	prompt := exactPrompt(i)
	const asked = 100000
	kind := a.sc.kinds[i%len(a.sc.kinds)]
	ctx, hangUp := context.WithCancel(ctx)
	defer hangUp()
	switch kind {
	case 'r':
		return a.responses(ctx, hangUp, c, id, i, prompt, asked)
	case 'a':
		return a.messages(ctx, hangUp, d, base, i, prompt, asked)
	}
	res := exactResult{task: id, kind: "chat", call: i}
	hangsUp := a.hanger(id, i)
	var hdr *http.Response
	p := openai.ChatCompletionNewParams{Model: d.Body.OpenAI.Model,
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage(prompt)},
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}}
	if kind == 'm' {
		p.MaxTokens = openai.Int(asked)
	} else {
		p.MaxCompletionTokens = openai.Int(asked)
	}
	stream := c.Chat.Completions.NewStreaming(ctx, p, option.WithResponseInto(&hdr))
	if hdr != nil {
		res.requestID = hdr.Header.Get("X-Request-Id")
	}
	var pieces, usageChunks int64
	var usage openai.CompletionUsage
	finish, lastFinish := "", false
	for events := 0; stream.Next(); events++ {
		if hangsUp(events) {
			// The agent hangs up: the provider has the prompt and goes on.
			hangUp()
			_ = stream.Close()
			res.abandoned, res.read = true, exactPromptTokens(a.model)[i]+pieces
			return res
		}
		ch := stream.Current()
		if len(ch.Choices) == 0 {
			if ch.Usage.TotalTokens > 0 {
				usageChunks++
				usage = ch.Usage
			}
			continue
		}
		if lastFinish {
			res.err = "content after the finish_reason chunk"
		}
		for _, choice := range ch.Choices {
			pieces += int64(strings.Count(choice.Delta.Content, " "))
			if choice.FinishReason != "" {
				finish, lastFinish = choice.FinishReason, true
			}
		}
	}
	if err := stream.Err(); err != nil {
		res.refused, res.err = exactRefusal(err, pieces)
		return res
	}
	res.read = exactPromptTokens(a.model)[i] + pieces
	// The stream ended: the upstream has made its choice.
	res.under = a.up.wasUnder(id, i)
	switch {
	case res.err != "":
	case finish != "length":
		res.err = fmt.Sprintf("finish_reason %q, want length", finish)
	case res.under:
		// The provider's usage chunk (0) is relayed as it came; what is
		// charged is checked against the ledger.
	case usageChunks != 1:
		res.err = fmt.Sprintf("%d usage chunks, want 1", usageChunks)
	case usage.CompletionTokens != pieces || usage.PromptTokens <= 0 || usage.TotalTokens != usage.PromptTokens+usage.CompletionTokens:
		res.err = fmt.Sprintf("usage %+v, read %d tokens", usage, pieces)
	}
	res.prompt, res.completion = usage.PromptTokens, usage.CompletionTokens
	return res
}

func (a *exactAgent) responses(ctx context.Context, hangUp context.CancelFunc, c openai.Client, id string, i int, prompt string, asked int64) exactResult {
	res := exactResult{task: id, kind: "responses", call: i}
	hangsUp := a.hanger(id, i)
	var hdr *http.Response
	stream := c.Responses.NewStreaming(ctx, responses.ResponseNewParams{Model: a.model,
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String(prompt)}, MaxOutputTokens: openai.Int(asked)},
		option.WithResponseInto(&hdr))
	if hdr != nil {
		res.requestID = hdr.Header.Get("X-Request-Id")
	}
	var pieces int64
	var seq int64 = -1
	var final responses.Response
	last := ""
	for events := 0; stream.Next(); events++ {
		if hangsUp(events) {
			hangUp()
			_ = stream.Close()
			res.abandoned, res.read = true, exactPromptTokens(a.model)[i]+pieces
			return res
		}
		ev := stream.Current()
		if ev.SequenceNumber <= seq && res.err == "" {
			res.err = fmt.Sprintf("sequence %d after %d", ev.SequenceNumber, seq)
		}
		seq, last = ev.SequenceNumber, ev.Type
		switch ev.Type {
		case "response.output_text.delta":
			pieces += int64(strings.Count(ev.Delta, " "))
		case "response.incomplete":
			final = ev.AsResponseIncomplete().Response
		}
	}
	if err := stream.Err(); err != nil {
		res.refused, res.err = exactRefusal(err, pieces)
		return res
	}
	res.read = exactPromptTokens(a.model)[i] + pieces
	res.under = a.up.wasUnder(id, i)
	switch {
	case res.err != "":
	case last != "response.incomplete":
		res.err = fmt.Sprintf("last event %q, want response.incomplete", last)
	case final.Status != "incomplete" || final.IncompleteDetails.Reason != "max_output_tokens":
		res.err = fmt.Sprintf("final status %q reason %q", final.Status, final.IncompleteDetails.Reason)
	case res.under:
	case final.Usage.OutputTokens != pieces || final.Usage.InputTokens <= 0 || final.OutputText() == "" ||
		int64(strings.Count(final.OutputText(), " ")) != pieces:
		res.err = fmt.Sprintf("usage %+v, read %d tokens, output %d pieces", final.Usage, pieces, strings.Count(final.OutputText(), " "))
	}
	res.prompt, res.completion = final.Usage.InputTokens, final.Usage.OutputTokens
	return res
}

// exactRefusal reads a call's error: the budget's 429 before any byte
// (what the client must get when the task, visitor or site cannot afford
// the call) is a refusal; anything else is a failure.
func exactRefusal(err error, pieces int64) (bool, string) {
	var apiErr *openai.Error
	if errors.As(err, &apiErr) && apiErr.StatusCode == 429 && apiErr.Code == "demo_budget_exhausted" && pieces == 0 &&
		apiErr.Response.Header.Get("X-Should-Retry") == "false" {
		return true, ""
	}
	return false, "error: " + err.Error()
}

// ---- the counters ----

// exactCounter is one budget scope's hash.
type exactCounter struct{ settled, outstanding, overage int64 }

type exactSnapshot struct {
	counters   map[string]exactCounter // by key
	byTask     map[string]int64        // settled, by task id
	days       map[string]bool
	max        map[string]int64 // of settled + outstanding − overage, by class
	violations []string
}

// atCap counts the scopes of class whose settled is within slack of cap.
func (s exactSnapshot) atCap(class string, limit, slack int64) int {
	n := 0
	for key, c := range s.counters {
		if exactClass(key) == class && c.settled >= limit-slack {
			n++
		}
	}
	return n
}

// exactClass is a budget key's scope class: site, tier, p (visitor),
// task, or "" for the keys that are not scope counters.
// exactName names a scope counter whatever slot its key is in: its day
// and what follows the hash tag (site, tier:…, p:…, task:…).
func exactName(key string) string {
	i, j := strings.Index(key, "{"), strings.Index(key, "}:")
	return key[i+1:i+11] + "|" + key[j+2:]
}

func exactClass(key string) string {
	if i := strings.Index(key, "|"); i >= 0 {
		key = "}:" + key[i+1:]
	}
	i := strings.Index(key, "}:")
	if i < 0 {
		return ""
	}
	rest := key[i+2:]
	switch {
	case rest == "site":
		return "site"
	case strings.HasPrefix(rest, "tier:"):
		return "tier"
	case strings.HasPrefix(rest, "p:"):
		return "p"
	case strings.HasPrefix(rest, "task:"):
		return "task"
	}
	return ""
}

// exactSample reads every scope counter (each hash atomically) and checks
// settled + outstanding − overage against its cap.
func exactSample(ctx context.Context, rdb *redis.Client, sc exactScale) (exactSnapshot, error) {
	s := exactSnapshot{counters: map[string]exactCounter{}, byTask: map[string]int64{}, days: map[string]bool{}, max: map[string]int64{}}
	keys, err := rdb.Keys(ctx, "faregate:budget:*").Result()
	if err != nil {
		return s, err
	}
	var scoped []string
	for _, k := range keys {
		if exactClass(k) != "" {
			scoped = append(scoped, k)
		}
	}
	cmds := make([]*redis.SliceCmd, len(scoped))
	_, err = rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range scoped {
			cmds[i] = p.HMGet(ctx, k, "settled", "outstanding", "overage")
		}
		return nil
	})
	if err != nil {
		return s, err
	}
	limit := map[string]int64{"site": sc.siteCap, "tier": sc.siteCap, "p": sc.visitorCap, "task": sc.taskCap}
	for i, k := range scoped {
		var v [3]int64
		for j, x := range cmds[i].Val() {
			if x != nil {
				v[j], _ = strconv.ParseInt(fmt.Sprint(x), 10, 64)
			}
		}
		c := exactCounter{settled: v[0], outstanding: v[1], overage: v[2]}
		s.counters[exactName(k)] = c
		class := exactClass(k)
		bound := c.settled + c.outstanding - c.overage
		s.max[class] = max(s.max[class], bound)
		if bound > limit[class] || c.settled+c.outstanding > limit[class] {
			s.violations = append(s.violations, fmt.Sprintf("%s: settled %d + outstanding %d − overage %d > cap %d",
				k, c.settled, c.outstanding, c.overage, limit[class]))
		}
		if c.overage != 0 {
			s.violations = append(s.violations, fmt.Sprintf("%s: overage %d", k, c.overage))
		}
		if class == "task" {
			s.byTask[k[strings.LastIndex(k, ":")+1:]] += c.settled
		}
		if j := strings.Index(k, "{"); j >= 0 {
			s.days[k[j+1:j+11]] = true
		}
	}
	return s, nil
}

// exactSampler samples the counters until stopped.
type exactSampler struct {
	done     chan struct{}
	finished chan struct{}
	once     sync.Once

	samples    int
	overage    int64
	max        map[string]int64
	violations []string
}

func startExactSampler(rdb *redis.Client, sc exactScale) *exactSampler {
	s := &exactSampler{done: make(chan struct{}), finished: make(chan struct{}), max: map[string]int64{}}
	go func() {
		defer close(s.finished)
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			snap, err := exactSample(context.Background(), rdb, sc)
			if err != nil {
				s.violations = append(s.violations, "sample: "+err.Error())
			}
			s.samples++
			for k, v := range snap.max {
				s.max[k] = max(s.max[k], v)
			}
			for _, c := range snap.counters {
				s.overage = max(s.overage, c.overage)
			}
			if len(s.violations) < 20 {
				s.violations = append(s.violations, snap.violations...)
			}
			select {
			case <-s.done:
				return
			case <-tick.C:
			}
		}
	}()
	return s
}

func (s *exactSampler) stop() {
	s.once.Do(func() { close(s.done) })
	<-s.finished
}

// ---- the ledger ----

type exactLine struct {
	task, principal    string
	requestID, outcome string
	tokens, overage    int64
	// What a line's cost is computed from, and the cost.
	prompt, completion, cacheWrite, cacheRead, cost int64
}

type exactLedger struct {
	lines []exactLine
	// sums of the lines' tokens by the counter key they must equal (task,
	// principal and site, per day).
	sums  map[string]int64
	total int64
	// byRequest is the lines by request id.
	byRequest map[string]exactLine
}

// exactLedgerLen is how many calls' lines the ledger holds, every day:
// not the records of what leases and direct reservations charged the
// day's scopes.
func exactLedgerLen(rdb *redis.Client) int {
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "faregate:usage:*").Result()
	if err != nil {
		return -1
	}
	n := 0
	for _, k := range keys {
		if rdb.Type(ctx, k).Val() != "stream" {
			continue // a stream's counters
		}
		msgs, err := rdb.XRange(ctx, k, "-", "+").Result()
		if err != nil {
			return -1
		}
		for _, m := range msgs {
			if _, record := m.Values["kind"]; !record {
				n++
			}
		}
	}
	return n
}

func exactReadLedger(t *testing.T, rdb *redis.Client) exactLedger {
	t.Helper()
	ctx := context.Background()
	keys, err := rdb.Keys(ctx, "faregate:usage:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(keys)
	l := exactLedger{sums: map[string]int64{}, byRequest: map[string]exactLine{}}
	for _, k := range keys {
		if rdb.Type(ctx, k).Val() != "stream" {
			continue // a stream's counters
		}
		// The day's stream and each principal bucket's: {<day>} or {<day>:b…}.
		day := k[strings.Index(k, "{")+1 : strings.Index(k, "{")+11]
		msgs, err := rdb.XRange(ctx, k, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range msgs {
			if _, record := m.Values["kind"]; record {
				continue // what a lease or a direct reservation charged the day's scopes
			}
			num := func(f string) int64 {
				n, err := strconv.ParseInt(fmt.Sprint(m.Values[f]), 10, 64)
				if err != nil {
					t.Fatalf("ledger %s field %s: %v (%v)", m.ID, f, m.Values[f], err)
				}
				return n
			}
			e := exactLine{task: fmt.Sprint(m.Values["task"]), principal: fmt.Sprint(m.Values["principal"]),
				requestID: fmt.Sprint(m.Values["request_id"]), outcome: fmt.Sprint(m.Values["outcome"]),
				tokens: num("prompt_tokens") + num("completion_tokens"), overage: num("overage_tokens"),
				prompt: num("prompt_tokens"), completion: num("completion_tokens"), cacheWrite: num("cache_creation_input_tokens"),
				cacheRead: num("cache_read_input_tokens"), cost: num("cost_micro")}
			l.lines = append(l.lines, e)
			l.byRequest[e.requestID] = e
			l.total += e.tokens
			for _, key := range []string{"task:" + e.task, "p:" + e.principal, "site"} {
				l.sums[day+"|"+key] += e.tokens
			}
		}
	}
	return l
}
