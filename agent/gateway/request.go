package gateway

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"faregate/agent/govern"
	"faregate/agent/tokens"
	"faregate/protect/kit/jsonstr"
)

// field is one member of a JSON object, its value exactly as received.
type field struct {
	key string
	raw json.RawMessage
}

// object is a JSON object with its members in the order received. Patching
// one member leaves every other byte of the others as it was.
type object struct{ fields []field }

// parseObject reads a JSON object, refusing anything else, trailing data
// and a member name given twice, or twice but for case, or a name this
// package reads spelled otherwise (a provider might read the first where
// we read the last, or match names ignoring case: what we check must be
// what it gets; names.go).
func parseObject(b []byte, name string) (*object, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, invalid(name, "must be a JSON object")
	}
	o := &object{}
	seen := make(map[string]struct{}, 16)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, invalid(name, "is not valid JSON")
		}
		key, _ := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return nil, invalid(name, "is not valid JSON")
		}
		// Names are compared folded, as a provider written in Go would
		// match them (names.go).
		folded := foldName(key)
		if _, dup := seen[folded]; dup {
			return nil, invalid(joinField(name, key), "appears more than once (member names are compared ignoring case)")
		}
		seen[folded] = struct{}{}
		if want, ok := readNames[folded]; ok && want != key {
			return nil, invalid(joinField(name, key), "must be spelled "+strconv.Quote(want)+": a provider may read it as that")
		}
		o.fields = append(o.fields, field{key, raw})
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return nil, invalid(name, "is not valid JSON")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, invalid(name, "has data after the JSON object")
	}
	return o, nil
}

func joinField(parent, key string) string {
	if parent == "body" || parent == "" {
		return key
	}
	return parent + "." + key
}

// get returns a member's raw value; a JSON null counts as absent.
func (o *object) get(key string) (json.RawMessage, bool) {
	for _, f := range o.fields {
		if f.key == key {
			if isNull(f.raw) {
				return nil, false
			}
			return f.raw, true
		}
	}
	return nil, false
}

// encode writes the object with the members of set replacing (or, when
// absent, appended after) the received ones.
func (o *object) encode(dst []byte, set []field) []byte {
	dst = append(dst, '{')
	n := 0
	put := func(k string, v []byte) {
		if n > 0 {
			dst = append(dst, ',')
		}
		n++
		dst = appendJSONString(dst, k)
		dst = append(dst, ':')
		dst = append(dst, v...)
	}
	done := make([]bool, len(set))
	for _, f := range o.fields {
		v := []byte(f.raw)
		for i, s := range set {
			if s.key == f.key {
				v, done[i] = s.raw, true
			}
		}
		put(f.key, v)
	}
	for i, s := range set {
		if !done[i] {
			put(s.key, s.raw)
		}
	}
	return append(dst, '}')
}

func isNull(raw []byte) bool { return string(bytes.TrimSpace(raw)) == "null" }

func asString(raw []byte) (string, bool) {
	var s string
	if len(raw) == 0 || raw[0] != '"' || json.Unmarshal(raw, &s) != nil {
		return "", false
	}
	return s, true
}

// asInt reads a JSON integer in [math.MinInt64, math.MaxInt64]; 1e3 and
// 1000.0 are integers too, as JSON numbers are.
func asInt(raw []byte) (int64, bool) {
	s := string(bytes.TrimSpace(raw))
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return n, true
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) >= 1<<62 {
		return 0, false
	}
	return int64(f), true
}

// call is a parsed, checked request.
type call struct {
	// req is the client's request (for the error writer's in-stream event).
	req    *http.Request
	kind   string
	obj    *object
	model  string
	stream bool
	// includeUsage: the client asked for the usage chunk of a chat stream.
	includeUsage bool
	// streamOptions is the client's stream_options object (chat).
	streamOptions *object
	// maxOut is the client's output limit (0 = none); limitFields names
	// the limit fields the request carried.
	maxOut      int64
	limitFields []string
	prompt      int64
	// refTokens is what a Responses item reference is held at
	// (Options.ReferenceTokens).
	refTokens int64
	// images and lowImages are how many images the prompt holds, at any
	// detail and at low detail, each counted at tokens.ImageTokens of the
	// model.
	images, lowImages int64
	counter           tokens.Counter
	// memo remembers the messages earlier calls carried (nil: none);
	// split is its split of the body (empty when parseObject parsed it).
	memo  *seenMemo
	split splitBody
	// toolsTokens is what the tools add to the prompt (refuseCostly
	// checks and counts them).
	toolsTokens int64
	// promptFloor is the part of prompt counted from the messages' text
	// alone (govern.Outcome.PromptCounted).
	promptFloor int64
	// deadline ends every attempt of the call (Options.CallTimeout, or
	// the task's deadline when taskFirst).
	deadline  time.Time
	taskFirst bool
}

