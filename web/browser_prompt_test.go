package web

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/chromedp/chromedp"
)

// promptConfig is /api/config of a server whose external agent takes a
// prompt.
func promptConfig(base string) map[string]any {
	c := devConfig(base)
	c["input"] = "prompt"
	c["offline_model"] = false
	c["limits"].(map[string]any)["prompt_max_chars"] = 40
	return c
}

// hostileMarkdown is an agent's answer that tries to run script through
// every door the Markdown subset has.
const hostileMarkdown = "# Night trains\n\n" +
	"Take the **Nightjet** from *Vienna*; see `<b>tickets</b>`.\n\n" +
	"- [timetable](https://www.oebb.at/en?x=1&y=2)\n" +
	"- [click me](javascript:window.__pwned=1)\n" +
	"- [also me](JaVaScRiPt:window.__pwned=1)\n" +
	"- [data](data:text/html,<script>window.__pwned=1</script>)\n" +
	"1. <script>window.__pwned=1</script>\n" +
	"2. <img src=x onerror=\"window.__pwned=1\">\n\n" +
	"```\n<script>window.__pwned=1</script>\n```\n"

// browserPromptForm (#21 item 6): with input "prompt" the page shows a text
// box instead of the trip form, checks the prompt's length before spending
// a token, sends {turnstile_token, prompt, language}, and renders the
// answer's Markdown subset inert: no script runs, no javascript: or data:
// link exists, the http(s) link has rel="nofollow noopener". An
// agent_failed task keeps its message.
func browserPromptForm(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: promptConfig, create: accept("t_prompt")}
	var fail bool
	f.events = func(w http.ResponseWriter, r *http.Request, _ int) {
		final := map[string]any{
			"id": r.PathValue("id"), "status": "succeeded",
			"request": map[string]any{"prompt": "Night trains?", "language": "en"},
			"steps":   []any{map[string]any{"seq": 1, "kind": "agent", "name": "search", "status": "ok", "duration_ms": 5}},
			"result":  map[string]any{"text": hostileMarkdown, "title": "<i>Trains</i>", "warnings": []string{}, "model": "gpt-test", "language": "en"},
			"usage":   map[string]any{"prompt_tokens": 10, "completion_tokens": 20},
		}
		if fail {
			final = map[string]any{"id": r.PathValue("id"), "status": "failed", "request": map[string]any{"prompt": "x", "language": "en"},
				"steps": []any{}, "error": map[string]any{"code": "agent_failed", "message": "server text"}}
		}
		writeEvents(w, "done", final)
	}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx,
		chromedp.Navigate(srv.URL),
		chromedp.WaitVisible(chromedp.ID("prompt")),
		chromedp.WaitEnabled(chromedp.ID("submit")),
	)
	type form struct {
		TripHidden, PromptShown     bool
		Heading, Submit, Hint, Form string
	}
	fm := eval[form](t, ctx, `({
		TripHidden: document.getElementById('trip-fields').hidden,
		PromptShown: !document.getElementById('prompt-field').hidden,
		Heading: document.getElementById('app-heading').textContent,
		Submit: document.getElementById('submit').textContent,
		Hint: document.getElementById('prompt-hint').textContent,
		Form: document.getElementById('form-heading').textContent,
	})`)
	if !fm.TripHidden || !fm.PromptShown || fm.Heading != "Ask the agent" || fm.Submit != "Send to the agent" || !strings.Contains(fm.Hint, "40") || fm.Form != "Your request" {
		t.Fatalf("prompt form: %+v", fm)
	}

	// Too long: refused on the page, no token spent.
	setValue(t, ctx, "prompt", strings.Repeat("x", 41))
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `!document.getElementById('prompt-error').hidden`)
	if got := text(t, ctx, "prompt-error"); !strings.Contains(got, "1 to 40 characters") || f.postCount() != 0 {
		t.Fatalf("too long: %q, %d posts", got, f.postCount())
	}
	// A zero-width space is refused too, a line break is not.
	setValue(t, ctx, "prompt", "night\u200btrains")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `document.getElementById('prompt-error').textContent.includes('invisible')`)

	setValue(t, ctx, "prompt", "  Night trains\nfrom Vienna? ")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `!document.getElementById('answer').hidden`)
	post := f.lastPost(t)
	if post["prompt"] != "Night trains\nfrom Vienna?" || post["language"] != "en" || post["turnstile_token"] == nil || post["destination"] != nil {
		t.Fatalf("posted %v", post)
	}

	type answer struct {
		Pwned                          bool
		Scripts, Imgs, Links, Headings int
		Hrefs, Rels                    []string
		Title, Heading, ResultHeading  string
		Strong, Em, Code, Pre          string
		Items                          []string
		SummaryHidden, DaysEmpty       bool
		Message                        string
	}
	a := eval[answer](t, ctx, `(() => {
		const box = document.getElementById('answer');
		const links = [...box.querySelectorAll('a')];
		return {
			Pwned: !!window.__pwned,
			Scripts: box.querySelectorAll('script').length,
			Imgs: box.querySelectorAll('img, b, i').length + document.getElementById('answer-title').querySelectorAll('*').length,
			Links: links.length,
			Headings: box.querySelectorAll('h4').length,
			Hrefs: links.map((l) => l.getAttribute('href')),
			Rels: links.map((l) => l.getAttribute('rel')),
			Title: document.getElementById('answer-title').textContent,
			Heading: document.getElementById('task-heading').textContent,
			ResultHeading: document.getElementById('result-heading').textContent,
			Strong: (box.querySelector('strong') || {}).textContent || '',
			Em: (box.querySelector('em') || {}).textContent || '',
			Code: (box.querySelector('p code') || {}).textContent || '',
			Pre: (box.querySelector('pre code') || {}).textContent || '',
			Items: [...box.querySelectorAll('li')].map((li) => li.textContent),
			SummaryHidden: document.getElementById('summary').hidden,
			DaysEmpty: document.getElementById('days-list').children.length === 0,
			Message: document.getElementById('message-text').textContent,
		};
	})()`)
	if a.Pwned || a.Scripts != 0 || a.Imgs != 0 {
		t.Errorf("the answer ran or built markup: pwned %v, %d scripts, %d other elements", a.Pwned, a.Scripts, a.Imgs)
	}
	if a.Links != 1 || a.Hrefs[0] != "https://www.oebb.at/en?x=1&y=2" || a.Rels[0] != "nofollow noopener" {
		t.Errorf("links %v rel %v, want only the https link with rel=\"nofollow noopener\"", a.Hrefs, a.Rels)
	}
	if a.Headings != 1 || a.Strong != "Nightjet" || a.Em != "Vienna" || a.Code != "<b>tickets</b>" || a.Pre != "<script>window.__pwned=1</script>" {
		t.Errorf("Markdown subset: %+v", a)
	}
	if len(a.Items) != 6 || a.Items[1] != "[click me](javascript:window.__pwned=1)" || a.Items[4] != "<script>window.__pwned=1</script>" {
		t.Errorf("list items %q: a refused link and raw HTML must stay visible as text", a.Items)
	}
	if a.Title != "<i>Trains</i>" || a.Heading != "Your task" || a.ResultHeading != "Answer" || !a.SummaryHidden || !a.DaysEmpty || a.Message != "Your answer is ready." {
		t.Errorf("answer view: %+v", a)
	}

	// A failed task: the agent_failed message, worded for both modes.
	fail = true
	setValue(t, ctx, "prompt", "again")
	do2(t, ctx, chromedp.Click(chromedp.ID("submit")))
	waitFor(t, ctx, `!document.getElementById('task-error').hidden`)
	if got := text(t, ctx, "task-error-text"); got != "The agent could not finish this task." {
		t.Errorf("agent_failed reads %q", got)
	}
}

