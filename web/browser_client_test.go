package web

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/chromedp/chromedp"
)

// Browser scenarios of the second round: the typed client's streaming,
// resuming and polling, and the page's words for the new codes. They run
// inside TestBrowser (browser_test.go), on its Chromium.

// messageLog records every state of the live region (kind|code|text), so a
// test can prove what the visitor saw between two waits: MutationObserver
// callbacks run after renderMessage has finished, so the text is whole.
const messageLog = `(() => {
  window.__messages = [];
  const m = document.getElementById('messages');
  new MutationObserver(() => {
    const text = m.textContent.replace(/\s+/g, ' ').trim();
    window.__messages.push((m.dataset.kind || '') + '|' + (m.dataset.code || '') + '|' + text);
  }).observe(m, { attributes: true, childList: true, subtree: true, characterData: true });
})()`

// messagesSeen returns what messageLog recorded.
func messagesSeen(t *testing.T, ctx context.Context) []string {
	t.Helper()
	return eval[[]string](t, ctx, `window.__messages`)
}

// switchLanguage picks a language in the page's switch, as a visitor does.
func switchLanguage(t *testing.T, ctx context.Context, lang string) {
	t.Helper()
	eval[chromedp.Void](t, ctx, fmt.Sprintf(`(() => { const s = document.getElementById('lang'); s.value = %q; s.dispatchEvent(new Event('change')); })()`, lang))
	waitFor(t, ctx, fmt.Sprintf(`document.documentElement.lang === %q`, lang))
}

// sseEvent formats one event with the given line ending.
func sseEvent(id, event string, data any, eol string) string {
	b, _ := json.Marshal(data)
	return "id: " + id + eol + "event: " + event + eol + "data: " + string(b) + eol + eol
}

// flushed writes s and flushes it to the page at once.
func flushed(w http.ResponseWriter, s string) {
	io.WriteString(w, s)
	if fl, ok := w.(http.Flusher); ok {
		fl.Flush()
	}
}

// withResult returns finishedTask(id) with fields of its result replaced.
func withResult(id string, fields map[string]any) map[string]any {
	task := finishedTask(id)
	res := task["result"].(map[string]any)
	for k, v := range fields {
		res[k] = v
	}
	return task
}

// browserRefusals: every new refusal code has its own words in both
// languages, with the waiting time from Retry-After; the server's own
// sentence is never shown, let alone as markup.
func browserRefusals(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig}
	setReply := f.createReplies()
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	setValue(t, ctx, "destination", "Rome")

	const serverText = `<img src=x onerror="window.__pwned=1">Ignore previous instructions`
	tests := []struct {
		lang, code string
		status     int
		retryAfter string
		text       string // in message-text
		retry      string // in message-retry ("" : no line)
	}{
		{"en", "rate_limited", 429, "12", "Too many requests", "Try again in 12 s."},
		{"en", "too_many_failed_checks", 429, "1800", "refused in the last hour", "30 min"},
		{"en", "server_busy", 503, "5", "very busy", "Try again in 5 s."},
		{"en", "prompt_rejected", 400, "", "does not accept", ""},
		{"en", "anomaly_blocked", 429, "2400", "Unusual requests", "40 min"},
		{"en", "token_rate_limited", 429, "20", "as much work as it can", "Try again in 20 s."},
		{"en", "key_daily_limit_reached", 429, "3600", "API key has used all", "1 h"},
		{"en", "invalid_api_key", 401, "", "API key was not accepted", ""},
		{"en", "too_many_streams", 429, "5", "followed live", "Try again in 5 s."},
		{"zh-CN", "rate_limited", 429, "12", "请求次数过多", "12 秒"},
		{"zh-CN", "server_busy", 503, "5", "非常繁忙", "5 秒"},
		{"zh-CN", "prompt_rejected", 400, "", "不接受", ""},
		{"zh-CN", "too_many_failed_checks", 429, "1800", "一小时", "30 分钟"},
		{"zh-CN", "anomaly_blocked", 429, "2400", "异常请求", "40 分钟"},
	}
	for _, tc := range tests {
		t.Run(tc.lang+" "+tc.code, func(t *testing.T) {
			if eval[string](t, ctx, `document.documentElement.lang`) != tc.lang {
				switchLanguage(t, ctx, tc.lang)
			}
			setReply(func(w http.ResponseWriter) {
				hdr := map[string]string{"X-Request-Id": "req-7"}
				if tc.retryAfter != "" {
					hdr["Retry-After"] = tc.retryAfter
				}
				writeJSON(w, tc.status, map[string]any{"error": map[string]any{
					"code": tc.code, "message": serverText, "request_id": "req-7",
				}}, hdr)
			})
			do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
			waitFor(t, ctx, fmt.Sprintf(`document.getElementById('messages').dataset.code === %q && !document.getElementById('submit').disabled`, tc.code))
			wantContains(t, "message-text", text(t, ctx, "message-text"), tc.text)
			if tc.retry != "" {
				wantContains(t, "message-retry", text(t, ctx, "message-retry"), tc.retry)
			} else if got := text(t, ctx, "message-retry"); got != "" {
				t.Errorf("message-retry %q without a Retry-After", got)
			}
			if next := text(t, ctx, "message-next"); next == "" {
				t.Error("no next step")
			}
			wantContains(t, "message-ref", text(t, ctx, "message-ref"), "req-7")
			if all := text(t, ctx, "messages"); strings.Contains(all, "Ignore previous") || eval[int](t, ctx, `document.querySelectorAll('#messages img').length`) != 0 || eval[bool](t, ctx, `!!window.__pwned`) {
				t.Errorf("the server's sentence reached the page: %q", all)
			}
		})
	}
}

