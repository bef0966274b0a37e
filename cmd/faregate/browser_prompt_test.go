package main

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"faregate/protect/kit/testkit/redistest"
	"faregate/web/browsertest"
)

// The prompt form end to end (#21 items 5 and 6): the real server with an
// external agent the test controls, a real redis-server and headless
// Chromium. The agent holds its answer until the page has shown each of its
// progress events, so the steps are proved live, not replayed at the end.

// promptMaxChars is FAREGATE_PROMPT_MAX_CHARS in these tests.
const promptMaxChars = 120

// promptFailMarker in a visitor's prompt makes the fake agent answer 500.
const promptFailMarker = "FAIL_WITH_500"

// promptAnswer is the agent's Markdown: the subset (heading, emphasis, a
// list, an http(s) link) and three doors to script that must stay shut.
const promptAnswer = "# Two days in Porto\n\n" +
	"Start at the **Ribeira** and walk *slowly* uphill.\n\n" +
	"- Livraria Lello, early\n" +
	"- [Tourist office](https://example.org/porto)\n" +
	"- [click](javascript:window.__pwned=3)\n\n" +
	"<script>window.__pwned=1</script>\n\n" +
	"<img src=x onerror=\"window.__pwned=2\">\n"

// promptTitle is the answer's title, markup that must stay text.
const promptTitle = "Porto <b onmouseover=\"window.__pwned=4\">fast</b>"

// promptSteps are the progress events the agent posts, one at a time,
// each held until the page has shown it. They share a name, so the second
// finishes the step the first started.
var promptSteps = []struct {
	body string
	// shown is a JavaScript predicate on the step's row (r) that holds
	// once the page shows this event.
	shown string
}{
	{`{"name":"read_sources","status":"started"}`, `r.dataset.status === 'started'`},
	{`{"name":"read_sources","status":"ok","detail":"2 pages read"}`,
		`r.dataset.status === 'ok' && r.querySelector('.step-detail') !== null && r.querySelector('.step-detail').textContent === '2 pages read'`},
}

// promptAgent is an external agent under the test's control: for every
// delivery it posts promptSteps to the task's events_url, waiting on seen
// after each, then answers promptAnswer (or 500 for promptFailMarker).
type promptAgent struct {
	t   *testing.T
	srv *httptest.Server
	// seen receives one value each time the test has seen a step on the page.
	seen chan struct{}
	// quit ends a wait when the test is over.
	quit chan struct{}

	mu         sync.Mutex
	deliveries []delivery
	prompts    []string
	posts      []int // statuses of the event posts
}

func newPromptAgent(t *testing.T) *promptAgent {
	a := &promptAgent{t: t, seen: make(chan struct{}), quit: make(chan struct{})}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	// Cleanups run last first: quit ends any wait, then the server closes.
	t.Cleanup(a.srv.Close)
	t.Cleanup(func() { close(a.quit) })
	return a
}

func (a *promptAgent) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	d := delivery{Raw: raw, Signature: r.Header.Get("X-Faregate-Signature")}
	if err := json.Unmarshal(raw, &d.Body); err != nil {
		http.Error(w, "bad delivery", http.StatusBadRequest)
		return
	}
	var req struct {
		Prompt string `json:"prompt"`
	}
	_ = json.Unmarshal(d.Body.Task.Request, &req)
	a.mu.Lock()
	a.deliveries = append(a.deliveries, d)
	a.prompts = append(a.prompts, req.Prompt)
	a.mu.Unlock()
	if strings.Contains(req.Prompt, promptFailMarker) {
		http.Error(w, "the agent broke", http.StatusInternalServerError)
		return
	}
	for _, step := range promptSteps {
		a.postEvent(d, step.body)
		select {
		case <-a.seen:
		case <-a.quit:
			return
		case <-r.Context().Done():
			return
		}
	}
	body, _ := json.Marshal(map[string]any{"result": map[string]any{"text": promptAnswer, "title": promptTitle}})
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(body)
}

