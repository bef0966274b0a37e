package gateway

import (
	"bytes"
	"encoding/json"
	"hash/maphash"
	"strings"

	lru "github.com/hashicorp/golang-lru/v2"

	"faregate/agent/tokens"
)

// An agent re-sends its whole conversation on every call: a call's body
// is mostly messages this process has already parsed, checked and counted
// (the previous call's history), plus the one or two the agent added. A
// seenMemo remembers, for each message (a chat message) and tool list it
// has accepted, what parsing and counting it found, by a hash of its raw
// bytes; a later call that carries the same bytes skips validating,
// decoding, checking and counting them.
//
// That is sound because those facts are a function of the bytes and the
// model they are counted for, nothing else: the key is both. A part is
// remembered only once encoding/json has validated it and every check has
// accepted it (a refusal is worked out again, in the same words), so the
// bytes a later call skips are bytes that were accepted before. The hash
// is maphash with a seed made at start-up, which a client cannot learn: it
// cannot craft other bytes that pass for remembered ones. The memo is an
// LRU of seenEntries parts, so a flood of distinct messages costs its
// bound and no more.
//
// The body is split by a structural scanner (splitObject, splitArray)
// instead of encoding/json's decoder: validating 20 KB with encoding/json
// costs more than everything else a call does here. Every member is still
// validated before any check reads it, in the order parseObject validates
// them (the messages and tools through the memo), and anything the
// scanner finds unusual (broken structure, a value that is not valid JSON,
// a member name given twice or spelled otherwise than this package reads
// it, trailing data) sends the body to parseObject, which says what is
// wrong in the words it always has. BenchmarkAgentCallParse measures it.
type seenMemo struct {
	seed  maphash.Seed
	parts *lru.Cache[seenKey, seenFacts]
}

// seenEntries bounds the memo: about 100 bytes an entry, so a few MB.
const seenEntries = 32 << 10

// seenKey names a part: its bytes' hash and length, and what was found
// about it (kind): validValue (the bytes are valid JSON), or the tokens
// for model of a message (the call's kind: chat messages and Responses
// items count alike bytes differently) or of a tool list (toolsKind).
type seenKey struct {
	hash  uint64
	size  int
	model string
	kind  string
}

// validValue is the seenKey kind of "these bytes are valid JSON".
const validValue = "valid"

// toolsKind is the seenKey kind of a call's tool list.
func toolsKind(kind string) string {
	if kind == KindResponses {
		return "tools/" + KindResponses
	}
	return "tools/" + KindChat
}

// seenFacts is what a part was found to be: its tokens (a message's with
// its framing: tokens.Counter.Message; a tool list's: Tools, plus twins),
// the tokens besides its text (images, files, unknown parts at their
// JSON), and its images.
type seenFacts struct {
	tokens, extra     int64
	images, lowImages int64
	// refs counts Responses item references, each held at the call's
	// Options.ReferenceTokens (added by the caller, not remembered).
	refs int64
}

func newSeenMemo() *seenMemo {
	c, _ := lru.New[seenKey, seenFacts](seenEntries) // only a size < 1 fails
	return &seenMemo{seed: maphash.MakeSeed(), parts: c}
}

// seenPart is one element of a split array (or a whole member) and its
// hash, made once for both of the memo's questions.
type seenPart struct {
	raw  []byte
	hash uint64
}

func (m *seenMemo) part(raw []byte) seenPart {
	return seenPart{raw: raw, hash: maphash.Bytes(m.seed, raw)}
}

func (m *seenMemo) key(p seenPart, model, kind string) seenKey {
	return seenKey{hash: p.hash, size: len(p.raw), model: model, kind: kind}
}

// valid reports whether p is valid JSON, remembering a yes.
func (m *seenMemo) valid(p seenPart) bool {
	k := m.key(p, "", validValue)
	if m.parts.Contains(k) {
		return true
	}
	if !json.Valid(p.raw) {
		return false
	}
	m.parts.Add(k, seenFacts{})
	return true
}

// splitBody is the memo's split of a call's body: its members, and the
// elements of its messages (chat) or input items (Responses) (nil when it
// has none, or none that is an array) and its tools as parts, each
// validated.
type splitBody struct {
	obj   *object
	items []seenPart
	tools *seenPart
}