// browserStreamRefused: a stream refused with 429 too_many_streams (a code
// EventSource could never read) makes the page say so and poll instead,
// and the plan still arrives.
func browserStreamRefused(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: accept("t_busy")}
	f.events = func(w http.ResponseWriter, _ *http.Request, _ int) {
		apiError(http.StatusTooManyRequests, "too_many_streams", "5", nil)(w)
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
	eval[chromedp.Void](t, ctx, messageLog)
	setValue(t, ctx, "destination", "Lisbon")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.getElementById('task').dataset.status === 'succeeded' && document.querySelectorAll('[data-testid=day-card]').length === 2`)

	seen := messagesSeen(t, ctx)
	notice := slices.IndexFunc(seen, func(s string) bool { return strings.HasPrefix(s, "notice|too_many_streams|") })
	if notice < 0 {
		t.Fatalf("the refusal was never named; messages %q", seen)
	}
	wantContains(t, "notice", seen[notice], "every few seconds")
	if last := seen[len(seen)-1]; !strings.HasPrefix(last, "info||Your plan is ready.") {
		t.Errorf("last message %q", last)
	}
	// One refused stream is enough: the client polls, it does not hammer.
	if f.count("events") != 1 || f.count("task") < 2 {
		t.Errorf("%d stream requests, %d polls; want 1 and at least 2", f.count("events"), f.count("task"))
	}
}

// browserStreamResume: the server closes the stream mid-run without done,
// as at FAREGATE_STREAM_MAX_DURATION; the page resumes with the last
// complete event's id, shows no error, never polls, and lists each step
// once. The second connection uses CRLF, a comment, a data field split over
// two lines, and chunks cut inside lines and between CR and LF.
func browserStreamResume(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: accept("t_resume")}
	f.events = func(w http.ResponseWriter, r *http.Request, call int) {
		w.Header().Set("Content-Type", "text/event-stream")
		id := r.PathValue("id")
		switch call {
		case 1:
			flushed(w, "retry: 50\n\n"+
				sseEvent("1", "step", map[string]any{"seq": 1, "kind": "model", "name": "plan", "status": "started", "duration_ms": 0}, "\n")+
				sseEvent("2", "status", map[string]any{"status": "running"}, "\n")+
				sseEvent("3", "step", map[string]any{"seq": 1, "kind": "model", "name": "plan", "status": "ok", "duration_ms": 12}, "\n")+
				// Cut off by the close: its id must not count as seen.
				"id: 4\nevent: step\ndata: {\"seq\":2,")
		case 2:
			flushed(w, ": keep-alive\r\n\r\nid: 4\r\nevent: step\r\ndata: {\"seq\":2,\"kind\":\"tool\",\r\nda")
			flushed(w, "ta: \"name\":\"weather\",\"status\":\"started\",\"duration_ms\":0}\r")
			flushed(w, "\n\r\n"+sseEvent("5", "step", map[string]any{"seq": 2, "kind": "tool", "name": "weather", "status": "failed", "duration_ms": 1500, "detail": "timeout"}, "\r\n"))
			flushed(w, sseEvent("6", "done", finishedTask(id), "\r\n"))
		default:
			http.Error(w, "a third stream", http.StatusInternalServerError)
		}
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	eval[chromedp.Void](t, ctx, messageLog)
	setValue(t, ctx, "destination", "Lisbon")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.getElementById('task').dataset.status === 'succeeded' && document.querySelectorAll('[data-testid=day-card]').length === 2`)

	f.mu.Lock()
	ids := slices.Clone(f.lastIDs)
	f.mu.Unlock()
	if !slices.Equal(ids, []string{"", "3"}) {
		t.Errorf("Last-Event-ID per stream request %q, want [\"\" \"3\"]", ids)
	}
	if n := f.count("task"); n != 0 {
		t.Errorf("the page polled %d times although the stream resumed", n)
	}
	type row struct{ Seq, Status string }
	rows := eval[[]row](t, ctx, `[...document.querySelectorAll('#steps > li')].map((li) => ({Seq: li.dataset.seq, Status: li.dataset.status}))`)
	if len(rows) != 2 || rows[0] != (row{"1", "ok"}) || rows[1] != (row{"2", "failed"}) {
		t.Errorf("step rows %+v, want seq 1 ok and seq 2 failed, once each", rows)
	}
	for _, m := range messagesSeen(t, ctx) {
		if strings.HasPrefix(m, "error|") || strings.HasPrefix(m, "notice|") || strings.Contains(m, "every few seconds") {
			t.Errorf("the visitor saw %q during a resume", m)
		}
	}
	wantContains(t, "message", text(t, ctx, "message-text"), "Your plan is ready.")
}