// postEvent posts one progress event with the delivery's task key.
func (a *promptAgent) postEvent(d delivery, body string) {
	req, _ := http.NewRequest("POST", d.Body.EventsURL, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+d.Body.OpenAI.APIKey)
	status := 0
	if resp, err := http.DefaultClient.Do(req); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		status = resp.StatusCode
	}
	a.mu.Lock()
	a.posts = append(a.posts, status)
	a.mu.Unlock()
}

// delivered returns the deliveries and their prompts so far.
func (a *promptAgent) delivered() ([]delivery, []string, []int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]delivery(nil), a.deliveries...), append([]string(nil), a.prompts...), append([]int(nil), a.posts...)
}

// release tells the agent the page has shown its last event.
func (a *promptAgent) release(t *testing.T) {
	t.Helper()
	select {
	case a.seen <- struct{}{}:
	case <-time.After(browserWait):
		t.Fatal("the agent was not waiting for the page")
	}
}

// TestBrowserPromptForm: with FAREGATE_TASK_INPUT=prompt and an external
// agent, the page shows a text box instead of the trip form; the visitor's
// prompt reaches the agent signed; the agent's progress events appear on
// the page while it works; its Markdown answer is rendered in the safe
// subset with every script door inert; an over-long prompt and an agent's
// 500 get messages that speak of requests and tasks, not trips.
func TestBrowserPromptForm(t *testing.T) {
	b := browsertest.Start(t)
	redistest.Require(t)
	shots := artifactDir(t)
	rs := redistest.Start(t)
	agent := newPromptAgent(t)
	s := startServer(t, browserServerEnv(t, realRedisEnv(rs.URL(), map[string]string{
		"FAREGATE_AGENT_URL": agent.srv.URL, "FAREGATE_AGENT_SECRET": agentSecret, "FAREGATE_TASK_INPUT": "prompt",
		"FAREGATE_AGENT_TIMEOUT": "60s", "FAREGATE_PROMPT_MAX_CHARS": fmt.Sprint(promptMaxChars),
	})))

	t.Run("live steps and an inert markdown answer", func(t *testing.T) { promptLiveAnswer(t, b, shots, s, agent) })
	t.Run("over-long prompt", func(t *testing.T) { promptTooLong(t, b, shots, s, agent) })
	t.Run("agent answers 500", func(t *testing.T) { promptAgentFailed(t, b, shots, s, agent) })
}

// promptOpen opens the page and checks that it shows the prompt form.
func promptOpen(t *testing.T, b *browserTab, base string) {
	t.Helper()
	b.open(base)
	type form struct {
		PromptShown, TripHidden bool
		Heading, Submit, Hint   string
		Offline, Title          string
	}
	f := jsValue[form](b, `({
		PromptShown: !document.getElementById('prompt-field').hidden && document.getElementById('prompt').offsetHeight > 0,
		TripHidden: document.getElementById('trip-fields').hidden && document.getElementById('destination').offsetHeight === 0,
		Heading: document.getElementById('app-heading').textContent,
		Submit: document.getElementById('submit').textContent,
		Hint: document.getElementById('prompt-hint').textContent,
		Offline: document.getElementById('offline-note').hidden ? '' : document.getElementById('offline-note').textContent,
		Title: document.title,
	})`)
	if !f.PromptShown || !f.TripHidden || f.Heading != "Ask the agent" || f.Submit != "Send to the agent" {
		t.Fatalf("the page does not show the prompt form: %+v", f)
	}
	wantIn(t, "prompt hint", f.Hint, fmt.Sprint(promptMaxChars))
	// No FAREGATE_LLM_BASE_URL: the offline model answers the agent's
	// calls, and the page says so in the prompt form's words.
	wantIn(t, "offline note", f.Offline, "demo model")
	promptNoTripWords(t, "offline note", f.Offline)
	promptNoTripWords(t, "page title", f.Title)
}

// promptType types text into the prompt box as a visitor does.
func promptType(b *browserTab, text string) {
	b.t.Helper()
	jsValue[chromedp.Void](b, `(() => { const p = document.getElementById('prompt'); p.value = ''; p.dispatchEvent(new Event('input', {bubbles: true})); })()`)
	b.run(chromedp.SendKeys(chromedp.ID("prompt"), text))
}