// exact reports whether the call's counts are the tokenizer of model, an
// attempt's: the prompt was counted for the model asked, the output is
// counted for model.
func (c *call) exact(model string) bool {
	return c.counter.Known() && tokens.EncodingFor(model) == tokens.EncodingFor(c.model)
}

// echo is the request's size, which a provider's answer may repeat (0
// once the request is forgotten).
func (c *call) echo() int64 {
	if c.obj == nil {
		return 0
	}
	return int64(totalSize(c.obj))
}

// imageDetail is an image part's detail: chat's image_url.detail,
// Responses' detail.
func imageDetail(typ string, p map[string]json.RawMessage) string {
	raw := p["detail"]
	if typ == "image_url" {
		var u map[string]json.RawMessage
		if json.Unmarshal(p["image_url"], &u) == nil {
			raw = u["detail"]
		}
	}
	d, _ := asString(raw)
	return d
}

// The most output a client may ask for; above it the number is nonsense
// and refused (the attempt's limit is far lower anyway).
const maxOutputAsked = 1 << 40

// parseCall checks a request body of kind. The model comes first, checked
// with allowed before anything else of the body is read: a refused model
// costs the JSON scan only, never a tokenizer's load or a prompt's count
// (up to FAREGATE_V1_MAX_BODY of BPE), which no limit would hold.
func parseCall(kind string, body []byte, allowed func(model string) bool) (*call, error) {
	return parseCallHolding(kind, body, allowed, DefaultReferenceTokens, nil)
}

// parseCallHolding is parseCall with a Responses item reference held at
// refTokens, and the parts memo (nil: none) remembering what earlier
// calls' messages were found to be.
func parseCallHolding(kind string, body []byte, allowed func(model string) bool, refTokens int64, memo *seenMemo) (*call, error) {
	var split splitBody
	ok := false
	if memo != nil {
		split, ok = memo.splitCall(kind, body)
	}
	if !ok {
		o, err := parseObject(body, "body")
		if err != nil {
			return nil, err
		}
		split = splitBody{obj: o}
	}
	var err error
	c := &call{kind: kind, obj: split.obj, refTokens: refTokens, memo: memo, split: split}
	o := c.obj
	raw, ok := o.get("model")
	if !ok {
		return nil, invalid("model", "is required")
	}
	if c.model, ok = asString(raw); !ok || c.model == "" {
		return nil, invalid("model", "must be a non-empty string")
	}
	if !allowed(c.model) {
		return nil, ErrModelNotAllowed
	}
	c.counter = tokens.ForModel(c.model)
	if kind == KindEmbeddings {
		c.prompt, err = c.embeddingInput()
		c.promptFloor = c.prompt
		return c, err
	}
	if raw, ok := o.get("stream"); ok {
		switch string(bytes.TrimSpace(raw)) {
		case "true":
			c.stream = true
		case "false":
		default:
			return nil, invalid("stream", "must be a boolean")
		}
	}
	if err := c.refuseCostly(); err != nil {
		return nil, err
	}
	limits := []string{"max_tokens", "max_completion_tokens"}
	if kind == KindResponses {
		limits = []string{"max_output_tokens"}
	}
	for _, name := range limits {
		raw, ok := o.get(name)
		if !ok {
			continue
		}
		n, ok := asInt(raw)
		if !ok || n < 1 || n > maxOutputAsked {
			return nil, invalid(name, "must be a positive integer")
		}
		c.limitFields = append(c.limitFields, name)
		if c.maxOut == 0 || n < c.maxOut {
			c.maxOut = n
		}
	}
	if kind == KindChat && c.stream {
		c.streamOptions = &object{}
		if raw, ok := o.get("stream_options"); ok {
			if c.streamOptions, err = parseObject(raw, "stream_options"); err != nil {
				return nil, err
			}
			if v, ok := c.streamOptions.get("include_usage"); ok {
				switch string(bytes.TrimSpace(v)) {
				case "true":
					c.includeUsage = true
				case "false":
				default:
					return nil, invalid("stream_options.include_usage", "must be a boolean")
				}
			}
		}
	}
	if kind == KindChat {
		c.prompt, err = c.chatPrompt()
	} else {
		c.prompt, err = c.responsesPrompt()
	}
	return c, err
}

