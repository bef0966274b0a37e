package openai

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"faregate/agent/chat"
)

// streamShim sits between langchaingo and the server and reads every
// successful answer before langchaingo does, because langchaingo cannot be
// trusted with a hostile one:
//
//   - It reads SSE with a bufio.Scanner of 64 KiB lines, so one large line
//     fails the call ("token too long") and its usage is lost; it
//     accumulates delta.reasoning_content without bound (and quadratically);
//     and it decodes usage into int, so a report past 64 bits, a fraction
//     or a string silently drops the whole chunk.
//   - A server that ignores "stream": true and answers with one JSON
//     chat.completion would be read as an empty stream.
//
// So the shim parses every line itself, with a bounded line length: usage
// and reasoning are taken out and handed to the call (reasoning counts as
// output, is cut at the limit like content and is never kept), content and
// tool-call arguments are passed on in pieces small enough for
// langchaingo's scanner, and a one-piece JSON answer becomes the same
// stream. An answer it cannot read marks the call unreadable, which the
// caller charges at least its reservation.
type streamShim struct{ next http.RoundTripper }

const (
	// maxShimBody bounds a non-streamed answer the shim will read.
	maxShimBody = 8 << 20
	// maxLine bounds one SSE line read from the server; a call's memory is
	// this line plus what the output cap lets through.
	maxLine = 1 << 20
	// piece is the most content or argument bytes passed on in one chunk:
	// JSON escaping can grow text sixfold, and langchaingo's scanner takes
	// lines of at most 64 KiB.
	piece = 8 << 10
	// maxRaw bounds the raw usage report kept for the ledger.
	maxRaw = 512
)

// callKey carries a Generate's *callState to the shim on the request's
// context.
type callKey struct{}

// callState is what one Generate and its request's shim share. The
// stream callback is called from langchaingo's goroutine (content) and
// from the shim's read (reasoning), so it runs under mu, and never after
// Generate has returned.
type callState struct {
	mu         sync.Mutex
	emit       func(chat.Chunk) error // the turn's Stream; nil: count only
	closed     bool
	emitErr    error // what emit returned when it stopped the call
	reasoning  chat.Counter
	usage      chat.Usage
	unreadable string // why the answer could not be read; "" if it could
	chunks     int    // data chunks read
	// upstream is what the provider did when it did not answer 200: its
	// status (*StatusError) or the transport's own error, which
	// langchaingo reports only as text.
	upstream error
}

// errClosed stops a shim that is still reading after Generate returned.
var errClosed = errors.New("openai: call ended")

func (c *callState) send(ch chat.Chunk) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return errClosed
	}
	if c.emitErr != nil {
		return c.emitErr
	}
	c.reasoning.Add(ch.Reasoning)
	if c.emit == nil {
		return nil
	}
	if err := c.emit(ch); err != nil {
		c.emitErr = err
		return err
	}
	return nil
}

func (c *callState) fail(why string) {
	c.mu.Lock()
	if c.unreadable == "" {
		c.unreadable = why
	}
	c.mu.Unlock()
}

func (c *callState) setUsage(u chat.Usage) {
	c.mu.Lock()
	c.usage = u
	c.mu.Unlock()
}

func (c *callState) failedUpstream(err error) {
	c.mu.Lock()
	c.upstream = err
	c.mu.Unlock()
}

func (c *callState) upstreamErr() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.upstream
}

func (c *callState) sawChunk() {
	c.mu.Lock()
	c.chunks++
	c.mu.Unlock()
}

// close ends the call: later sends fail. It returns the final state.
func (c *callState) close() (usage chat.Usage, unreadable string, chunks int, emitErr error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	return c.usage, c.unreadable, c.chunks, c.emitErr
}

// withCall returns ctx carrying c for the shim.
func withCall(ctx context.Context, c *callState) context.Context {
	return context.WithValue(ctx, callKey{}, c)
}

