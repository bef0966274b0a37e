// Command example-agent is a small agent for faregate's "bring your own
// agent" mode (FAREGATE_AGENT_URL): it answers each signed delivery with
// the official OpenAI Go client pointed at faregate's model endpoint and
// the task key it was given, offers the model one tool (fetch_page, served
// by faregate's /v1/tools/fetch), reports its progress to the visitor's
// page, and posts a Markdown answer to the task's result_url.
//
//	FAREGATE_AGENT_SECRET=… go run ./cmd/example-agent
//
// It listens on EXAMPLE_AGENT_ADDR (default 127.0.0.1:8090) and checks
// every delivery's X-Faregate-Signature with FAREGATE_AGENT_SECRET, the
// same variable faregate signs with, so both can read one environment.
// EXAMPLE_AGENT_API=anthropic makes it a Claude agent instead: the same
// loop on Anthropic's Go SDK, against the delivery's "anthropic" endpoint
// (faregate's /v1/messages; the SDK appends /v1/messages to its base URL).
package main

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/shared"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args, os.Getenv, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "example-agent:", err)
		os.Exit(1)
	}
}

// Bounds of one task's work.
const (
	maxDelivery = 1 << 20 // a delivery is a few hundred bytes; its request at most a few KiB
	maxTurns    = 4       // model calls that may ask for tools; one closing call comes on top
	maxPageText = 6000    // characters of a fetched page handed to the model
	maxAnswer   = 60000   // bytes of the answer (faregate takes at most 64 KiB)
)

// run serves deliveries until ctx ends. Tests call it on 127.0.0.1:0 and
// read the address from stdout's first line.
func run(ctx context.Context, args []string, getenv func(string) string, stdout io.Writer) error {
	if len(args) > 1 {
		return fmt.Errorf("no arguments expected (configuration: EXAMPLE_AGENT_ADDR, FAREGATE_AGENT_SECRET, EXAMPLE_AGENT_API)")
	}
	api := getenv("EXAMPLE_AGENT_API")
	switch api {
	case "":
		api = apiOpenAI
	case apiOpenAI, apiAnthropic:
	default:
		return fmt.Errorf("EXAMPLE_AGENT_API: %q, want openai or anthropic", api)
	}
	secret := getenv("FAREGATE_AGENT_SECRET")
	if len(secret) < 16 {
		return errors.New("FAREGATE_AGENT_SECRET: at least 16 characters, the same as faregate's")
	}
	addr := getenv("EXAMPLE_AGENT_ADDR")
	if addr == "" {
		addr = "127.0.0.1:8090"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	lg := slog.New(slog.NewTextHandler(stdout, nil))
	a := &agent{secret: []byte(secret), api: api, lg: lg, now: time.Now, http: &http.Client{Timeout: 30 * time.Second}}
	srv := &http.Server{Handler: a, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 10 * time.Second}
	fmt.Fprintf(stdout, "example-agent: listening on http://%s\n", ln.Addr())
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	a.work.Wait() // tasks under way post their answer (their deadline bounds them)
	return nil
}

// delivery is faregate's task delivery.
type delivery struct {
	Task struct {
		ID       string          `json:"id"`
		Request  json.RawMessage `json:"request"`
		Deadline time.Time       `json:"deadline"`
	} `json:"task"`
	OpenAI    endpoint `json:"openai"`
	Anthropic endpoint `json:"anthropic"`
	Tools     struct {
		FetchURL string `json:"fetch_url"`
	} `json:"tools"`
	EventsURL string `json:"events_url"`
	ResultURL string `json:"result_url"`
}

// endpoint is where the delivery says a model API is: faregate's own,
// behind the task key.
type endpoint struct {
	BaseURL string `json:"base_url"`
	APIKey  string `json:"api_key"`
	Model   string `json:"model"`
}

// The model APIs the agent speaks (EXAMPLE_AGENT_API).
const (
	apiOpenAI    = "openai"
	apiAnthropic = "anthropic"
)

// endpoint is the delivery's endpoint for the API the agent speaks.
func (d *delivery) endpoint(api string) endpoint {
	if api == apiAnthropic {
		return d.Anthropic
	}
	return d.OpenAI
}

type agent struct {
	secret []byte
	api    string
	lg     *slog.Logger
	now    func() time.Time
	http   *http.Client
	work   sync.WaitGroup
}

// ServeHTTP takes a delivery: signed by faregate, not past its deadline.
// It answers 202 at once and does the work in the background.
func (a *agent) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST a delivery", http.StatusMethodNotAllowed)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxDelivery+1))
	if err != nil || len(body) > maxDelivery {
		http.Error(w, "unreadable or too large", http.StatusBadRequest)
		return
	}
	if !a.signed(body, r.Header.Get("X-Faregate-Signature")) {
		http.Error(w, "bad signature", http.StatusUnauthorized)
		return
	}
	var d delivery
	if err := json.Unmarshal(body, &d); err != nil || d.Task.ID == "" || d.endpoint(a.api).APIKey == "" || d.ResultURL == "" {
		http.Error(w, "not a delivery", http.StatusBadRequest)
		return
	}
	if !a.now().Before(d.Task.Deadline) {
		http.Error(w, "past its deadline", http.StatusBadRequest)
		return
	}
	w.WriteHeader(http.StatusAccepted)
	a.work.Add(1)
	go func() {
		defer a.work.Done()
		ctx, cancel := context.WithDeadline(context.Background(), d.Task.Deadline)
		defer cancel()
		a.handle(ctx, d)
	}()
}