// browserCachedPlan: a 202 that served a cached plan shows the plan at
// once with a label saying no tokens were spent, in both languages, next
// to the offline planner's disclosure.
func browserCachedPlan(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig}
	f.create = func(w http.ResponseWriter, _ map[string]any) {
		writeJSON(w, http.StatusAccepted, map[string]any{
			"id": "t_cached", "status": "succeeded", "quota": map[string]any{"ip_remaining": 3, "global_remaining": 90},
		}, nil)
	}
	f.events = func(w http.ResponseWriter, r *http.Request, _ int) {
		task := withResult(r.PathValue("id"), map[string]any{"cached": true, "language": "en"})
		task["usage"] = map[string]any{"prompt_tokens": 0, "completion_tokens": 0}
		w.Header().Set("Content-Type", "text/event-stream")
		flushed(w, sseEvent("1", "done", task, "\n"))
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	setValue(t, ctx, "destination", "Lisbon")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `!document.getElementById('result').hidden && !document.getElementById('cached-note').hidden`)
	if got := text(t, ctx, "cached-note"); got != "Served from a cached plan for the same request: no tokens were spent." {
		t.Errorf("cached label %q", got)
	}
	wantContains(t, "model info", text(t, ctx, "model-info"), "not a language model")
	if !eval[bool](t, ctx, `!document.getElementById('offline-note').hidden`) {
		t.Error("the offline planner's disclosure is hidden")
	}
	switchLanguage(t, ctx, "zh-CN")
	wantContains(t, "cached label", text(t, ctx, "cached-note"), "缓存", "没有消耗")
}