// splitCall splits body as parseObject parses it, validating the messages
// element by element and the tools as a whole through the memo, and every
// other member with encoding/json. ok is false when anything is unusual;
// parseObject then says what.
func (m *seenMemo) splitCall(kind string, body []byte) (splitBody, bool) {
	var s splitBody
	obj, ok := splitObject(body, func(key string, raw []byte) bool {
		switch {
		case (kind == KindChat && key == "messages" || kind == KindResponses && key == "input") && raw[0] == '[':
			elems, ok := splitArray(raw)
			if !ok {
				return false
			}
			s.items = make([]seenPart, len(elems))
			for i, el := range elems {
				if s.items[i] = m.part(el); !m.valid(s.items[i]) {
					return false
				}
			}
			return true
		case kind != KindEmbeddings && key == "tools":
			p := m.part(raw)
			s.tools = &p
			return m.valid(p)
		}
		return json.Valid(raw)
	})
	s.obj = obj
	return s, ok
}

// chatMessages counts a chat request's messages, split and validated by
// splitCall, through the memo: the tokens of every message
// (tokens.Counter.Message) and what besides their text.
func (c *call) chatMessages(parts []seenPart) (n, extra int64, err error) {
	return seenParts(c, parts, "messages", invalid("messages", "must be an array of messages"), c.chatMessage)
}

// inputItems counts a Responses request's input items as chatMessages
// counts messages.
func (c *call) inputItems(parts []seenPart) (n, extra int64, err error) {
	return seenParts(c, parts, "input", invalid("input", "must be a string or an array of items"),
		func(i int, it *map[string]json.RawMessage) (seenFacts, error) { return c.itemFacts(i, *it) })
}

// seenParts counts the parts of an array member (field), each decoded as
// a T, through the memo. A part the memo does not know is checked as the
// whole array is without the memo, in the same phases (every member name
// first, then the decoding, refused as undecodable; then each part's
// content in order, which count checks and counts), so the first refusal
// is the one it would be, in the same words; a part the memo knows was
// accepted before and refuses nothing.
func seenParts[T any](c *call, parts []seenPart, field string, undecodable error, count func(i int, v *T) (seenFacts, error)) (n, extra int64, err error) {
	facts := make([]seenFacts, len(parts))
	var missed []int
	for i, p := range parts {
		var hit bool
		if facts[i], hit = c.memo.parts.Get(c.memo.key(p, c.model, c.kind)); !hit {
			missed = append(missed, i)
		}
	}
	for _, i := range missed {
		if err := checkNames(parts[i].raw, field, true); err != nil {
			return 0, 0, err
		}
	}
	vs := make([]T, len(missed))
	for j, i := range missed {
		if json.Unmarshal(parts[i].raw, &vs[j]) != nil {
			return 0, 0, undecodable
		}
	}
	for j, i := range missed {
		if facts[i], err = count(i, &vs[j]); err != nil {
			return 0, 0, err
		}
		c.memo.parts.Add(c.memo.key(parts[i], c.model, c.kind), facts[i])
	}
	for _, f := range facts {
		n += f.tokens
		extra += f.extra + f.refs*c.refTokens
		c.images += f.images
		c.lowImages += f.lowImages
	}
	return n, extra, nil
}

// chatMessage counts the i-th message, msg, which the memo did not know.
func (c *call) chatMessage(i int, msg *chatMessage) (seenFacts, error) {
	images, low := c.images, c.lowImages
	text, extra, ref := c.contentText(msg.Content)
	if ref != "" {
		return seenFacts{}, unsupported(messageField(i)+ref, fileRefReason)
	}
	f := seenFacts{extra: extra, images: c.images - images, lowImages: c.lowImages - low}
	c.images, c.lowImages = images, low // chatMessages adds them, hit or miss alike
	f.tokens = c.counter.Message(msg.message(text))
	return f, nil
}

// message is m as agent/tokens counts it, with its content's text.
func (m *chatMessage) message(text string) tokens.Message {
	t := tokens.Message{Role: m.Role, Name: m.Name, Content: text}
	for _, tc := range m.ToolCalls {
		t.ToolCalls = append(t.ToolCalls, tokens.ToolCall{Name: tc.Function.Name, Arguments: tc.Function.Arguments})
	}
	return t
}

func messageField(i int) string { return "messages[" + itoa(int64(i)) + "].content" }