// signed checks X-Faregate-Signature: sha256=<hex HMAC of the body>.
func (a *agent) signed(body []byte, sig string) bool {
	hexSum, ok := strings.CutPrefix(sig, "sha256=")
	if !ok {
		return false
	}
	got, err := hex.DecodeString(hexSum)
	if err != nil {
		return false
	}
	m := hmac.New(sha256.New, a.secret)
	m.Write(body)
	return hmac.Equal(got, m.Sum(nil))
}

// handle does one task and posts its answer (or its error).
func (a *agent) handle(ctx context.Context, d delivery) {
	lg := a.lg.With("task", d.Task.ID)
	text, err := a.answer(ctx, d)
	var body any
	if err != nil {
		lg.Warn("task failed", "err", err.Error())
		body = map[string]any{"error": map[string]string{"code": "example_agent_failed", "message": err.Error()}}
	} else {
		body = map[string]any{"result": map[string]string{"text": text}}
	}
	// The answer is owed even when the deadline is near: a little grace.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if st, err := a.post(pctx, d, d.ResultURL, body, nil); err != nil || st != http.StatusNoContent {
		lg.Warn("result not taken", "status", st, "err", errString(err))
		return
	}
	lg.Info("task answered", "bytes", len(text))
}

// systemPrompt is what the agent is, on either API.
const systemPrompt = "You answer a visitor's request in Markdown: short headings, lists where they help. " +
	"You may call fetch_page to read a public web page; cite what you used."

// answer runs the model loop: the model may call fetch_page a few times,
// then writes the answer.
func (a *agent) answer(ctx context.Context, d delivery) (string, error) {
	if a.api == apiAnthropic {
		return a.answerClaude(ctx, d)
	}
	question := describe(d.Task.Request)
	a.event(ctx, d, "think", "started", "")
	client := openai.NewClient(option.WithBaseURL(d.OpenAI.BaseURL), option.WithAPIKey(d.OpenAI.APIKey),
		option.WithHTTPClient(a.http))
	fetch := openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
		Name:        "fetch_page",
		Description: openai.String("Fetch a public web page and return its readable text."),
		Parameters: shared.FunctionParameters{
			"type":                 "object",
			"properties":           map[string]any{"url": map[string]any{"type": "string", "description": "an absolute http(s) URL"}},
			"required":             []string{"url"},
			"additionalProperties": false,
		},
	})
	msgs := []openai.ChatCompletionMessageParamUnion{
		openai.SystemMessage(systemPrompt),
		openai.UserMessage(question),
	}
	for turn := 0; ; turn++ {
		params := openai.ChatCompletionNewParams{Model: shared.ChatModel(d.OpenAI.Model), Messages: msgs}
		if turn < maxTurns {
			params.Tools = []openai.ChatCompletionToolUnionParam{fetch}
		}
		comp, err := client.Chat.Completions.New(ctx, params)
		if err != nil {
			a.event(ctx, d, "think", "failed", "")
			return "", fmt.Errorf("model call: %w", err)
		}
		if len(comp.Choices) == 0 {
			return "", errors.New("the model answered no choice")
		}
		msg := comp.Choices[0].Message
		if len(msg.ToolCalls) == 0 || turn >= maxTurns {
			a.event(ctx, d, "think", "ok", "")
			text := strings.TrimSpace(msg.Content)
			if text == "" {
				return "", errors.New("the model answered no text")
			}
			return clipBytes(text, maxAnswer), nil
		}
		msgs = append(msgs, msg.ToParam())
		for _, tc := range msg.ToolCalls {
			msgs = append(msgs, openai.ToolMessage(a.tool(ctx, d, tc.Function.Name, tc.Function.Arguments), tc.ID))
		}
	}
}

