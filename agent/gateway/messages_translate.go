package gateway

import (
	"bytes"
	"encoding/json"
	"strings"
)

// A Messages request is translated for an OpenAI-compatible upstream
// (the offline demo model included) into a chat completion request: the
// system prompt as a system message; text and image blocks as content
// parts (a document's text as text, a PDF's data as a file part);
// tool_use blocks as the assistant's tool calls and tool_result blocks as
// tool messages, before the rest of their user message; custom tools as
// function tools; stop_sequences as stop; temperature, top_p and
// tool_choice as their chat forms; stream with the usage chunk asked for.
// What has no chat form (top_k, metadata, earlier thinking, cache_control,
// thinking itself) is left out: each only lowers what the call costs or
// changes nothing of it. The answer comes back as a Messages answer
// (translateChatJSON, translateChatStream).

// chatCall is the chat completion call the Messages call m stands for:
// its body translated, counted as m was (the prompt), sent and patched
// (model, output limit, stream_options) as any chat call is.
func (m *msgCall) chatCall() (*call, error) {
	body, err := m.chatBody()
	if err != nil {
		return nil, err
	}
	o, err := parseObject(body, "body")
	if err != nil {
		return nil, err
	}
	c := &call{kind: KindChat, obj: o, model: m.model, stream: m.stream, maxOut: m.maxOut,
		prompt: m.prompt, images: m.images, counter: m.counter}
	if m.stream {
		c.streamOptions, c.includeUsage = &object{}, true
	}
	return c, nil
}

// chatBody builds the chat completion request's JSON.
func (m *msgCall) chatBody() ([]byte, error) {
	var msgs []any
	if raw, ok := m.obj.get("system"); ok {
		if text := blocksPlainText(raw); text != "" {
			msgs = append(msgs, map[string]any{"role": "system", "content": text})
		}
	}
	raw, _ := m.obj.get("messages")
	var in []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(raw, &in) != nil {
		return nil, invalid("messages", "must be an array of messages")
	}
	for _, msg := range in {
		msgs = append(msgs, chatMessagesOf(msg.Role, msg.Content)...)
	}
	req := map[string]any{"model": m.model, "messages": msgs}
	if m.stream {
		req["stream"] = true
	}
	for from, to := range map[string]string{"stop_sequences": "stop", "temperature": "temperature", "top_p": "top_p"} {
		if raw, ok := m.obj.get(from); ok {
			req[to] = raw
		}
	}
	if raw, ok := m.obj.get("tools"); ok {
		req["tools"] = chatToolsOf(raw)
		if raw, ok := m.obj.get("tool_choice"); ok {
			choice, parallel := chatToolChoice(raw)
			if choice != nil {
				req["tool_choice"] = choice
			}
			if !parallel {
				req["parallel_tool_calls"] = false
			}
		}
	}
	return json.Marshal(req)
}