// RoundTrip implements http.RoundTripper.
func (s streamShim) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := s.next.RoundTrip(req)
	c, _ := req.Context().Value(callKey{}).(*callState)
	if c != nil {
		// The facts the breaker judges by, kept before langchaingo turns
		// them into text.
		switch {
		case err != nil:
			c.failedUpstream(pastDeadline(req.Context(), err))
		case resp.StatusCode != http.StatusOK:
			c.failedUpstream(statusError(resp))
		}
	}
	if err != nil || resp.StatusCode != http.StatusOK {
		return resp, err
	}
	if c == nil {
		// Not a Generate call; still read through the bounds.
		c = &callState{}
	}
	var src io.Reader = resp.Body
	body := resp.Body
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt == "application/json" {
		raw, err := io.ReadAll(io.LimitReader(resp.Body, maxShimBody+1))
		resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("openai: read model answer: %w", err)
		}
		sse, why := completionToSSE(raw)
		if why != "" {
			c.fail(why)
		}
		src, body = bytes.NewReader(sse), io.NopCloser(nil)
	}
	resp.Body = &sseFilter{src: bufio.NewReaderSize(src, 64<<10), closer: body, c: c, ctx: req.Context()}
	resp.ContentLength = -1
	resp.Header.Del("Content-Length")
	resp.Header.Set("Content-Type", "text/event-stream")
	return resp, nil
}

// sseFilter reads the server's SSE and writes the stream langchaingo
// reads: data lines re-encoded (usage and reasoning taken out, content
// and arguments in pieces), everything else dropped.
type sseFilter struct {
	src    *bufio.Reader
	closer io.Closer
	c      *callState
	ctx    context.Context // the request's: its deadline is the client's timeout
	out    bytes.Buffer
	err    error
}

var errLineTooLong = errors.New("openai: SSE line too long")

func (f *sseFilter) Read(p []byte) (int, error) {
	for f.out.Len() == 0 && f.err == nil {
		f.step()
	}
	if f.out.Len() > 0 {
		return f.out.Read(p)
	}
	return 0, f.err
}

func (f *sseFilter) Close() error {
	if f.closer == nil {
		return nil
	}
	return f.closer.Close()
}

// step reads one line and handles it.
func (f *sseFilter) step() {
	line, err := readLine(f.src)
	if errors.Is(err, errLineTooLong) {
		f.c.fail(fmt.Sprintf("an SSE line over %d bytes", maxLine))
		f.err = err
		return
	}
	if len(line) > 0 {
		if lerr := f.line(line); lerr != nil {
			f.err = lerr
			return
		}
	}
	if err != nil {
		if errors.Is(err, io.EOF) && f.c.chunksRead() == 0 {
			f.c.fail("no chat.completion chunk in the answer")
		}
		if !errors.Is(err, io.EOF) {
			// A stream broken off (a timeout, a reset): the transport's
			// own error, kept for the breaker as a refused request's is.
			f.c.failedUpstream(pastDeadline(f.ctx, err))
		}
		f.err = err
	}
}

// pastDeadline is a transport's err, marked a timeout when the request's
// deadline has passed: an http.Client's Timeout ends the request below it
// by cancelling it, and the transport reports only "request canceled".
func pastDeadline(ctx context.Context, err error) error {
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %w", context.DeadlineExceeded, err)
	}
	return err
}

func (c *callState) chunksRead() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.chunks
}

// readLine reads one line without its end, at most maxLine bytes: a
// longer one is read to its end and discarded, and reported.
func readLine(r *bufio.Reader) ([]byte, error) {
	var line []byte
	for {
		frag, err := r.ReadSlice('\n')
		if len(line)+len(frag) > maxLine {
			for errors.Is(err, bufio.ErrBufferFull) {
				_, err = r.ReadSlice('\n')
			}
			return nil, errLineTooLong
		}
		line = append(line, frag...)
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		return bytes.TrimRight(line, "\r\n"), err
	}
}

