package offline

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"unicode/utf8"

	"faregate/agent/tokens"
)

// Wire answers the OpenAI wire (POST …/chat/completions, …/responses and
// …/embeddings, JSON and SSE) as the offline demo model, so an operator's
// own agent gets answers on embedded defaults through exactly the relay a
// real provider's answers take. It is deterministic rules, not a language
// model, and says so in every answer: it calls the first offered function
// tool once (arguments filled from the last user message), then answers in
// text. Its usage is honest by its own count: agent/tokens' bound for its
// model name, the same count faregate's gateway makes of what passes, and
// it honours the output limit it is sent.
type Wire struct{}

// NewWire returns the handler; Client serves it in process.
func NewWire() http.Handler { return Wire{} }

// maxWireBody bounds a request body (the gateway already bounds them).
const maxWireBody = 8 << 20

// chunkBytes is how much text one streamed event carries, about a token
// of English at a time, as providers stream.
const chunkBytes = 4

// ServeHTTP routes by the path's last segments, so any base URL works.
func (Wire) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		wireError(w, http.StatusMethodNotAllowed, "method_not_allowed", "use POST")
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxWireBody+1))
	if err != nil || len(body) > maxWireBody {
		wireError(w, http.StatusRequestEntityTooLarge, "request_too_large", "the body is too large")
		return
	}
	var req wireRequest
	if err := json.Unmarshal(body, &req); err != nil {
		wireError(w, http.StatusBadRequest, "invalid_request", "the body is not a valid request: "+err.Error())
		return
	}
	if req.Model == "" {
		req.Model = ModelName
	}
	switch {
	case strings.HasSuffix(r.URL.Path, "/chat/completions"):
		serveChat(w, r, &req)
	case strings.HasSuffix(r.URL.Path, "/responses"):
		serveResponses(w, r, &req)
	case strings.HasSuffix(r.URL.Path, "/embeddings"):
		serveEmbeddings(w, &req)
	default:
		wireError(w, http.StatusNotFound, "not_found", "no such endpoint")
	}
}

// wireRequest is the part of a request the demo model reads.
type wireRequest struct {
	Model         string `json:"model"`
	Stream        bool   `json:"stream"`
	StreamOptions struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
	MaxTokens     int64           `json:"max_tokens"`
	MaxCompletion int64           `json:"max_completion_tokens"`
	MaxOutput     int64           `json:"max_output_tokens"`
	Messages      []wireMessage   `json:"messages"`
	Tools         []wireTool      `json:"tools"`
	Instructions  string          `json:"instructions"`
	Input         json.RawMessage `json:"input"`
}

type wireMessage struct {
	Role    string          `json:"role"`
	Type    string          `json:"type"`
	Content json.RawMessage `json:"content"`
	Output  json.RawMessage `json:"output"`
}

// wireTool is a chat tool ({"type","function":{…}}) or a Responses one
// ({"type","name","parameters"}).
type wireTool struct {
	Type     string `json:"type"`
	Name     string `json:"name"`
	Params   schema `json:"parameters"`
	Function struct {
		Name   string `json:"name"`
		Params schema `json:"parameters"`
	} `json:"function"`
}

type schema struct {
	Properties map[string]struct {
		Type any `json:"type"`
	} `json:"properties"`
	Required []string `json:"required"`
}

// text is the text of a content value: a string or parts with "text".
func text(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var parts []struct {
		Text string `json:"text"`
	}
	_ = json.Unmarshal(raw, &parts)
	var b strings.Builder
	for _, p := range parts {
		b.WriteString(p.Text)
	}
	return b.String()
}

// conversation is the request as the demo model understands it.
type conversation struct {
	msgs      []tokens.Message
	lastUser  string
	toolSeen  int // tool results since the last user message
	toolsJSON string
	tool      *wireTool
}

func (req *wireRequest) conversation(responses bool) conversation {
	var c conversation
	add := func(role, content string) {
		c.msgs = append(c.msgs, tokens.Message{Role: role, Content: content})
		switch role {
		case "user":
			c.lastUser, c.toolSeen = content, 0
		case "tool":
			c.toolSeen++
		}
	}
	if responses {
		if req.Instructions != "" {
			add("system", req.Instructions)
		}
		var s string
		if json.Unmarshal(req.Input, &s) == nil {
			add("user", s)
		} else {
			var items []wireMessage
			_ = json.Unmarshal(req.Input, &items)
			for _, it := range items {
				switch {
				case it.Type == "function_call_output":
					add("tool", text(it.Output))
				case it.Role != "":
					add(it.Role, text(it.Content))
				}
			}
		}
	} else {
		for _, m := range req.Messages {
			add(m.Role, text(m.Content))
		}
	}
	for i := range req.Tools {
		if req.Tools[i].Type == "function" {
			c.tool = &req.Tools[i]
			break
		}
	}
	if len(req.Tools) > 0 {
		raw, _ := json.Marshal(req.Tools)
		c.toolsJSON = string(raw)
	}
	return c
}

