package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"unicode/utf8"

	"faregate/protect/repetition"
)

// A JSON answer is in memory whole before it is relayed, so it is counted
// first and held to its reservation as a stream is: one whose output passes
// the reservation by more than overTolerance, or whose content or tool-call
// arguments loop, is cut before it is relayed, at the reservation or at the
// loop, the way the provider itself cuts at its output limit:
//
//   - a chat completion (one choice) keeps its texts up to the cut (the
//     reasoning, then the content, then the tool calls in order: a tool
//     call whose name is cut is dropped whole, its arguments are kept up
//     to the cut), drops what follows, and ends with finish_reason
//     "length";
//   - a Responses answer keeps its output items up to the cut, the cut
//     item "incomplete", and ends with status "incomplete" and
//     incomplete_details.reason "max_output_tokens".
//
// Anything else (several choices, a text that is not a string, an answer
// that does not decode into these shapes) cannot be cut well formed and is
// refused: ErrUpstreamAnswer, 502 upstream_invalid. Either way the call is
// charged what the provider produced (budget.Charged), the excess over the
// reservation as overage.

// errNotCuttable: the answer has no shape a cut can keep well formed.
var errNotCuttable = errors.New("gateway: the answer cannot be cut well formed")

// overTolerance is how far a JSON answer's output may pass its reservation
// of limit tokens before it is cut. Counted with the model's own tokenizer
// the count is the provider's within the framing of parts counted apart: a
// sixteenth and 16 tokens. With the conservative bound, which can count up
// to about twice a model's own tokenizer, an honest answer may count up to
// twice its limit: the bound's own margin, as for a report (budget.Charged).
func overTolerance(limit int64, exact bool) int64 {
	if !exact {
		return max(limit, 1000)
	}
	return limit/16 + 16
}

// textRef is one output text of a decoded answer, in the order the model
// produced it.
type textRef struct {
	m    map[string]any // the object holding the text
	key  string
	text string
	// group is the tool call or output item the text belongs to (-1: the
	// chat message itself); name marks a tool call's name, never cut
	// inside (the call is dropped whole); loop marks the texts the loop cut
	// reads (content, tool-call arguments).
	group      int
	name, loop bool
}

// textRefs collects an answer's texts for chatTexts and responseTexts.
type textRefs []textRef

// add appends m[key] if it is present and not null; it returns false when
// the member is there but not a string: such an answer cannot be cut well
// formed (errNotCuttable).
func (r *textRefs) add(m map[string]any, key string, group int, name, loop bool) bool {
	raw, present := m[key]
	if !present || raw == nil {
		return true
	}
	s, ok := raw.(string)
	*r = append(*r, textRef{m: m, key: key, text: s, group: group, name: name, loop: loop})
	return ok
}

