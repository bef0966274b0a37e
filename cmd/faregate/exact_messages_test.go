package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"

	"faregate/agent/tokens"
	"faregate/protect/budget"
)

// The exactness test on Anthropic's Messages wire (issue #31): the same
// run as exact_test.go's, with FAREGATE_LLM_PROVIDER=anthropic, the agents
// on Anthropic's Go SDK making streaming /v1/messages calls that each ask
// for far more than the task can afford, and an Anthropic-shaped upstream
// that streams exactly the max_tokens it was sent and reports exactly
// that: message_start with the prompt split into input, cache writes and
// cache reads, then a cumulative message_delta twice (half, then all).

// The upstream's prompt report: its whole prompt is faregate's own count
// (the same tokenizer), of which these are cache writes and reads.
const (
	exactCacheWrite, exactCacheRead = 4, 6
	// exactMessagesPrices are the model's prices per million tokens:
	// input, output, cache write, cache read.
	exactMessagesPrices = "3/15/3.75/0.3"
)

// TestExactMessages: 6 tasks × 4 Messages streams on 2 replicas, caps
// binding at every level.
func TestExactMessages(t *testing.T) {
	exactRun(t, exactScale{calls: 4, heavy: 1, heavyTasks: 4, light: 2, lightTasks: 1,
		maxTokens: 200, taskCap: 500, visitorCap: 900, siteCap: 1800,
		deadline: 60 * time.Second, overallBudget: 90 * time.Second, kinds: "a", siteBinds: true, anthropic: true})
}

// TestExactMessagesSoak is the size (FAREGATE_SOAK=1): 50 tasks on
// two replicas, each agent making 10 concurrent Messages streams
// (FAREGATE_AGENT_MAX_PARALLEL=10), half of them hung up at a random
// point.
func TestExactMessagesSoak(t *testing.T) {
	if os.Getenv("FAREGATE_SOAK") != "1" {
		t.Skip("set FAREGATE_SOAK=1 for the soak tests (.ci/run does)")
	}
	exactRun(t, exactScale{calls: 10, heavy: 5, heavyTasks: 8, light: 5, lightTasks: 2,
		maxTokens: 200, taskCap: 1000, visitorCap: 3000, siteCap: 24000,
		deadline: 180 * time.Second, overallBudget: 240 * time.Second, kinds: "a", siteBinds: true,
		hangUps: true, anthropic: true})
}

// exactMessagesCosts checks every ledger line's money: its cache tokens
// priced as configured, apart from its other input.
func exactMessagesCosts(t *testing.T, led exactLedger) {
	t.Helper()
	p, err := budget.ParsePrices("m=" + exactMessagesPrices)
	if err != nil {
		t.Fatal(err)
	}
	price := p["m"]
	for _, l := range led.lines {
		if l.cacheWrite != exactCacheWrite || l.cacheRead != exactCacheRead {
			t.Errorf("ledger line of %s: cache %d written, %d read; the upstream reported %d and %d", l.requestID, l.cacheWrite, l.cacheRead,
				exactCacheWrite, exactCacheRead)
			continue
		}
		want := price.CostOf(budget.Tokens{Input: l.prompt - l.cacheWrite - l.cacheRead, CacheWrite: l.cacheWrite,
			CacheRead: l.cacheRead, Output: l.completion})
		if l.cost != want {
			t.Errorf("ledger line of %s: cost %d µ, want %d µ at %s", l.requestID, l.cost, want, exactMessagesPrices)
		}
	}
}

// exactMsgRequest is what the upstream reads of a Messages request.
type exactMsgRequest struct {
	Model     string `json:"model"`
	Stream    bool   `json:"stream"`
	MaxTokens int64  `json:"max_tokens"`
	Messages  []struct {
		Role    string `json:"role"`
		Content []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		} `json:"content"`
	} `json:"messages"`
	Task string `json:"exact_task"`
	Call int    `json:"exact_call"`
}