// msgContent is a content block of a Messages request, as translated.
type msgContent struct {
	Type      string          `json:"type"`
	Text      string          `json:"text"`
	ID        string          `json:"id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	ToolUseID string          `json:"tool_use_id"`
	Content   json.RawMessage `json:"content"`
	Source    struct {
		Type      string `json:"type"`
		MediaType string `json:"media_type"`
		Data      string `json:"data"`
		URL       string `json:"url"`
	} `json:"source"`
}

// chatMessagesOf translates one Messages message into chat messages: an
// assistant's text and tool calls in one; a user's tool results each a
// tool message, then its other content in one user message.
func chatMessagesOf(role string, content json.RawMessage) []any {
	if s, ok := asString(content); ok {
		return []any{map[string]any{"role": role, "content": s}}
	}
	var blocks []msgContent
	_ = json.Unmarshal(content, &blocks) // counted and checked before (countPrompt)
	if role == "assistant" {
		var text strings.Builder
		var calls []any
		for _, b := range blocks {
			switch b.Type {
			case "text":
				text.WriteString(b.Text)
			case "tool_use":
				args := "{}"
				if in := bytes.TrimSpace(b.Input); len(in) > 0 {
					args = string(in)
				}
				calls = append(calls, map[string]any{"id": b.ID, "type": "function",
					"function": map[string]any{"name": b.Name, "arguments": args}})
			}
		}
		out := map[string]any{"role": "assistant", "content": text.String()}
		if len(calls) > 0 {
			out["tool_calls"] = calls
			if text.Len() == 0 {
				out["content"] = nil
			}
		}
		return []any{out}
	}
	var out, parts []any
	for _, b := range blocks {
		if b.Type == "tool_result" {
			out = append(out, map[string]any{"role": "tool", "tool_call_id": b.ToolUseID, "content": blocksPlainText(b.Content)})
			// Images a tool returned reach the model with the user's turn.
			var inner []msgContent
			if json.Unmarshal(b.Content, &inner) == nil {
				for _, ib := range inner {
					if p := chatPart(ib); p != nil && ib.Type != "text" {
						parts = append(parts, p)
					}
				}
			}
			continue
		}
		if p := chatPart(b); p != nil {
			parts = append(parts, p)
		}
	}
	if len(parts) > 0 {
		out = append(out, map[string]any{"role": role, "content": parts})
	}
	return out
}

// chatPart is a block's chat content part, or nil for a block with none.
func chatPart(b msgContent) any {
	switch b.Type {
	case "text":
		return map[string]any{"type": "text", "text": b.Text}
	case "image":
		url := b.Source.URL
		if b.Source.Type == "base64" {
			url = "data:" + b.Source.MediaType + ";base64," + b.Source.Data
		}
		return map[string]any{"type": "image_url", "image_url": map[string]any{"url": url}}
	case "document":
		switch b.Source.Type {
		case "text":
			return map[string]any{"type": "text", "text": b.Source.Data}
		case "base64":
			return map[string]any{"type": "file", "file": map[string]any{"filename": "document.pdf",
				"file_data": "data:" + b.Source.MediaType + ";base64," + b.Source.Data}}
		}
	}
	return nil
}

// blocksPlainText is the text of a string or of an array of blocks' text
// blocks, joined by new lines.
func blocksPlainText(raw json.RawMessage) string {
	if s, ok := asString(raw); ok {
		return s
	}
	var blocks []msgContent
	if json.Unmarshal(raw, &blocks) != nil {
		return ""
	}
	var texts []string
	for _, b := range blocks {
		if b.Type == "text" {
			texts = append(texts, b.Text)
		}
	}
	return strings.Join(texts, "\n")
}

// chatToolsOf rewrites Messages custom tools ({"name","description",
// "input_schema"}) as chat function tools, for the translated request and
// for the tokenizer's rendering of the prompt.
func chatToolsOf(raw json.RawMessage) json.RawMessage {
	var tools []struct {
		Name        json.RawMessage `json:"name"`
		Description json.RawMessage `json:"description"`
		InputSchema json.RawMessage `json:"input_schema"`
	}
	if json.Unmarshal(raw, &tools) != nil {
		return raw
	}
	type fn struct {
		Name        json.RawMessage `json:"name,omitempty"`
		Description json.RawMessage `json:"description,omitempty"`
		Parameters  json.RawMessage `json:"parameters,omitempty"`
	}
	type tool struct {
		Type     string `json:"type"`
		Function fn     `json:"function"`
	}
	out := make([]tool, len(tools))
	for i, t := range tools {
		out[i] = tool{Type: "function", Function: fn{t.Name, t.Description, t.InputSchema}}
	}
	b, err := json.Marshal(out)
	if err != nil {
		return raw
	}
	return b
}

// chatToolChoice is a Messages tool_choice's chat form (nil: none to
// send) and whether the model may call tools in parallel.
func chatToolChoice(raw json.RawMessage) (any, bool) {
	var c struct {
		Type                   string `json:"type"`
		Name                   string `json:"name"`
		DisableParallelToolUse bool   `json:"disable_parallel_tool_use"`
	}
	if json.Unmarshal(raw, &c) != nil {
		return nil, true
	}
	parallel := !c.DisableParallelToolUse
	switch c.Type {
	case "auto":
		return "auto", parallel
	case "any":
		return "required", parallel
	case "none":
		return "none", true
	case "tool":
		return map[string]any{"type": "function", "function": map[string]any{"name": c.Name}}, parallel
	}
	return nil, parallel
}

// stopReasonOf is the Messages stop_reason of a chat finish_reason.
func stopReasonOf(finish string) string {
	switch finish {
	case "length":
		return "max_tokens"
	case "tool_calls", "function_call":
		return "tool_use"
	case "content_filter":
		return "refusal"
	}
	return "end_turn"
}