// refuseCostly refuses the fields whose cost a reservation cannot see:
// more than one choice (or sequence), another server's output limit,
// priority tiers, audio output, server-side state
// (earlier responses, conversations, stored prompts, background runs) and
// hosted tools (web search, file search, code interpreter, MCP, …) that
// the provider bills besides tokens.
func (c *call) refuseCostly() error {
	o := c.obj
	if raw, ok := o.get("n"); ok {
		if n, ok := asInt(raw); !ok || n != 1 {
			return unsupported("n", "only n=1 is served")
		}
	}
	// Other servers' names for more sequences and for the output limit:
	// best_of generates that many and returns one (vLLM, OpenAI's legacy
	// completions); llama.cpp's server copies every member into its
	// parameters, where n_cmpl is its n and n_predict overrides
	// max_tokens.
	for _, name := range []string{"best_of", "n_cmpl"} {
		if raw, ok := o.get(name); ok {
			if n, ok := asInt(raw); !ok || n != 1 {
				return unsupported(name, "only "+name+"=1 is served")
			}
		}
	}
	if err := c.refuseForeign(); err != nil {
		return err
	}
	if raw, ok := o.get("service_tier"); ok {
		if s, ok := asString(raw); !ok || (s != "auto" && s != "default") {
			return unsupported("service_tier", "only auto or default is served")
		}
	}
	if raw, ok := o.get("modalities"); ok {
		var mods []string
		if json.Unmarshal(raw, &mods) != nil {
			return invalid("modalities", "must be an array of strings")
		}
		for _, m := range mods {
			if m != "text" {
				return unsupported("modalities", "only text output is served")
			}
		}
	}
	if _, ok := o.get("audio"); ok {
		return unsupported("audio", "audio output is not served")
	}
	if err := c.refuseKindCostly(); err != nil {
		return err
	}
	// Routers' own members that choose what is billed: OpenRouter's
	// models (other models to try, at their prices) and plugins (its web
	// search, billed per result).
	for _, name := range []string{"models", "plugins"} {
		if raw, ok := o.get(name); ok && string(bytes.TrimSpace(raw)) != "[]" {
			return unsupported(name, "other models and router plugins are not served")
		}
	}
	if err := c.refuseHostedChoice(); err != nil {
		return err
	}
	raw, ok := o.get("tools")
	if !ok {
		return nil
	}
	var err error
	c.toolsTokens, err = c.toolsFacts(raw)
	return err
}

// refuseKindCostly refuses what only one kind's wire can ask for and a
// reservation cannot see: chat's hosted web search; Responses' background
// runs, stored conversations and stored prompts (state held at the
// provider, whose tokens the prompt count never saw).
func (c *call) refuseKindCostly() error {
	o := c.obj
	switch c.kind {
	case KindChat:
		if _, ok := o.get("web_search_options"); ok {
			return unsupported("web_search_options", "hosted web search is not served")
		}
	case KindResponses:
		if raw, ok := o.get("background"); ok && string(bytes.TrimSpace(raw)) != "false" {
			return unsupported("background", "background responses are not served")
		}
		if raw, ok := o.get("previous_response_id"); ok {
			if s, isStr := asString(raw); !isStr || s != "" {
				return unsupported("previous_response_id", "send the conversation in input instead")
			}
		}
		if _, ok := o.get("conversation"); ok {
			return unsupported("conversation", "send the conversation in input instead")
		}
		if _, ok := o.get("prompt"); ok {
			return unsupported("prompt", "stored prompts are not served; send instructions and input")
		}
	}
	return nil
}

