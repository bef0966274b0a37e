package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"faregate/agent/govern"
	"faregate/agent/tokens"
)

// MinThinkingBudget is the least thinking.budget_tokens Anthropic takes:
// a call with manual extended thinking must be sent with max_tokens above
// it (budget_tokens < max_tokens), so it is reserved with at least
// MinThinkingBudget+1 output tokens, and one that cannot afford them is
// refused with the budget's code, as a call that cannot afford its
// MinOutput is.
const MinThinkingBudget = 1024

// msgCall is a parsed, checked Messages request (POST /v1/messages, or
// count_tokens' body, which has no max_tokens).
type msgCall struct {
	// req is the client's request (for the error writer's in-stream
	// event).
	req *http.Request
	// deadline bounds the call (callDeadline); taskFirst: it is the
	// task's.
	deadline  time.Time
	taskFirst bool
	obj       *object
	model     string
	stream    bool
	// maxOut is max_tokens as asked (0 for count_tokens).
	maxOut int64
	// thinking is the thinking object when its type is "enabled" (manual
	// extended thinking, whose budget_tokens is patched), else nil.
	thinking *object
	// prompt is the prompt as counted (images at their allowance); floor
	// the part counted from its text (countPrompt).
	prompt, floor int64
	// images is how many images the prompt holds, each counted at
	// tokens.ImageTokens of the model (at high detail: Messages has none).
	images  int64
	counter tokens.Counter
	// version and beta are the client's anthropic-version and
	// anthropic-beta, forwarded to an Anthropic upstream.
	version, beta string
}

// msgNames are the members of a Messages body this package reads or
// refuses, by their folded names: a provider written in Go matches
// names ignoring case (names.go), so "MAX_TOKENS" must not pass as an
// unknown member beside the max_tokens checked here.
var msgNames = foldedNames("model", "messages", "system", "max_tokens", "stream", "thinking", "tools",
	"tool_choice", "mcp_servers", "container", "speed", "inference_geo", "service_tier", "output_config",
	"stop_sequences", "temperature", "top_p", "top_k", "metadata")

// thinkingNames are the members of the thinking object read here.
var thinkingNames = foldedNames("type", "budget_tokens")

func foldedNames(names ...string) map[string]string {
	m := make(map[string]string, len(names))
	for _, n := range names {
		m[foldName(n)] = n
	}
	return m
}

// checkSpelling refuses a member of o whose name folds to one of names
// but is spelled otherwise (parseObject has refused two that fold alike).
func checkSpelling(o *object, parent string, names map[string]string) error {
	for _, f := range o.fields {
		if want, ok := names[foldName(f.key)]; ok && want != f.key {
			return invalid(joinField(parent, f.key), "must be spelled "+strconv.Quote(want)+": a provider may read it as that")
		}
	}
	return nil
}

// parseMessages checks a Messages request body. The model comes first,
// checked with allowed before anything else is read (a refused model
// costs the JSON scan only, as on the other routes). countOnly parses
// count_tokens' body: max_tokens is not required there.
func parseMessages(body []byte, allowed func(model string) bool, countOnly bool) (*msgCall, error) {
	o, err := parseObject(body, "body")
	if err != nil {
		return nil, err
	}
	if err := checkSpelling(o, "body", msgNames); err != nil {
		return nil, err
	}
	m := &msgCall{obj: o}
	raw, ok := o.get("model")
	if !ok {
		return nil, invalid("model", "is required")
	}
	if m.model, ok = asString(raw); !ok || m.model == "" {
		return nil, invalid("model", "must be a non-empty string")
	}
	if !allowed(m.model) {
		return nil, ErrModelNotAllowed
	}
	m.counter = tokens.ForModel(m.model)
	if raw, ok := o.get("stream"); ok {
		switch string(bytes.TrimSpace(raw)) {
		case "true":
			m.stream = true
		case "false":
		default:
			return nil, invalid("stream", "must be a boolean")
		}
	}
	raw, ok = o.get("max_tokens")
	switch {
	case ok:
		n, isInt := asInt(raw)
		if !isInt || n < 1 || n > maxOutputAsked {
			return nil, invalid("max_tokens", "must be a positive integer of at most 2^40")
		}
		m.maxOut = n
	case !countOnly:
		return nil, invalid("max_tokens", "is required")
	}
	if err := m.refuseCostly(); err != nil {
		return nil, err
	}
	if err := m.parseThinking(countOnly); err != nil {
		return nil, err
	}
	m.prompt, err = m.countPrompt()
	return m, err
}

// refuseCostly refuses what a reservation cannot see the cost of: the
// provider's server tools (web search, web fetch, code execution, and
// every tool of a type other than a custom tool: Anthropic's own client
// tools, bash, text editor, computer use, add hidden prompt text of their
// own), the MCP connector, a code execution container, fast mode and
// regional inference (priced above the standard rate), and a service
// tier other than the standard ones.
func (m *msgCall) refuseCostly() error {
	o := m.obj
	if raw, ok := o.get("mcp_servers"); ok && string(bytes.TrimSpace(raw)) != "[]" {
		return unsupported("mcp_servers", "the MCP connector is billed per use by the provider; it is not served")
	}
	if _, ok := o.get("container"); ok {
		return unsupported("container", "code execution containers are billed per use by the provider; they are not served")
	}
	if raw, ok := o.get("speed"); ok {
		if s, _ := asString(raw); s != "standard" {
			return unsupported("speed", "only standard speed is served (fast mode is priced above it)")
		}
	}
	if raw, ok := o.get("inference_geo"); ok {
		if s, _ := asString(raw); s != "global" {
			return unsupported("inference_geo", "only global inference is served (regional inference is priced above it)")
		}
	}
	if raw, ok := o.get("service_tier"); ok {
		if s, _ := asString(raw); s != "auto" && s != "standard_only" {
			return unsupported("service_tier", "only auto or standard_only is served")
		}
	}
	raw, ok := o.get("tools")
	if !ok {
		return nil
	}
	var tools []map[string]json.RawMessage
	if json.Unmarshal(raw, &tools) != nil {
		return invalid("tools", "must be an array of objects")
	}
	if err := checkNames(raw, "tools", false); err != nil {
		return err
	}
	for i, t := range tools {
		typ, isStr := asString(t["type"])
		if raw, has := t["type"]; has && !isNull(raw) && (!isStr || typ != "custom") {
			return unsupported("tools["+strconv.Itoa(i)+"].type", "only custom tools are served (server tools and Anthropic-defined tools bill beyond the tokens reserved)")
		}
		if _, ok := asString(t["name"]); !ok {
			return invalid("tools["+strconv.Itoa(i)+"].name", "must be a string")
		}
	}
	return nil
}