// cutAnswer cuts a JSON answer of kind (KindChat or KindResponses) at limit
// output tokens counted for model (0: no limit), or where loop (nil: none)
// finds the output repeating, whichever comes first. It returns the answer
// to relay, whether it was cut at a loop, and errNotCuttable when the
// answer cannot be cut well formed. An answer that needs no cut is
// returned as it is.
func cutAnswer(raw []byte, kind, model string, limit int64, loop *repetition.Detector) ([]byte, bool, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v map[string]any
	if err := dec.Decode(&v); err != nil || v == nil {
		return nil, false, errNotCuttable
	}
	var refs []textRef
	var trim func(keep int)
	var ok bool
	if kind == KindChat {
		refs, trim, ok = chatTexts(v)
	} else {
		refs, trim, ok = responseTexts(v)
	}
	if !ok {
		return nil, false, errNotCuttable
	}
	at, where, looped, found := findCut(refs, model, limit, loop)
	if !found {
		return raw, false, nil
	}
	r := refs[at]
	keep := r.group + 1
	if r.name {
		keep = r.group
	}
	r.m[r.key] = r.text[:where]
	for _, later := range refs[at+1:] {
		if later.group == r.group || later.group < 0 {
			clearText(later)
		}
	}
	trim(max(keep, 0))
	if kind == KindChat {
		choice := v["choices"].([]any)[0].(map[string]any)
		choice["finish_reason"] = "length"
	} else {
		v["status"] = "incomplete"
		v["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
		if out, _ := v["output"].([]any); r.group < len(out) && !r.name {
			if it, ok := out[r.group].(map[string]any); ok {
				it["status"] = "incomplete"
			}
		}
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, false, errNotCuttable
	}
	return bytes.TrimRight(b.Bytes(), "\n"), looped, nil
}

// clearText empties a text after the cut: a chat message's content
// becomes null (as a provider's is when it produced none), its other texts
// and an item's texts are removed or emptied.
func clearText(r textRef) {
	switch {
	case r.group < 0 && r.key == "content":
		r.m[r.key] = nil
	case r.group < 0:
		delete(r.m, r.key)
	default:
		r.m[r.key] = ""
	}
}

// findCut walks refs in order, a word at a time, counting with a fresh
// counter for model, and returns where the first cut falls: before the
// piece that takes the count past limit, or after the piece on which loop
// fires (on the loop texts only).
func findCut(refs []textRef, model string, limit int64, loop *repetition.Detector) (ref, at int, looped, found bool) {
	oc := newOutCounter(model)
	for i, r := range refs {
		oc.cut()
		s := r.text
		for start := 0; start < len(s); {
			end := nextPiece(s, start)
			oc.Add(s[start:end])
			if limit > 0 && oc.Tokens() > limit {
				return i, start, false, true
			}
			if loop != nil && r.loop && loop.Write([]byte(s[start:end])) {
				return i, end, true, true
			}
			start = end
		}
		if loop != nil && r.loop {
			loop.Write([]byte{'\n'}) // a text ends its last word
		}
	}
	return 0, 0, false, false
}

// nextPiece is where the piece of s that starts at start ends: before the
// next space (a piece is a word with the space before it, as a stream's
// deltas mostly are), or after 64 bytes, at a rune's start.
func nextPiece(s string, start int) int {
	end := start + 1
	for end < len(s) && end-start < 64 && s[end] != ' ' {
		end++
	}
	for end < len(s) && !utf8.RuneStart(s[end]) {
		end++
	}
	return end
}

// chatTexts lists the output texts of a chat completion of one choice, in
// the order a model produces them, and returns trim, which keeps the first
// keep tool calls (a legacy function_call counts as the one after them).
func chatTexts(v map[string]any) ([]textRef, func(int), bool) {
	choices, _ := v["choices"].([]any)
	if len(choices) != 1 {
		return nil, nil, false
	}
	choice, _ := choices[0].(map[string]any)
	msg, _ := choice["message"].(map[string]any)
	if msg == nil {
		return nil, nil, false
	}
	var refs textRefs
	add := refs.add
	for _, k := range []string{"reasoning_content", "reasoning", "content", "refusal"} {
		if !add(msg, k, -1, false, k == "content") {
			return nil, nil, false
		}
	}
	calls, _ := msg["tool_calls"].([]any)
	fns := make([]map[string]any, 0, len(calls)+1)
	for _, tc := range calls {
		call, _ := tc.(map[string]any)
		fn, _ := call["function"].(map[string]any)
		if fn == nil {
			return nil, nil, false
		}
		fns = append(fns, fn)
	}
	if fc, ok := msg["function_call"].(map[string]any); ok {
		fns = append(fns, fc)
	}
	for i, fn := range fns {
		if !add(fn, "name", i, true, false) || !add(fn, "arguments", i, false, true) {
			return nil, nil, false
		}
	}
	trim := func(keep int) {
		if keep < len(calls) {
			if keep == 0 {
				delete(msg, "tool_calls")
			} else {
				msg["tool_calls"] = calls[:keep]
			}
		}
		if _, ok := msg["function_call"]; ok && keep <= len(calls) {
			delete(msg, "function_call")
		}
	}
	return refs, trim, true
}

// responseTexts lists the output texts of a Responses answer as respItem
// counts them (names, arguments, content texts and refusals, summaries),
// item by item, and returns trim, which keeps the first keep items.
func responseTexts(v map[string]any) ([]textRef, func(int), bool) {
	output, ok := v["output"].([]any)
	if !ok {
		return nil, nil, false
	}
	var refs textRefs
	add := refs.add
	parts := func(it map[string]any, key string, group int) bool {
		list, _ := it[key].([]any)
		for _, p := range list {
			part, ok := p.(map[string]any)
			if !ok || !add(part, "text", group, false, key == "content") || !add(part, "refusal", group, false, false) {
				return false
			}
		}
		return true
	}
	for i, raw := range output {
		it, ok := raw.(map[string]any)
		if !ok || !add(it, "name", i, true, false) || !add(it, "arguments", i, false, true) ||
			!parts(it, "content", i) || !parts(it, "summary", i) {
			return nil, nil, false
		}
	}
	trim := func(keep int) {
		if keep < len(output) {
			v["output"] = output[:keep]
		}
	}
	return refs, trim, true
}