// inChunk is what the shim reads of a chat.completion.chunk.
type inChunk struct {
	ID      string `json:"id"`
	Model   string `json:"model"`
	Choices []struct {
		Delta struct {
			Role             string          `json:"role"`
			Content          string          `json:"content"`
			ReasoningContent json.RawMessage `json:"reasoning_content"`
			Reasoning        json.RawMessage `json:"reasoning"`
			ToolCalls        []toolCall      `json:"tool_calls"`
		} `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	} `json:"choices"`
	Usage json.RawMessage `json:"usage"`
}

// line handles one SSE line; an error stops the stream (the call's
// callback cut it).
func (f *sseFilter) line(line []byte) error {
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		return nil // comments, event:, id:, retry: — langchaingo ignores them too
	}
	data = bytes.TrimSpace(data)
	if string(data) == "[DONE]" {
		f.out.WriteString("data: [DONE]\n\n")
		return nil
	}
	var in inChunk
	if json.Unmarshal(data, &in) != nil {
		return nil // as langchaingo does: a provider's non-JSON data line
	}
	f.c.sawChunk()
	if len(in.Usage) > 0 && string(in.Usage) != "null" {
		f.c.setUsage(readUsage(in.Usage))
	}
	if len(in.Choices) == 0 {
		return nil
	}
	ch := in.Choices[0]
	for _, raw := range []json.RawMessage{ch.Delta.ReasoningContent, ch.Delta.Reasoning} {
		text := reasoningText(raw)
		for text != "" {
			var p string
			p, text = cut(text, piece)
			if err := f.c.send(chat.Chunk{Reasoning: p}); err != nil {
				return err
			}
		}
	}
	// Pieces for langchaingo: content, then each tool call with its
	// arguments continued in further chunks (langchaingo appends an
	// argument-only delta to the last call), the finish reason on the last.
	var deltas []delta
	role := ch.Delta.Role
	for s := ch.Delta.Content; s != ""; {
		var p string
		p, s = cut(s, piece)
		deltas = append(deltas, delta{Role: role, Content: p})
		role = ""
	}
	for _, tc := range ch.Delta.ToolCalls {
		args := string(tc.Function.Arguments)
		first, rest := cut(args, piece)
		tc.Function.Arguments = arguments(first)
		deltas = append(deltas, delta{Role: role, ToolCalls: []toolCall{tc}})
		role = ""
		for rest != "" {
			var p string
			p, rest = cut(rest, piece)
			more := toolCall{Index: tc.Index}
			more.Function.Arguments = arguments(p)
			deltas = append(deltas, delta{ToolCalls: []toolCall{more}})
		}
	}
	if len(deltas) == 0 && (role != "" || ch.FinishReason != nil) {
		deltas = append(deltas, delta{Role: role})
	}
	for i, d := range deltas {
		out := sseChunk{ID: in.ID, Model: in.Model, Choices: []sseChoice{{Delta: d}}}
		if i == len(deltas)-1 {
			out.Choices[0].FinishReason = ch.FinishReason
		}
		writeChunk(&f.out, out)
	}
	return nil
}

// reasoningText is a reasoning field as text: a JSON string unquoted,
// anything else (an object some providers send) as its JSON, which still
// counts as output.
func reasoningText(raw json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return ""
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}

// cut splits s after at most n bytes, at a code point boundary.
func cut(s string, n int) (head, tail string) {
	if len(s) <= n {
		return s, ""
	}
	i := n
	for i > 0 && !utf8.RuneStart(s[i]) {
		i--
	}
	if i == 0 {
		i = n
	}
	return s[:i], s[i:]
}

// readUsage reads a usage object as the provider sent it. A count that is
// not an integer (a fraction, past 64 bits, a string, missing) makes the
// report Unreadable; negative numbers are read as they are, for the
// caller's ceiling rules to judge. Zero for both means the server sent
// none, as some do.
func readUsage(raw json.RawMessage) chat.Usage {
	u := chat.Usage{Reported: true, Raw: clipRaw(string(raw))}
	var v struct {
		Prompt     json.RawMessage `json:"prompt_tokens"`
		Completion json.RawMessage `json:"completion_tokens"`
		Details    struct {
			Reasoning json.RawMessage `json:"reasoning_tokens"`
		} `json:"completion_tokens_details"`
	}
	if json.Unmarshal(raw, &v) != nil {
		u.Unreadable = true
		return u
	}
	p, okP := integer(v.Prompt)
	c, okC := integer(v.Completion)
	if !okP || !okC {
		u.Unreadable = true
		return u
	}
	if p == 0 && c == 0 {
		return chat.Usage{}
	}
	u.PromptTokens, u.CompletionTokens = p, c
	if r, ok := integer(v.Details.Reasoning); ok {
		// Reasoning is part of the output; a larger report is not believed.
		u.ReasoningTokens = min(max(r, 0), max(c, 0))
	}
	return u
}

// integer reads a JSON number that is a whole number within 64 bits
// ("12", and "12.0" or "1.2e1" as some servers write them).
func integer(raw json.RawMessage) (int64, bool) {
	s := strings.TrimSpace(string(raw))
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return n, true
	}
	if s == "" || s[0] == '"' || s == "null" {
		return 0, false
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) >= 1<<53 {
		return 0, false
	}
	return int64(f), true
}

func clipRaw(s string) string {
	if len(s) <= maxRaw {
		return s
	}
	s, _ = cut(s, maxRaw)
	return s
}

// completion is the part of a chat.completion object the shim carries over.
type completion struct {
	ID      string `json:"id"`
	Model   string `json:"model"`
	Choices []struct {
		Message struct {
			Content          string          `json:"content"`
			ReasoningContent json.RawMessage `json:"reasoning_content"`
			Reasoning        json.RawMessage `json:"reasoning"`
			ToolCalls        []toolCall      `json:"tool_calls"`
		} `json:"message"`
		FinishReason string `json:"finish_reason"`
	} `json:"choices"`
	// Usage is passed on as it came, for the filter to read.
	Usage json.RawMessage `json:"usage"`
}

// toolCall is a tool call in a completion, and with Index set, a tool-call
// delta in a chunk.
type toolCall struct {
	Index    *int   `json:"index,omitempty"`
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name string `json:"name,omitempty"`
		// Arguments is a JSON string by the API's definition; some servers
		// send the object itself, which is carried as its JSON text.
		Arguments arguments `json:"arguments"`
	} `json:"function"`
}

// arguments reads a JSON string, or any other JSON value as its text, and
// writes a JSON string.
type arguments string

func (a *arguments) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err == nil {
		*a = arguments(s)
		return nil
	}
	if string(b) == "null" {
		*a = ""
		return nil
	}
	*a = arguments(b)
	return nil
}

// sseChunk is one chat.completion.chunk event.
type sseChunk struct {
	ID      string          `json:"id"`
	Object  string          `json:"object"`
	Model   string          `json:"model,omitempty"`
	Choices []sseChoice     `json:"choices"`
	Usage   json.RawMessage `json:"usage,omitempty"`
}

type sseChoice struct {
	Index        int     `json:"index"`
	Delta        delta   `json:"delta"`
	FinishReason *string `json:"finish_reason"`
}

type delta struct {
	Role             string     `json:"role,omitempty"`
	Content          string     `json:"content,omitempty"`
	ReasoningContent string     `json:"reasoning_content,omitempty"`
	ToolCalls        []toolCall `json:"tool_calls,omitempty"`
}

func writeChunk(out *bytes.Buffer, v sseChunk) {
	v.Object = "chat.completion.chunk"
	b, _ := json.Marshal(v)
	out.WriteString("data: ")
	out.Write(b)
	out.WriteString("\n\n")
}

// completionToSSE turns a chat.completion object into the chunks a server
// would have streamed: reasoning and content in pieces, the tool calls
// with their index, the finish reason, the usage. It returns why it could
// not (a body past maxShimBody, not a completion), with an empty stream.
func completionToSSE(raw []byte) ([]byte, string) {
	if len(raw) > maxShimBody {
		return nil, fmt.Sprintf("a JSON answer over %d bytes", maxShimBody)
	}
	var c completion
	if err := json.Unmarshal(raw, &c); err != nil || len(c.Choices) == 0 {
		return nil, "a JSON answer that is not a chat.completion"
	}
	msg := c.Choices[0].Message
	var out bytes.Buffer
	write := func(d delta, finish *string, usage json.RawMessage) {
		choices := []sseChoice{{Delta: d, FinishReason: finish}}
		if usage != nil {
			choices = []sseChoice{}
		}
		writeChunk(&out, sseChunk{ID: c.ID, Model: c.Model, Choices: choices, Usage: usage})
	}
	// The usage goes first: a large answer is cut at the reservation
	// before its end, and the provider's count of it must not be lost.
	if len(c.Usage) > 0 && string(c.Usage) != "null" {
		write(delta{}, nil, c.Usage)
	}
	for _, r := range []json.RawMessage{msg.ReasoningContent, msg.Reasoning} {
		for s := reasoningText(r); s != ""; {
			var p string
			p, s = cut(s, piece)
			write(delta{ReasoningContent: p}, nil, nil)
		}
	}
	role := "assistant"
	for s := msg.Content; s != ""; {
		var p string
		p, s = cut(s, piece)
		write(delta{Role: role, Content: p}, nil, nil)
		role = ""
	}
	for i, tc := range msg.ToolCalls {
		tc.Index = &i
		if tc.Type == "" {
			tc.Type = "function"
		}
		first, rest := cut(string(tc.Function.Arguments), piece)
		tc.Function.Arguments = arguments(first)
		write(delta{Role: role, ToolCalls: []toolCall{tc}}, nil, nil)
		role = ""
		for rest != "" {
			var p string
			p, rest = cut(rest, piece)
			more := toolCall{Index: &i}
			more.Function.Arguments = arguments(p)
			write(delta{ToolCalls: []toolCall{more}}, nil, nil)
		}
	}
	finish := c.Choices[0].FinishReason
	if finish == "" {
		finish = "stop"
	}
	write(delta{Role: role}, &finish, nil)
	out.WriteString("data: [DONE]\n\n")
	return out.Bytes(), ""
}