// parseThinking reads thinking: "enabled" (manual extended thinking,
// budget_tokens ≥ MinThinkingBudget and below max_tokens), "disabled" or
// "adaptive" (the model thinks within max_tokens as it sees fit); any
// other type is refused, its cost unknown.
func (m *msgCall) parseThinking(countOnly bool) error {
	raw, ok := m.obj.get("thinking")
	if !ok {
		return nil
	}
	t, err := parseObject(raw, "thinking")
	if err != nil {
		return err
	}
	if err := checkSpelling(t, "thinking", thinkingNames); err != nil {
		return err
	}
	typRaw, _ := t.get("type")
	typ, _ := asString(typRaw)
	switch typ {
	case "disabled", "adaptive":
		return nil
	case "enabled":
	default:
		return unsupported("thinking.type", "only enabled, adaptive or disabled thinking is served")
	}
	b, ok := t.get("budget_tokens")
	n, isInt := asInt(b)
	if !ok || !isInt || n < MinThinkingBudget || n > maxOutputAsked {
		return invalid("thinking.budget_tokens", "must be an integer of at least 1024")
	}
	if !countOnly && m.maxOut <= MinThinkingBudget {
		// Raising max_tokens to make room would spend more than the
		// client asked for.
		return invalid("max_tokens", "must be above 1024 with thinking enabled (budget_tokens counts within it)")
	}
	m.thinking = t
	return nil
}

// minOutput is the least output limit a call may be reserved and sent
// with on an upstream of wire: above MinThinkingBudget when thinking is
// enabled and sent (an OpenAI-compatible upstream is sent no thinking),
// else 1.
func (m *msgCall) minOutput(wire string) int64 {
	if m.thinking != nil && wire == WireAnthropic {
		return MinThinkingBudget + 1
	}
	return 1
}

// thinkingBudget is budget_tokens as sent with an output limit of
// maxOut: what the client asked, held below maxOut. ok is false when
// maxOut leaves no room for MinThinkingBudget (the governor granted less
// than minOutput: a wiring fault, refused rather than sent).
func (m *msgCall) thinkingBudget(maxOut int64) (int64, bool) {
	raw, _ := m.thinking.get("budget_tokens")
	asked, _ := asInt(raw)
	n := min(asked, maxOut-1)
	return n, n >= MinThinkingBudget
}

// anthropicBody is the request as sent to an Anthropic upstream on
// attempt a: the raw body with model, max_tokens and thinking's
// budget_tokens patched, every other byte as received.
func (m *msgCall) anthropicBody(a govern.Attempt) ([]byte, error) {
	set := []field{{"model", json.RawMessage(appendJSONString(nil, a.Model.Name))}}
	if a.MaxOutput > 0 {
		set = append(set, field{"max_tokens", strconv.AppendInt(nil, a.MaxOutput, 10)})
	}
	if m.thinking != nil {
		limit := a.MaxOutput
		if limit <= 0 {
			limit = m.maxOut
		}
		n, ok := m.thinkingBudget(limit)
		if !ok {
			return nil, fmt.Errorf("%w: an output limit of %d leaves no room for %d thinking tokens", ErrUpstream, limit, MinThinkingBudget)
		}
		set = append(set, field{"thinking", m.thinking.encode(nil, []field{{"budget_tokens", strconv.AppendInt(nil, n, 10)}})})
	}
	return m.obj.encode(make([]byte, 0, 256+totalSize(m.obj)), set), nil
}

// refusedBetas are anthropic-beta flags that change the price of what
// the reservation holds: the 1M-token context bills a long prompt at a
// premium, fast mode every token. (Betas that enable paid tools do
// nothing without the tool, which refuseCostly refuses.)
var refusedBetas = []string{"context-1m-", "fast-mode-"}

// maxBetaHeader bounds the anthropic-beta and anthropic-version values
// forwarded upstream.
const maxBetaHeader = 4 << 10

// checkHeaders reads the client's anthropic-version and anthropic-beta,
// refusing a beta that bills unseen and values too long to forward.
func (m *msgCall) checkHeaders(version string, betas []string) error {
	beta := strings.Join(betas, ",")
	if len(version) > 128 {
		return invalid("anthropic-version", "is too long")
	}
	if len(beta) > maxBetaHeader {
		return invalid("anthropic-beta", "is too long")
	}
	for b := range strings.SplitSeq(beta, ",") {
		b = strings.ToLower(strings.TrimSpace(b))
		for _, p := range refusedBetas {
			if strings.HasPrefix(b, p) {
				return unsupported("anthropic-beta", strconv.Quote(b)+" changes the price of the tokens reserved; it is not served")
			}
		}
	}
	m.version, m.beta = version, beta
	return nil
}
