package web

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/chromedp/chromedp/kb"

	"faregate/web/browsertest"
)

// The browser tests drive the real page in headless Chromium against a
// hand-written fake of the API. They need a Chromium binary and take a few
// seconds, so they run only with FAREGATE_BROWSER_TESTS=1 (as .ci/run
// sets it, like the end-to-end browser tests in cmd/faregate):
//
//	FAREGATE_BROWSER_TESTS=1 go test ./web/ -run Browser

// fakeAPI answers the four API paths the page uses. Function fields decide
// the answers; the rest records what the page sent.
type fakeAPI struct {
	config func(base string) map[string]any
	create func(w http.ResponseWriter, body map[string]any)
	task   func(w http.ResponseWriter, id string, call int)
	// events answers the call-th stream request (from 1).
	events func(w http.ResponseWriter, r *http.Request, call int)

	mu      sync.Mutex
	posts   []map[string]any
	calls   map[string]int
	lastIDs []string // the Last-Event-ID header of each stream request
	tsQuery string
}

// hit counts one call to the named path and returns the running count.
func (f *fakeAPI) hit(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.calls == nil {
		f.calls = map[string]int{}
	}
	f.calls[name]++
	return f.calls[name]
}

// createReplies makes f's creations answer with the reply last given to
// the returned function, so one page can meet many answers in turn.
func (f *fakeAPI) createReplies() func(reply func(http.ResponseWriter)) {
	var mu sync.Mutex
	var current func(http.ResponseWriter)
	f.create = func(w http.ResponseWriter, _ map[string]any) {
		mu.Lock()
		r := current
		mu.Unlock()
		r(w)
	}
	return func(reply func(http.ResponseWriter)) {
		mu.Lock()
		current = reply
		mu.Unlock()
	}
}

// count reports how often the named path was called.
func (f *fakeAPI) count(name string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[name]
}

// postCount reports how many tasks the page posted.
func (f *fakeAPI) postCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.posts)
}

// lastPost returns the body of the latest POST /api/tasks.
func (f *fakeAPI) lastPost(t *testing.T) map[string]any {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.posts) == 0 {
		t.Fatal("the page posted no task")
	}
	return f.posts[len(f.posts)-1]
}

// fakeTurnstile stands in for Cloudflare's api.js: it records the render
// options and lets the test hand out tokens through window.__ts.opts.
const fakeTurnstile = `(() => {
  window.__ts = { resets: 0, opts: null };
  window.turnstile = {
    render(el, o) { window.__ts.opts = o; window.__ts.el = el.id; return 'w1'; },
    reset(id) { window.__ts.resets++; window.__ts.resetId = id; },
  };
  const cb = new URL(document.currentScript.src).searchParams.get('onload');
  window[cb]();
})();`

// startSite serves the real page plus the fake API and widget on loopback.
func startSite(t *testing.T, f *fakeAPI) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	h, err := Handler(Files(), Options{TurnstileScriptURL: srv.URL + "/ts.js"})
	if err != nil {
		t.Fatal(err)
	}
	mux.Handle("/", h)
	mux.HandleFunc("GET /ts.js", func(w http.ResponseWriter, r *http.Request) {
		f.hit("ts.js")
		f.mu.Lock()
		f.tsQuery = r.URL.RawQuery
		f.mu.Unlock()
		w.Header().Set("Content-Type", "text/javascript")
		fmt.Fprint(w, fakeTurnstile)
	})
	mux.HandleFunc("GET /api/config", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, http.StatusOK, f.config(srv.URL), nil)
	})
	mux.HandleFunc("POST /api/tasks", func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
			writeJSON(w, http.StatusBadRequest, nil, nil)
			return
		}
		f.mu.Lock()
		f.posts = append(f.posts, body)
		f.mu.Unlock()
		f.create(w, body)
	})
	mux.HandleFunc("GET /api/tasks/{id}", func(w http.ResponseWriter, r *http.Request) {
		f.task(w, r.PathValue("id"), f.hit("task"))
	})
	mux.HandleFunc("GET /api/tasks/{id}/events", func(w http.ResponseWriter, r *http.Request) {
		call := f.hit("events")
		f.mu.Lock()
		f.lastIDs = append(f.lastIDs, r.Header.Get("Last-Event-ID"))
		f.mu.Unlock()
		f.events(w, r, call)
	})
	return srv
}

