package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/anthropics/anthropic-sdk-go/v2/option"
)

// maxTokens is each Messages call's max_tokens (required by the API):
// faregate lowers it to what the task can still afford.
const maxTokens = 2048

// answerClaude is answer on Anthropic's Messages API: the same loop and
// tool, the delivery's "anthropic" endpoint and the task key (the SDK
// sends it as x-api-key and appends /v1/messages to the base URL).
func (a *agent) answerClaude(ctx context.Context, d delivery) (string, error) {
	question := describe(d.Task.Request)
	a.event(ctx, d, "think", "started", "")
	client := anthropic.NewClient(option.WithBaseURL(d.Anthropic.BaseURL), option.WithAPIKey(d.Anthropic.APIKey),
		option.WithHTTPClient(a.http), option.WithMaxRetries(2))
	fetch := anthropic.ToolUnionParam{OfTool: &anthropic.ToolParam{
		Name:        "fetch_page",
		Description: anthropic.String("Fetch a public web page and return its readable text."),
		InputSchema: anthropic.ToolInputSchemaParam{
			Properties: map[string]any{"url": map[string]any{"type": "string", "description": "an absolute http(s) URL"}},
			Required:   []string{"url"},
		},
	}}
	msgs := []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(question))}
	for turn := 0; ; turn++ {
		params := anthropic.MessageNewParams{Model: anthropic.Model(d.Anthropic.Model), MaxTokens: maxTokens,
			System: []anthropic.TextBlockParam{{Text: systemPrompt}}, Messages: msgs}
		if turn < maxTurns {
			params.Tools = []anthropic.ToolUnionParam{fetch}
		}
		msg, err := client.Messages.New(ctx, params)
		if err != nil {
			a.event(ctx, d, "think", "failed", "")
			return "", fmt.Errorf("model call: %w", err)
		}
		var text strings.Builder
		var results []anthropic.ContentBlockParamUnion
		for _, b := range msg.Content {
			switch b.Type {
			case "text":
				text.WriteString(b.Text)
			case "tool_use":
				if turn >= maxTurns {
					continue // offered no tool: nothing to run
				}
				results = append(results, anthropic.NewToolResultBlock(b.ID, a.tool(ctx, d, b.Name, string(b.Input)), false))
			}
		}
		if len(results) == 0 || turn >= maxTurns {
			a.event(ctx, d, "think", "ok", "")
			out := strings.TrimSpace(text.String())
			if out == "" {
				return "", errors.New("the model answered no text")
			}
			return clipBytes(out, maxAnswer), nil
		}
		msgs = append(msgs, msg.ToParam(), anthropic.NewUserMessage(results...))
	}
}