// toolsFacts checks the tools array raw (function tools only, member names
// a provider in Go reads as we do) and counts what it adds to the prompt:
// through the memo, which remembers both for a tool list it has seen.
func (c *call) toolsFacts(raw []byte) (int64, error) {
	var k seenKey
	if c.memo != nil {
		p := c.split.tools
		if p == nil {
			part := c.memo.part(raw)
			p = &part
		}
		k = c.memo.key(*p, c.model, toolsKind(c.kind))
		if f, hit := c.memo.parts.Get(k); hit {
			return f.tokens, nil
		}
	}
	var tools []map[string]json.RawMessage
	if json.Unmarshal(raw, &tools) != nil {
		return 0, invalid("tools", "must be an array of objects")
	}
	// A tool's own members: a "Type" would be its type to a provider in
	// Go, and no type here.
	if err := checkNames(raw, "tools", false); err != nil {
		return 0, err
	}
	for i, t := range tools {
		typ, _ := asString(t["type"])
		if typ != "function" {
			return 0, unsupported("tools["+strconv.Itoa(i)+"].type", "only function tools are served")
		}
	}
	toolsJSON := string(raw)
	if c.kind == KindResponses {
		toolsJSON = chatTools(raw)
	}
	n := c.counter.Tools(toolsJSON)
	if foldTwins(raw) {
		// Two names that fold alike: the tokenizer's rendering keeps
		// one, a provider may read the other; the JSON is counted too.
		n += c.counter.Count(string(raw))
	}
	if c.memo != nil {
		c.memo.parts.Add(k, seenFacts{tokens: n})
	}
	return n, nil
}

// refuseForeign refuses the members other servers read as an output
// limit or a count of sequences, and those they expand into the prompt on
// their side: what the provider bills would not be what was reserved.
func (c *call) refuseForeign() error {
	o := c.obj
	// Other servers' output limits and sequence counts (llama.cpp's
	// n_predict, Hugging Face's max_new_tokens and num_return_sequences,
	// Ollama's num_predict and options.num_predict, Gemini's
	// candidate_count, vLLM's min_tokens, which makes the model write past
	// its end): refused whenever present, whatever their value (null is
	// absent to every server).
	for _, name := range []string{"n_predict", "max_new_tokens", "num_predict", "num_return_sequences", "candidate_count", "min_tokens"} {
		if _, ok := o.get(name); ok {
			return unsupported(name, "the output limit is max_tokens or max_completion_tokens (max_output_tokens), which the task's budget sets")
		}
	}
	if raw, ok := o.get("options"); ok {
		opts, err := parseObject(raw, "options")
		if err != nil {
			return err
		}
		if _, ok := opts.get("num_predict"); ok {
			return unsupported("options.num_predict", "the output limit is max_tokens or max_completion_tokens, which the task's budget sets")
		}
	}
	// Members a server expands into the prompt on its side (vLLM's
	// documents and chat templates, a generation prompt, a continued
	// message): the prompt the provider bills would not be the one
	// counted here.
	for _, name := range []string{"documents", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"} {
		if _, ok := o.get(name); ok {
			return unsupported(name, "a member the provider expands into the prompt is not served; send the prompt itself")
		}
	}
	return nil
}

// refuseHostedChoice refuses a tool_choice that forces a tool other than
// a function (web search, file search, code interpreter, MCP, custom): a
// choice need not name a tool the request lists, so it is checked as the
// tools are. Its string forms (none, auto, required) pass.
func (c *call) refuseHostedChoice() error {
	raw, ok := c.obj.get("tool_choice")
	if !ok || len(raw) == 0 || raw[0] == '"' {
		return nil
	}
	var choice map[string]json.RawMessage
	if json.Unmarshal(raw, &choice) != nil {
		return invalid("tool_choice", "must be a string or an object")
	}
	if err := checkNames(append(append([]byte{'['}, raw...), ']'), "tool_choice", false); err != nil {
		return err
	}
	typ, _ := asString(choice["type"])
	switch typ {
	case "function":
		return nil
	case "allowed_tools":
		// Chat nests the list in allowed_tools, Responses does not.
		list := choice["tools"]
		if inner, ok := choice["allowed_tools"]; ok {
			var a map[string]json.RawMessage
			if json.Unmarshal(inner, &a) != nil {
				return invalid("tool_choice.allowed_tools", "must be an object")
			}
			list = a["tools"]
		}
		var tools []map[string]json.RawMessage
		if len(list) > 0 && json.Unmarshal(list, &tools) != nil {
			return invalid("tool_choice", "allowed tools must be an array of objects")
		}
		for i, t := range tools {
			if typ, _ := asString(t["type"]); typ != "function" {
				return unsupported("tool_choice.tools["+strconv.Itoa(i)+"].type", "only function tools are served")
			}
		}
		return nil
	}
	return unsupported("tool_choice.type", "only function tools are served")
}

// fileTokens is the allowance of a file part's extracted text beyond its
// JSON (unknown: the raw JSON is counted on top). An image is held at the
// most it can cost on the model (tokens.ImageTokens).
const fileTokens = 1536