// promptNoTripWords fails when a message meant for the prompt form speaks
// of trips or plans, which the visitor never asked for.
func promptNoTripWords(t *testing.T, what, got string) {
	t.Helper()
	low := strings.ToLower(got)
	for _, w := range []string{"trip", "plan", "destination", "itinerar"} {
		if strings.Contains(low, w) {
			t.Errorf("%s = %q speaks of %q in the prompt form", what, got, w)
		}
	}
}

// promptLiveAnswer: the visitor types a prompt and sends it; each agent
// step shows while the task is still running (the agent waits for it);
// the answer renders as the safe subset and nothing in it can run.
func promptLiveAnswer(t *testing.T, parent context.Context, shots string, s *server, agent *promptAgent) {
	b := openTab(t, parent, shots, "prompt-answer", 1280, 900)
	promptOpen(t, b, s.Web)
	const prompt = "Two days in Porto, please.\nKeep it short."
	promptType(b, prompt)
	b.submit()

	for i, step := range promptSteps {
		// The agent is holding its answer: the task cannot have ended, so
		// a row seen now was delivered live.
		b.wait(`(() => { const r = document.querySelector('#steps > li[data-kind="agent"]');
			const task = document.getElementById('task');
			return r !== null && r.querySelector('.step-name').textContent === 'read_sources' && (` + step.shown + `) &&
				(task.dataset.status === 'queued' || task.dataset.status === 'running') && document.getElementById('result').hidden; })()`)
		b.shot(fmt.Sprintf("prompt-live-step-%d", i+1))
		promptNoTripWords(t, "message while the agent works", b.text("message-text"))
		agent.release(t)
	}
	if st := b.waitTaskDone(); st != "succeeded" {
		t.Fatalf("task ended %q", st)
	}
	b.wait(`document.getElementById('messages').dataset.kind === 'info' && !document.getElementById('result').hidden`)

	ds, prompts, posts := agent.delivered()
	if len(ds) != 1 {
		t.Fatalf("%d deliveries, want 1", len(ds))
	}
	m := hmac.New(sha256.New, []byte(agentSecret))
	m.Write(ds[0].Raw)
	if want := "sha256=" + hex.EncodeToString(m.Sum(nil)); ds[0].Signature != want {
		t.Errorf("delivery signature %q, want %q", ds[0].Signature, want)
	}
	if req := string(ds[0].Body.Task.Request); req != `{"prompt":"Two days in Porto, please.\nKeep it short.","language":"en"}` || prompts[0] != prompt {
		t.Errorf("delivered request %s, want the typed prompt", req)
	}
	if len(posts) != len(promptSteps) || posts[0] != 204 || posts[1] != 204 {
		t.Errorf("event posts answered %v, want 204 each", posts)
	}
	// The server stores the answer as the agent wrote it: whatever is inert
	// on the page was made so by the page.
	id := strings.TrimPrefix(jsValue[string](b, `location.hash`), "#")
	res, _ := waitTask(t, s.URL, id)["result"].(map[string]any)
	if res["text"] != promptAnswer || res["title"] != promptTitle {
		t.Fatalf("stored result %v", res)
	}

	type view struct {
		Heading, Strong, Em, Title, Text, Message, ResultHeading string
		Quota, PageTitle, TaskHeading                            string
		TitleChildren                                            int
		Items                                                    []string
		Links                                                    []map[string]string
		Scripts, Imgs, InlineScripts                             int
		OnAttrs, ScriptURLs                                      []string
		Steps                                                    []string
		Pwned                                                    string
	}
	const read = `({
		Heading: (document.querySelector('#answer > h4') || {}).textContent || '',
		Strong: (document.querySelector('#answer p strong') || {}).textContent || '',
		Em: (document.querySelector('#answer p em') || {}).textContent || '',
		Title: document.getElementById('answer-title').textContent,
		TitleChildren: document.getElementById('answer-title').children.length,
		Text: document.getElementById('answer').innerText,
		Message: document.getElementById('message-text').textContent,
		ResultHeading: document.getElementById('result-heading').textContent,
		Quota: document.getElementById('quota').textContent,
		PageTitle: document.title,
		TaskHeading: document.getElementById('task-heading').textContent,
		Items: [...document.querySelectorAll('#answer > ul > li')].map((li) => li.textContent),
		Links: [...document.querySelectorAll('#answer a')].map((a) => ({href: a.getAttribute('href'), rel: a.getAttribute('rel'), text: a.textContent})),
		Scripts: document.querySelectorAll('#result script, #answer-title *').length,
		Imgs: document.querySelectorAll('#result img, #result iframe, #result object, #result embed').length,
		InlineScripts: [...document.scripts].filter((s) => !s.src).length,
		OnAttrs: [...document.querySelectorAll('*')].flatMap((e) => [...e.attributes].filter((a) => /^on/i.test(a.name)).map((a) => e.tagName + '[' + a.name + ']')),
		ScriptURLs: [...document.querySelectorAll('[href], [src], [action], [formaction], [xlink\\:href]')].flatMap((e) =>
			['href', 'src', 'action', 'formaction', 'xlink:href'].map((n) => e.getAttribute(n)).filter((v) => v !== null && /^\s*(javascript|data|vbscript):/i.test(v.replace(/[\u0000-\u0020]/g, '')))),
		Steps: [...document.querySelectorAll('#steps > li')].map((li) => li.dataset.kind + ':' + li.querySelector('.step-name').textContent + ':' + li.dataset.status),
		Pwned: typeof window.__pwned,
	})`
	v := jsValue[view](b, read)
	if v.Heading != "Two days in Porto" || v.Strong != "Ribeira" || v.Em != "slowly" {
		t.Errorf("heading %q, strong %q, em %q: the Markdown subset did not render", v.Heading, v.Strong, v.Em)
	}
	if want := []string{"Livraria Lello, early", "Tourist office", "[click](javascript:window.__pwned=3)"}; strings.Join(v.Items, "|") != strings.Join(want, "|") {
		t.Errorf("list items %q, want %q", v.Items, want)
	}
	if len(v.Links) != 1 || v.Links[0]["href"] != "https://example.org/porto" || v.Links[0]["rel"] != "nofollow noopener" || v.Links[0]["text"] != "Tourist office" {
		t.Errorf("links %v, want only the https one with rel=\"nofollow noopener\"", v.Links)
	}
	if v.Scripts != 0 || v.Imgs != 0 || v.InlineScripts != 0 || len(v.OnAttrs) != 0 || len(v.ScriptURLs) != 0 {
		t.Errorf("markup from the answer became live: %d script or title elements, %d img/iframe, %d inline scripts, on* attributes %v, script URLs %v",
			v.Scripts, v.Imgs, v.InlineScripts, v.OnAttrs, v.ScriptURLs)
	}
	// What the visitor reads: the markup's source as text, in order.
	wantIn(t, "answer text", v.Text, "Two days in Porto", "Start at the Ribeira and walk slowly uphill.",
		"<script>window.__pwned=1</script>", `<img src=x onerror="window.__pwned=2">`, "[click](javascript:window.__pwned=3)")
	if strings.Contains(v.Text, "**") || strings.Contains(v.Text, "# Two") {
		t.Errorf("answer text %q shows Markdown markers the subset covers", v.Text)
	}
	if v.Title != promptTitle || v.TitleChildren != 0 {
		t.Errorf("title %q with %d elements, want %q as text", v.Title, v.TitleChildren, promptTitle)
	}
	if v.Message != "Your answer is ready." || v.ResultHeading != "Answer" {
		t.Errorf("message %q, result heading %q", v.Message, v.ResultHeading)
	}
	// The prompt form's visitor asked for a task, not a trip.
	wantIn(t, "quota", v.Quota, "4", "99")
	for what, text := range map[string]string{"quota": v.Quota, "page title": v.PageTitle, "task heading": v.TaskHeading} {
		promptNoTripWords(t, what, text)
	}
	if strings.Join(v.Steps, ",") != "agent:read_sources:ok" {
		t.Errorf("steps %v, want the agent's one finished step", v.Steps)
	}
	if v.Pwned != "undefined" {
		t.Errorf("window.__pwned is %s before any click", v.Pwned)
	}

	// Clicking where the javascript: link is written does nothing; the
	// page stays where it is.
	before := jsValue[string](b, `location.href`)
	b.run(chromedp.ScrollIntoView(chromedp.CSS(`#answer > ul > li:nth-child(3)`)),
		chromedp.Click(chromedp.CSS(`#answer > ul > li:nth-child(3)`)))
	// A round trip after the click, so anything it started has run.
	if v := jsValue[view](b, read); v.Pwned != "undefined" {
		t.Errorf("window.__pwned is %s after clicking the javascript: text", v.Pwned)
	}
	if after := jsValue[string](b, `location.href`); after != before {
		t.Errorf("the click moved the page from %s to %s", before, after)
	}
}