// writeJSON writes v as a JSON answer with extra headers.
func writeJSON(w http.ResponseWriter, status int, v any, hdr map[string]string) {
	for k, val := range hdr {
		w.Header().Set(k, val)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// apiError answers with the documented error envelope.
func apiError(status int, code, retryAfter string, fields map[string]string) func(http.ResponseWriter) {
	return func(w http.ResponseWriter) {
		e := map[string]any{"code": code, "message": "server text", "request_id": "req-1"}
		if fields != nil {
			e["fields"] = fields
		}
		hdr := map[string]string{}
		if retryAfter != "" {
			hdr["Retry-After"] = retryAfter
		}
		writeJSON(w, status, map[string]any{"error": e}, hdr)
	}
}

// writeEvents sends a whole SSE stream: name/data pairs with ids 1, 2, …
func writeEvents(w http.ResponseWriter, events ...any) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	for i := 0; i+1 < len(events); i += 2 {
		data, _ := json.Marshal(events[i+1])
		fmt.Fprintf(w, "id: %d\nevent: %s\ndata: %s\n\n", i/2+1, events[i], data)
	}
	if fl, ok := w.(http.Flusher); ok {
		fl.Flush()
	}
}

// degradedDetail is what a weather step says when it used seasonal norms.
const degradedDetail = "Live forecast unavailable; seasonal norms for Lisbon in December: high 16 °C, low 10 °C, usually rainy."

const hostile = `<img src=x onerror="window.__pwned=1">Sunny & <b>calm</b>`

// finishedTask is a succeeded task whose texts try to inject markup.
func finishedTask(id string) map[string]any {
	return map[string]any{
		"id": id, "status": "succeeded",
		"request": map[string]any{"destination": "Lisbon", "days": 2, "interests": []string{"Food"}},
		"steps": []any{
			map[string]any{"seq": 1, "kind": "model", "name": "plan", "status": "ok", "duration_ms": 12},
			map[string]any{"seq": 2, "kind": "tool", "name": "weather", "status": "failed", "duration_ms": 1500, "detail": "timeout"},
		},
		"result": map[string]any{
			"summary": hostile,
			"days": []any{
				map[string]any{"day": 1, "title": "Alfama", "items": []string{"Tram 28", hostile}},
				map[string]any{"day": 2, "title": "Belém", "items": []string{"Pastéis"}},
			},
			"warnings": []string{"weather_unavailable", "brand_new_warning"},
			"model":    "offline-demo-planner", "offline": true,
		},
		"usage": map[string]any{"prompt_tokens": 10, "completion_tokens": 20},
	}
}

// devConfig is /api/config of a server on embedded defaults.
func devConfig(base string) map[string]any {
	return map[string]any{
		"turnstile_site_key": "1x00000000000000000000AA", "turnstile_script_url": base + "/ts.js",
		"turnstile_test": true, "dev_mode": true, "model_status": "ok", "offline_model": true,
		"input": "trip",
		"limits": map[string]any{"ip_daily": 5, "global_daily": 100, "prompt_max_chars": 2000,
			"destination_max": 80, "days_min": 1, "days_max": 7, "interests_max": 5, "interest_max": 32},
	}
}

// accept answers POST /api/tasks with 202 and the given id.
func accept(id string) func(http.ResponseWriter, map[string]any) {
	return func(w http.ResponseWriter, _ map[string]any) {
		writeJSON(w, http.StatusAccepted, map[string]any{
			"id": id, "status": "queued", "quota": map[string]any{"ip_remaining": 4, "global_remaining": 99},
		}, nil)
	}
}

// errorProbe collects uncaught errors and CSP violations inside the page.
const errorProbe = `window.__errors = [];
addEventListener('error', (e) => window.__errors.push('error: ' + e.message));
addEventListener('unhandledrejection', (e) => window.__errors.push('rejection: ' + e.reason));
document.addEventListener('securitypolicyviolation', (e) => window.__errors.push('csp: ' + e.violatedDirective + ' ' + e.blockedURI));`

// tab opens a fresh tab with the error probe installed.
func tab(t *testing.T, browser context.Context) context.Context {
	t.Helper()
	ctx, cancel := chromedp.NewContext(browser)
	t.Cleanup(cancel)
	ctx, cancelT := context.WithTimeout(ctx, 40*time.Second)
	t.Cleanup(cancelT)
	if _, err := chromedp.Call(ctx, page.AddScriptToEvaluateOnNewDocument, page.AddScriptToEvaluateOnNewDocumentParams{Source: errorProbe}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		errs, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`window.__errors || []`))
		if err != nil {
			t.Errorf("reading page errors: %v", err)
		}
		for _, e := range errs {
			t.Errorf("page error: %s", e)
		}
	})
	return ctx
}

