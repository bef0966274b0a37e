package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/responses"
	"github.com/openai/openai-go/v3/shared"
)

// e2eAgent is an operator's agent as one is written: on a delivery it
// calls the model endpoint with the official client (github.com/openai/
// openai-go/v3) configured from the delivery, through both replicas (the
// delivering one's base_url and the other's), posts its progress to the
// other replica, and answers 200 with its result. What it saw is kept for
// the test: the deliveries, each call's parsed answer, and every error.
type e2eAgent struct {
	t        *testing.T
	srv      *httptest.Server
	replicas []string

	mu         sync.Mutex
	deliveries []delivery
	calls      []e2eCall
	events     []string // name:status of the events posted, in order
	errs       []string
}

// e2eCall is one model call as the official client parsed it.
type e2eCall struct {
	What string
	// Prompt and Completion are the usage the client read.
	Prompt, Completion int64
	Finish             string
	Text               string
}

func newE2EAgent(t *testing.T) *e2eAgent {
	a := &e2eAgent{t: t}
	a.srv = httptest.NewServer(http.HandlerFunc(a.serve))
	t.Cleanup(a.srv.Close)
	return a
}

func (a *e2eAgent) fail(format string, args ...any) {
	a.mu.Lock()
	a.errs = append(a.errs, fmt.Sprintf(format, args...))
	a.mu.Unlock()
}

func (a *e2eAgent) called(c e2eCall) {
	a.mu.Lock()
	a.calls = append(a.calls, c)
	a.mu.Unlock()
}

// Seen is what the agent saw: deliveries, calls, events posted and errors.
func (a *e2eAgent) Seen() ([]delivery, []e2eCall, []string, []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]delivery(nil), a.deliveries...), append([]e2eCall(nil), a.calls...),
		append([]string(nil), a.events...), append([]string(nil), a.errs...)
}