type chatMessage struct {
	Role      string          `json:"role"`
	Name      string          `json:"name"`
	Content   json.RawMessage `json:"content"`
	ToolCalls []struct {
		Function struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		} `json:"function"`
	} `json:"tool_calls"`
}

// chatPrompt counts the prompt of a chat completion request with the
// model's tokenizer (or its bound), the way agent/tokens counts the
// built-in agent's.
func (c *call) chatPrompt() (int64, error) {
	raw, ok := c.obj.get("messages")
	if !ok {
		return 0, invalid("messages", "is required")
	}
	n, extra, err := c.messagesTokens(raw)
	if err != nil {
		return 0, err
	}
	// The messages' own count (framing and text, not the allowances held
	// beside them) is the prompt's floor: what a provider bills at least.
	c.promptFloor = n + c.counter.Priming()
	n += c.counter.Priming() + c.toolsTokens
	// Structured output schemas and legacy functions reach the model as
	// text; their JSON is counted as it is, which errs high. A predicted
	// output's tokens that the model does not use are billed as output
	// beside the output limit: they are reserved with the prompt.
	for _, k := range []string{"functions", "response_format", "prediction"} {
		if raw, ok := c.obj.get(k); ok {
			n += c.counter.Count(string(raw))
		}
	}
	return n + extra, nil
}

// messagesTokens counts a chat request's messages, framing and all, and
// what they hold besides text (images, files): through the memo when the
// call has one.
func (c *call) messagesTokens(raw []byte) (n, extra int64, err error) {
	if c.split.items != nil {
		return c.chatMessages(c.split.items)
	}
	// chatMessage matches names ignoring case; OpenAI does not.
	if err := checkNames(raw, "messages", true); err != nil {
		return 0, 0, err
	}
	var msgs []chatMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return 0, 0, invalid("messages", "must be an array of messages")
	}
	for i, m := range msgs {
		text, more, ref := c.contentText(m.Content)
		if ref != "" {
			return 0, 0, unsupported("messages["+strconv.Itoa(i)+"].content"+ref, fileRefReason)
		}
		extra += more
		n += c.counter.Message(m.message(text))
	}
	return n, extra, nil
}

// contentText is the text of a message's content (a string or an array of
// parts) and the tokens of its other parts: images and files at their
// allowance plus their JSON, anything unknown at its JSON.
//
// A file given by reference (a file_id, a file_url) is not served: its
// text is the provider's to extract, unseen by the reservation; ref then
// names it within raw ("[1].file.file_id"), for the caller's refusal. (An
// image by reference is bounded by its allowance; a file's data sent
// inline is counted as its JSON.)
func (c *call) contentText(raw json.RawMessage) (text string, extra int64, ref string) {
	if len(raw) == 0 || isNull(raw) {
		return "", 0, ""
	}
	if s, ok := asString(raw); ok {
		return s, 0, ""
	}
	var parts []map[string]json.RawMessage
	if json.Unmarshal(raw, &parts) != nil {
		return "", c.counter.Count(string(raw)), ""
	}
	var b strings.Builder
	for j, p := range parts {
		typ, _ := asString(p["type"])
		if ref := fileRef(typ, p); ref != "" {
			return "", 0, "[" + strconv.Itoa(j) + "]." + ref
		}
		switch typ {
		case "text", "input_text", "output_text", "refusal":
			key := "text"
			if typ == "refusal" {
				key = "refusal"
			}
			if s, ok := asString(p[key]); ok {
				b.WriteString(s)
				continue
			}
		case "image_url", "input_image":
			low := imageDetail(typ, p) == "low"
			if low {
				c.lowImages++
			} else {
				c.images++
			}
			extra += tokens.ImageTokens(c.model, low)
		case "file", "input_file":
			extra += fileTokens
		}
		raw, _ := json.Marshal(p)
		extra += c.counter.Count(string(raw))
	}
	return b.String(), extra, ""
}

// fileRefReason is why a file by reference is refused.
const fileRefReason = "files by reference are not served; send the file's data"