// do2 runs browser steps or stops the test.
func do2(t *testing.T, ctx context.Context, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if err := chromedp.Do(ctx, steps...); err != nil {
		t.Fatal(err)
	}
}

// eval evaluates a JavaScript expression and decodes its value.
func eval[T any](t *testing.T, ctx context.Context, expr string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	return v
}

// waitFor polls a JavaScript predicate in the page (on animation frames,
// not sleeps) and fails with the page's message region when it times out.
func waitFor(t *testing.T, ctx context.Context, expr string) {
	t.Helper()
	if _, err := chromedp.Run(ctx, chromedp.Poll[chromedp.Void](expr, chromedp.WithPollingTimeout(10*time.Second))); err != nil {
		msg, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.getElementById('messages').textContent`))
		t.Fatalf("waiting for %s: %v (messages: %q)", expr, err, msg)
	}
}

// setValue sets an input's value the way a script would (chromedp's
// SetValue refuses the empty string).
func setValue(t *testing.T, ctx context.Context, id, value string) {
	t.Helper()
	eval[chromedp.Void](t, ctx, fmt.Sprintf(`document.getElementById(%q).value = %q`, id, value))
}

func text(t *testing.T, ctx context.Context, id string) string {
	t.Helper()
	return eval[string](t, ctx, fmt.Sprintf(`document.getElementById(%q).textContent`, id))
}

func wantContains(t *testing.T, what, got string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(got, w) {
			t.Errorf("%s = %q, want it to contain %q", what, got, w)
		}
	}
}

func TestBrowser(t *testing.T) {
	browser := browsertest.Start(t)

	t.Run("dev mode task by keyboard", func(t *testing.T) { browserTask(t, browser) })
	t.Run("errors", func(t *testing.T) { browserErrors(t, browser) })
	t.Run("language", func(t *testing.T) { browserLanguage(t, browser) })
	t.Run("task from link", func(t *testing.T) { browserLink(t, browser) })
	t.Run("polling fallback", func(t *testing.T) { browserPolling(t, browser) })
	t.Run("turnstile widget", func(t *testing.T) { browserWidget(t, browser) })
	t.Run("refusal messages", func(t *testing.T) { browserRefusals(t, browser) })
	t.Run("stream refused: polling", func(t *testing.T) { browserStreamRefused(t, browser) })
	t.Run("stream closed: resume", func(t *testing.T) { browserStreamResume(t, browser) })
	t.Run("cached plan", func(t *testing.T) { browserCachedPlan(t, browser) })
	t.Run("worker lost", func(t *testing.T) { browserWorkerLost(t, browser) })
	t.Run("plan language", func(t *testing.T) { browserPlanLanguage(t, browser) })
	t.Run("prompt form and Markdown answer", func(t *testing.T) { browserPromptForm(t, browser) })
	t.Run("markdown renderer", func(t *testing.T) { browserMarkdown(t, browser) })
}

// browserTask: a whole task by keyboard on a phone-sized screen, from the
// form to day cards, with hostile text kept as text.
func browserTask(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: accept("t_abc")}
	f.events = func(w http.ResponseWriter, r *http.Request, _ int) {
		final := finishedTask(r.PathValue("id"))
		degraded := map[string]any{"seq": 3, "kind": "tool", "name": "weather", "status": "degraded", "duration_ms": 300, "detail": degradedDetail}
		final["steps"] = append(final["steps"].([]any), degraded)
		writeEvents(w,
			"step", map[string]any{"seq": 1, "kind": "model", "name": "plan", "status": "started"},
			"status", map[string]any{"status": "running"},
			"step", map[string]any{"seq": 1, "kind": "model", "name": "plan", "status": "ok", "duration_ms": 12},
			"step", map[string]any{"seq": 2, "kind": "tool", "name": "weather", "status": "failed", "duration_ms": 1500, "detail": "timeout"},
			"step", degraded,
			"done", final)
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx,
		chromedp.EmulateViewport(360, 740),
		chromedp.Navigate(srv.URL),
		chromedp.WaitVisible(chromedp.ID("dev-banner")),
		chromedp.WaitEnabled(chromedp.ID("submit")),
		// Keyboard only: type, press Space on a chip, submit with Enter.
		chromedp.Focus(chromedp.ID("destination")),
		chromedp.KeyEvent("Lisbon"),
		chromedp.Focus(chromedp.ID("days")),
		chromedp.KeyEvent(kb.ArrowDown), // 3 → 2
		chromedp.Focus(chromedp.ID("chip-food")),
		chromedp.KeyEvent(" "),
		chromedp.Focus(chromedp.ID("destination")),
		chromedp.KeyEvent("\r"),
	)
	waitFor(t, ctx, `document.querySelectorAll('[data-testid=day-card]').length === 2`)

	type snapshot struct {
		Steps       []string
		Degraded    string
		Warnings    []string
		Quota       string
		Hash        string
		Summary     string
		Items       string
		Imgs        int
		Pwned       bool
		Message     string
		DevTS, Off  bool
		Scripts     int
		Overflow    bool
		ChipPressed string
		Modules     []string
	}
	s := eval[snapshot](t, ctx, `({
		Steps: [...document.querySelectorAll('#steps > li')].map((li) => li.dataset.status),
		Degraded: document.querySelector('#steps > li[data-status=degraded]')?.textContent ?? '',
		Warnings: [...document.querySelectorAll('#warnings li')].map((li) => li.textContent),
		Quota: document.getElementById('quota').textContent,
		Hash: location.hash,
		Summary: document.getElementById('summary').textContent,
		Items: document.getElementById('days-list').textContent,
		Imgs: document.querySelectorAll('#task img, #task b').length,
		Pwned: !!window.__pwned,
		Message: document.getElementById('message-text').textContent,
		DevTS: !document.getElementById('dev-banner-turnstile').hidden,
		Off: !document.getElementById('offline-note').hidden,
		Scripts: document.querySelectorAll('script[src*="ts.js"]').length,
		Overflow: document.documentElement.scrollWidth > 360,
		ChipPressed: document.getElementById('chip-food').getAttribute('aria-pressed'),
		Modules: performance.getEntriesByType('resource').map((e) => new URL(e.name).pathname.split('/').pop()).filter((n) => n.endsWith('.js')),
	})`)
	if strings.Join(s.Steps, ",") != "ok,failed,degraded" {
		t.Errorf("step rows %v, want ok,failed,degraded (seq 1 updated in place)", s.Steps)
	}
	// A tool that fell back is shown as such, with what it used instead.
	wantContains(t, "degraded step", s.Degraded, "done with a fallback", "seasonal norms")
	if strings.Contains(s.Degraded, "failed") {
		t.Errorf("degraded step reads as a failure: %q", s.Degraded)
	}
	if len(s.Warnings) != 2 || !strings.Contains(s.Warnings[0], "seasonal norms") || !strings.Contains(s.Warnings[1], "Something limited") {
		t.Errorf("warnings %q", s.Warnings)
	}
	wantContains(t, "quota", s.Quota, "4", "99")
	if s.Hash != "#t_abc" {
		t.Errorf("hash %q", s.Hash)
	}
	if s.Summary != hostile || !strings.Contains(s.Items, hostile) || s.Imgs != 0 || s.Pwned {
		t.Errorf("server text was not rendered as text: summary %q, %d elements injected, pwned %v", s.Summary, s.Imgs, s.Pwned)
	}
	if s.Message != "Your plan is ready." || !s.DevTS || !s.Off || s.Scripts != 0 || f.count("ts.js") != 0 {
		t.Errorf("message %q, dev banner %v, offline note %v, widget scripts %d/%d", s.Message, s.DevTS, s.Off, s.Scripts, f.count("ts.js"))
	}
	if s.Overflow {
		t.Error("the page scrolls sideways at 360 px")
	}
	if s.ChipPressed != "true" {
		t.Errorf("chip aria-pressed %q", s.ChipPressed)
	}
	// The page talks to the server through the typed client other
	// frontends use, so these tests exercise it.
	if !slices.Contains(s.Modules, "client.js") || slices.Contains(s.Modules, "api.js") {
		t.Errorf("modules loaded %v, want client.js and no api.js", s.Modules)
	}
	post := f.lastPost(t)
	got, _ := json.Marshal(post)
	want := `{"days":2,"destination":"Lisbon","interests":["Food"],"language":"en","turnstile_token":"XXXX.DUMMY.TOKEN.XXXX"}`
	if string(got) != want {
		t.Errorf("posted %s, want %s", got, want)
	}
}

// browserErrors: each failure gets its own words, waiting time, reference
// and field marks; client-side refusals send nothing.
func browserErrors(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig}
	setReply := f.createReplies()
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))

	hangUp := func(w http.ResponseWriter) {
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			conn.Close()
		}
	}
	htmlPage := func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "text/html")
		w.WriteHeader(http.StatusBadGateway)
		fmt.Fprint(w, "<h1>bad gateway</h1>")
	}
	tests := []struct {
		name        string
		destination string
		reply       func(http.ResponseWriter)
		code        string
		want        map[string][]string // element id → substrings
		check       string              // extra predicate
	}{
		{
			name: "client-side check", destination: "", code: "invalid_request",
			want:  map[string][]string{"destination-error": {"1 to 80"}, "message-next": {"highlighted"}},
			check: `document.getElementById('destination').getAttribute('aria-invalid') === 'true' && document.getElementById('destination').getAttribute('aria-describedby').includes('destination-error') && document.activeElement.id === 'destination'`,
		},
		{
			name: "daily limit", destination: "Rome", reply: apiError(429, "demo_ip_limit_reached", "18720", nil), code: "demo_ip_limit_reached",
			want: map[string][]string{"message-text": {"free plans"}, "message-retry": {"5 h 12 min", "UTC"}, "message-ref": {"Reference: req-1"}},
		},
		{
			name: "protection down", destination: "Rome", reply: apiError(503, "demo_protection_unavailable", "5", nil), code: "demo_protection_unavailable",
			want: map[string][]string{"message-retry": {"Try again in 5 s."}},
		},
		{
			name: "server field error", destination: "Rome", reply: apiError(400, "invalid_request", "", map[string]string{"days": "must be 1 to 7"}), code: "invalid_request",
			want:  map[string][]string{"days-error": {"1 to 7"}},
			check: `document.getElementById('days').getAttribute('aria-invalid') === 'true' && !document.getElementById('destination').hasAttribute('aria-invalid')`,
		},
		{
			name: "unknown code", destination: "Rome", reply: apiError(418, "brand_new", "", nil), code: "brand_new",
			want: map[string][]string{"message-text": {"Something unexpected"}},
		},
		{
			name: "proxy page", destination: "Rome", reply: htmlPage, code: "unknown",
			want: map[string][]string{"message-text": {"Something unexpected"}},
		},
		{
			name: "network failure", destination: "Rome", reply: hangUp, code: "network",
			want: map[string][]string{"message-text": {"could not be reached"}},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			setReply(tc.reply)
			before := f.postCount()
			setValue(t, ctx, "destination", tc.destination)
			do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
			waitFor(t, ctx, fmt.Sprintf(`document.getElementById('messages').dataset.code === %q && !document.getElementById('submit').disabled`, tc.code))
			for id, subs := range tc.want {
				wantContains(t, id, text(t, ctx, id), subs...)
			}
			if tc.check != "" && !eval[bool](t, ctx, tc.check) {
				t.Errorf("%s is false", tc.check)
			}
			// Chrome itself retries a POST whose connection closed before
			// any answer, so a hang-up may arrive more than once.
			if posted := f.postCount() - before; (tc.reply == nil) != (posted == 0) {
				t.Errorf("%d posts; a client-side refusal must send none, anything else at least one", posted)
			}
		})
	}
}

// browserLanguage: the switch changes every text and lang, and is remembered.
func browserLanguage(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: func(w http.ResponseWriter, _ map[string]any) {
		apiError(429, "demo_global_limit_reached", "18720", nil)(w)
	}}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	eval[chromedp.Void](t, ctx, `(() => { const s = document.getElementById('lang'); s.value = 'zh-CN'; s.dispatchEvent(new Event('change')); })()`)
	check := `document.documentElement.lang === 'zh-CN' && document.getElementById('submit').textContent === '规划我的旅行' && document.title.includes('旅行')`
	waitFor(t, ctx, check)
	// The choice survives a reload.
	do2(t, ctx, chromedp.Reload(), chromedp.WaitEnabled(chromedp.ID("submit")))
	waitFor(t, ctx, check)
	setValue(t, ctx, "destination", "罗马")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.getElementById('messages').dataset.code === 'demo_global_limit_reached'`)
	wantContains(t, "retry", text(t, ctx, "message-retry"), "5 小时 12 分钟", "UTC")
	wantContains(t, "message", text(t, ctx, "message-text"), "上限")
	// Switching back re-renders the message in English.
	eval[chromedp.Void](t, ctx, `(() => { const s = document.getElementById('lang'); s.value = 'en'; s.dispatchEvent(new Event('change')); })()`)
	wantContains(t, "retry", text(t, ctx, "message-retry"), "5 h 12 min")
}