// reply is the demo model's answer: a tool call or text.
type reply struct {
	toolName, toolArgs string
	text               string
	finish             string // stop, length, tool_calls
	prompt, completion int64
}

// answer decides deterministically: the first function tool once per user
// message, then text that says what this is. Text beyond the output limit
// is cut, with finish "length".
func answer(c conversation, model string, limit int64) reply {
	counter := tokens.ForModel(model)
	r := reply{prompt: counter.Chat(c.msgs, c.toolsJSON), finish: "stop"}
	if args, ok := c.toolArgs(); ok {
		name := c.tool.Name
		if name == "" {
			name = c.tool.Function.Name
		}
		raw, _ := json.Marshal(args)
		r.toolName, r.toolArgs, r.finish = name, string(raw), "tool_calls"
		r.completion = counter.Count(r.toolName) + counter.Count(r.toolArgs)
		return r
	}
	last := clip(strings.Join(strings.Fields(c.lastUser), " "), 160)
	t := "This is faregate's offline demo model: deterministic rules, not a language model. " +
		fmt.Sprintf("It read %d messages", len(c.msgs))
	if c.toolSeen > 0 {
		t += fmt.Sprintf(" and %d tool results", c.toolSeen)
	}
	if last != "" {
		t += fmt.Sprintf("; the last request was: %q", last)
	}
	t += ". Set FAREGATE_LLM_BASE_URL to answer with a real model."
	if limit > 0 && counter.Count(t) > limit {
		t = cutTo(counter, t, limit)
		r.finish = "length"
	}
	r.text = t
	r.completion = counter.Count(t)
	return r
}

// toolArgs fills the first function tool's required string parameters
// from the last user message, once per user message. A parameter named
// like a URL takes the message's first http(s) URL; with none there, the
// tool is not called (a demo that fetched the request's words as an
// address would only show a refused step).
func (c conversation) toolArgs() (map[string]string, bool) {
	if c.tool == nil || c.toolSeen != 0 {
		return nil, false
	}
	params := c.tool.Params
	if c.tool.Name == "" {
		params = c.tool.Function.Params
	}
	args := map[string]string{}
	for _, p := range params.Required {
		if t, _ := params.Properties[p].Type.(string); t != "string" && t != "" {
			continue
		}
		if strings.Contains(strings.ToLower(p), "url") {
			u := firstURL(c.lastUser)
			if u == "" {
				return nil, false
			}
			args[p] = u
			continue
		}
		args[p] = clip(strings.TrimSpace(c.lastUser), 200)
	}
	return args, true
}

// firstURL is the first http(s) URL in s, "" when there is none.
func firstURL(s string) string {
	for _, f := range strings.Fields(s) {
		f = strings.Trim(f, "<>()[]\"'.,;")
		if strings.HasPrefix(f, "https://") || strings.HasPrefix(f, "http://") {
			return clip(f, 200)
		}
	}
	return ""
}

