package gateway

import (
	"encoding/json"
	"strconv"
	"strings"

	"faregate/agent/tokens"
)

// countPrompt counts a Messages prompt by the rules the chat route
// counts its own with (agent/tokens, the model's tokenizer where known,
// else its conservative bound): the system prompt as a system message,
// a message's text (and earlier thinking) as its content, tool_use blocks
// as its tool calls, tool_result blocks as tool messages, images at the
// most they can cost plus their JSON, other blocks at their JSON, and
// the custom tools in the chat form the tokenizer renders.
//
// Member names of messages, blocks and sources are refused when a
// case-insensitive decoder would read them as others (names.go); a
// tool_use block's input is the agent's own JSON and is not looked into.
func (m *msgCall) countPrompt() (int64, error) {
	var tm []tokens.Message
	var extra int64
	if raw, ok := m.obj.get("system"); ok {
		text, more, err := m.blocksText(raw, "system")
		if err != nil {
			return 0, err
		}
		extra += more
		tm = append(tm, tokens.Message{Role: "system", Content: text})
	}
	raw, ok := m.obj.get("messages")
	if !ok {
		return 0, invalid("messages", "is required")
	}
	var msgs []map[string]json.RawMessage
	if json.Unmarshal(raw, &msgs) != nil {
		return 0, invalid("messages", "must be an array of messages")
	}
	for i, msg := range msgs {
		at := "messages[" + strconv.Itoa(i) + "]"
		if err := foldedKeys(msg, at); err != nil {
			return 0, err
		}
		more, err := m.countMessage(msg, at, &tm)
		if err != nil {
			return 0, err
		}
		extra += more
	}
	toolsJSON, twins := "", int64(0)
	if raw, ok := m.obj.get("tools"); ok {
		toolsJSON = string(chatToolsOf(raw))
		if foldTwins(raw) {
			twins = m.counter.Count(string(raw))
		}
	}
	n := m.counter.Chat(tm, toolsJSON) + twins
	// The messages' text alone is the floor a provider's report of the
	// prompt is judged against (budget.Charged), as on the chat route.
	m.floor = m.counter.Chat(tm, "")
	if raw, ok := m.obj.get("output_config"); ok {
		n += m.counter.Count(string(raw)) // a structured output schema reaches the model as text
	}
	return n + extra, nil
}

// countMessage appends msg (at names it) to tm as the chat messages it
// stands for: its own, then one tool message per tool result.
func (m *msgCall) countMessage(msg map[string]json.RawMessage, at string, tm *[]tokens.Message) (int64, error) {
	role, _ := asString(msg["role"])
	content := msg["content"]
	if s, ok := asString(content); ok {
		*tm = append(*tm, tokens.Message{Role: role, Content: s})
		return 0, nil
	}
	var blocks []map[string]json.RawMessage
	if json.Unmarshal(content, &blocks) != nil {
		return 0, invalid(at+".content", "must be a string or an array of content blocks")
	}
	out := tokens.Message{Role: role}
	var text strings.Builder
	var results []tokens.Message
	var extra int64
	for j, b := range blocks {
		path := at + ".content[" + strconv.Itoa(j) + "]"
		if err := foldedKeys(b, path); err != nil {
			return 0, err
		}
		typ, _ := asString(b["type"])
		switch typ {
		case "text":
			s, _ := asString(b["text"])
			text.WriteString(s)
		case "thinking":
			s, _ := asString(b["thinking"])
			text.WriteString(s)
		case "tool_use":
			name, _ := asString(b["name"])
			out.ToolCalls = append(out.ToolCalls, tokens.ToolCall{Name: name, Arguments: string(b["input"])})
		case "tool_result":
			s, more, err := m.blocksText(b["content"], path+".content")
			if err != nil {
				return 0, err
			}
			extra += more
			results = append(results, tokens.Message{Role: "tool", Content: s})
		default:
			more, err := m.otherBlock(typ, b, path)
			if err != nil {
				return 0, err
			}
			extra += more
		}
	}
	out.Content = text.String()
	*tm = append(append(*tm, out), results...)
	return extra, nil
}

// blocksText is the text of raw, a string or an array of content blocks
// (a system prompt, a tool result's content), and the tokens of its other
// blocks.
func (m *msgCall) blocksText(raw json.RawMessage, at string) (string, int64, error) {
	if len(raw) == 0 || isNull(raw) {
		return "", 0, nil
	}
	if s, ok := asString(raw); ok {
		return s, 0, nil
	}
	var blocks []map[string]json.RawMessage
	if json.Unmarshal(raw, &blocks) != nil {
		return "", 0, invalid(at, "must be a string or an array of content blocks")
	}
	var b strings.Builder
	var extra int64
	for j, blk := range blocks {
		path := at + "[" + strconv.Itoa(j) + "]"
		if err := foldedKeys(blk, path); err != nil {
			return "", 0, err
		}
		typ, _ := asString(blk["type"])
		if typ == "text" {
			if s, ok := asString(blk["text"]); ok {
				b.WriteString(s)
				continue
			}
		}
		more, err := m.otherBlock(typ, blk, path)
		if err != nil {
			return "", 0, err
		}
		extra += more
	}
	return b.String(), extra, nil
}

// otherBlock counts a content block that is not text: an image at the
// most it can cost plus its JSON, a document's text or its data's
// allowance plus its JSON, anything else at its JSON (which errs high).
// A file by reference (a file_id, a document's URL, a container upload)
// is refused: its content is the provider's to read, unseen by the
// reservation. (An image by URL is bounded by its allowance.)
func (m *msgCall) otherBlock(typ string, b map[string]json.RawMessage, at string) (int64, error) {
	var src map[string]json.RawMessage
	if raw, ok := b["source"]; ok && !isNull(raw) {
		if json.Unmarshal(raw, &src) != nil {
			return 0, invalid(at+".source", "must be an object")
		}
		if err := foldedKeys(src, at+".source"); err != nil {
			return 0, err
		}
	}
	srcType, _ := asString(src["type"])
	jsonTokens := func() int64 {
		raw, _ := json.Marshal(b)
		return m.counter.Count(string(raw))
	}
	switch typ {
	case "container_upload":
		return 0, unsupported(at+".file_id", fileRefReason)
	case "image":
		if srcType == "file" {
			return 0, unsupported(at+".source.file_id", fileRefReason)
		}
		m.images++
		return tokens.ImageTokens(m.model, false) + jsonTokens(), nil
	case "document":
		switch srcType {
		case "file":
			return 0, unsupported(at+".source.file_id", fileRefReason)
		case "url":
			return 0, unsupported(at+".source.url", fileRefReason)
		case "text":
			s, _ := asString(src["data"])
			return m.counter.Count(s) + jsonTokens(), nil
		case "base64":
			return fileTokens + jsonTokens(), nil
		}
	}
	return jsonTokens(), nil
}

// foldedKeys refuses a member of a message, block or source whose name a
// case-insensitive decoder would read as another (Anthropic's names are
// all lower case).
func foldedKeys(obj map[string]json.RawMessage, at string) error {
	for k := range obj {
		if caseFolds([]byte(k)) {
			return invalid(at, "has a member named "+strconv.Quote(k)+
				", which a case-insensitive decoder reads as another; member names here are lower case")
		}
	}
	return nil
}
