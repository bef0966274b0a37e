package gateway

import (
	"bytes"
	"encoding/json"
	"slices"
	"strconv"
	"unicode"
	"unicode/utf8"
)

// Member names are read here exactly, as OpenAI and the Python servers
// read them; a provider written in Go (Ollama, LocalAI, a Go gateway in
// front of one) decodes into structs, which match a member name
// case-insensitively, "K" (Kelvin sign), "ſ" (long s), "ı" and "İ"
// included, and take the last of two that match. So
// {"model":"gpt-4o-mini", …, "MODEL":"gpt-5-pro"} is the allowed model to
// us and the other one to such a provider; "N":5 is no n to us and five
// choices to it; {"content":"a long text","Content":"hi"} in a message
// is counted "hi" by a struct and read whole by OpenAI. Whatever two
// decoders could read differently is refused, so what is checked and
// counted is what every provider reads:
//   - in any object parsed here (the body, stream_options), two members
//     whose names fold to the same name (foldName), and a member whose
//     name folds to a name this package reads but is spelled otherwise;
//   - in messages and Responses input, at any depth, and in each tool's
//     own members, a member name a case-insensitive decoder would read as
//     another: one with an upper-case ASCII letter or a rune that folds
//     into ASCII (caseFolds). OpenAI's names there are all lower case.
//
// A tool's parameters are JSON Schema, whose keywords are camelCase
// ("additionalProperties"), so they are not refused; tools whose JSON
// has two names in one object that fold alike (foldTwins) are counted as
// their JSON too, which counts both, beside the rendering (agent/tokens
// renders with structs, which count one).

// readNames are the top-level and stream_options members this package
// reads or refuses, by their folded names.
var readNames = func() map[string]string {
	m := map[string]string{}
	for _, n := range []string{
		"model", "messages", "input", "instructions", "stream", "stream_options", "include_usage",
		"max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of", "n_cmpl", "n_predict", "service_tier", "modalities",
		"max_new_tokens", "num_predict", "num_return_sequences", "candidate_count", "min_tokens", "options",
		"documents", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
		"audio", "web_search_options", "background", "previous_response_id", "conversation", "prompt",
		"tools", "tool_choice", "functions", "response_format", "text", "models", "plugins",
	} {
		m[foldName(n)] = n
	}
	return m
}()

// foldName folds a member name as encoding/json matches one to a struct
// field: ASCII letters to upper case, any other rune to the upper case of
// its lower case.
func foldName(s string) string {
	b := make([]byte, 0, len(s))
	for _, r := range s {
		b = utf8.AppendRune(b, foldRune(r))
	}
	return string(b)
}

func foldRune(r rune) rune {
	if r < utf8.RuneSelf {
		if 'a' <= r && r <= 'z' {
			r -= 'a' - 'A'
		}
		return r
	}
	return unicode.ToUpper(unicode.ToLower(r))
}

// caseFolds reports whether a case-insensitive decoder could read name
// as another name: it has an upper-case ASCII letter, or a rune beyond
// ASCII that folds into it.
func caseFolds(name []byte) bool {
	for _, r := range string(name) {
		if 'A' <= r && r <= 'Z' || r >= utf8.RuneSelf && foldRune(r) < utf8.RuneSelf {
			return true
		}
	}
	return false
}

// checkNames refuses, in the valid JSON raw (the value of field), a
// member name that caseFolds: at any depth when deep, else only the
// members of the objects that are raw's array's elements (a tool's own
// members, not its parameters' JSON Schema, whose names are the
// agent's).
func checkNames(raw []byte, field string, deep bool) error {
	var bad string
	eachName(raw, func(depth int, name []byte, _ *[]string) bool {
		if (deep || depth == 2) && caseFolds(name) {
			bad = string(name)
			return false
		}
		return true
	})
	if bad != "" {
		return invalid(field, "has a member named "+strconv.Quote(bad)+
			", which a case-insensitive decoder reads as another; member names here are lower case")
	}
	return nil
}

// eachName calls fn with each member name of the valid JSON raw, in order
// (decoded when it has an escape), the depth of the objects and arrays it
// is in (1 for a member of raw itself), and the names fn kept for its
// object so far (fn appends to keep one). It stops when fn returns false.
// It scans the bytes once.
func eachName(raw []byte, fn func(depth int, name []byte, kept *[]string) bool) {
	// One entry per open object or array: what fn kept (an array's stays
	// empty).
	var open [][]string
	for i := 0; i < len(raw); i++ {
		switch raw[i] {
		case '{', '[':
			open = append(open, nil)
		case '}', ']':
			if len(open) > 0 {
				open = open[:len(open)-1]
			}
		case '"':
			end := stringEnd(raw, i+1)
			if end < 0 {
				return // not valid JSON: the decoders refuse it
			}
			if len(open) > 0 && isMemberName(raw, end+1) {
				name := raw[i+1 : end]
				if bytes.IndexByte(name, '\\') >= 0 {
					var s string
					if json.Unmarshal(raw[i:end+1], &s) != nil {
						return
					}
					name = []byte(s)
				}
				if !fn(len(open), name, &open[len(open)-1]) {
					return
				}
			}
			i = end
		}
	}
}

// stringEnd is the index of the quote that ends the JSON string whose
// first byte is raw[from], or -1.
func stringEnd(raw []byte, from int) int {
	for j := from; j < len(raw); {
		q := bytes.IndexByte(raw[j:], '"')
		if q < 0 {
			return -1
		}
		q += j
		// The quote is escaped when an odd number of backslashes
		// precedes it.
		n := 0
		for k := q - 1; k >= from && raw[k] == '\\'; k-- {
			n++
		}
		if n%2 == 0 {
			return q
		}
		j = q + 1
	}
	return -1
}

// isMemberName reports whether the string that ended just before raw[at]
// is a member name: a colon follows it.
func isMemberName(raw []byte, at int) bool {
	for ; at < len(raw); at++ {
		switch raw[at] {
		case ' ', '\t', '\n', '\r':
			continue
		case ':':
			return true
		}
		return false
	}
	return false
}

// foldTwins reports whether an object anywhere in the valid JSON raw has
// two members whose names fold to the same name (foldName), "description"
// and "Description" say: a struct decoder reads the last, OpenAI the
// exact one.
func foldTwins(raw []byte) bool {
	twins := false
	eachName(raw, func(_ int, name []byte, kept *[]string) bool {
		f := foldName(string(name))
		if slices.Contains(*kept, f) {
			twins = true
			return false
		}
		*kept = append(*kept, f)
		return true
	})
	return twins
}

// AmbiguousName returns the first member name, at any depth of the valid
// JSON raw, that two decoders could read differently: one whose name
// folds like an earlier member's of the same object (a repeated name
// included: encoding/json takes the last, others the first), or one a
// case-insensitive decoder could read as another (caseFolds). It is the
// rule above for bodies whose member names are all lower case: the
// agent's events, fetches and results.
func AmbiguousName(raw []byte) (string, bool) {
	var bad string
	eachName(raw, func(_ int, name []byte, kept *[]string) bool {
		f := foldName(string(name))
		if caseFolds(name) || slices.Contains(*kept, f) {
			bad = string(name)
			return false
		}
		*kept = append(*kept, f)
		return true
	})
	return bad, bad != ""
}