// cutTo is the longest prefix of t, at a word boundary where one fits, of
// at most limit tokens.
func cutTo(counter tokens.Counter, t string, limit int64) string {
	lo, hi := 0, len(t)
	for lo < hi {
		mid := (lo + hi + 1) / 2
		for mid < len(t) && !utf8.RuneStart(t[mid]) {
			mid++
		}
		if mid <= len(t) && counter.Count(t[:mid]) <= limit {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	return t[:lo]
}

// pieces splits text for streaming, never inside a code point.
func pieces(s string) []string {
	var out []string
	for s != "" {
		n := min(len(s), chunkBytes)
		for n < len(s) && !utf8.RuneStart(s[n]) {
			n++
		}
		out = append(out, s[:n])
		s = s[n:]
	}
	return out
}

func firstPositive(ns ...int64) int64 {
	for _, n := range ns {
		if n > 0 {
			return n
		}
	}
	return 0
}

// ids are derived from the request, so the same request gets the same
// answer, ids included.
func wireID(prefix string, parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		h.Write([]byte(p))
		h.Write([]byte{0})
	}
	return prefix + fmt.Sprintf("%x", h.Sum(nil)[:12])
}

func serveChat(w http.ResponseWriter, r *http.Request, req *wireRequest) {
	c := req.conversation(false)
	rep := answer(c, req.Model, min(firstPositive(req.MaxCompletion, req.MaxTokens), math.MaxInt64))
	id := wireID("chatcmpl-offline-", req.Model, c.lastUser, strconv.Itoa(len(c.msgs)))
	usage := map[string]int64{"prompt_tokens": rep.prompt, "completion_tokens": rep.completion, "total_tokens": rep.prompt + rep.completion}
	var toolCalls []map[string]any
	if rep.toolName != "" {
		toolCalls = []map[string]any{{"index": 0, "id": wireID("call_", id), "type": "function",
			"function": map[string]string{"name": rep.toolName, "arguments": rep.toolArgs}}}
	}
	if !req.Stream {
		msg := map[string]any{"role": "assistant", "content": nilIfEmpty(rep.text), "refusal": nil}
		if toolCalls != nil {
			msg["tool_calls"] = toolCalls
		}
		writeWireJSON(w, map[string]any{"id": id, "object": "chat.completion", "created": 0, "model": req.Model,
			"choices": []any{map[string]any{"index": 0, "message": msg, "finish_reason": rep.finish, "logprobs": nil}},
			"usage":   usage})
		return
	}
	sse := newWireSSE(w, r)
	chunk := func(delta map[string]any, finish any) bool {
		return sse.data(map[string]any{"id": id, "object": "chat.completion.chunk", "created": 0, "model": req.Model,
			"choices": []any{map[string]any{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": nil}}, "usage": nil})
	}
	if !chunk(map[string]any{"role": "assistant", "content": ""}, nil) {
		return
	}
	if toolCalls != nil {
		if !chunk(map[string]any{"tool_calls": toolCalls}, nil) {
			return
		}
	}
	for _, p := range pieces(rep.text) {
		if !chunk(map[string]any{"content": p}, nil) {
			return
		}
	}
	if !chunk(map[string]any{}, rep.finish) {
		return
	}
	if req.StreamOptions.IncludeUsage {
		if !sse.data(map[string]any{"id": id, "object": "chat.completion.chunk", "created": 0, "model": req.Model, "choices": []any{}, "usage": usage}) {
			return
		}
	}
	sse.raw("[DONE]")
}

func serveResponses(w http.ResponseWriter, r *http.Request, req *wireRequest) {
	c := req.conversation(true)
	rep := answer(c, req.Model, req.MaxOutput)
	id := wireID("resp_offline_", req.Model, c.lastUser, strconv.Itoa(len(c.msgs)))
	status := "completed"
	var incomplete any
	if rep.finish == "length" {
		status, incomplete = "incomplete", map[string]string{"reason": "max_output_tokens"}
	}
	var item map[string]any
	if rep.toolName != "" {
		item = map[string]any{"type": "function_call", "id": wireID("fc_", id), "call_id": wireID("call_", id),
			"name": rep.toolName, "arguments": rep.toolArgs, "status": "completed"}
	} else {
		item = map[string]any{"type": "message", "id": wireID("msg_", id), "role": "assistant", "status": status,
			"content": []any{map[string]any{"type": "output_text", "text": rep.text, "annotations": []any{}}}}
	}
	usage := map[string]any{"input_tokens": rep.prompt, "input_tokens_details": map[string]int64{"cached_tokens": 0},
		"output_tokens": rep.completion, "output_tokens_details": map[string]int64{"reasoning_tokens": 0},
		"total_tokens": rep.prompt + rep.completion}
	resp := func(status string, output []any, usage any) map[string]any {
		m := map[string]any{"id": id, "object": "response", "created_at": 0, "model": req.Model, "status": status,
			"output": output, "usage": usage, "error": nil, "incomplete_details": nil, "tools": []any{}, "parallel_tool_calls": true}
		if status == "incomplete" {
			m["incomplete_details"] = incomplete
		}
		return m
	}
	if !req.Stream {
		writeWireJSON(w, resp(status, []any{item}, usage))
		return
	}
	sse := newWireSSE(w, r)
	seq := 0
	ev := func(typ string, m map[string]any) bool {
		m["type"], m["sequence_number"] = typ, seq
		seq++
		return sse.event(typ, m)
	}
	ok := ev("response.created", map[string]any{"response": resp("in_progress", []any{}, nil)}) &&
		ev("response.in_progress", map[string]any{"response": resp("in_progress", []any{}, nil)})
	itemID := item["id"]
	if ok && rep.toolName != "" {
		added := map[string]any{}
		for k, v := range item {
			added[k] = v
		}
		added["arguments"], added["status"] = "", "in_progress"
		ok = ev("response.output_item.added", map[string]any{"output_index": 0, "item": added})
		for _, p := range pieces(rep.toolArgs) {
			ok = ok && ev("response.function_call_arguments.delta", map[string]any{"item_id": itemID, "output_index": 0, "delta": p})
		}
		ok = ok && ev("response.function_call_arguments.done", map[string]any{"item_id": itemID, "output_index": 0, "arguments": rep.toolArgs})
	} else if ok {
		ok = ev("response.output_item.added", map[string]any{"output_index": 0, "item": map[string]any{
			"type": "message", "id": itemID, "role": "assistant", "status": "in_progress", "content": []any{}}})
		loc := func(m map[string]any) map[string]any {
			m["item_id"], m["output_index"], m["content_index"] = itemID, 0, 0
			return m
		}
		ok = ok && ev("response.content_part.added", loc(map[string]any{"part": map[string]any{"type": "output_text", "text": "", "annotations": []any{}}}))
		for _, p := range pieces(rep.text) {
			ok = ok && ev("response.output_text.delta", loc(map[string]any{"delta": p, "logprobs": []any{}}))
		}
		ok = ok && ev("response.output_text.done", loc(map[string]any{"text": rep.text, "logprobs": []any{}})) &&
			ev("response.content_part.done", loc(map[string]any{"part": map[string]any{"type": "output_text", "text": rep.text, "annotations": []any{}}}))
	}
	ok = ok && ev("response.output_item.done", map[string]any{"output_index": 0, "item": item})
	if ok {
		ev("response."+status, map[string]any{"response": resp(status, []any{item}, usage)})
	}
}

// EmbeddingDims is the length of the demo model's embedding vectors.
const EmbeddingDims = 64

// serveEmbeddings answers with deterministic unit vectors derived from a
// hash of each input: equal texts embed equally, nothing more is meant.
func serveEmbeddings(w http.ResponseWriter, req *wireRequest) {
	var inputs []string
	var one string
	if json.Unmarshal(req.Input, &one) == nil {
		inputs = []string{one}
	} else if json.Unmarshal(req.Input, &inputs) != nil {
		wireError(w, http.StatusBadRequest, "invalid_request", "input must be a string or strings")
		return
	}
	counter := tokens.ForModel(req.Model)
	var prompt int64
	data := make([]any, len(inputs))
	for i, s := range inputs {
		prompt += counter.Count(s)
		sum := sha256.Sum256([]byte(s))
		vec := make([]float64, EmbeddingDims)
		var norm float64
		for d := range vec {
			h := sha256.Sum256(append(sum[:], byte(d)))
			vec[d] = float64(int32(binary.BigEndian.Uint32(h[:4]))) / math.MaxInt32
			norm += vec[d] * vec[d]
		}
		for d := range vec {
			vec[d] /= math.Sqrt(norm)
		}
		data[i] = map[string]any{"object": "embedding", "index": i, "embedding": vec}
	}
	writeWireJSON(w, map[string]any{"object": "list", "data": data, "model": req.Model,
		"usage": map[string]int64{"prompt_tokens": prompt, "total_tokens": prompt}})
}

func nilIfEmpty(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func writeWireJSON(w http.ResponseWriter, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	_, _ = w.Write(b)
}

func wireError(w http.ResponseWriter, status int, code, msg string) {
	b, _ := json.Marshal(map[string]any{"error": map[string]any{"code": code, "message": msg, "type": "invalid_request_error", "param": nil}})
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// wireSSE writes events and stops at the first failed write or when the
// caller has gone.
type wireSSE struct {
	w  http.ResponseWriter
	r  *http.Request
	rc *http.ResponseController
}

func newWireSSE(w http.ResponseWriter, r *http.Request) *wireSSE {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	return &wireSSE{w: w, r: r, rc: http.NewResponseController(w)}
}

func (s *wireSSE) raw(data string) bool {
	if s.r.Context().Err() != nil {
		return false
	}
	if _, err := io.WriteString(s.w, "data: "+data+"\n\n"); err != nil {
		return false
	}
	_ = s.rc.Flush()
	return true
}

func (s *wireSSE) data(v any) bool {
	b, _ := json.Marshal(v)
	return s.raw(string(b))
}

func (s *wireSSE) event(name string, v any) bool {
	b, _ := json.Marshal(v)
	if s.r.Context().Err() != nil {
		return false
	}
	if _, err := io.WriteString(s.w, "event: "+name+"\ndata: "+string(b)+"\n\n"); err != nil {
		return false
	}
	_ = s.rc.Flush()
	return true
}