// serveMessages streams a Messages answer of exactly max_tokens tokens.
func (u *exactUpstream) serveMessages(w http.ResponseWriter, r *http.Request) {
	raw, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return
	}
	var req exactMsgRequest
	if err := json.Unmarshal(raw, &req); err != nil || !req.Stream || req.MaxTokens < 1 {
		u.t.Errorf("upstream: not a streaming Messages request with max_tokens: %v %s", err, raw)
		http.Error(w, "bad request", http.StatusBadRequest)
		return
	}
	if !strings.HasPrefix(req.Task, "t_") || r.Header.Get("X-Api-Key") != "sk-upstream" {
		u.t.Errorf("upstream: the agent's extra field or the upstream key did not arrive: %q %q", req.Task, r.Header.Get("X-Api-Key"))
	}
	var msgs []tokens.Message
	for _, m := range req.Messages {
		for _, c := range m.Content {
			msgs = append(msgs, tokens.Message{Role: m.Role, Content: c.Text})
		}
	}
	c := exactUpCall{task: req.Task, kind: "messages", prompt: u.counter.Chat(msgs, ""), limit: req.MaxTokens,
		under: u.chooseUnder(req.Task, req.Call)}
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	rc := http.NewResponseController(w)
	send := func(name string, v map[string]any) bool {
		v["type"] = name
		b, _ := json.Marshal(v)
		if _, err := io.WriteString(w, "event: "+name+"\ndata: "+string(b)+"\n\n"); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	defer func() {
		u.mu.Lock()
		u.calls = append(u.calls, c)
		u.mu.Unlock()
	}()
	// The prompt reported is input + cache writes + cache reads.
	p, _ := c.reported()
	cw, cr := int64(exactCacheWrite), int64(exactCacheRead)
	if c.under {
		cw, cr = 0, 0
	}
	input := p - cw - cr
	if input < 0 {
		u.t.Errorf("upstream: a prompt of %d tokens cannot hold the cache's %d", p, cw+cr)
	}
	if !send("message_start", map[string]any{"message": map[string]any{"id": "msg_exact", "type": "message", "role": "assistant",
		"model": req.Model, "content": []any{}, "stop_reason": nil, "stop_sequence": nil,
		"usage": map[string]any{"input_tokens": input, "cache_creation_input_tokens": cw, "cache_read_input_tokens": cr, "output_tokens": 1}}}) ||
		!send("content_block_start", map[string]any{"index": 0, "content_block": map[string]any{"type": "text", "text": ""}}) {
		return
	}
	for i := int64(0); i < c.limit; i++ {
		if r.Context().Err() != nil {
			return
		}
		c.generated++
		if !send("content_block_delta", map[string]any{"index": 0, "delta": map[string]any{"type": "text_delta", "text": u.word(i)}}) {
			return
		}
		if i == c.limit/2 {
			// A cumulative report mid-stream: replaced by the next, never
			// added to it.
			_, o := c.reported()
			if !send("message_delta", map[string]any{"delta": map[string]any{"stop_reason": nil, "stop_sequence": nil},
				"usage": map[string]any{"output_tokens": min(o, c.generated)}}) {
				return
			}
		}
	}
	_, o := c.reported()
	_ = send("content_block_stop", map[string]any{"index": 0}) &&
		send("message_delta", map[string]any{"delta": map[string]any{"stop_reason": "max_tokens", "stop_sequence": nil},
			"usage": map[string]any{"output_tokens": o}}) &&
		send("message_stop", map[string]any{})
}

// messages makes call i as a Messages stream on Anthropic's Go SDK,
// asking max_tokens far above the task's cap.
func (a *exactAgent) messages(ctx context.Context, hangUp context.CancelFunc, d delivery, base string, i int, prompt string, asked int64) exactResult {
	id := d.Body.Task.ID
	res := exactResult{task: id, kind: "messages", call: i}
	c := anthropic.NewClient(option.WithBaseURL(base), option.WithAPIKey(d.Body.Anthropic.APIKey), option.WithMaxRetries(0),
		option.WithJSONSet("exact_task", id), option.WithJSONSet("exact_call", i))
	hangsUp := a.hanger(id, i)
	var hdr *http.Response
	stream := c.Messages.NewStreaming(ctx, anthropic.MessageNewParams{Model: anthropic.Model(d.Body.Anthropic.Model), MaxTokens: asked,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(prompt))}}, option.WithResponseInto(&hdr))
	if hdr != nil {
		res.requestID = hdr.Header.Get("X-Request-Id")
	}
	var msg anthropic.Message
	pieces := func() int64 {
		n := 0
		for _, b := range msg.Content {
			n += strings.Count(b.Text, " ")
		}
		return int64(n)
	}
	for events := 0; stream.Next(); events++ {
		if hangsUp(events) {
			hangUp()
			_ = stream.Close()
			res.abandoned, res.read = true, exactPromptTokens(a.model)[i]+pieces()
			return res
		}
		if err := msg.Accumulate(stream.Current()); err != nil && res.err == "" {
			res.err = "accumulate: " + err.Error()
		}
	}
	if err := stream.Err(); err != nil {
		res.refused, res.err = exactMessagesRefusal(err, pieces())
		return res
	}
	n := pieces()
	res.read = exactPromptTokens(a.model)[i] + n
	res.under = a.up.wasUnder(id, i)
	u := msg.Usage
	switch {
	case res.err != "":
	case msg.StopReason != "max_tokens":
		res.err = fmt.Sprintf("stop_reason %q, want max_tokens", msg.StopReason)
	case res.under:
	case u.OutputTokens != n || u.InputTokens <= 0 || u.CacheReadInputTokens != exactCacheRead || u.CacheCreationInputTokens != exactCacheWrite:
		res.err = fmt.Sprintf("usage %+v, read %d tokens", u, n)
	}
	res.prompt, res.completion = u.InputTokens+u.CacheCreationInputTokens+u.CacheReadInputTokens, u.OutputTokens
	return res
}

// exactMessagesRefusal is exactRefusal in Anthropic's error shape: the
// budget's 429 before any byte, its code in error.code.
func exactMessagesRefusal(err error, pieces int64) (bool, string) {
	var apiErr *anthropic.Error
	if errors.As(err, &apiErr) && apiErr.StatusCode == 429 && pieces == 0 && apiErr.Response.Header.Get("X-Should-Retry") == "false" {
		var body struct {
			Type  string
			Error struct{ Type, Code string }
		}
		if json.Unmarshal([]byte(apiErr.RawJSON()), &body) == nil && body.Error.Code == "demo_budget_exhausted" &&
			body.Type == "error" && body.Error.Type == "rate_limit_error" {
			return true, ""
		}
		return false, "a 429 not in Anthropic's shape with the budget's code: " + apiErr.RawJSON()
	}
	return false, "error: " + err.Error()
}
