package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"

	"faregate/agent/chat"
	"faregate/agent/outbound"
	"faregate/agent/tools"
	"faregate/protect/codes"
)

// runTools executes the tool calls of one model answer, in order, and
// appends the assistant message and one tool message per call: the text
// for the model, the typed data for planners that are not models.
// depth is the model step that asked, sent downstream as X-AITF-Depth.
func (r *run) runTools(ctx context.Context, reply chat.Reply, depth int) {
	r.msgs = append(r.msgs, chat.Message{Role: chat.RoleAssistant, Content: reply.Content, ToolCalls: reply.ToolCalls})
	for _, tc := range reply.ToolCalls {
		tctx, end := r.startTool(ctx, tc.Name)
		obs := r.toolCall(tctx, tc.ID, tc.Name, tc.Arguments, depth)
		end()
		r.msgs = append(r.msgs, chat.Message{Role: chat.RoleTool, ToolCallID: tc.ID, Name: tc.Name,
			Content: obs.Text, Data: obs.Data})
	}
}

// toolCall answers one tool call: from the task's memory when repeated
// (a third identical call is a loop and withdraws the tools), refused past
// the tool-call bound, else executed.
func (r *run) toolCall(ctx context.Context, id, name, args string, depth int) tools.Observation {
	t, ok := r.tools[name]
	if !ok {
		st := r.startStep("tool", name, "")
		obs := tools.Observation{Text: fmt.Sprintf("Unknown tool %q. Available tools: %s.", name, strings.Join(r.toolNames(), ", ")), Failed: true}
		r.endStep(st, "failed", "unknown tool")
		return obs
	}
	key := name + " " + canonicalArgs(args)
	if m, ok := r.memory[key]; ok {
		m.count++
		st := r.startStep("tool", name, argsDetail(args))
		detail := "answered from this task's memory"
		if m.count >= 3 {
			// The model is looping on one call: stop offering tools.
			r.withdrawn = true
			r.warn(codes.ToolLoop)
			detail = "repeated call: tools withdrawn"
		}
		r.endStep(st, "cached", detail)
		return m.obs
	}
	if r.executed >= r.w.cfg.MaxToolCalls {
		r.withdrawn = true
		r.warn(codes.ToolLimit)
		st := r.startStep("tool", name, argsDetail(args))
		r.endStep(st, "failed", "tool-call limit reached")
		return tools.Observation{Text: "Tool-call limit reached for this task; answer from what you have.", Failed: true}
	}
	r.executed++
	st := r.startStep("tool", name, argsDetail(args))
	callCtx := outbound.WithCall(ctx, id, depth)
	obs := t.Call(callCtx, args)
	if obs.Warning != "" {
		r.warn(obs.Warning)
	}
	status, detail := "ok", summarize(obs.Text)
	switch {
	case obs.Degraded:
		// The plan goes on with a stand-in (the text says which): shown
		// as such, not as a failure beside the task's warning.
		status = "degraded"
	case obs.Failed:
		status = "failed"
	}
	r.endStep(st, status, detail)
	r.memory[key] = &memo{obs: obs, count: 1}
	return obs
}

func (r *run) toolNames() []string {
	var out []string
	for n := range r.tools {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

// canonicalArgs makes equal arguments compare equal whatever their key order
// or spacing; invalid JSON compares as its trimmed text.
func canonicalArgs(args string) string {
	var v any
	if err := json.Unmarshal([]byte(args), &v); err != nil {
		return strings.TrimSpace(args)
	}
	v = normalizeStrings(v)
	out, _ := json.Marshal(v) // map keys are sorted by encoding/json
	return string(out)
}

// normalizeStrings trims and lower-cases strings: "Lisbon " and "lisbon"
// ask a tool the same question.
func normalizeStrings(v any) any {
	switch t := v.(type) {
	case string:
		return strings.ToLower(strings.TrimSpace(t))
	case map[string]any:
		for k, x := range t {
			t[k] = normalizeStrings(x)
		}
	case []any:
		for i, x := range t {
			t[i] = normalizeStrings(x)
		}
	}
	return v
}

func argsDetail(args string) string { return clip(strings.Join(strings.Fields(args), " "), 160) }
func summarize(s string) string     { return clip(strings.Join(strings.Fields(s), " "), 160) }