// fileRef names the member by which a content part of type typ refers to
// a file the provider holds or fetches ("file.file_id", "file_id",
// "file_url"), or is "".
func fileRef(typ string, p map[string]json.RawMessage) string {
	switch typ {
	case "file":
		var f map[string]json.RawMessage
		if json.Unmarshal(p["file"], &f) == nil {
			for _, k := range []string{"file_id", "file_url"} {
				if v, ok := f[k]; ok && !isNull(v) {
					return "file." + k
				}
			}
		}
	case "input_file":
		for _, k := range []string{"file_id", "file_url"} {
			if v, ok := p[k]; ok && !isNull(v) {
				return k
			}
		}
	}
	return ""
}

// responsesPrompt counts the prompt of a Responses request: instructions,
// input (a string or items) and the function tools in the chat form the
// tokenizer's tool rendering knows.
func (c *call) responsesPrompt() (int64, error) {
	n := c.counter.Priming()
	if raw, ok := c.obj.get("instructions"); ok {
		s, isStr := asString(raw)
		if !isStr {
			return 0, invalid("instructions", "must be a string")
		}
		n += c.counter.Message(tokens.Message{Role: "system", Content: s})
	}
	raw, ok := c.obj.get("input")
	if !ok {
		return 0, invalid("input", "is required")
	}
	var extra int64
	if s, isStr := asString(raw); isStr {
		n += c.counter.Message(tokens.Message{Role: "user", Content: s})
	} else {
		items, more, err := c.inputTokens(raw)
		if err != nil {
			return 0, err
		}
		n, extra = n+items, more
	}
	c.promptFloor = n // instructions and input, not the tools' estimate
	n += c.toolsTokens
	if raw, ok := c.obj.get("text"); ok {
		n += c.counter.Count(string(raw)) // a structured output schema
	}
	return n + extra, nil
}

// inputTokens counts a Responses request's input items, framing and all,
// and what they hold besides text: through the memo when the call has
// one (inputItems).
func (c *call) inputTokens(raw []byte) (n, extra int64, err error) {
	if c.split.items != nil {
		return c.inputItems(c.split.items)
	}
	if err := checkNames(raw, "input", true); err != nil {
		return 0, 0, err
	}
	var items []map[string]json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return 0, 0, invalid("input", "must be a string or an array of items")
	}
	for i, it := range items {
		f, err := c.itemFacts(i, it)
		if err != nil {
			return 0, 0, err
		}
		n += f.tokens
		extra += f.extra + f.refs*c.refTokens
		c.images += f.images
		c.lowImages += f.lowImages
	}
	return n, extra, nil
}

// itemFacts counts the i-th input item it: what it adds to the prompt as
// a message, and besides (images, files, its JSON for kinds that are not
// messages, the earlier output an item reference stands for: refs).
func (c *call) itemFacts(i int, it map[string]json.RawMessage) (seenFacts, error) {
	at := func(rest string) string { return "input[" + strconv.Itoa(i) + "]" + rest }
	typ, _ := asString(it["type"])
	role, _ := asString(it["role"])
	images, low := c.images, c.lowImages
	var f seenFacts
	var m tokens.Message
	switch {
	case typ == "function_call":
		name, _ := asString(it["name"])
		args, _ := asString(it["arguments"])
		m = tokens.Message{Role: "assistant", ToolCalls: []tokens.ToolCall{{Name: name, Arguments: args}}}
	case typ == "function_call_output":
		text, more, ref := c.contentText(it["output"])
		if ref != "" {
			return seenFacts{}, unsupported(at(".output")+ref, fileRefReason)
		}
		f.extra, m = more, tokens.Message{Role: "tool", Content: text}
	case role != "" && (typ == "" || typ == "message"):
		text, more, ref := c.contentText(it["content"])
		if ref != "" {
			return seenFacts{}, unsupported(at(".content")+ref, fileRefReason)
		}
		f.extra, m = more, tokens.Message{Role: role, Content: text}
	default:
		if typ == "item_reference" || typ == "" {
			// An item the provider stored, its content unseen (an item
			// with neither type nor role is one: the type defaults to
			// item_reference). The Vercel AI SDK sends each earlier
			// answer so (its store defaults to true): an output of an
			// earlier call, held at the most one call may produce
			// (Options.ReferenceTokens), beside its JSON.
			f.refs = 1
		}
		// Reasoning items, item references and kinds this package does
		// not know: their JSON, which errs high. They are no message.
		b, _ := json.Marshal(it)
		f.extra = c.counter.Count(string(b))
		return f, nil
	}
	f.tokens = c.counter.Message(m)
	f.images, f.lowImages = c.images-images, c.lowImages-low
	c.images, c.lowImages = images, low // the caller adds them
	return f, nil
}

