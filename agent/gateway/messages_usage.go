package gateway

import (
	"encoding/json"
	"strconv"

	"faregate/agent/govern"
)

// msgUsageReport is a Messages usage object: message_start's, each
// message_delta's, a JSON answer's. A number sent as anything but a
// number fails its decode (the report is then unreadable).
type msgUsageReport struct {
	Input         *float64 `json:"input_tokens"`
	Output        *float64 `json:"output_tokens"`
	CacheWrite    *float64 `json:"cache_creation_input_tokens"`
	CacheRead     *float64 `json:"cache_read_input_tokens"`
	CacheCreation *struct {
		Hour *float64 `json:"ephemeral_1h_input_tokens"`
	} `json:"cache_creation"`
}

// msgUsage is what a Messages stream or answer reported, read as
// Anthropic defines it: message_start carries the input, the cache
// fields and a first output count; each message_delta's usage is
// cumulative, the whole message so far, so a later value replaces an
// earlier one, never adds to it. A value that goes down does not lower
// what is charged (each part keeps the most reported), and a repeated
// one changes nothing.
type msgUsage struct {
	input, cacheWrite, cacheWrite1h, cacheRead, output int64
	// seen: a usage object was read; final: a message_delta (or a JSON
	// answer) reported output_tokens, so output is the provider's count
	// of the message, not message_start's first one.
	seen, final bool
	// unreadable: a usage object did not say in numbers what was used.
	unreadable bool
	raw        string
}

// merge reads one usage object; final marks one whose output_tokens is
// the message's (message_delta, a JSON answer).
func (u *msgUsage) merge(raw json.RawMessage, final bool) {
	if len(raw) == 0 || isNull(raw) {
		return
	}
	u.seen = true
	u.raw = boundedRaw(raw)
	var r msgUsageReport
	if json.Unmarshal(raw, &r) != nil {
		u.unreadable = true
		return
	}
	keep := func(dst *int64, v *float64) {
		if v != nil {
			*dst = max(*dst, clampInt(*v)) // clampInt bounds it; max keeps it ≥ 0
		}
	}
	keep(&u.input, r.Input)
	keep(&u.cacheWrite, r.CacheWrite)
	keep(&u.cacheRead, r.CacheRead)
	if r.CacheCreation != nil {
		keep(&u.cacheWrite1h, r.CacheCreation.Hour)
	}
	keep(&u.output, r.Output)
	if final && r.Output != nil {
		u.final = true
	}
}

// prompt is the prompt the provider reported: Anthropic's input_tokens
// excludes what it wrote to or read from its cache.
func (u *msgUsage) prompt() int64 {
	return satAdd(satAdd(u.input, u.cacheWrite), u.cacheRead)
}

// usage is the govern.Usage an attempt reports. A whole report (the stream
// ended with the provider's final count, or a JSON answer gave one) is
// the provider's; anything less is this package's estimate (prompt
// estimated, passed counted) with the provider's prompt and cache parts
// where it reported them, as the chat relay does for a stream it did not
// see end.
func (u *msgUsage) usage(estimate, passed int64, whole bool) govern.Usage {
	out := govern.Usage{Prompt: estimate, Completion: passed}
	if !u.seen {
		return out
	}
	if u.unreadable {
		out.Reported, out.Unreadable, out.Raw = true, true, u.raw
		return out
	}
	out.Prompt = u.prompt()
	out.CacheCreation, out.CacheCreation1h, out.CacheRead = u.cacheWrite, min(u.cacheWrite1h, u.cacheWrite), u.cacheRead
	if whole && u.final {
		out.Completion, out.Reported, out.Raw = u.output, true, u.raw
	}
	return out
}

// appendMsgUsage appends a usage object in Anthropic's shape: input
// excludes the cache parts, each given apart.
func appendMsgUsage(b []byte, u govern.Usage) []byte {
	in := max(u.Prompt-u.CacheCreation-u.CacheRead, 0)
	b = append(b, `{"input_tokens":`...)
	b = strconv.AppendInt(b, in, 10)
	b = append(b, `,"cache_creation_input_tokens":`...)
	b = strconv.AppendInt(b, u.CacheCreation, 10)
	b = append(b, `,"cache_read_input_tokens":`...)
	b = strconv.AppendInt(b, u.CacheRead, 10)
	b = append(b, `,"output_tokens":`...)
	b = strconv.AppendInt(b, u.Completion, 10)
	return append(b, '}')
}