// browserMarkdown runs the renderer on its own in the page (the page's
// JavaScript runs nowhere else): each case's DOM, serialised, against the
// expected markup.
func browserMarkdown(t *testing.T, browser context.Context) {
	f := &fakeAPI{config: devConfig, create: accept("t_x")}
	srv := startSite(t, f)
	ctx := tab(t, browser)
	do2(t, ctx, chromedp.Navigate(srv.URL), chromedp.WaitEnabled(chromedp.ID("submit")))
	cases := []struct{ in, want string }{
		{"plain", "<p>plain</p>"},
		{"# One\n## Two\n### Three\n#### Four", "<h4>One</h4><h5>Two</h5><h6>Three</h6><h6>Four</h6>"},
		{"a\nb\n\nc", "<p>a b</p><p>c</p>"},
		{"- x\n- y\n\n1. a\n2. b", "<ul><li>x</li><li>y</li></ul><ol><li>a</li><li>b</li></ol>"},
		{"3. c\n4. d", `<ol start="3"><li>c</li><li>d</li></ol>`},
		{"- item\n  more", "<ul><li>item more</li></ul>"},
		{"**b** *i* __b__ _i_ `c`", "<p><strong>b</strong> <em>i</em> <strong>b</strong> <em>i</em> <code>c</code></p>"},
		{"**a *b* c**", "<p><strong>a <em>b</em> c</strong></p>"},
		{"snake_case_name and 2*3*4", "<p>snake_case_name and 2<em>3</em>4</p>"},
		{"[x](https://a.example/p?q=1)", `<p><a href="https://a.example/p?q=1" rel="nofollow noopener">x</a></p>`},
		{"[**x**](http://a.example)", `<p><a href="http://a.example/" rel="nofollow noopener"><strong>x</strong></a></p>`},
		{"[x](javascript:alert(1))", "<p>[x](javascript:alert(1))</p>"},
		{"[x](javascript:alert)", "<p>[x](javascript:alert)</p>"},
		{"[x](/relative)", "<p>[x](/relative)</p>"},
		{"[x](https://)", "<p>[x](https://)</p>"},
		{"<script>alert(1)</script>", "<p>&lt;script&gt;alert(1)&lt;/script&gt;</p>"},
		{"```js\nif (a < b) {}\n```", "<pre><code>if (a &lt; b) {}</code></pre>"},
		{"```\nunclosed", "<pre><code>unclosed</code></pre>"},
		{"a & b", "<p>a &amp; b</p>"},
		{"", ""},
	}
	for _, tc := range cases {
		in, _ := json.Marshal(tc.in)
		got := evalAsync[string](t, ctx, `(async () => {
			const src = [...document.scripts].find((s) => s.type === 'module').src;
			const { renderMarkdown } = await import(new URL('markdown.js', src));
			const box = document.createElement('div');
			box.append(renderMarkdown(`+string(in)+`));
			return box.innerHTML;
		})()`)
		if got != tc.want {
			t.Errorf("renderMarkdown(%q) = %s, want %s", tc.in, got, tc.want)
		}
	}
	// Linear time on hostile input: 60,000 unclosed brackets and markers.
	ms := evalAsync[float64](t, ctx, `(async () => {
		const src = [...document.scripts].find((s) => s.type === 'module').src;
		const { renderMarkdown } = await import(new URL('markdown.js', src));
		const t0 = performance.now();
		renderMarkdown('['.repeat(60000) + '*a '.repeat(20000) + '_'.repeat(60000) + (String.fromCharCode(96) + ' ').repeat(20000));
		return performance.now() - t0;
	})()`)
	t.Logf("hostile 180 KB of markers: %.0f ms", ms)
	if ms > 5000 {
		t.Errorf("hostile markers took %.0f ms", ms)
	}
}

// evalAsync evaluates an expression whose value is a promise and decodes
// what it resolves to.
func evalAsync[T any](t *testing.T, ctx context.Context, expr string) T {
	t.Helper()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[T](expr, chromedp.EvalAwaitPromise))
	if err != nil {
		t.Fatalf("%s: %v", expr, err)
	}
	return v
}