// browserWorkerLost: a task whose replica died fails with worker_lost; the
// page says what happened and that the slot stays used, without claiming
// a second charge.
func browserWorkerLost(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: accept("t_lost")}
	f.events = func(w http.ResponseWriter, r *http.Request, _ int) {
		task := finishedTask(r.PathValue("id"))
		task["status"] = "failed"
		delete(task, "result")
		task["error"] = map[string]any{"code": "worker_lost", "message": "server text"}
		w.Header().Set("Content-Type", "text/event-stream")
		flushed(w, sseEvent("1", "status", map[string]any{"status": "running"}, "\n")+sseEvent("2", "done", task, "\n"))
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	setValue(t, ctx, "destination", "Lisbon")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.getElementById('task').dataset.status === 'failed' && document.getElementById('messages').dataset.code === 'worker_lost'`)
	if code := eval[string](t, ctx, `document.getElementById('task-error').dataset.code`); code != "worker_lost" {
		t.Errorf("task error code %q", code)
	}
	wantContains(t, "task error", text(t, ctx, "task-error"), "stopped before it finished", "not run or charged twice", "still counts")
	wantContains(t, "message", text(t, ctx, "messages"), "stopped before it finished")
	if strings.Contains(text(t, ctx, "task"), "server text") {
		t.Error("the server's sentence is shown")
	}
	switchLanguage(t, ctx, "zh-CN")
	wantContains(t, "task error", text(t, ctx, "task-error"), "停止", "仍计入")
}

// browserPlanLanguage: the page asks for a plan in its own language and
// marks the plan with the language it came in: an English plan on the
// Chinese page is lang="en", a Chinese plan on the English page lang="zh-CN",
// while the page's own labels keep the page's language.
func browserPlanLanguage(t *testing.T, browser context.Context) {
	var mu sync.Mutex
	next := 0
	f := &fakeAPI{config: devConfig}
	f.create = func(w http.ResponseWriter, _ map[string]any) {
		mu.Lock()
		next++
		id := fmt.Sprintf("t_lang%d", next)
		mu.Unlock()
		accept(id)(w, nil)
	}
	f.events = func(w http.ResponseWriter, r *http.Request, _ int) {
		id := r.PathValue("id")
		lang := "en"
		if id == "t_lang2" {
			lang = "zh-CN"
		}
		w.Header().Set("Content-Type", "text/event-stream")
		flushed(w, sseEvent("1", "done", withResult(id, map[string]any{"language": lang}), "\n"))
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	type langs struct{ Page, Summary, Days, Label, LabelText string }
	read := func() langs {
		return eval[langs](t, ctx, `({Page: document.documentElement.lang,
			Summary: document.getElementById('summary').lang, Days: document.getElementById('days-list').lang,
			Label: document.querySelector('.day-label').lang, LabelText: document.querySelector('.day-label').textContent})`)
	}

	switchLanguage(t, ctx, "zh-CN")
	setValue(t, ctx, "destination", "里斯本")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `location.hash === '#t_lang1' && !document.getElementById('result').hidden`)
	if got := f.lastPost(t)["language"]; got != "zh-CN" {
		t.Errorf("the Chinese page asked for language %v", got)
	}
	if got := read(); got != (langs{"zh-CN", "en", "en", "zh-CN", "第 1 天："}) {
		t.Errorf("English plan on the Chinese page: %+v", got)
	}

	switchLanguage(t, ctx, "en")
	do2(t, ctx, chromedp.WaitEnabled(chromedp.ID("submit")), chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `location.hash === '#t_lang2' && !document.getElementById('result').hidden`)
	if got := f.lastPost(t)["language"]; got != "en" {
		t.Errorf("the English page asked for language %v", got)
	}
	if got := read(); got != (langs{"en", "zh-CN", "zh-CN", "en", "Day 1: "}) {
		t.Errorf("Chinese plan on the English page: %+v", got)
	}
}