// splitObject splits the JSON object b into its members as parseObject
// does, by structure; accept validates each value (in order) and says
// whether it may stand. ok is false when anything is unusual: broken
// structure, trailing data, a name given twice (folded) or spelled
// otherwise than this package reads it, a value accept refuses.
func splitObject(b []byte, accept func(key string, raw []byte) bool) (*object, bool) {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	o := &object{fields: make([]field, 0, 16)}
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return o, skipSpace(b, i+1) == len(b)
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return nil, false
		}
		end := skipString(b, i)
		if end < 0 {
			return nil, false
		}
		key, ok := plainKey(b[i:end])
		if !ok {
			return nil, false
		}
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ':' {
			return nil, false
		}
		i = skipSpace(b, i+1)
		end = skipValue(b, i)
		if end <= i {
			return nil, false
		}
		raw := b[i:end]
		if !o.admits(key) || !accept(key, raw) {
			return nil, false
		}
		o.fields = append(o.fields, field{key, raw})
		i = skipSpace(b, end)
		if i >= len(b) {
			return nil, false
		}
		switch b[i] {
		case ',':
			i = skipSpace(b, i+1)
		case '}':
			if skipSpace(b, i+1) != len(b) {
				return nil, false
			}
			return o, true
		default:
			return nil, false
		}
	}
}

// plainKey is a member name's text when it is plain printable ASCII with
// no escape (every name a client of this API sends); anything else goes
// the long way.
func plainKey(quoted []byte) (string, bool) {
	for _, c := range quoted[1 : len(quoted)-1] {
		if c < 0x20 || c >= 0x80 || c == '\\' || c == '"' {
			return "", false
		}
	}
	return string(quoted[1 : len(quoted)-1]), true
}

// admits reports whether key may join o: not a name o has already, folded
// as a provider in Go would compare them, and spelled as this package
// reads it (parseObject's rules). Keys here are plain ASCII (plainKey),
// whose folding is ASCII's.
func (o *object) admits(key string) bool {
	if want, ok := readNames[foldName(key)]; ok && want != key {
		return false
	}
	for _, f := range o.fields {
		if strings.EqualFold(f.key, key) {
			return false
		}
	}
	return true
}

// splitArray splits the JSON array raw into its elements' bytes by its
// structure alone (strings, escapes, nesting): it does not validate the
// elements, which the caller does. ok is false when raw is not an array of
// values separated by single commas.
func splitArray(raw []byte) (elems [][]byte, ok bool) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, false
	}
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		return nil, skipSpace(raw, i+1) == len(raw)
	}
	for {
		end := skipValue(raw, i)
		if end <= i {
			return nil, false
		}
		elems = append(elems, raw[i:end])
		i = skipSpace(raw, end)
		if i >= len(raw) {
			return nil, false
		}
		switch raw[i] {
		case ',':
			i = skipSpace(raw, i+1)
		case ']':
			return elems, skipSpace(raw, i+1) == len(raw)
		default:
			return nil, false
		}
	}
}

// skipSpace is the index of the first byte at or after i that is not JSON
// whitespace.
func skipSpace(b []byte, i int) int {
	for i < len(b) {
		switch b[i] {
		case ' ', '\t', '\n', '\r':
			i++
		default:
			return i
		}
	}
	return i
}

// skipValue is the index just past the JSON value that starts at b[i],
// found by structure alone (a scalar ends at the next delimiter), or -1
// when the structure is broken.
func skipValue(b []byte, i int) int {
	depth := 0
	for i < len(b) {
		switch b[i] {
		case '"':
			end := skipString(b, i)
			if end < 0 {
				return -1
			}
			i = end
			if depth == 0 {
				return i
			}
			continue
		case '{', '[':
			depth++
		case '}', ']':
			depth--
			if depth < 0 {
				return -1
			}
			if depth == 0 {
				return i + 1
			}
		case ',', ':', ' ', '\t', '\n', '\r':
			if depth == 0 {
				return i // a scalar's end
			}
		}
		i++
	}
	if depth == 0 && i > 0 {
		return i // a scalar at the end of b
	}
	return -1
}

// skipString is the index just past the JSON string that starts at
// b[i] == '"', or -1 when it does not end. A quote ends the string unless
// an odd run of backslashes escapes it; the search for quotes is
// bytes.IndexByte's, which is vectorised (most of a message is its text).
func skipString(b []byte, i int) int {
	j := i + 1
	for {
		q := bytes.IndexByte(b[j:], '"')
		if q < 0 {
			return -1
		}
		q += j
		k := q
		for k > j && b[k-1] == '\\' {
			k--
		}
		if (q-k)%2 == 0 {
			return q + 1
		}
		j = q + 1
	}
}