// promptTooLong: a prompt over FAREGATE_PROMPT_MAX_CHARS is refused by the
// page itself, nothing is sent, and the message speaks of the request.
func promptTooLong(t *testing.T, parent context.Context, shots string, s *server, agent *promptAgent) {
	b := openTab(t, parent, shots, "prompt-too-long", 1280, 900)
	promptOpen(t, b, s.Web)
	sent := postedTasks(t, s.URL)
	promptType(b, strings.Repeat("é", promptMaxChars+1))
	b.run(chromedp.Click(chromedp.ID("submit")))
	b.waitMessage("invalid_request")
	type field struct {
		Error, Message, Next string
		Hidden, Invalid      bool
		Focus                bool
	}
	f := jsValue[field](b, `({Error: document.getElementById('prompt-error').textContent,
		Message: document.getElementById('message-text').textContent,
		Next: document.getElementById('message-next').textContent,
		Hidden: document.getElementById('prompt-error').hidden,
		Invalid: document.getElementById('prompt').getAttribute('aria-invalid') === 'true',
		Focus: document.activeElement.id === 'prompt'})`)
	if f.Hidden || !f.Invalid || !f.Focus {
		t.Errorf("prompt error not shown, linked or focused: %+v", f)
	}
	wantIn(t, "prompt-error", f.Error, fmt.Sprintf("1 to %d", promptMaxChars))
	promptNoTripWords(t, "message", f.Message)
	promptNoTripWords(t, "next step", f.Next)
	if n := postedTasks(t, s.URL); n != sent {
		t.Errorf("the page sent %v requests for a prompt it refuses itself", n-sent)
	}
	if ds, _, _ := agent.delivered(); len(ds) != 1 {
		t.Errorf("%d deliveries after a refused prompt, want still 1", len(ds))
	}
}