// tool runs one tool call and returns what the model reads back.
func (a *agent) tool(ctx context.Context, d delivery, name, args string) string {
	if name != "fetch_page" {
		return "There is no tool named " + name + "."
	}
	var in struct {
		URL string `json:"url"`
	}
	if json.Unmarshal([]byte(args), &in) != nil || in.URL == "" {
		return `fetch_page needs {"url": "https://…"}.`
	}
	a.event(ctx, d, "fetch", "started", in.URL)
	var page struct {
		Status    int    `json:"status"`
		Text      string `json:"text"`
		Truncated bool   `json:"truncated"`
	}
	st, err := a.post(ctx, d, d.Tools.FetchURL, map[string]any{"url": in.URL}, &page)
	if err != nil || st != http.StatusOK {
		a.event(ctx, d, "fetch", "failed", fmt.Sprintf("%s (%d)", in.URL, st))
		return fmt.Sprintf("Could not fetch %s (answer %d).", in.URL, st)
	}
	a.event(ctx, d, "fetch", "ok", fmt.Sprintf("%s (%d)", in.URL, page.Status))
	return fmt.Sprintf("Page %s (HTTP %d):\n\n%s", in.URL, page.Status, clipRunes(page.Text, maxPageText))
}

// event reports progress; a refused event (the task's limit) is no reason
// to stop working.
func (a *agent) event(ctx context.Context, d delivery, name, status, detail string) {
	ev := map[string]string{"name": name, "status": status}
	if detail != "" {
		ev["detail"] = clipRunes(detail, 500)
	}
	if st, err := a.post(ctx, d, d.EventsURL, ev, nil); err != nil || st != http.StatusNoContent {
		a.lg.Debug("event not shown", "task", d.Task.ID, "status", st, "err", errString(err))
	}
}

// post sends v as JSON to url with the task key, decoding a 200's body
// into out when given.
func (a *agent) post(ctx context.Context, d delivery, url string, v, out any) (int, error) {
	raw, _ := json.Marshal(v)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(raw))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+d.endpoint(a.api).APIKey)
	resp, err := a.http.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	if out != nil && resp.StatusCode == http.StatusOK {
		if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(out); err != nil {
			return resp.StatusCode, err
		}
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, nil
}

// describe turns the task's request into the user's message: the prompt
// form's text, or the trip request in words.
func describe(raw json.RawMessage) string {
	var r struct {
		Prompt      string   `json:"prompt"`
		Destination string   `json:"destination"`
		Days        int      `json:"days"`
		Interests   []string `json:"interests"`
		Language    string   `json:"language"`
	}
	_ = json.Unmarshal(raw, &r)
	lang := "Answer in English."
	if r.Language == "zh-CN" {
		lang = "请用简体中文回答。"
	}
	if r.Prompt != "" {
		return r.Prompt + "\n\n" + lang
	}
	q := fmt.Sprintf("Plan %d days in %s.", r.Days, r.Destination)
	if len(r.Interests) > 0 {
		q += " Interests: " + strings.Join(r.Interests, ", ") + "."
	}
	return q + " " + lang
}

func clipRunes(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n]) + " …"
}

// clipBytes cuts s to at most n bytes on a rune boundary.
func clipBytes(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