// chatTools rewrites Responses function tools ({"type","name",
// "description","parameters"}) into the chat form ({"type","function":{…}})
// agent/tokens renders.
func chatTools(raw json.RawMessage) string {
	var tools []map[string]json.RawMessage
	if json.Unmarshal(raw, &tools) != nil {
		return string(raw)
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
		out[i] = tool{Type: "function", Function: fn{t["name"], t["description"], t["parameters"]}}
	}
	b, err := json.Marshal(out)
	if err != nil {
		return string(raw)
	}
	return string(b)
}

// embeddingInput counts an embeddings request's input: a string, strings,
// or token arrays (one token per integer).
func (c *call) embeddingInput() (int64, error) {
	raw, ok := c.obj.get("input")
	if !ok {
		return 0, invalid("input", "is required")
	}
	if s, ok := asString(raw); ok {
		return c.counter.Count(s), nil
	}
	var strs []string
	if json.Unmarshal(raw, &strs) == nil {
		var n int64
		for _, s := range strs {
			n += c.counter.Count(s)
		}
		return n, nil
	}
	var ints []int64
	if json.Unmarshal(raw, &ints) == nil {
		return int64(len(ints)), nil
	}
	var arrays [][]int64
	if json.Unmarshal(raw, &arrays) == nil {
		var n int64
		for _, a := range arrays {
			n += int64(len(a))
		}
		return n, nil
	}
	return 0, invalid("input", "must be a string, strings or token arrays")
}

// minOpenAIOutput is the least max_output_tokens OpenAI's models take on
// the Responses API; they refuse a smaller limit.
const minOpenAIOutput = 16

// minOutput is the least output limit the provider of model takes for a
// call of kind: minOpenAIOutput for Responses on a model with an OpenAI
// tokenizer, else 1.
func minOutput(kind, model string) int64 {
	if kind == KindResponses && tokens.EncodingFor(model) != tokens.Bound {
		return minOpenAIOutput
	}
	return 1
}

// body is the request as sent upstream on attempt a: the attempt's model,
// the output limit clamped to the attempt's (set when the client gave
// none), and for chat streams stream_options.include_usage.
func (c *call) body(a govern.Attempt, legacy bool) []byte {
	set := []field{{"model", json.RawMessage(appendJSONString(nil, a.Model.Name))}}
	if c.kind != KindEmbeddings && a.MaxOutput > 0 {
		// The governor reserves at least govern.Spec.MinOutput, the largest of
		// the asked and fallback models' (Options.FallbackModels), so
		// this raises nothing the reservation does not cover; it is a
		// guard for a fallback the options did not name.
		limit := max(a.MaxOutput, minOutput(c.kind, a.Model.Name))
		v := json.RawMessage(strconv.AppendInt(nil, limit, 10))
		fields := c.limitFields
		if len(fields) == 0 {
			fields = []string{c.defaultLimitField(a.Model.Name)}
		}
		if legacy && c.kind == KindChat && !slices.Contains(fields, "max_tokens") {
			// A server that reads only max_tokens would read no limit
			// in max_completion_tokens, whichever the agent chose.
			fields = append(slices.Clip(fields), "max_tokens")
		}
		for _, f := range fields {
			set = append(set, field{f, v})
		}
	}
	if c.streamOptions != nil {
		so := c.streamOptions.encode(nil, []field{{"include_usage", json.RawMessage("true")}})
		set = append(set, field{"stream_options", so})
	}
	return c.obj.encode(make([]byte, 0, 256+totalSize(c.obj)), set)
}

// defaultLimitField is the output limit to add when the client sent none:
// OpenAI's own models take max_completion_tokens (its reasoning models
// refuse max_tokens); the other OpenAI-compatible servers (vLLM, Ollama,
// llama.cpp) all read max_tokens.
func (c *call) defaultLimitField(model string) string {
	if c.kind == KindResponses {
		return "max_output_tokens"
	}
	if tokens.EncodingFor(model) != tokens.Bound {
		return "max_completion_tokens"
	}
	return "max_tokens"
}

func totalSize(o *object) int {
	n := 0
	for _, f := range o.fields {
		n += len(f.key) + len(f.raw) + 4
	}
	return n
}

// appendJSONString appends s as a JSON string (no HTML escaping): the
// module's one escaper.
func appendJSONString(dst []byte, s string) []byte { return jsonstr.Append(dst, s) }

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