// promptAgentFailed: an agent that answers 500 ends the task agent_failed,
// and the page's message for it fits the prompt form.
func promptAgentFailed(t *testing.T, parent context.Context, shots string, s *server, agent *promptAgent) {
	b := openTab(t, parent, shots, "prompt-agent-failed", 1280, 900)
	promptOpen(t, b, s.Web)
	promptType(b, "Please answer this one: "+promptFailMarker)
	b.submit()
	if st := b.waitTaskDone(); st != "failed" {
		t.Fatalf("task ended %q, want failed", st)
	}
	b.waitMessage("agent_failed")
	type view struct {
		Code, Text, Next, Message, MessageNext string
		ErrorShown, ResultHidden               bool
	}
	v := jsValue[view](b, `({Code: document.getElementById('task-error').dataset.code,
		Text: document.getElementById('task-error-text').textContent,
		Next: document.getElementById('task-error-next').textContent,
		Message: document.getElementById('message-text').textContent,
		MessageNext: document.getElementById('message-next').textContent,
		ErrorShown: !document.getElementById('task-error').hidden,
		ResultHidden: document.getElementById('result').hidden})`)
	if v.Code != "agent_failed" || !v.ErrorShown || !v.ResultHidden {
		t.Errorf("failed task view: %+v", v)
	}
	wantIn(t, "task error", v.Text, "The agent could not finish this task.")
	wantIn(t, "task error next step", v.Next, "still counts")
	for what, text := range map[string]string{"task error": v.Text, "task error next step": v.Next, "message": v.Message, "message next step": v.MessageNext} {
		promptNoTripWords(t, what, text)
	}
	ds, prompts, _ := agent.delivered()
	if len(ds) != 2 || !strings.Contains(prompts[1], promptFailMarker) {
		t.Errorf("deliveries %d, prompts %q", len(ds), prompts)
	}
}