// browserLink: #t_<id> reopens a task; an unknown one says so.
func browserLink(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig}
	f.task = func(w http.ResponseWriter, id string, _ int) {
		if id == "t_done" {
			writeJSON(w, http.StatusOK, finishedTask(id), nil)
			return
		}
		apiError(404, "task_not_found", "", nil)(w)
	}
	f.events = func(w http.ResponseWriter, _ *http.Request, _ int) {
		http.Error(w, "unexpected", http.StatusInternalServerError)
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL+"/#t_done"))
	waitFor(t, ctx, `document.querySelectorAll('[data-testid=day-card]').length === 2 && document.getElementById('task').dataset.status === 'succeeded'`)
	if n := f.count("events"); n != 0 {
		t.Errorf("a finished task opened %d event streams", n)
	}
	eval[chromedp.Void](t, ctx, `location.hash = '#t_gone'`)
	waitFor(t, ctx, `document.getElementById('messages').dataset.code === 'task_not_found' && document.getElementById('task').hidden`)
	do2(t, ctx, chromedp.Reload())
	waitFor(t, ctx, `document.getElementById('messages').dataset.code === 'task_not_found'`)
	wantContains(t, "message", text(t, ctx, "message-text"), "could not be found")
}

// browserPolling: when the event stream is refused the page polls instead.
func browserPolling(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: accept("t_poll")}
	f.events = func(w http.ResponseWriter, _ *http.Request, _ int) {
		http.Error(w, "down", http.StatusServiceUnavailable)
	}
	f.task = func(w http.ResponseWriter, id string, call int) {
		if call == 1 {
			writeJSON(w, http.StatusOK, map[string]any{"id": id, "status": "running", "steps": []any{
				map[string]any{"seq": 1, "kind": "model", "name": "plan", "status": "started"},
			}}, nil)
			return
		}
		writeJSON(w, http.StatusOK, finishedTask(id), nil)
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	setValue(t, ctx, "destination", "Lisbon")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.querySelector('#steps > li') !== null && document.getElementById('task').dataset.status === 'running'`)
	waitFor(t, ctx, `document.getElementById('task').dataset.status === 'succeeded' && document.querySelectorAll('[data-testid=day-card]').length === 2`)
	if f.count("events") < 1 || f.count("task") < 2 {
		t.Errorf("events %d, polls %d", f.count("events"), f.count("task"))
	}
}

// browserWidget: with a real widget the button waits for a token, and each
// token is used once: reset after a submission and on expiry.
func browserWidget(t *testing.T, browser context.Context) {
	f := &fakeAPI{create: func(w http.ResponseWriter, _ map[string]any) {
		apiError(403, "turnstile_failed", "", nil)(w)
	}}
	f.config = func(base string) map[string]any {
		c := devConfig(base)
		c["turnstile_test"], c["dev_mode"], c["offline_model"], c["model_status"] = false, false, false, "degraded"
		c["turnstile_script_url"] = base + "/ts.js?v=1"
		return c
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL))
	waitFor(t, ctx, `window.__ts && window.__ts.opts !== null`)
	type widget struct {
		Sitekey, Action, El string
		Disabled, Banner    bool
		Model               bool
	}
	w := eval[widget](t, ctx, `({Sitekey: __ts.opts.sitekey, Action: __ts.opts.action, El: __ts.el,
		Disabled: document.getElementById('submit').disabled, Banner: !document.getElementById('dev-banner').hidden,
		Model: !document.getElementById('model-status').hidden})`)
	if w != (widget{Sitekey: "1x00000000000000000000AA", Action: "create-task", El: "turnstile", Disabled: true, Model: true}) {
		t.Errorf("widget state %+v", w)
	}
	f.mu.Lock()
	q := f.tsQuery
	f.mu.Unlock()
	if q != "v=1&render=explicit&onload=faregateTurnstileReady" {
		t.Errorf("script query %q", q)
	}

	eval[chromedp.Void](t, ctx, `__ts.opts.callback('tok-1')`)
	do2(t, ctx, chromedp.WaitEnabled(chromedp.ID("submit")))
	setValue(t, ctx, "destination", "Oslo")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.getElementById('messages').dataset.code === 'turnstile_failed'`)
	if tok := f.lastPost(t)["turnstile_token"]; tok != "tok-1" {
		t.Errorf("posted token %v", tok)
	}
	// The spent token is gone: the widget was reset and the button waits.
	if !eval[bool](t, ctx, `__ts.resets === 1 && __ts.resetId === 'w1' && document.getElementById('submit').disabled`) {
		t.Error("widget not reset after the submission")
	}
	eval[chromedp.Void](t, ctx, `__ts.opts.callback('tok-2')`)
	do2(t, ctx, chromedp.WaitEnabled(chromedp.ID("submit")))
	eval[chromedp.Void](t, ctx, `__ts.opts['expired-callback']()`)
	if !eval[bool](t, ctx, `__ts.resets === 2 && document.getElementById('submit').disabled`) {
		t.Error("expiry did not reset the widget and disable the button")
	}
}
