package gateway

import (
	"context"
	"strings"
	"testing"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/responses"
	"github.com/openai/openai-go/v3/shared"

	"faregate/agent/offline"
)

// The official client, as an operator's agent uses it, against the offline
// model through the gateway: JSON and streams, chat and Responses, tools,
// embeddings and the model list.

func userTurn(text string) openai.ChatCompletionNewParams {
	return openai.ChatCompletionNewParams{Model: offline.ModelName,
		Messages: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("You plan trips."), openai.UserMessage(text)}}
}

var lookupTool = openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
	Name: "lookup", Description: openai.String("Look a city up."),
	Parameters: shared.FunctionParameters{"type": "object",
		"properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}}})

func TestChatJSONThroughOfficialClient(t *testing.T) {
	e := newEnv(t, offlineUpstream(), nil)
	res, err := e.client.Chat.Completions.New(context.Background(), userTurn("Three days in Lisbon"))
	if err != nil {
		t.Fatal(err)
	}
	text := res.Choices[0].Message.Content
	if !strings.Contains(text, "deterministic") || !strings.Contains(text, "not a language model") {
		t.Fatalf("the demo model must say what it is: %q", text)
	}
	spec, a, out, err := e.gov.last(t)
	if err != nil {
		t.Fatal(err)
	}
	if spec.Kind != KindChat || spec.TaskID != "t_test" || spec.Principal.ID != "p1" || spec.Model != offline.ModelName {
		t.Fatalf("spec %+v", spec)
	}
	// The offline model counts with the same bound as the gateway: its
	// usage, the gateway's prompt estimate and its output count agree.
	if !out.Usage.Reported || out.Usage.Prompt != res.Usage.PromptTokens || out.Usage.Completion != res.Usage.CompletionTokens {
		t.Fatalf("usage %+v, answer %+v", out.Usage, res.Usage)
	}
	if spec.PromptTokens != res.Usage.PromptTokens || out.Counted != res.Usage.CompletionTokens {
		t.Fatalf("estimate %d counted %d, reported %d/%d", spec.PromptTokens, out.Counted, res.Usage.PromptTokens, res.Usage.CompletionTokens)
	}
	if a.MaxOutput != 1000 || !out.Started {
		t.Fatalf("attempt %+v outcome %+v", a, out)
	}
}

func TestChatStreamWithIncludeUsage(t *testing.T) {
	e := newEnv(t, offlineUpstream(), nil)
	p := userTurn("Two days in Porto")
	p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := e.client.Chat.Completions.NewStreaming(context.Background(), p)
	var acc openai.ChatCompletionAccumulator
	usageChunks := 0
	for stream.Next() {
		ch := stream.Current()
		acc.AddChunk(ch)
		if len(ch.Choices) == 0 && ch.Usage.TotalTokens > 0 {
			usageChunks++
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if usageChunks != 1 {
		t.Fatalf("%d usage chunks, want 1", usageChunks)
	}
	if !strings.Contains(acc.Choices[0].Message.Content, "deterministic") || acc.Choices[0].FinishReason != "stop" {
		t.Fatalf("accumulated %+v", acc.Choices[0])
	}
	_, _, out, err := e.gov.last(t)
	if err != nil || out.Truncated || !out.Usage.Reported {
		t.Fatalf("outcome %+v err %v", out, err)
	}
	if out.Counted != acc.Usage.CompletionTokens || out.Usage.Completion != acc.Usage.CompletionTokens {
		t.Fatalf("counted %d, usage %+v, client saw %+v", out.Counted, out.Usage, acc.Usage)
	}
}

func TestChatToolCallsThroughOfficialClient(t *testing.T) {
	e := newEnv(t, offlineUpstream(), nil)
	p := userTurn("Lisbon")
	p.Tools = []openai.ChatCompletionToolUnionParam{lookupTool}
	res, err := e.client.Chat.Completions.New(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	calls := res.Choices[0].Message.ToolCalls
	if res.Choices[0].FinishReason != "tool_calls" || len(calls) != 1 || calls[0].Function.Name != "lookup" ||
		calls[0].Function.Arguments != `{"city":"Lisbon"}` {
		t.Fatalf("answer %+v", res.Choices[0])
	}
	// Streamed, the same call arrives through the accumulator.
	stream := e.client.Chat.Completions.NewStreaming(context.Background(), p)
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if got := acc.Choices[0].Message.ToolCalls; len(got) != 1 || got[0].Function.Arguments != `{"city":"Lisbon"}` {
		t.Fatalf("streamed tool calls %+v", got)
	}
	_, _, out, _ := e.gov.last(t)
	if out.Counted == 0 {
		t.Fatal("tool-call arguments were not counted")
	}
	// With the tool's result the model answers in text.
	p.Messages = append(p.Messages, res.Choices[0].Message.ToParam(), openai.ToolMessage("Lisbon: hills, trams.", calls[0].ID))
	res, err = e.client.Chat.Completions.New(context.Background(), p)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(res.Choices[0].Message.Content, "1 tool results") {
		t.Fatalf("answer after the tool: %q", res.Choices[0].Message.Content)
	}
}

func TestResponsesThroughOfficialClient(t *testing.T) {
	e := newEnv(t, offlineUpstream(), nil)
	params := responses.ResponseNewParams{Model: offline.ModelName, Instructions: openai.String("Be brief."),
		Input: responses.ResponseNewParamsInputUnion{OfString: openai.String("A weekend in Rome")}}
	res, err := e.client.Responses.New(context.Background(), params)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(res.OutputText(), "deterministic") || res.Status != "completed" {
		t.Fatalf("response %q %s", res.OutputText(), res.Status)
	}
	spec, _, out, _ := e.gov.last(t)
	if spec.Kind != KindResponses || !out.Usage.Reported || out.Usage.Completion != res.Usage.OutputTokens || out.Counted != res.Usage.OutputTokens {
		t.Fatalf("spec %+v outcome %+v usage %+v", spec, out, res.Usage)
	}

	stream := e.client.Responses.NewStreaming(context.Background(), params)
	var text strings.Builder
	var final responses.Response
	var seq int64 = -1
	for stream.Next() {
		ev := stream.Current()
		if ev.SequenceNumber <= seq {
			t.Fatalf("sequence %d after %d", ev.SequenceNumber, seq)
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
		t.Fatal(err)
	}
	if final.Status != "completed" || final.OutputText() != text.String() || final.Usage.OutputTokens == 0 {
		t.Fatalf("final %+v, streamed %q", final, text.String())
	}
	_, _, out, _ = e.gov.last(t)
	if out.Counted != final.Usage.OutputTokens || out.Usage.Completion != final.Usage.OutputTokens {
		t.Fatalf("outcome %+v, final usage %+v", out, final.Usage)
	}

	// A function tool is called, streamed as argument deltas.
	params.Tools = []responses.ToolUnionParam{responses.ToolParamOfFunction("lookup",
		map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}, "required": []string{"city"}}, false)}
	res, err = e.client.Responses.New(context.Background(), params)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Output) != 1 || res.Output[0].Type != "function_call" || res.Output[0].Arguments.OfString != `{"city":"A weekend in Rome"}` {
		t.Fatalf("output %+v", res.Output)
	}
}

func TestEmbeddingsAndModels(t *testing.T) {
	e := newEnv(t, offlineUpstream(), nil)
	res, err := e.client.Embeddings.New(context.Background(), openai.EmbeddingNewParams{Model: "text-embedding-3-small",
		Input: openai.EmbeddingNewParamsInputUnion{OfArrayOfStrings: []string{"hills", "trams"}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Data) != 2 || len(res.Data[0].Embedding) != offline.EmbeddingDims || res.Usage.PromptTokens == 0 {
		t.Fatalf("embeddings %d, usage %+v", len(res.Data), res.Usage)
	}
	spec, a, out, _ := e.gov.last(t)
	if spec.Kind != KindEmbeddings || a.MaxOutput != 0 || spec.PromptTokens != res.Usage.PromptTokens || out.Usage.Prompt != res.Usage.PromptTokens {
		t.Fatalf("spec %+v attempt %+v outcome %+v", spec, a, out)
	}
	// Only the embedding model embeds.
	_, err = e.client.Embeddings.New(context.Background(), openai.EmbeddingNewParams{Model: testModel,
		Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String("x")}})
	var apiErr *openai.Error
	if !asAPIError(err, &apiErr) || apiErr.StatusCode != 400 || apiErr.Code != "model_not_allowed" {
		t.Fatalf("embedding with a chat model: %v", err)
	}

	page, err := e.client.Models.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, m := range page.Data {
		ids = append(ids, m.ID)
	}
	if strings.Join(ids, ",") != testModel+","+offline.ModelName+",text-embedding-3-small" {
		t.Fatalf("models %v", ids)
	}
	// models.retrieve: each listed model, and no other.
	for _, id := range ids {
		m, err := e.client.Models.Get(context.Background(), id)
		if err != nil || m.ID != id || m.Object != "model" {
			t.Fatalf("retrieve %s: %+v, %v", id, m, err)
		}
	}
	for _, id := range []string{"gpt-4", testModel + "x", "a/b"} {
		_, err := e.client.Models.Get(context.Background(), id)
		if !asAPIError(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "not_found" || apiErr.Param != "model" {
			t.Fatalf("retrieve %s: %v", id, err)
		}
	}

	// Without an embedding model the route is not there.
	e = newEnv(t, offlineUpstream(), func(o *Options) { o.EmbeddingModel = "" })
	resp, _ := e.post(t, "/v1/embeddings", `{"model":"x","input":"y"}`)
	if resp.StatusCode != 404 {
		t.Fatalf("embeddings without a model: %d", resp.StatusCode)
	}
}