var e2eLookupTool = openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
	Name: "lookup", Description: openai.String("Look a city up."),
	Parameters: shared.FunctionParameters{"type": "object",
		"properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}}})

func (a *e2eAgent) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	d := delivery{Raw: raw, Signature: r.Header.Get("X-Faregate-Signature")}
	if err := json.Unmarshal(raw, &d.Body); err != nil {
		a.fail("delivery body: %v", err)
		http.Error(w, "bad delivery", 400)
		return
	}
	a.mu.Lock()
	a.deliveries = append(a.deliveries, d)
	a.mu.Unlock()
	// The delivering replica is base_url's; the other serves the same
	// task with the same key.
	own := strings.TrimSuffix(d.Body.OpenAI.BaseURL, "/v1")
	other := own
	for _, rep := range a.replicas {
		if rep != own {
			other = rep
		}
	}
	ctx, cancel := context.WithDeadline(r.Context(), d.Body.Task.Deadline)
	defer cancel()
	newClient := func(base string) openai.Client {
		return openai.NewClient(option.WithBaseURL(base+"/v1/"), option.WithAPIKey(d.Body.OpenAI.APIKey), option.WithMaxRetries(0))
	}
	near, far := newClient(own), newClient(other)
	model, embed := d.Body.OpenAI.Model, d.Body.OpenAI.EmbeddingModel
	event := func(name, status, detail string) {
		body, _ := json.Marshal(map[string]string{"name": name, "status": status, "detail": detail})
		st := e2ePost(ctx, other+"/v1/tasks/"+d.Body.Task.ID+"/events", d.Body.OpenAI.APIKey, body)
		if st != 204 {
			a.fail("event %s:%s answered %d", name, status, st)
		}
		a.mu.Lock()
		a.events = append(a.events, name+":"+status)
		a.mu.Unlock()
	}
	turn := func(text string) openai.ChatCompletionNewParams {
		return openai.ChatCompletionNewParams{Model: model, MaxCompletionTokens: openai.Int(64),
			Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You plan trips."), openai.UserMessage(text)}}
	}

	event("plan", "started", "")
	// The models this key may use.
	if page, err := far.Models.List(ctx); err != nil {
		a.fail("models: %v", err)
	} else {
		var ids []string
		for _, m := range page.Data {
			ids = append(ids, m.ID)
		}
		if strings.Join(ids, ",") != model+","+embed {
			a.fail("models %v, want %s and %s", ids, model, embed)
		}
	}

	// Chat, JSON.
	if res, err := near.Chat.Completions.New(ctx, turn("Three days in Lisbon")); err != nil {
		a.fail("chat JSON: %v", err)
	} else if len(res.Choices) != 1 {
		a.fail("chat JSON: %d choices", len(res.Choices))
	} else {
		a.called(e2eCall{"chat", res.Usage.PromptTokens, res.Usage.CompletionTokens, res.Choices[0].FinishReason, res.Choices[0].Message.Content})
	}

	// Chat, streamed with include_usage, through the other replica.
	p := turn("Two days in Porto")
	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	a.chatStream(ctx, far, p, "chat stream")

	// A tool round: the model asks for lookup (streamed), the agent
	// answers it with the call's id, the model answers in text (JSON).
	p = turn("Lisbon, with a lookup")
	p.Tools = []openai.ChatCompletionToolUnionParam{e2eLookupTool}
	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	if acc, ok := a.chatStream(ctx, near, p, "tool call"); ok {
		calls := acc.Choices[0].Message.ToolCalls
		if len(calls) != 1 || calls[0].Function.Name != "lookup" || calls[0].Function.Arguments != `{"city":"Lisbon"}` || calls[0].ID == "" {
			a.fail("tool call: %+v", calls)
		} else {
			event("lookup", "started", "")
			p.StreamOptions = openai.ChatCompletionStreamOptionsParam{}
			p.Messages = append(p.Messages, acc.Choices[0].Message.ToParam(), openai.ToolMessage("Lisbon: hills, trams.", calls[0].ID))
			if res, err := far.Chat.Completions.New(ctx, p); err != nil {
				a.fail("after the tool: %v", err)
			} else {
				a.called(e2eCall{"tool result", res.Usage.PromptTokens, res.Usage.CompletionTokens, res.Choices[0].FinishReason, res.Choices[0].Message.Content})
			}
			event("lookup", "ok", "Lisbon: hills, trams.")
		}
	}

	// Responses, JSON and streamed.
	rp := responses.ResponseNewParams{Model: model, Instructions: openai.String("Be brief."), MaxOutputTokens: openai.Int(64),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("A weekend in Rome")}}
	if res, err := far.Responses.New(ctx, rp); err != nil {
		a.fail("responses JSON: %v", err)
	} else {
		a.called(e2eCall{"responses", res.Usage.InputTokens, res.Usage.OutputTokens, string(res.Status), res.OutputText()})
	}
	stream := near.Responses.NewStreaming(ctx, rp)
	var text strings.Builder
	var final responses.Response
	var seq int64 = -1
	for stream.Next() {
		ev := stream.Current()
		if ev.SequenceNumber <= seq {
			a.fail("responses stream: sequence %d after %d", ev.SequenceNumber, seq)
		}
		seq = ev.SequenceNumber
		switch ev.Type {
		case "response.output_text.delta":
			text.WriteString(ev.Delta)
		case "response.completed":
			final = ev.AsResponseCompleted().Response
		}
	}
	if err := stream.Err(); err != nil {
		a.fail("responses stream: %v", err)
	} else if final.OutputText() != text.String() {
		a.fail("responses stream: final %q, deltas %q", final.OutputText(), text.String())
	} else {
		a.called(e2eCall{"responses stream", final.Usage.InputTokens, final.Usage.OutputTokens, string(final.Status), text.String()})
	}

	// Embeddings.
	if res, err := far.Embeddings.New(ctx, openai.EmbeddingNewParams{Model: embed,
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"hills", "trams"}}}); err != nil {
		a.fail("embeddings: %v", err)
	} else if len(res.Data) != 2 || len(res.Data[1].Embedding) != 3 {
		a.fail("embeddings: %+v", res.Data)
	} else {
		a.called(e2eCall{"embeddings", res.Usage.PromptTokens, 0, "", ""})
	}

	// The agent ends its task right after its last call, as agents do:
	// each call's answer completes only once its step is on the task, so
	// none is lost (the test checks the task's usage and both followers'
	// steps).
	event("plan", "ok", "7 model calls")
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"result":{"text":"# Lisbon\n\nHills and *trams*.","title":"Lisbon"}}`)
}

// chatStream reads one streamed chat completion through the client's
// accumulator: it must end with a finish reason and exactly one usage
// chunk.
func (a *e2eAgent) chatStream(ctx context.Context, c openai.Client, p openai.ChatCompletionNewParams, what string) (openai.ChatCompletionAccumulator, bool) {
	stream := c.Chat.Completions.NewStreaming(ctx, p)
	var acc openai.ChatCompletionAccumulator
	usageChunks := 0
	for stream.Next() {
		ch := stream.Current()
		if !acc.AddChunk(ch) {
			a.fail("%s: the accumulator refused a chunk", what)
		}
		if len(ch.Choices) == 0 && ch.JSON.Usage.Valid() {
			usageChunks++
		}
	}
	if err := stream.Err(); err != nil {
		a.fail("%s: %v", what, err)
		return acc, false
	}
	if usageChunks != 1 || len(acc.Choices) != 1 {
		a.fail("%s: %d usage chunks, %d choices", what, usageChunks, len(acc.Choices))
		return acc, false
	}
	a.called(e2eCall{what, acc.Usage.PromptTokens, acc.Usage.CompletionTokens, acc.Choices[0].FinishReason, acc.Choices[0].Message.Content})
	return acc, true
}

// e2ePost posts body with the task key and returns the status (0: no answer).
func e2ePost(ctx context.Context, url, key string, body []byte) int {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(string(body)))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}
